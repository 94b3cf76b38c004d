"""``python -m graphstep.bench.packed_attention --out DIR``: which attention kernel packed rows should use.

Packed SFT rows (docs/data.md) attend within each document. graphstep's
model does it with ``scaled_dot_product_attention`` and an additive
block-diagonal causal mask, or for long rows on a GPU with varlen attention
(``PackedRows.kernel_for``, chosen from this benchmark). It times, on one
GPU, the forward and backward of the attention alone -- the part the choice
changes -- for the same packed rows through each candidate PyTorch offers:

* ``sdpa_mask``: the model's path for short rows (key/value heads repeated for grouped-query
  attention, the mask ``[batch, 1, seq, seq]`` in bf16);
* ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (flash attention over
  the documents laid end to end; the padded offset slots are empty documents),
  the model's path for rows of ``VARLEN_MIN_SEQ`` tokens or more;
* ``flex``: ``flex_attention`` compiled, with a block mask of the same
  documents (its construction timed apart: it is made once per micro-batch);
* ``sdpa_causal``: the same rows as one causal sequence each (no document
  boundaries) -- not a candidate, the speed an unpacked row of that length gets.

Every candidate's output is compared with ``sdpa_mask``'s (the largest
absolute difference is reported) so that the timings are of the same
attention. Method (device/METHOD.md): warm-up, CUDA events around each
iteration, the median of ``--iters``; the candidates interleaved round by
round. Writes ``packed_attention_<gpu>_<date>.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..models.transformer import PackedRows, _repeat_heads, flat_offsets, varlen_attention, varlen_causal


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    seq: int
    heads: int
    groups: int
    head_dim: int
    doc_min: int  # document lengths drawn uniformly from [doc_min, doc_max]
    doc_max: int


SHAPES = (
    Shape("small_dense (seq 256)", 4, 256, 8, 8, 32, 16, 128),
    Shape("llama32_1b (seq 2048)", 2, 2048, 32, 8, 64, 64, 1024),
    Shape("llama32_1b (seq 8192)", 1, 8192, 32, 8, 64, 128, 2048),
    Shape("llama3_8b (seq 8192)", 1, 8192, 32, 8, 128, 128, 2048),
)


def offsets(shape: Shape, generator: torch.Generator) -> torch.Tensor:
    """``[batch, slots]`` document offsets as data/packing.py lays them: ``[0, e1, ..., S, S, ...]``."""
    rows = []
    for _ in range(shape.batch):
        ends, at = [0], 0
        while at < shape.seq:
            at = min(shape.seq, at + int(torch.randint(shape.doc_min, shape.doc_max + 1, (), generator=generator)))
            ends.append(at)
        rows.append(ends)
    slots = max(len(r) for r in rows) + 2
    return torch.tensor([r + [shape.seq] * (slots - len(r)) for r in rows], dtype=torch.int64)


def candidates(shape: Shape, cu_rows: torch.Tensor, device: torch.device, dtype: torch.dtype):
    """name -> (setup seconds or None, fn(q, k, v) -> out); a candidate that cannot run -> its reason."""
    rep = shape.heads // shape.groups
    packed = PackedRows()
    packed.update(cu_rows, shape.seq, dtype)
    mask = packed.mask
    out: dict[str, object] = {}

    def sdpa_mask(q, k, v):
        if rep > 1:  # as Attention.core_attention does for the kernels that take a mask
            k, v = (_repeat_heads(t, rep) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    out["sdpa_mask"] = sdpa_mask
    if varlen_attention() is None:
        out["varlen"] = "torch.nn.attention.varlen is absent in this torch"
    else:
        cu = flat_offsets(cu_rows, shape.seq)

        def varlen(q, k, v):  # the model's path for long packed rows (PackedRows.kernel_for)
            return varlen_causal(q, k, v, cu)

        out["varlen"] = varlen
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        token = torch.arange(shape.seq, device=device)
        document = (cu_rows[:, None, 1:] <= token[None, :, None]).sum(-1)

        def same_document(b, h, q_idx, kv_idx):
            return (document[b, q_idx] == document[b, kv_idx]) & (q_idx >= kv_idx)

        compiled = torch.compile(flex_attention)
        block = create_block_mask(same_document, shape.batch, None, shape.seq, shape.seq, device=device)

        def flex(q, k, v):
            return compiled(q, k, v, block_mask=block, enable_gqa=rep > 1)

        out["flex"] = flex
        out["_flex_mask"] = lambda: create_block_mask(same_document, shape.batch, None, shape.seq, shape.seq,
                                                      device=device)
    except Exception as exc:  # noqa: BLE001 -- reported in the table
        out["flex"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"

    def sdpa_causal(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=rep > 1)

    out["sdpa_causal"] = sdpa_causal
    return out


def _time(fn: Callable[[], None], iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def measure_shape(shape: Shape, device: torch.device, *, iters: int, rounds: int, seed: int = 0) -> dict:
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    cu_rows = offsets(shape, g).to(device)
    real_docs = int(sum(len(set(r.tolist())) - 1 for r in cu_rows.cpu()))
    torch.manual_seed(seed)
    q = torch.randn(shape.batch, shape.heads, shape.seq, shape.head_dim, device=device, dtype=dtype,
                    requires_grad=True)
    k, v = (torch.randn(shape.batch, shape.groups, shape.seq, shape.head_dim, device=device, dtype=dtype,
                        requires_grad=True) for _ in range(2))
    grad = torch.randn_like(q)
    cands = candidates(shape, cu_rows, device, dtype)
    mask_maker = cands.pop("_flex_mask", None)
    result = {"shape": shape.__dict__, "documents": real_docs, "slots": cu_rows.shape[1], "rows": {}}
    runnable = {}
    reference = None
    for name, fn in cands.items():
        if isinstance(fn, str):
            result["rows"][name] = {"error": fn}
            continue
        try:
            out = fn(q, k, v)
            out.backward(grad)
            torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 -- a candidate that fails is reported, the others measured
            result["rows"][name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
            continue
        if name == "sdpa_mask":
            reference = out.detach().float()
        row = {"max_abs_diff_vs_sdpa_mask": None if reference is None or name == "sdpa_mask"
               else float((out.detach().float() - reference).abs().max())}
        result["rows"][name] = row
        q.grad = k.grad = v.grad = None

        def step(fn=fn) -> None:
            fn(q, k, v).backward(grad)
            q.grad = k.grad = v.grad = None

        runnable[name] = step
    for step in runnable.values():  # warm-up (compiles, autotuning, allocator)
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {n: [] for n in runnable}
    for _ in range(rounds):  # interleaved: A B C A B C
        for name, step in runnable.items():
            times[name].append(statistics.median(_time(step, iters)))
    for name, per_round in times.items():
        result["rows"][name].update(fwd_bwd_ms=statistics.median(per_round), rounds_ms=per_round)
    if mask_maker is not None and "flex" in runnable:
        mask_maker()
        result["flex_block_mask_ms"] = statistics.median(_time(lambda: mask_maker(), iters))
    packed = PackedRows()
    packed.update(cu_rows, shape.seq, dtype)
    result["sdpa_mask_build_ms"] = statistics.median(_time(lambda: packed.update(cu_rows, shape.seq, dtype), iters))
    return result


def render(doc: dict) -> str:
    env = doc["environment"]
    lines = [f"packed-row attention, forward + backward -- {env['gpu']}, torch {env['torch']}, {env['date']} "
             f"(median of {doc['iters']} iterations per round, median over {doc['rounds']} interleaved rounds)", ""]
    for s in doc["shapes"]:
        sh = s["shape"]
        lines += [f"### {sh['name']}: batch {sh['batch']}, {sh['heads']} heads / {sh['groups']} KV heads of "
                  f"{sh['head_dim']}, {s['documents']} documents ({sh['doc_min']}-{sh['doc_max']} tokens), "
                  f"{s['slots']} offset slots", "",
                  "| kernel | fwd+bwd ms | vs sdpa_mask | rounds min-max | max abs diff vs sdpa_mask |",
                  "|---|---|---|---|---|"]
        base = s["rows"].get("sdpa_mask", {}).get("fwd_bwd_ms")
        for name, r in s["rows"].items():
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error']} | | | |")
                continue
            ms = r["fwd_bwd_ms"]
            diff = r["max_abs_diff_vs_sdpa_mask"]
            lines.append(f"| {name} | {ms:.3f} | {ms / base:.2f}x | {min(r['rounds_ms']):.3f}-"
                         f"{max(r['rounds_ms']):.3f} | {'-' if diff is None else f'{diff:.2e}'} |" if base else
                         f"| {name} | {ms:.3f} | - | | |")
        extra = [f"mask build (PackedRows.update) {s['sdpa_mask_build_ms']:.3f} ms"]
        if "flex_block_mask_ms" in s:
            extra.append(f"flex block mask {s['flex_block_mask_ms']:.3f} ms")
        lines += ["", "Per micro-batch: " + ", ".join(extra) + ".", ""]
    lines.append("sdpa_causal runs the rows as one causal sequence each (no document boundaries): not a candidate, "
                 "the speed an unpacked row of that length gets.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphstep.bench.packed_attention", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("packed_attention: no CUDA device; this benchmark times GPU kernels")
        return 2
    device = torch.device("cuda")
    env = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
           "date": datetime.date.today().isoformat()}
    doc = {"environment": env, "iters": args.iters, "rounds": args.rounds,
           "shapes": [measure_shape(s, device, iters=args.iters, rounds=args.rounds) for s in SHAPES]}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"packed_attention_{env['gpu'].replace(' ', '-')}_{env['date']}{'_' + args.tag if args.tag else ''}"
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    text = render(doc)
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
