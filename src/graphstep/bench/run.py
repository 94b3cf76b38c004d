"""``run_bench(cfg, rows)``: measure the rows of one shape and write the results.

Row names: ``eager``; graphstep settings ``full_iteration``,
``full_iteration+optimizer``, ``local[attn]``, ``local[mlp]``,
``local[attn,mlp]``, ``local[]`` (whole layer), ``te[...]`` (Transformer
Engine semantics), MoE scopes such as ``local[attn,moe_router,moe_preprocess]``;
peers ``manual_graph``, ``make_graphed_callables`` and
``compile[reduce-overhead]`` (bench/peers.py), and ``compile+full_iteration``:
graphstep's full-iteration graph around ``torch.compile(model)`` (Inductor's
fused kernels, default mode, and no launch overhead).
"""

from __future__ import annotations

import datetime
import json
import platform
import re
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import Config
from ..cuda_graph.devices import GiB, normalize_device
from ..training.flops import flops_per_step
from .harness import Row, finish, graphstep_row, make_workload, matmul_tflops, measure, row_config
from .peers import compiled, make_graphed, manual_graph

DENSE_ROWS = [
    "eager", "full_iteration", "full_iteration+optimizer", "local[attn]", "local[mlp]", "local[attn,mlp]",
    "local[]", "te[attn,mlp]", "manual_graph", "make_graphed_callables", "compile[reduce-overhead]", "compile",
    "compile+full_iteration", "compile+local[attn,mlp]", "megatron_full_cuda_graph",
]
MOE_ROWS = [
    "eager", "full_iteration", "full_iteration+optimizer", "local[attn,moe_router,moe_preprocess]",
    "local[moe_router]", "local[attn,moe]", "manual_graph",
]
HYBRID_ROWS = ["eager", "full_iteration", "full_iteration+optimizer", "local[attn,mamba]", "local[]", "manual_graph"]
NO_GRAPH = ["model.cuda_graph_impl=none", "model.cuda_graph_modules=[]", "optimizer.optimizer_cuda_graph=false"]


def default_rows(cfg: Config) -> list[str]:
    if cfg.model.num_moe_experts:
        return MOE_ROWS
    if cfg.model.hybrid_override_pattern:
        return HYBRID_ROWS
    return DENSE_ROWS


FSDP = ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"]


def split_rows(text: str) -> list[str]:
    """``eager,local[attn,mlp],manual_graph`` -> the three rows (commas inside brackets stay)."""
    return [r for r in re.split(r",(?![^\[]*\])", text) if r]


def row_overrides(name: str) -> list[str] | None:
    """Config overrides of a graphstep row; None for a peer."""
    if name == "eager":
        return NO_GRAPH
    if name == "full_iteration":
        return NO_GRAPH + ["model.cuda_graph_impl=full_iteration"]
    if name == "full_iteration+optimizer":
        return NO_GRAPH + ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"]
    if name.startswith("fsdp_"):  # FSDP2 (ZeRO-3) on this one GPU: a one-rank mesh, as the trainer builds it
        inner = row_overrides(name[len("fsdp_"):])
        return None if inner is None else inner + FSDP
    if name.startswith("compile+") or name == "compile":  # the trainer's compile section (compile.enable)
        inner = row_overrides(name[len("compile+"):]) if name != "compile" else NO_GRAPH
        return None if inner is None else inner + ["compile.enable=true"]
    m = re.fullmatch(r"(local|te)\[([a-z_,]*)\]", name)
    if m:
        impl = "local" if m.group(1) == "local" else "transformer_engine"
        return NO_GRAPH + [f"model.cuda_graph_impl={impl}", f"model.cuda_graph_modules=[{m.group(2)}]"]
    return None


def _builder(name: str, base: Config, device: torch.device) -> Callable[[], tuple]:
    overrides = row_overrides(name)
    if overrides is not None:
        cfg = row_config(base, overrides)

        compile_mode = "default" if name.startswith("compile+") or name == "compile" else None

        def build() -> tuple:
            step, w, runner = graphstep_row(cfg, device, compile_mode=compile_mode)
            capture = (lambda: sum(r.seconds for r in runner.reports)) if runner.backend else None
            return step, w.data(), capture, runner

        return build
    cfg = row_config(base, NO_GRAPH)
    if name == "manual_graph":
        return lambda: manual_graph(cfg, device)
    if name == "make_graphed_callables":
        return lambda: make_graphed(cfg, device)
    m = re.fullmatch(r"compile\[([a-z-]+)\]", name)
    if m:
        return lambda: compiled(cfg, device, mode=m.group(1))
    if name == "megatron_full_cuda_graph":

        def build_megatron() -> tuple:
            from .megatron_peer import megatron_full_graph  # megatron-core (a wheel) is imported only here

            return megatron_full_graph(cfg, device)

        return build_megatron
    raise ValueError(f"unknown bench row {name!r}")


def environment(device: torch.device) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(device)
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": props.name,
        "gpu_memory_gib": round(props.total_memory / GiB, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def run_bench(cfg: Config, rows: list[str], *, recipe: str, iters: int = 50, warmup: int = 8,
              profile_iters: int = 5, progress: Callable[[int, str], None] | None = None) -> dict[str, Any]:
    """Measure every row on this process's GPU; returns the result document.

    ``progress(rows_done, name)`` is called before each row.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("graphstep bench measures CUDA graphs: it needs a CUDA GPU")
    device = normalize_device("cuda")
    peak = matmul_tflops(device)
    probe = make_workload(row_config(cfg, NO_GRAPH), device, n_steps=1)
    flops = flops_per_step(cfg, probe.model)
    del probe
    warmup = max(warmup, cfg.model.cuda_graph_warmup_steps + 2)
    results: list[Row] = []
    for done, name in enumerate(rows):
        if progress is not None:
            progress(done, name)
        results.append(measure(name, _builder(name, cfg, device), warmup=warmup, iters=iters,
                               profile_iters=profile_iters, device=device))
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    finish(results, tokens_per_step=tokens, flops_per_step=flops, peak_tflops=peak)
    m = cfg.model
    return {
        "recipe": recipe,
        "environment": environment(device),
        "shape": {"layers": m.num_layers, "hidden": m.hidden_size, "seq": m.seq_length, "vocab": m.vocab_size,
                  "micro_batch": cfg.train.micro_batch_size, "global_batch": cfg.train.global_batch_size,
                  "experts": m.num_moe_experts, "pattern": m.hybrid_override_pattern},
        "method": {"iters": iters, "warmup": warmup, "profile_iters": profile_iters,
                   "step": "median CUDA-event interval between back-to-back iterations",
                   "busy": "sum of device activity durations per iteration (torch.profiler)"},
        "bf16_matmul_tflops": peak,
        "flops_per_step": flops,
        "rows": [r.as_dict() for r in results],
    }


def write_results(doc: dict[str, Any], out_dir: str | Path) -> Path:
    """``<recipe>_<gpu>_<date>``: .json (everything), .md (the table) and .png (the chart, with matplotlib)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = doc["environment"]
    stem = f"{doc['recipe']}_{env['gpu'].replace(' ', '-')}_{env['date']}"
    path = out / f"{stem}.json"
    path.write_text(json.dumps(doc, indent=1))
    path.with_suffix(".md").write_text(markdown_table(doc))
    try:
        write_chart(doc, path.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)")
    return path


def write_chart(doc: dict[str, Any], path: str | Path) -> None:
    """Per row: GPU-busy time and host overhead stacked (the step), and peak memory; failed rows marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"][::-1]  # first row on top
    names = [r["name"] for r in rows]
    ys = range(len(rows))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 1.8), sharey=True,
                                     gridspec_kw={"width_ratios": [3, 2]})
    busy = [r["busy_ms"] or 0.0 for r in rows]
    host = [max(0.0, r["host_ms"] or 0.0) for r in rows]
    ax_t.barh(ys, busy, color="#2b6cb0", label="GPU busy (sum of kernel times)")
    ax_t.barh(ys, host, left=busy, color="#f6ad55", label="host overhead (step - busy)")
    for y, r in zip(ys, rows):
        label = "failed" if r["error"] else f"{r['step_ms']:.2f} ms" + (f"  {r['speedup']:.2f}x" if r["speedup"] else "")
        ax_t.text((r["step_ms"] or 0.0), y, "  " + label, va="center", fontsize=8,
                  color="#c53030" if r["error"] else "black")
    ax_t.set_yticks(list(ys), names, fontsize=9)
    ax_t.set_xlabel("ms per training iteration (median)")
    ax_t.legend(loc="lower right", fontsize=8)
    ax_t.margins(x=0.25)
    mem = [r["peak_allocated_gib"] or 0.0 for r in rows]
    ax_m.barh(ys, mem, color="#68d391")
    for y, r in zip(ys, rows):
        if r["memory_vs_eager"]:
            ax_m.text(r["peak_allocated_gib"], y, f"  {r['memory_vs_eager']:.2f}x", va="center", fontsize=8)
    ax_m.set_xlabel("peak allocated GiB (x eager)")
    ax_m.margins(x=0.25)
    env = doc["environment"]
    fig.suptitle(f"{doc['recipe']} -- {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, {env['date']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(doc: dict[str, Any]) -> Any:
    from rich.markup import escape
    from rich.table import Table

    env = doc["environment"]
    t = Table(title=f"{doc['recipe']} on {env['gpu']} (torch {env['torch']}, CUDA {env['cuda']}, {env['date']})")
    for col in ("row", "step ms", "busy ms", "host ms", "kernels", "speed-up", "step/floor", "peak GiB",
                "mem/eager", "capture s", "tok/s", "TFLOP/s", "MFU"):
        t.add_column(col, justify="right" if col != "row" else "left")
    for r in doc["rows"]:
        name = escape(r["name"])  # "local[attn,mlp]" is not rich markup
        if r["error"]:
            t.add_row(name, f"error: {escape(r['error'][:80])}", *[""] * 11)
            continue
        t.add_row(
            name, _f(r["step_ms"], 3), _f(r["busy_ms"], 3), _f(r["host_ms"], 3), str(r["kernels"]),
            _f(r["speedup"], 2, "x"), _f(r["floor_ratio"], 2, "x"), _f(r["peak_allocated_gib"], 2),
            _f(r["memory_vs_eager"], 2, "x"), _f(r["capture_s"], 2), _f(r["tokens_per_s"], 0),
            _f(r["tflops"], 1), _f(r["mfu"] * 100 if r["mfu"] else None, 1, "%"),
        )
    return t


def markdown_table(doc: dict[str, Any]) -> str:
    """The rows as a Markdown table (README, docs/perf-log.md, gpu-check summaries)."""
    env = doc["environment"]
    head = (f"{doc['recipe']} -- {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, {env['date']} "
            f"(bf16 matmul {doc['bf16_matmul_tflops']:.0f} TFLOP/s measured)\n\n")
    lines = ["| row | step ms | GPU-busy ms | host ms | kernels | host syncs | speed-up | step/floor | peak GiB "
             "| mem/eager | capture s | MFU |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        if r["error"]:
            lines.append(f"| {r['name']} | failed: {r['error'].splitlines()[0][:120]} | | | | | | | | | | |")
            continue
        lines.append(
            f"| {r['name']} | {_f(r['step_ms'], 3)} | {_f(r['busy_ms'], 3)} | {_f(r['host_ms'], 3)} | {r['kernels']} "
            f"| {'-' if r.get('host_syncs') is None else r['host_syncs']} "
            f"| {_f(r['speedup'], 2, 'x')} | {_f(r['floor_ratio'], 2, 'x')} | {_f(r['peak_allocated_gib'], 3)} "
            f"| {_f(r['memory_vs_eager'], 2, 'x')} | {_f(r['capture_s'], 2)} "
            f"| {_f(r['mfu'] * 100 if r['mfu'] else None, 1, '%')} |"
        )
    return head + "\n".join(lines) + "\n"


def _f(v: Any, digits: int, suffix: str = "") -> str:
    return "-" if v is None else f"{v:,.{digits}f}{suffix}"
