"""Where a bench row's host time goes, without a profiler: one GPU.

``python benchmarks/host_breakdown.py --out DIR [--recipe small_dense_bench]
[--rows eager,full_iteration,local[attn,mlp]] [--iters 30]``

A profiler slows the host it measures (cProfile several times over for Python,
``torch.profiler`` for every operator), so its times say where the host goes,
not how long it takes. Here each row (``graphstep bench`` names, built as the
bench builds them) runs ``--iters`` steps after its warm-up, the device drained
before each step so that no launch waits for room in the queue, and host clocks
are read around a few calls only: the whole step (the row's issue time), the
optimizer step, the graph launches (``Graph.replay``: ``cudaGraphLaunch``), the
per-layer graphs' replay calls (``ModuleGraph.replay_forward`` /
``replay_backward``, the launch included) and ``Tensor.backward`` (the layer
backward replays run inside it). The rest of the step (the model's eager
forward and the loss, the data copies, the gradient zeroing; with an
optimizer graph beside layer graphs, its launch) is the difference. Medians
per step, in ms. Writes ``host_breakdown_<recipe>_<gpu>_<date>.json`` and the
table as ``.md`` to ``--out``, and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from graphstep.bench.harness import free_row, graphstep_row, row_config
from graphstep.bench.run import row_overrides, split_rows
from graphstep.cuda_graph.backend import Graph
from graphstep.cuda_graph.graphed_module import ModuleGraph
from graphstep.recipes import get_recipe
from graphstep.training.optim import AdamW

PARTS = ("optimizer", "backward", "layer forwards", "layer backwards", "graph launches")


class Clocks:
    """Host seconds spent in the wrapped calls during the current step (outermost call counted once)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.depth: dict[str, int] = defaultdict(int)

    def wrap(self, owner: type, attr: str, part: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            self.depth[part] += 1
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.depth[part] -= 1
                if self.depth[part] == 0:
                    self.spent[part] += time.perf_counter() - t0
                    self.calls[part] += 1

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.spent.clear()
        self.calls.clear()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def breakdown(name: str, base, device: torch.device, iters: int, clocks: Clocks) -> dict:
    overrides = row_overrides(name)
    if overrides is None:
        raise SystemExit(f"host_breakdown: {name!r} is not a graphstep bench row")
    compile_mode = "default" if name.startswith("compile+") or name == "compile" else None
    step, workload, _owner = graphstep_row(row_config(base, overrides), device, compile_mode=compile_mode)
    data = workload.data()
    try:
        for _ in range(5):  # warm-up, the capture included
            step(data)
        per_step: dict[str, list[float]] = defaultdict(list)
        calls: dict[str, int] = defaultdict(int)
        for _ in range(iters):
            sync(device)
            clocks.reset()
            t0 = time.perf_counter()
            step(data)
            total = time.perf_counter() - t0
            per_step["step"].append(total * 1e3)
            for part in PARTS:
                per_step[part].append(clocks.spent.get(part, 0.0) * 1e3)
                calls[part] = clocks.calls.get(part, 0)
        sync(device)
    finally:
        workload.close()
        if device.type == "cuda":
            free_row()
    med = {k: statistics.median(v) for k, v in per_step.items()}
    # the layer backwards run inside Tensor.backward, the graph launches inside the layer replays (or the optimizer's
    # graph): the rest is what none of the outer parts covers
    launches = 0.0 if calls["layer forwards"] else med["graph launches"]
    covered = med["optimizer"] + med["backward"] + med["layer forwards"] + launches
    return {"row": name, "ms": med, "calls": dict(calls), "rest_ms": med["step"] - covered}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--recipe", default="small_dense_bench")
    ap.add_argument("--rows", default="eager,full_iteration,local[attn,mlp],local[]")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script on the CPU replay backend")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("host_breakdown: needs a CUDA GPU")
    clocks = Clocks()
    clocks.wrap(AdamW, "step", "optimizer")
    clocks.wrap(torch.Tensor, "backward", "backward")
    clocks.wrap(ModuleGraph, "replay_forward", "layer forwards")
    clocks.wrap(ModuleGraph, "replay_backward", "layer backwards")
    for cls in Graph.__subclasses__():
        if "replay" in vars(cls):
            clocks.wrap(cls, "replay", "graph launches")
    base = get_recipe(args.recipe)
    results = [breakdown(r, base, device, args.iters, clocks) for r in split_rows(args.rows)]
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    doc = {"recipe": args.recipe, "gpu": gpu, "torch": torch.__version__,
           "date": datetime.date.today().isoformat(), "iters": args.iters, "rows": results,
           "note": "host ms per step, medians, the device drained before each step; 'backward' is Tensor.backward "
                   "(the layer backward replays run inside it); 'graph launches' are inside the layer replays, or "
                   "the whole-step graph's; 'rest' = step - optimizer - backward - layer forwards (or the launches "
                   "without layer graphs): the eager forward, the loss, data copies, gradient zeroing"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"host_breakdown_{args.recipe}_{doc['gpu'].replace(' ', '-')}_{doc['date']}"
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    lines = [f"Host breakdown, {args.recipe} -- {doc['gpu']}, torch {doc['torch']}, {doc['date']} (host ms per step, "
             f"medians of {args.iters}, the device drained before each step)", "",
             "| row | step | optimizer | backward | layer forwards (calls) | layer backwards (calls) "
             "| graph launches (calls) | rest |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        m, c = r["ms"], r["calls"]
        lines.append(f"| {r['row']} | {m['step']:.3f} | {m['optimizer']:.3f} | {m['backward']:.3f} "
                     + "".join(f"| {m[k]:.3f} ({c.get(k, 0)}) "
                               for k in ("layer forwards", "layer backwards", "graph launches"))
                     + f"| {r['rest_ms']:.3f} |")
    text = "\n".join(lines) + "\n"
    (out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
