"""A plain PyTorch training loop on a small CNN, with its whole step captured by graphstep.

    python examples/plain_loop.py [--steps 200] [--device cpu|cuda]

Runs the same loop three times: eager, with the whole step captured
(``graph_step``) and with per-block graphs (``graph_layers``). On a GPU the
graphs are CUDA graphs; on the CPU they run on graphstep's replay backend
(checks capture, no speed-up). Prints each run's losses and step time, and
whether its losses are bit-identical to eager.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import graphstep


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Dropout(0.1)),
            nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Dropout(0.1)),
        ])
        self.head = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.flatten(1))


def make_data(steps: int, device: torch.device, micro_batches: int = 2):
    g = torch.Generator().manual_seed(0)
    return [[(torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g))
             for _ in range(micro_batches)] for _ in range(steps)]


def run(graphs: str, steps: int, device: torch.device) -> tuple[list[float], float]:
    torch.manual_seed(0)
    model = SmallCNN().to(device)
    # fused=True keeps the optimizer free of host syncs (capturable=True on CUDA for graph capture).
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=device.type == "cuda")

    def train_step(batches):
        opt.zero_grad(set_to_none=False)  # gradients stay at fixed addresses
        total = torch.zeros((), device=device)
        for x, y in batches:  # gradient accumulation over micro-batches
            loss = F.cross_entropy(model(x), y)
            (loss / len(batches)).backward()
            total += loss.detach()
        opt.step()
        return total / len(batches)

    step = train_step
    if graphs == "full":
        step = graphstep.graph_step(train_step, warmup_steps=3, device=device, modules=[model])
    elif graphs == "layers":
        graphstep.graph_layers(model, "blocks.*", warmup_steps=3)
    data = make_data(steps, device)
    losses, t0 = [], None
    for i, batches in enumerate(data):
        if i == 5:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        batches = [(x.to(device), y.to(device)) for x, y in batches]
        losses.append(step(batches).clone())  # graph-owned output: clone what you keep
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / max(1, steps - 5) * 1e3
    graphstep.close_all()
    return [float(v) for v in losses], ms


def main(argv: list[str] | None = None) -> dict[str, tuple[list[float], float]]:
    # cuDNN picks convolution algorithms by heuristics and some backward ones
    # accumulate with atomics: deterministic ones make eager and graphed runs
    # comparable bit for bit.
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="training steps of each run")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda (default: cuda when available)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    results = {mode: run(mode, args.steps, device) for mode in ("none", "full", "layers")}
    eager = results["none"][0]
    for mode, (losses, ms) in results.items():
        same = "bit-identical to eager" if losses == eager else "DIFFERS from eager"
        print(f"{mode:>6}: first loss {losses[0]:.4f}, last {losses[-1]:.4f}, {ms:.2f} ms/step, {same}")
    return results


if __name__ == "__main__":
    main()
