"""Draw docs/images/trace_eager_vs_graphed.png from two profiler traces of one iteration each.

    python scripts/render_trace_picture.py EAGER.json[.gz] GRAPHED.json[.gz] OUT.png [iteration]

The traces are what ``profiling.use_pytorch_profiler`` writes (one profiled iteration,
``profile_step_start = profile_step_end``); benchmarks/results/trace_small_dense_*.json.gz
are the ones behind the picture in docs/observability.md.
"""

from __future__ import annotations

import gzip
import json
import sys


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def draw(ax, events: list[dict], title: str, iteration: int) -> None:
    step = next(e for e in events if e.get("name") == f"ProfilerStep#{iteration}" and e.get("cat") == "user_annotation")
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime" and t0 <= e["ts"] <= t1]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"], 0.5) / 1e3) for e in runtime], (1.1, 0.8), color="#d62728")
    ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"], 0.5) / 1e3) for e in kernels], (0.1, 0.8), color="#1f77b4")
    busy = sum(e["dur"] for e in kernels) / 1e3
    launches = sum(1 for e in runtime if "Graph" in e["name"])
    ax.set_yticks([0.5, 1.5], ["GPU kernels", "host: CUDA API"])
    ax.set_ylim(0, 2)
    ax.set_title(f"{title}: iteration {step['dur'] / 1e3:.1f} ms on the host, {len(kernels)} kernels busy {busy:.2f} ms, "
                 f"{len(runtime)} CUDA API calls ({launches} graph launch{'es' if launches != 1 else ''})",
                 fontsize=9, loc="left")


def main(argv: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eager, graphed, out = argv[:3]
    iteration = int(argv[3]) if len(argv) > 3 else 6
    fig, axes = plt.subplots(2, 1, figsize=(12, 4.2), sharex=True)
    draw(axes[0], load(eager), "eager (cuda_graph_impl=none)", iteration)
    draw(axes[1], load(graphed), "full_iteration graph", iteration)
    axes[-1].set_xlabel(f"ms from the start of iteration {iteration} (host clock)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
