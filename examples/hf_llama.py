"""A Hugging Face ``transformers`` Llama, built from a config (no download), trained with graphstep's graphs.

    python examples/hf_llama.py [--steps 100] [--device cpu|cuda] [--hidden 256 --layers 4]

Three runs on the same data: eager, per-layer graphs on the built-in Llama
scope map (``attn`` -> model.layers.*.self_attn, ``mlp`` -> model.layers.*.mlp)
and the whole step as one graph. Prints each run's losses (bit-identical to
eager) and step time. On a GPU these are CUDA graphs; on the CPU the replay
backend checks capture (no speed-up).
"""

from __future__ import annotations

import argparse
import time

import torch

import graphstep


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 4 // 1,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2),
        max_position_embeddings=args.seq, attention_dropout=args.dropout, use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def run(mode: str, args: argparse.Namespace, device: torch.device) -> tuple[list[float], float]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(args, device, dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=device.type == "cuda")

    def train_step(input_ids: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        opt.step()
        return loss.detach()

    step = train_step
    if mode == "per-layer":
        graphstep.graph_layers(model, ["attn", "mlp"], warmup_steps=3)
    elif mode == "full-step":
        step = graphstep.graph_step(train_step, warmup_steps=3, device=device, modules=[model])
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(args.steps)]
    losses, t0 = [], 0.0
    for i, ids in enumerate(data):
        if i == 5:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        losses.append(step(ids.to(device)).float().clone())
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / max(1, args.steps - 5) * 1e3
    graphstep.close_all()
    return [float(v) for v in losses], ms


def main(argv: list[str] | None = None) -> dict[str, tuple[list[float], float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    results = {mode: run(mode, args, device) for mode in ("eager", "per-layer", "full-step")}
    eager = results["eager"][0]
    for mode, (losses, ms) in results.items():
        same = "bit-identical to eager" if losses == eager else "DIFFERS from eager"
        print(f"{mode:>9}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, {ms:.2f} ms/step, {same}")
    return results


if __name__ == "__main__":
    main()
