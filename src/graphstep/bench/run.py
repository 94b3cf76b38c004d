"""``run_bench(cfg, rows)``: measure the rows of one shape and write the results.

Row names: ``eager``; graphstep settings ``full_iteration``,
``full_iteration+optimizer``, ``local[attn]``, ``local[mlp]``,
``local[attn,mlp]``, ``local[]`` (whole layer), ``te[...]`` (Transformer
Engine semantics), MoE scopes such as ``local[attn,moe_router,moe_preprocess]``;
``lora_<row>`` (the row fine-tuning LoRA adapters on the frozen model, against ``<row>`` fine-tuning every
weight: its step time and peak memory beside it) and ``fp8_<row>``; peers ``manual_graph``,
``make_graphed_callables`` and ``compile[reduce-overhead]`` (bench/peers.py), ``torchtitan_cuda_graph``
(bench/torchtitan_peer.py), ``megatron_full_cuda_graph`` and
``megatron_full_cuda_graph@VERSION`` (bench/megatron_peer.py; what each peer
captures: ``CAPTURES``), and ``compile+full_iteration``:
graphstep's full-iteration graph around ``torch.compile(model)`` (Inductor's
fused kernels, default mode, and no launch overhead). ``fp8_<row>`` is the row
with the decoder layers' linear layers in FP8 (torchao, current scaling), and
``fp8_delayed_<row>`` with delayed scaling (converters/fp8_delayed.py); each
faces the same row in bf16 (``compile+fp8_full_iteration`` and ``compile+fp8_delayed_full_iteration``:
``compile+full_iteration``).

Layout prefixes (bench/layouts.py) run a graphstep row over every rank of
the world: ``fsdp_`` and ``zero2_`` (also on one GPU, a one-rank mesh), and under torchrun
``dp_``, ``dp_overlap_``, ``tp_``, ``pp_`` and ``ep_`` (bench/ranks.py). A
prefixed row's config is checked against every rule at the world size before
anything is measured; a refused row is reported with the rules' messages
and not built.
"""

from __future__ import annotations

import datetime
import json
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import Config
from ..cuda_graph.devices import GiB, normalize_device
from ..training.flops import flops_per_step
from ..parallel.dims import ParallelDims
from ..validation import validate_config
from .harness import Row, combine_rounds, finish, graphstep_row, make_workload, matmul_tflops, measure, row_config
from .layouts import batch_overrides, check_world, layout_overrides, multi_rank_rows, split_prefix
from .peers import compiled, make_graphed, manual_graph
from .ranks import Ranks, world_size_from_env

DENSE_ROWS = [
    "eager", "full_iteration", "full_iteration+optimizer", "local[attn]", "local[mlp]", "local[attn,mlp]",
    "local[]", "te[attn,mlp]", "manual_graph", "make_graphed_callables", "compile[reduce-overhead]", "compile",
    "compile+full_iteration", "compile+local[attn,mlp]", "torchtitan_cuda_graph", "megatron_full_cuda_graph",
]
MOE_ROWS = [
    "eager", "full_iteration", "full_iteration+optimizer", "local[attn,moe_router,moe_preprocess]",
    "local[moe_router]", "local[attn,moe]", "manual_graph",
]
HYBRID_ROWS = ["eager", "full_iteration", "full_iteration+optimizer", "local[attn,mamba]", "local[]", "manual_graph"]
# fp8_<row>: the row with the decoder layers' linear layers in FP8 (current scaling; e4m3 forward, e5m2 gradients);
# fp8_delayed_<row>: the same with delayed scaling (Bridge's delayed preset: an amax history of 1024 steps, max)
FP8_PREFIX = "fp8_"
FP8_OVERRIDES = ["mixed_precision.fp8=hybrid", "mixed_precision.fp8_recipe=tensorwise"]
# lora_<row>: the row fine-tuning LoRA adapters (Bridge's defaults: rank 32 on linear_qkv, linear_proj, linear_fc1,
# linear_fc2) on the frozen model: converters/lora.py; its peer is the row fine-tuning every weight
LORA_PREFIX = "lora_"
LORA_OVERRIDES = ["peft=lora"]
FP8_DELAYED_PREFIX = "fp8_delayed_"
FP8_DELAYED_OVERRIDES = ["mixed_precision.fp8=hybrid", "mixed_precision.fp8_recipe=delayed",
                         "mixed_precision.fp8_amax_history_len=1024", "mixed_precision.fp8_amax_compute_algo=max"]
# the FP8 rows beside their bf16 rows (scripts/gpu-check runs them on dense_1b_bench and llama3_8b_stack_bench)
FP8_ROWS = ["eager", "full_iteration", "local[attn,mlp]", "compile+full_iteration", "fp8_eager", "fp8_full_iteration",
            "fp8_local[attn,mlp]", "compile+fp8_full_iteration", "fp8_delayed_full_iteration",
            "compile+fp8_delayed_full_iteration"]
OPTIMIZER_SUFFIX = "+optimizer"  # ``local[attn,mlp]+optimizer``: the row with optimizer.optimizer_cuda_graph=true
NO_GRAPH = ["model.cuda_graph_impl=none", "model.cuda_graph_modules=[]", "optimizer.optimizer_cuda_graph=false"]
REFUSED = "refused"  # the note of a row the config rules refused (not built)
# What each peer row captures, so a comparison with graphstep's rows is read fairly (shown under the tables).
CAPTURES = {
    "manual_graph": "whole step, one hand-written torch.cuda.graph (forward, backward of every micro-batch, "
                    "optimizer)",
    "make_graphed_callables": "per layer: torch.cuda.make_graphed_callables on each attention and MLP block",
    "compile[reduce-overhead]": "per micro-batch: torch.compile's CUDA graph trees (forward and backward), "
                                "optimizer eager",
    "torchtitan_cuda_graph": "per micro-batch: torchtitan's CUDAGraphWrapper around forward+backward, one graph "
                             "replayed per micro-batch, optimizer eager",
    "megatron_full_cuda_graph": "forward+backward of every micro-batch in one graph (Megatron Core's "
                                "FullCudaGraphWrapper), optimizer eager",
}


def captures(name: str) -> str | None:
    """What the peer row ``name`` captures (``megatron_full_cuda_graph@0.16.1`` as its unversioned row)."""
    return CAPTURES.get(name.split("@")[0])


def default_rows(cfg: Config, world_size: int = 1) -> list[str]:
    if world_size > 1:  # under torchrun: the layouts that fit the model (bench/layouts.py)
        return multi_rank_rows(cfg, world_size)
    if cfg.model.num_moe_experts:
        return MOE_ROWS
    if cfg.model.hybrid_override_pattern:
        return HYBRID_ROWS
    return DENSE_ROWS


def split_rows(text: str) -> list[str]:
    """``eager,local[attn,mlp],manual_graph`` -> the three rows (commas inside brackets stay)."""
    return [r for r in re.split(r",(?![^\[]*\])", text) if r]


def row_overrides(name: str, world_size: int = 1) -> list[str] | None:
    """Config overrides of a graphstep row on ``world_size`` ranks (the global batch aside: ``batch_overrides``);
    None for a peer."""
    if name == "eager":
        return NO_GRAPH
    if name == "full_iteration":
        return NO_GRAPH + ["model.cuda_graph_impl=full_iteration"]
    if name == "full_iteration+optimizer":
        return NO_GRAPH + ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"]
    if name.endswith(OPTIMIZER_SUFFIX):  # a per-layer row with the optimizer step captured too
        inner = row_overrides(name[: -len(OPTIMIZER_SUFFIX)], world_size)
        return None if inner is None else inner + ["optimizer.optimizer_cuda_graph=true"]
    if name.startswith(FP8_DELAYED_PREFIX):  # the row in FP8 with delayed scaling: converters/fp8_delayed.py
        inner = row_overrides(name[len(FP8_DELAYED_PREFIX):], world_size)
        return None if inner is None else inner + FP8_DELAYED_OVERRIDES
    if name.startswith(FP8_PREFIX):  # the row in FP8 (torchao float8, tensorwise, every decoder layer): converters/fp8.py
        inner = row_overrides(name[len(FP8_PREFIX):], world_size)
        return None if inner is None else inner + FP8_OVERRIDES
    if name.startswith(LORA_PREFIX):  # the row with LoRA adapters on the frozen model: converters/lora.py
        inner = row_overrides(name[len(LORA_PREFIX):], world_size)
        return None if inner is None else inner + LORA_OVERRIDES
    prefix, inner = split_prefix(name)
    if prefix:  # the one-process row ``inner`` on a layout over the world (fsdp_, zero2_ on one GPU: a one-rank mesh)
        graph = None if split_prefix(inner)[0] else row_overrides(inner)
        return None if graph is None else graph + layout_overrides(prefix, inner, world_size)
    if name.startswith("compile+") or name == "compile":  # the trainer's compile section (compile.enable)
        inner = row_overrides(name[len("compile+"):]) if name != "compile" else NO_GRAPH
        return None if inner is None else inner + ["compile.enable=true"]
    m = re.fullmatch(r"(local|te)\[([a-z_,]*)\]", name)
    if m:
        impl = "local" if m.group(1) == "local" else "transformer_engine"
        return NO_GRAPH + [f"model.cuda_graph_impl={impl}", f"model.cuda_graph_modules=[{m.group(2)}]"]
    return None


@dataclass
class RowPlan:
    """A row before it is measured: its config, layout and, for a prefixed row the rules refuse, why."""

    name: str
    cfg: Config  # the row's config (a peer: the recipe with graphstep's graphs off)
    graphstep: bool  # built by build_run; False for a peer
    layout: ParallelDims | None = None
    refusal: str | None = None

    def describe(self, row: Row) -> None:
        """Record the row's layout and batch on its result."""
        if not self.graphstep or self.layout is None:
            return
        row.layout, row.ranks = self.layout.describe(), self.layout.ranks
        row.global_batch = self.cfg.train.global_batch_size
        row.tokens_per_step = row.global_batch * self.cfg.model.seq_length


def plan_row(base: Config, name: str, world_size: int = 1) -> RowPlan:
    """The row ``name`` of the recipe ``base`` on ``world_size`` ranks; a prefixed row is checked against
    every rule there (``refusal``: the violations, one per line)."""
    overrides = row_overrides(name, world_size)
    if overrides is None:
        return RowPlan(name, row_config(base, NO_GRAPH), graphstep=False)
    cfg = row_config(base, overrides)
    if not split_prefix(name)[0]:
        return RowPlan(name, cfg, graphstep=True, layout=ParallelDims.from_config(cfg, 1))
    cfg = row_config(cfg, batch_overrides(cfg, world_size))
    violations = validate_config(cfg, world_size=world_size)
    refusal = None
    if violations:
        rules = ", ".join(sorted({v.rule for v in violations}))
        ranks = f"{world_size} rank" + ("s" if world_size > 1 else "")
        refusal = f"refused by the config rules ({rules}; {ranks}): " + "\n".join(map(str, violations))
    return RowPlan(name, cfg, graphstep=True, layout=ParallelDims.from_config(cfg, world_size), refusal=refusal)


def _builder(name: str, base: Config, device: torch.device, world_size: int = 1) -> Callable[[], tuple]:
    """The build function of row ``name`` of the recipe ``base`` (``measure`` calls it)."""
    return _plan_builder(plan_row(base, name, world_size), device, world_size)


def _plan_builder(plan: RowPlan, device: torch.device, world_size: int) -> Callable[[], tuple]:
    name, cfg = plan.name, plan.cfg
    if plan.graphstep:
        compile_mode = "default" if name.startswith("compile+") or name == "compile" else None

        def build() -> tuple:
            step, w, runner = graphstep_row(cfg, device, compile_mode=compile_mode, world_size=world_size)
            capture = (lambda: sum(r.seconds for r in runner.reports)) if runner.backend else None
            return step, w.data(), capture, runner

        return build
    if name == "manual_graph":
        return lambda: manual_graph(cfg, device)
    if name == "make_graphed_callables":
        return lambda: make_graphed(cfg, device)
    m = re.fullmatch(r"compile\[([a-z-]+)\]", name)
    if m:
        return lambda: compiled(cfg, device, mode=m.group(1))
    m = re.fullmatch(r"megatron_full_cuda_graph(?:@([0-9][0-9a-z.]*))?", name)
    if m:

        def build_megatron() -> tuple:
            from .megatron_peer import megatron_full_graph  # megatron-core (a wheel) is imported only here

            return megatron_full_graph(cfg, device, version=m.group(1))

        return build_megatron
    if name == "torchtitan_cuda_graph":

        def build_torchtitan() -> tuple:
            from .torchtitan_peer import torchtitan_graph  # torchtitan (a wheel) is imported only here

            return torchtitan_graph(cfg, device)

        return build_torchtitan
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
        **({"torchao": _version("torchao")} if _version("torchao") else {}),  # the FP8 rows' engine
    }


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def run_bench(cfg: Config, rows: list[str], *, recipe: str, iters: int = 50, warmup: int = 8,
              profile_iters: int = 5, progress: Callable[[int, str], None] | None = None,
              world_size: int | None = None, rounds: int = 1, host_top: int = 0) -> dict[str, Any] | None:
    """Measure every row on this process's GPU; returns the result document.

    ``world_size`` (default: torchrun's ``WORLD_SIZE``, 1 without torchrun): with more than one rank
    every rank measures every row in lockstep (bench/ranks.py), and only rank 0 gets the document (the
    others None). ``rounds``: every row is measured that many times, the rows interleaved round by round
    (bench/harness.py). ``progress(rows_done, name)`` is called before each row of each round. ``host_top``
    > 0: each row's host profile (that many Python functions by own time, first round only).
    """
    world = world_size_from_env() if world_size is None else world_size
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: a bench runs every row at least once (rounds >= 1)")
    check_world(rows, world, recipe)  # before anything is built: the refusal says what to launch instead
    if not torch.cuda.is_available():
        raise RuntimeError("graphstep bench measures CUDA graphs: it needs a CUDA GPU")
    plans = [plan_row(cfg, name, world) for name in rows]
    ranks = Ranks.join(plan_row(cfg, "dp_eager", world).cfg, world) if world > 1 else None  # cuda:LOCAL_RANK
    try:
        doc = _measure_rows(cfg, plans, recipe=recipe, iters=iters, warmup=warmup, profile_iters=profile_iters,
                            progress=progress, ranks=ranks, rounds=rounds, host_top=host_top)
    finally:
        if ranks is not None:
            ranks.close()  # after every row was freed
    return doc if ranks is None or ranks.is_main else None


def _measure_rows(cfg: Config, plans: list[RowPlan], *, recipe: str, iters: int, warmup: int, profile_iters: int,
                  progress: Callable[[int, str], None] | None, ranks: Ranks | None, rounds: int = 1,
                  host_top: int = 0) -> dict[str, Any]:
    world = 1 if ranks is None else ranks.world_size
    device = normalize_device("cuda")
    peak = matmul_tflops(device)
    probe = make_workload(row_config(cfg, NO_GRAPH), device, n_steps=1)  # one unsharded rank, for the FLOPs
    flops = flops_per_step(cfg, probe.model)
    del probe
    warmup = max(warmup, cfg.model.cuda_graph_warmup_steps + 2)
    measured: list[list[Row]] = [[] for _ in plans]
    for round_ in range(rounds):  # A B C A B C ...: the rows of one round share its host conditions
        for k, plan in enumerate(plans):
            if progress is not None:
                progress(round_ * len(plans) + k, plan.name)
            if plan.refusal is not None:  # the same on every rank: none builds it
                if round_ == 0:
                    measured[k].append(Row(plan.name, error=plan.refusal, note=REFUSED))
                continue
            measured[k].append(measure(plan.name, _plan_builder(plan, device, world), warmup=warmup, iters=iters,
                                       profile_iters=profile_iters, device=device, lockstep=ranks,
                                       host_top=host_top if round_ == 0 else 0))
    results = [combine_rounds(rows) for rows in measured]
    for plan, row in zip(plans, results):
        plan.describe(row)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    finish(results, tokens_per_step=tokens, flops_per_step=flops, peak_tflops=peak)
    m = cfg.model
    method = {"iters": iters, "warmup": warmup, "profile_iters": profile_iters, "rounds": rounds,
              "step": "median CUDA-event interval between back-to-back iterations"
                      + (f"; the median over {rounds} interleaved rounds" if rounds > 1 else ""),
              "busy": "sum of device activity durations per iteration (torch.profiler)"}
    if world > 1:
        method["ranks"] = (f"{world} processes (torchrun), one per GPU, every row in lockstep; times are rank 0's, "
                           "peak memory the maximum over ranks; tokens/s and TFLOP/s are the job's, MFU against "
                           "the peak of all its GPUs")
    return {
        "recipe": recipe,
        "environment": environment(device),
        "world_size": world,
        "shape": {"layers": m.num_layers, "hidden": m.hidden_size, "seq": m.seq_length, "vocab": m.vocab_size,
                  "micro_batch": cfg.train.micro_batch_size, "global_batch": cfg.train.global_batch_size,
                  "experts": m.num_moe_experts, "pattern": m.hybrid_override_pattern},
        "method": method,
        "bf16_matmul_tflops": peak,
        "flops_per_step": flops,
        "rows": [r.as_dict() for r in results],
    }


def gpus(doc: dict[str, Any]) -> str:
    """``NVIDIA H200``, or ``2 x NVIDIA H200`` for a run over several ranks."""
    world, gpu = doc.get("world_size", 1), doc["environment"]["gpu"]
    return f"{world} x {gpu}" if world > 1 else gpu


def result_stem(doc: dict[str, Any]) -> str:
    """``<recipe>_<gpu>_<date>``; ``<recipe>_<N>x<gpu>_<date>`` for a run over N ranks; ``_rounds<R>`` after it
    for a run of R rounds (its rows are usually a subset: it must not replace the day's full run)."""
    env, world, rounds = doc["environment"], doc.get("world_size", 1), _rounds(doc)
    return (f"{doc['recipe']}_{f'{world}x' if world > 1 else ''}{env['gpu'].replace(' ', '-')}_{env['date']}"
            + (f"_rounds{rounds}" if rounds > 1 else ""))


def _rounds(doc: dict[str, Any]) -> int:
    return doc.get("method", {}).get("rounds", 1)


def write_results(doc: dict[str, Any], out_dir: str | Path) -> Path:
    """``result_stem(doc)``: .json (everything), .md (the table) and .png (the chart, with matplotlib)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result_stem(doc)}.json"
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
    fig.suptitle(f"{doc['recipe']} -- {gpus(doc)}, torch {env['torch']}, CUDA {env['cuda']}, {env['date']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(doc: dict[str, Any]) -> Any:
    from rich.markup import escape
    from rich.table import Table

    env = doc["environment"]
    multi = doc.get("world_size", 1) > 1  # a layout column: each row's ranks and global batch
    t = Table(title=f"{doc['recipe']} on {gpus(doc)} (torch {env['torch']}, CUDA {env['cuda']}, {env['date']})")
    rounds = _rounds(doc)
    spread = ("rounds min-max",) if rounds > 1 else ()
    columns = ("row", "step ms", *spread, "busy ms", "host ms", "issue ms", "kernels", "speed-up", "step/floor",
               "vs peer", "peak GiB", "mem/eager", "capture s", "tok/s", "TFLOP/s", "MFU")
    for col in columns + (("layout",) if multi else ()):
        t.add_column(col, justify="right" if col not in ("row", "layout", "vs peer") else "left")
    for r in doc["rows"]:
        name = escape(r["name"])  # "local[attn,mlp]" is not rich markup
        layout = (escape(_layout(r)),) if multi else ()
        if r["error"]:
            t.add_row(name, f"error: {escape(r['error'][:80])}", *[""] * (13 + len(spread)), *layout)
            continue
        t.add_row(
            name, _f(r["step_ms"], 3), *((_spread(r),) if spread else ()), _f(r["busy_ms"], 3), _f(r["host_ms"], 3),
            _f(r.get("issue_ms"), 3), str(r["kernels"]), _f(r["speedup"], 2, "x"), _f(r["floor_ratio"], 2, "x"),
            escape(_vs_peer(r)), _f(r["peak_allocated_gib"], 2), _f(r["memory_vs_eager"], 2, "x"),
            _f(r["capture_s"], 2), _f(r["tokens_per_s"], 0), _f(r["tflops"], 1),
            _f(r["mfu"] * 100 if r["mfu"] else None, 1, "%"), *layout,
        )
    return t


def _spread(r: dict[str, Any]) -> str:
    """``5.12-6.57``: the fastest and slowest round's step time (ms)."""
    times = r.get("step_ms_rounds") or []
    return f"{min(times):.3f}-{max(times):.3f}" if times else "-"


def _vs_peer(r: dict[str, Any]) -> str:
    """``0.83x make_graphed_callables``, with the rounds' range ``(0.80-0.90x, ahead in 3/3)`` after several; a
    ``lora_`` row adds its peak memory against full fine-tuning (``, memory 0.41x``)."""
    if r.get("vs_peer") is None:
        return "-"
    ratios = r.get("vs_peer_rounds") or []
    spread = ""
    if len(ratios) > 1:
        spread = f" ({min(ratios):.2f}-{max(ratios):.2f}x, ahead in {sum(x < 1 for x in ratios)}/{len(ratios)})"
    memory = f", memory {r['memory_vs_peer']:.2f}x" if r.get("memory_vs_peer") and r["name"].startswith("lora_") else ""
    return f"{r['vs_peer']:.2f}x {r['peer']}{spread}{memory}"


def markdown_table(doc: dict[str, Any]) -> str:
    """The rows as a Markdown table (README, docs/perf-log.md, gpu-check summaries)."""
    env, world = doc["environment"], doc.get("world_size", 1)
    ranks = (f"; {world} ranks under torchrun: step = rank 0's, peak = the maximum over ranks, ratios against "
             "the eager row of the same layout" if world > 1 else "")
    ao = f", torchao {env['torchao']}" if env.get("torchao") else ""
    head = (f"{doc['recipe']} -- {gpus(doc)}, torch {env['torch']}{ao}, CUDA {env['cuda']}, {env['date']} "
            f"(bf16 matmul {doc['bf16_matmul_tflops']:.0f} TFLOP/s measured{ranks})\n\n")
    rounds = _rounds(doc)
    if rounds > 1:
        head += (f"{rounds} rounds, the rows interleaved: step = the median of the rounds' medians, vs peer = the "
                 "median of each round's ratio (range, rounds ahead of the peer)\n\n")
    extra = (" layout |", "---|") if world > 1 else ("", "")  # each row's ranks and global batch
    spread = (" rounds min-max ms |", "---|") if rounds > 1 else ("", "")
    lines = ["| row | step ms | GPU-busy ms | host ms | issue ms | kernels | host syncs | speed-up | step/floor "
             "| peak GiB | mem/eager | capture s | MFU | vs peer |" + spread[0] + extra[0],
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + spread[1] + extra[1]]
    for r in doc["rows"]:
        layout = f" {_layout(r)} |" if world > 1 else ""
        gap = " |" if rounds > 1 else ""
        if r["error"]:
            lines.append(f"| {r['name']} | failed: {r['error'].splitlines()[0][:120]} | | | | | | | | | | | | |"
                         f"{gap}{layout}")
            continue
        lines.append(
            f"| {r['name']} | {_f(r['step_ms'], 3)} | {_f(r['busy_ms'], 3)} | {_f(r['host_ms'], 3)} "
            f"| {_f(r.get('issue_ms'), 3)} | {r['kernels']} "
            f"| {'-' if r.get('host_syncs') is None else r['host_syncs']} "
            f"| {_f(r['speedup'], 2, 'x')} | {_f(r['floor_ratio'], 2, 'x')} | {_f(r['peak_allocated_gib'], 3)} "
            f"| {_f(r['memory_vs_eager'], 2, 'x')} | {_f(r['capture_s'], 2)} "
            f"| {_f(r['mfu'] * 100 if r['mfu'] else None, 1, '%')} | {_vs_peer(r)} |"
            + (f" {_spread(r)} |" if rounds > 1 else "") + layout
        )
    said = [f"- {r['name']}: {captures(r['name'])}" for r in doc["rows"] if captures(r["name"])]
    said += [f"- {r['name']}: {r['note']}" for r in doc["rows"] if r.get("note") and r["note"] != REFUSED]
    return (head + "\n".join(lines) + "\n" + ("\nPeers and notes:\n" + "\n".join(said) + "\n" if said else "")
            + "".join(map(_host_profile_md, doc["rows"])))


def _host_profile_md(r: dict[str, Any]) -> str:
    """A row's host profile (``--host-profile``) as a small table; empty without one."""
    lines = []
    if r.get("host_profile"):
        lines += [f"\nHost profile of {r['name']} (cProfile, the calling thread, per iteration; its overhead "
                  "inflates the times):\n", "| function | calls | own ms | with callees ms |", "|---|---|---|---|"]
        lines += [f"| `{p['function']}` | {p['calls']:.0f} | {p['self_ms']:.3f} | {p['total_ms']:.3f} |"
                  for p in r["host_profile"]]
    if r.get("host_ops"):
        lines += [f"\nHost time of {r['name']}'s torch operators (torch.profiler, every thread -- the backward's "
                  "too --, per iteration):\n", "| operator | calls | own ms | with callees ms |", "|---|---|---|---|"]
        lines += [f"| `{p['op']}` | {p['calls']:.0f} | {p['self_ms']:.3f} | {p['total_ms']:.3f} |"
                  for p in r["host_ops"]]
    return "\n".join(lines) + ("\n" if lines else "")


def _layout(r: dict[str, Any]) -> str:
    """``2 data-parallel ranks, global batch 8``; ``-`` for a peer."""
    if not r.get("layout"):
        return "-"
    return r["layout"] + (f", global batch {r['global_batch']}" if r.get("global_batch") else "")


def _f(v: Any, digits: int, suffix: str = "") -> str:
    return "-" if v is None else f"{v:,.{digits}f}{suffix}"
