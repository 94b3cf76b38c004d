"""Where the whole-iteration graph's last ~9% over the GPU-busy floor goes: experiments, one GPU.

``python benchmarks/graph_gap.py --out DIR [--recipe small_dense_bench] [--rounds 5] [--iters 30]``

The small dense shape's ``full_iteration`` step is ~1.09x its GPU-busy time;
docs/perf-log.md (2026-12-01) measured the cause as the time between
consecutive kernels inside a replayed graph. This script measures, in one
process and interleaved round by round (device/METHOD.md), what graphstep
can change about it:

* ``default``: the graph replayed on the current (default-priority) stream --
  what the trainer does;
* ``high_priority``: the same graph replayed on a stream of the highest
  priority. A graph's kernels take the priority of the stream it is launched
  into (torch instantiates graphs without ``cudaGraphInstantiateFlagUseNodePriority``),
  so this is what node priorities can give a graph that runs alone;
* ``optimizer_graph``: the optimizer in its own graph after the
  forward/backward graph (``optimizer.optimizer_cuda_graph=true``).

Each variant's GPU-busy time (profiler) is measured too, so each has its own
step/floor ratio. Writes ``graph_gap_<gpu>_<date>.json`` to ``--out`` and
prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
from pathlib import Path

import torch

from graphstep.bench.harness import busy_time, free_row, graphstep_row, row_config, time_steps
from graphstep.bench.run import row_overrides
from graphstep.recipes import get_recipe

VARIANTS = {
    "default": ("full_iteration", False),
    "high_priority": ("full_iteration", True),
    "optimizer_graph": ("full_iteration+optimizer", False),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--recipe", default="small_dense_bench")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("graph_gap: no CUDA device")
        return 2
    device = torch.device("cuda")
    base = get_recipe(args.recipe)
    low, high = torch.cuda.Stream.priority_range()  # (lowest, highest): a lower number is a higher priority
    warmup = base.model.cuda_graph_warmup_steps + 3
    results = {name: {"step_ms_rounds": [], "busy_ms_rounds": []} for name in VARIANTS}
    for _ in range(args.rounds):
        for name, (row, prioritised) in VARIANTS.items():
            free_row()
            cfg = row_config(base, row_overrides(row))
            step, w, _runner = graphstep_row(cfg, device)
            stream = torch.cuda.Stream(device, priority=high) if prioritised else None
            ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            with ctx:
                data = w.data()
                times, _ = time_steps(step, data, warmup=warmup, iters=args.iters, device=device)
                busy, kernels = busy_time(step, data, iters=5, device=device)
            results[name]["step_ms_rounds"].append(statistics.median(times))
            results[name]["busy_ms_rounds"].append(busy)
            results[name]["kernels"] = kernels
            del step, w, _runner, data
    env = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
           "date": datetime.date.today().isoformat(), "stream_priority_range": [low, high]}
    lines = [f"graph gap -- {args.recipe}, {env['gpu']}, torch {env['torch']}, {env['date']} "
             f"({args.rounds} interleaved rounds of {args.iters} iterations)", "",
             "| variant | step ms (median of rounds) | rounds min-max | busy ms | step/floor | kernels |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        step_ms, busy = statistics.median(r["step_ms_rounds"]), statistics.median(r["busy_ms_rounds"])
        r.update(step_ms=step_ms, busy_ms=busy)
        lines.append(f"| {name} | {step_ms:.3f} | {min(r['step_ms_rounds']):.3f}-{max(r['step_ms_rounds']):.3f} "
                     f"| {busy:.3f} | {step_ms / busy:.3f}x | {r['kernels']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"graph_gap_{env['gpu'].replace(' ', '-')}_{env['date']}"
    (args.out / f"{stem}.json").write_text(json.dumps({"environment": env, "recipe": args.recipe,
                                                       "rounds": args.rounds, "iters": args.iters,
                                                       "variants": results}, indent=1))
    (args.out / f"{stem}.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
