"""Where a bench row's GPU time goes, by kind of kernel: one GPU.

``python benchmarks/kernel_breakdown.py --out DIR [--recipe llama3_8b_share_bench]
[--rows compile+full_iteration,compile+fp8_full_iteration] [--iters 3]``

For each row (``graphstep bench`` names: the row is built as the bench builds
it), a few iterations run under ``torch.profiler`` after a warm-up (the
capture included), and every kernel's time is put in one class by its name:
Inductor's fused kernels (with compile: norms, activations and the FP8 casts
and amax reductions fused into them), eager FP8 casts, FP8 GEMMs, other
GEMMs, attention, the optimizer's, and the rest (elementwise work, copies). The table gives
milliseconds per iteration per class and row, and the costliest kernels of
each row (``--top``, 8 by default, with their calls per iteration), so the
FP8 rows' gain over bf16 can be read class by class. Writes
``kernel_breakdown_<gpu>_<date>.json`` to ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
from collections import defaultdict
from pathlib import Path

import torch

from graphstep.bench.harness import free_row, graphstep_row, row_config
from graphstep.bench.run import row_overrides
from graphstep.recipes import get_recipe

# the first pattern that matches a kernel's (lower-cased) name decides its class
CLASSES = (
    # Inductor's fused kernels first: their names list the ops they fused (a cast's amax and ``_scaled_mm``'s
    # operand preparation among them), not a GEMM
    ("fused (inductor)", re.compile(r"^triton_")),
    ("fp8 cast", re.compile(r"float8_copy|float8")),
    # cuBLAS's FP8 GEMMs on sm90 are nvjet kernels with a quantised-operand prefix (``nvjet_sm90_qq``/``qr``)
    ("fp8 gemm", re.compile(r"nvjet_sm\d+_q|e4m3|e5m2|f8f8|fp8_gemm")),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn.*(mha|attn)")),
    ("gemm", re.compile(r"gemm|sm90_xmma|cutlass|cublas|matmul|ampere_|sm80_|nvjet")),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach")),
)


def kind(name: str) -> str:
    low = name.lower()
    return next((label for label, pattern in CLASSES if pattern.search(low)), "other")


def profile_row(name: str, base, device: torch.device, iters: int, top_n: int = 8) -> dict:
    from torch.profiler import ProfilerActivity, profile

    overrides = row_overrides(name)
    if overrides is None:
        raise SystemExit(f"kernel_breakdown: {name!r} is not a graphstep bench row")
    cfg = row_config(base, overrides)
    # as graphstep bench builds its rows (bench/run.py): a compile+ row compiles with mode "default"
    compile_mode = "default" if name.startswith("compile+") or name == "compile" else None
    step, workload, _owner = graphstep_row(cfg, device, compile_mode=compile_mode)
    data = iter(workload.batches * 100)
    for _ in range(cfg.model.cuda_graph_warmup_steps + 3):  # warm-up, capture, and a replay
        step(data)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step(data)
        torch.cuda.synchronize(device)
    by_class: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            us = evt.time_range.elapsed_us()
            by_class[kind(evt.name)] += us
            by_kernel[evt.name] += us
            calls[evt.name] += 1
    del step, workload, _owner
    free_row()
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top_n]
    return {"classes_ms": {k: v / 1e3 / iters for k, v in sorted(by_class.items())},
            "total_ms": sum(by_class.values()) / 1e3 / iters,
            "top": [{"kernel": k[:160], "class": kind(k), "ms": v / 1e3 / iters, "calls": calls[k] // iters}
                    for k, v in top]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--recipe", default="llama3_8b_share_bench")
    p.add_argument("--rows", default="compile+full_iteration,compile+fp8_full_iteration")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--top", type=int, default=8, help="how many of each row's costliest kernels to list")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("kernel_breakdown: no CUDA device")
        return 2
    device = torch.device("cuda")
    base = get_recipe(args.recipe)
    rows = {name: profile_row(name, base, device, args.iters, args.top) for name in args.rows.split(",")}
    labels = [label for label, _ in CLASSES] + ["other"]
    print(f"{args.recipe} on {torch.cuda.get_device_name(device)} (torch {torch.__version__}), ms per iteration")
    print("| row | " + " | ".join(labels) + " | total |")
    print("|---|" + "---:|" * (len(labels) + 1))
    for name, r in rows.items():
        cells = " | ".join(f"{r['classes_ms'].get(label, 0.0):.2f}" for label in labels)
        print(f"| {name} | {cells} | {r['total_ms']:.2f} |")
    for name, r in rows.items():
        print(f"\n{name}: costliest kernels")
        for k in r["top"]:
            print(f"  {k['ms']:8.2f} ms {k['calls']:4d}x  {k['class']:<10} {k['kernel']}")
    gpu = torch.cuda.get_device_name(device).replace(" ", "-")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kernel_breakdown_{gpu}_{datetime.date.today().isoformat()}.json"
    path.write_text(json.dumps({"recipe": args.recipe, "gpu": torch.cuda.get_device_name(device),
                                "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                                "iters": args.iters, "rows": rows}, indent=1))
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
