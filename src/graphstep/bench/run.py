"""``run_bench(cfg, rows)``: measure the rows of one shape and write the results.

Row names: ``eager``; graphstep settings ``full_iteration``,
``full_iteration+optimizer``, ``local[attn]``, ``local[mlp]``,
``local[attn,mlp]``, ``local[]`` (whole layer), ``te[...]`` (Transformer
Engine semantics), MoE scopes such as ``local[attn,moe_router,moe_preprocess]``;
peers ``manual_graph`` and ``make_graphed_callables``.
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
from .harness import Row, finish, flops_per_step, graphstep_row, make_workload, matmul_tflops, measure, row_config
from .peers import make_graphed, manual_graph

DENSE_ROWS = [
    "eager", "full_iteration", "full_iteration+optimizer", "local[attn]", "local[mlp]", "local[attn,mlp]",
    "local[]", "te[attn,mlp]", "manual_graph", "make_graphed_callables",
]
MOE_ROWS = [
    "eager", "full_iteration", "full_iteration+optimizer", "local[attn,moe_router,moe_preprocess]",
    "local[moe_router]", "local[attn,moe]",
]
NO_GRAPH = ["model.cuda_graph_impl=none", "model.cuda_graph_modules=[]", "optimizer.optimizer_cuda_graph=false"]


def default_rows(cfg: Config) -> list[str]:
    if cfg.model.num_moe_experts:
        return MOE_ROWS
    if cfg.model.hybrid_override_pattern:
        return ["eager", "full_iteration", "full_iteration+optimizer", "local[attn,mamba]", "local[]"]
    return DENSE_ROWS


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
    m = re.fullmatch(r"(local|te)\[([a-z_,]*)\]", name)
    if m:
        impl = "local" if m.group(1) == "local" else "transformer_engine"
        return NO_GRAPH + [f"model.cuda_graph_impl={impl}", f"model.cuda_graph_modules=[{m.group(2)}]"]
    return None


def _builder(name: str, base: Config, device: torch.device) -> Callable[[], tuple]:
    overrides = row_overrides(name)
    if overrides is not None:
        cfg = row_config(base, overrides)

        def build() -> tuple:
            step, w, runner = graphstep_row(cfg, device)
            capture = (lambda: sum(r.seconds for r in runner.backend.reports)) if runner.backend else None
            return step, w.data(), capture, runner

        return build
    cfg = row_config(base, NO_GRAPH)
    if name == "manual_graph":
        return lambda: manual_graph(cfg, device)
    if name == "make_graphed_callables":
        return lambda: make_graphed(cfg, device)
    raise ValueError(f"unknown bench row {name!r}")


def environment(device: torch.device) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(device)
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": props.name,
        "gpu_memory_gib": round(props.total_memory / 1024**3, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def run_bench(cfg: Config, rows: list[str], *, recipe: str, iters: int = 50, warmup: int = 8,
              profile_iters: int = 5, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every row on this process's GPU; returns the result document."""
    if not torch.cuda.is_available():
        raise RuntimeError("graphstep bench measures CUDA graphs: it needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    peak = matmul_tflops(device)
    probe = make_workload(row_config(cfg, NO_GRAPH), device, n_steps=1)
    flops = flops_per_step(cfg, probe.model)
    del probe
    warmup = max(warmup, cfg.model.cuda_graph_warmup_steps + 2)
    results: list[Row] = []
    for name in rows:
        if progress is not None:
            progress(name)
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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = doc["environment"]
    stem = f"{doc['recipe']}_{env['gpu'].replace(' ', '-')}_{env['date']}"
    path = out / f"{stem}.json"
    path.write_text(json.dumps(doc, indent=1))
    path.with_suffix(".md").write_text(markdown_table(doc))
    return path


def table(doc: dict[str, Any]) -> Any:
    from rich.table import Table

    env = doc["environment"]
    t = Table(title=f"{doc['recipe']} on {env['gpu']} (torch {env['torch']}, CUDA {env['cuda']}, {env['date']})")
    for col in ("row", "step ms", "busy ms", "host ms", "kernels", "speed-up", "step/floor", "peak GiB",
                "mem/eager", "capture s", "tok/s", "TFLOP/s", "MFU"):
        t.add_column(col, justify="right" if col != "row" else "left")
    for r in doc["rows"]:
        if r["error"]:
            t.add_row(r["name"], f"error: {r['error'][:80]}", *[""] * 11)
            continue
        t.add_row(
            r["name"], _f(r["step_ms"], 3), _f(r["busy_ms"], 3), _f(r["host_ms"], 3), str(r["kernels"]),
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
    lines = ["| row | step ms | GPU-busy ms | host ms | kernels | speed-up | step/floor | peak GiB | mem/eager "
             "| capture s | MFU |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        if r["error"]:
            lines.append(f"| {r['name']} | failed: {r['error'].splitlines()[0][:120]} | | | | | | | | | |")
            continue
        lines.append(
            f"| {r['name']} | {_f(r['step_ms'], 3)} | {_f(r['busy_ms'], 3)} | {_f(r['host_ms'], 3)} | {r['kernels']} "
            f"| {_f(r['speedup'], 2, 'x')} | {_f(r['floor_ratio'], 2, 'x')} | {_f(r['peak_allocated_gib'], 3)} "
            f"| {_f(r['memory_vs_eager'], 2, 'x')} | {_f(r['capture_s'], 2)} "
            f"| {_f(r['mfu'] * 100 if r['mfu'] else None, 1, '%')} |"
        )
    return head + "\n".join(lines) + "\n"


def _f(v: Any, digits: int, suffix: str = "") -> str:
    return "-" if v is None else f"{v:,.{digits}f}{suffix}"
