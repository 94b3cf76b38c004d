"""``graphstep doctor --recipe R``: a recipe's training step, judged where its graphs capture.

1. Every validation rule (``validate_config``): violations are findings of
   category ``config`` and the step is not run.
2. The run is built by the trainer's own ``build_run`` (training/build.py:
   model -- with ``model.hf_path``, its shape and weights --, optimizer,
   steps, RNG tracker and graphs exactly as ``graphstep train`` builds them;
   one rank, on the CPU, GPU simulated), with a few batches of the recipe's
   data.
3. The run's graphs are captured through :class:`DryBackend`, handed to
   ``build_run`` as its backend: its captures run the
   region once, eagerly, under the analyzer, and its replays do nothing (the
   region already ran). So exactly what the config captures is judged --
   the full iteration, the evaluation step, the optimizer step, or each
   per-layer scope -- and what it leaves eager is not.
4. One warm-up iteration (``cuda_graph_warmup_steps`` only delays the
   capture), then the iteration that captures. With ``cuda_graph_impl=none``
   the whole step (forward, backward and optimizer over all micro-batches) is
   judged as a full-iteration graph would capture it.

Big recipes (llama3_8b ...) are too slow to build on a CPU: unless
``full_size``, the doctor shrinks widths, depth, vocabulary and micro-batches
to a proxy of the same structure (same layer kinds, attention grouping,
experts and routing, graph settings) and says so in the report. Fields the
user overrode are kept; a proxy starts from random weights (never ``model.hf_path``'s,
which have the recipe's shape). Before building, the trainer's memory estimate
(training/memory.py: parameters counted on the meta device, nothing
allocated) is checked against the host's available RAM: a model that does not
fit is refused in one line (exit 2) that says how much it needs and names
the fix, instead of growing until the machine swaps or kills it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from typing import Any, Iterator

import torch

from ..config import Config
from ..cuda_graph.devices import GiB
from ..training.memory import HEADROOM, SKIP_ENV, available_memory, estimate_memory
from ..parallel.dims import ParallelDims
from ..training.rundir import RunSetupError
from ..cuda_graph.backend import CaptureReport, Graph, GraphBackend
from ..validation import resolve_cuda_graph_settings, validate_config
from .findings import Finding, Report
from .session import Session

log = logging.getLogger("graphstep")

# A recipe above these sizes runs as a proxy unless full_size (or the user overrode the fields).
MAX_PARAMS = 60_000_000
MAX_TOKENS_PER_STEP = 16_384


class _DryGraph(Graph):
    def __init__(self, name: str) -> None:
        self.name, self.report, self._captured = name, None, False

    @property
    def captured(self) -> bool:
        return self._captured

    def replay(self) -> None:  # the capture ran the region already
        return None

    def reset(self) -> None:
        self._captured = False


class DryBackend(GraphBackend):
    """Captures run their region once under the doctor; replays do nothing."""

    name = "doctor"

    def __init__(self, device: torch.device, session: Session | None = None) -> None:
        super().__init__(device)
        self.session = session  # set before the first capture (the session needs the built run)

    def new_graph(self, name: str, *, shared_pool: bool = True) -> Graph:
        return self._track(_DryGraph(name))

    @contextlib.contextmanager
    def capture(self, graph: Graph, generators: Any = ()) -> Iterator[None]:
        t0 = time.perf_counter()
        self.session.generators |= {id(g) for g in generators}
        with self.session.region(graph.name):
            yield
        graph._captured = True
        graph.report = CaptureReport(graph.name, time.perf_counter() - t0, 0, 0, 0, 0)
        self.reports.append(graph.report)

    def memory(self) -> tuple[int, int]:
        return 0, 0


def estimate_params(cfg: Config) -> int:
    m = cfg.model
    heads_dim = m.kv_channels or m.hidden_size // max(1, m.num_attention_heads)
    groups = m.num_query_groups or m.num_attention_heads
    attn = m.hidden_size * heads_dim * (2 * m.num_attention_heads + 2 * groups)
    if m.num_moe_experts:
        ffn = 3 * m.hidden_size * (m.moe_ffn_hidden_size or m.ffn_hidden_size) * m.num_moe_experts
    else:
        ffn = 3 * m.hidden_size * m.ffn_hidden_size
    return m.num_layers * (attn + ffn) + m.vocab_size * m.hidden_size


def _tokens_per_step(cfg: Config) -> int:
    return cfg.train.global_batch_size * cfg.model.seq_length


def needs_proxy(cfg: Config) -> bool:
    return estimate_params(cfg) > MAX_PARAMS or _tokens_per_step(cfg) > MAX_TOKENS_PER_STEP


def shrink_to_proxy(cfg: Config, keep: set[str] = frozenset()) -> list[str]:
    """Make ``cfg`` a small model of the same structure (in place); returns what changed, for the report."""
    m, tr = cfg.model, cfg.train
    changed: list[str] = []

    def put(section: Any, key: str, value: Any) -> None:
        path = f"{'model' if section is m else 'train'}.{key}"
        old = getattr(section, key)
        if path in keep or old is None or old == value:
            return
        setattr(section, key, value)
        changed.append(f"{path}={old}->{value}")

    groups = m.num_query_groups or m.num_attention_heads
    ratio = max(1, m.num_attention_heads // max(1, groups))
    new_groups = min(groups, 2)
    if not m.hybrid_override_pattern:
        put(m, "num_layers", min(m.num_layers, 2))
    put(m, "hidden_size", 64)
    put(m, "num_attention_heads", new_groups * min(ratio, 4))
    if m.num_query_groups is not None:
        put(m, "num_query_groups", new_groups)
    put(m, "kv_channels", 16)
    put(m, "ffn_hidden_size", 128)
    put(m, "moe_ffn_hidden_size", 32)
    if m.moe_shared_expert_intermediate_size:
        put(m, "moe_shared_expert_intermediate_size", 32)
    put(m, "vocab_size", min(m.vocab_size, 512))
    put(m, "seq_length", min(m.seq_length, 64))
    put(tr, "micro_batch_size", min(tr.micro_batch_size, 2))
    num_mb = max(1, min(2, cfg.train.global_batch_size // max(1, cfg.train.micro_batch_size)))
    put(tr, "global_batch_size", tr.micro_batch_size * num_mb)
    put(tr, "eval_iters", min(tr.eval_iters, 2))
    return changed


def check_recipe(cfg: Config, *, name: str = "recipe", full_size: bool = False, keep: set[str] = frozenset(),
                 proxy: str = "auto") -> Report:
    """Validate ``cfg`` and judge its training step as its graphs would capture it (see module docstring).

    ``proxy``: "auto" (shrink big recipes unless ``full_size``), "always" or "never". ``keep``: dotted
    fields the user set, never shrunk.
    """
    from ..models.hf import with_hf_shape

    report = Report(f"recipe {name}")
    cfg = with_hf_shape(cfg)  # as the trainer does: model.hf_path's shape, before any rule
    for v in validate_config(cfg):
        report.add(Finding("config", v.rule, None, why=v.message, fix=v.fix, detail=", ".join(v.fields)))
    if report.findings:
        report.notes.append("the configuration breaks rules: the step was not run (fix the config first)")
        return report
    if ParallelDims.from_config(cfg, 1).needs_mesh:  # tensor parallel, FSDP2 or pipeline stages
        report.add(Finding("config", "layout", None, why="the doctor judges one unsharded rank; with tensor "
                           "parallel, FSDP2 or pipeline stages it would judge another model than the run trains",
                           fix="dry-run the layout on the CPU replay backend under torchrun (train.device=cpu, "
                           "docs/parallel.md): a capture error there names the op and your line",
                           detail="model.tensor_model_parallel_size, ddp.use_megatron_fsdp, "
                           "ddp.use_distributed_optimizer, model.pipeline_model_parallel_size"))
        report.notes.append("the step was not run: its layout is not judged by the doctor")
        return report
    cfg = copy.deepcopy(cfg)
    if proxy == "always" or (proxy == "auto" and not full_size and needs_proxy(cfg)):
        changed = shrink_to_proxy(cfg, set(keep))
        if changed:
            log.info("doctor: %s is big for a CPU run: judging a proxy of the same structure (%s); --full-size "
                     "runs it as configured", name, ", ".join(changed))
            report.notes.append(f"proxy of the same structure (about {estimate_params(cfg) / 1e6:.1f}M parameters; "
                                "--full-size runs the recipe as configured): " + ", ".join(changed))
            if cfg.model.hf_path:  # its weights have the recipe's shape, not the proxy's
                report.notes.append(f"the proxy starts from random weights, not model.hf_path={cfg.model.hf_path}")
                cfg.model.hf_path = None
    cfg.train.device = "cpu"
    if cfg.model.cuda_graph_warmup_steps != 1:
        report.notes.append(f"one warm-up iteration instead of {cfg.model.cuda_graph_warmup_steps} "
                            "(the count only delays the capture)")
        cfg.model.cuda_graph_warmup_steps = 1
    _check_host_memory(cfg, name, full_size)
    settings = resolve_cuda_graph_settings(cfg)
    _run(cfg, settings, report)
    return report


def _check_host_memory(cfg: Config, name: str, full_size: bool) -> None:
    """Refuse (``RunSetupError``, exit 2) a judged run that would not fit the host's RAM; say when it is big."""
    if os.environ.get(SKIP_ENV) == "1":
        return
    device = torch.device("cpu")
    try:
        estimate = estimate_memory(cfg, device)
    except Exception as exc:  # a shape the meta build cannot take: the real build will say why
        log.debug("doctor: no memory estimate (%s: %s)", type(exc).__name__, exc)
        return
    free = available_memory(device)
    if estimate.total > HEADROOM * free:
        fix = ("drop --full-size to judge a proxy of the same structure" if full_size else
               "smaller model.* or train.micro_batch_size overrides (fields you set are never shrunk)")
        raise RunSetupError(f"--recipe {name} as judged needs about {estimate.total / GiB:.1f} GiB of host RAM "
                            f"but {free / GiB:.1f} GiB are available "
                            f"({estimate.breakdown()}); {fix} ({SKIP_ENV}=1 skips this check)")
    if estimate.parameters > MAX_PARAMS:
        log.info("doctor: building %s as configured on the CPU (%.2fB parameters, about %.1f GiB): this takes a while",
                 name, estimate.parameters / 1e9, estimate.total / GiB)


def _parts(run: Any, cfg: Config, settings: Any) -> dict[str, Any]:
    """What the judged iterations use: the run's pieces and the recipe's data (one rank)."""
    from ..data import build_data

    valid = build_data(cfg, split="valid") if cfg.train.eval_iters > 0 and settings.full_iteration else None
    return dict(model=run.model, optimizer=run.optimizer, train_step=run.train_step, eval_step=run.eval_step,
                run=run, data=build_data(cfg, split="train"), valid=valid, num_mb=run.num_micro_batches,
                eval_iters=cfg.train.eval_iters)


def _run(cfg: Config, settings: Any, report: Report) -> None:
    from ..training.build import RunOptions, build_run

    device = torch.device("cpu")
    backend = DryBackend(device)
    run = build_run(cfg, RunOptions(device, settings=settings, backend=backend))
    try:
        parts = _parts(run, cfg, settings)
        roots = {k: parts[k] for k in ("model", "optimizer", "train_step", "eval_step")}
        session = backend.session = Session(report, simulated=True, roots=roots)
        runner = run.runner
        report.notes.append(f"judged: {runner.describe if settings.enabled else 'the whole step (cuda_graph_impl=none)'}")
        with session:
            try:
                if settings.enabled:
                    _graphed(session, runner, parts)
                else:
                    _whole_step(session, parts)
            except Exception as exc:
                session.error(exc)
    finally:
        run.close()
    if settings.enabled and not run.runner.reports and not report.findings:
        report.notes.append("no region was captured")


def _graphed(session: Session, runner: Any, parts: dict[str, Any]) -> None:
    data, valid = parts["data"], parts["valid"]

    def iteration() -> None:
        runner.optimizer_step(runner.train_step(data))
        if valid is not None:
            runner.evaluate(valid, parts["eval_iters"])

    with session.warmup():
        iteration()
    with session.tracked():  # the captures happen in this iteration
        iteration()


def _whole_step(session: Session, parts: dict[str, Any]) -> None:
    # the run's training step on batches already where the graph's static buffers would be, then its optimizer
    step, optimizer, data = parts["train_step"], parts["optimizer"], parts["data"]
    skip = parts["run"].cfg.train.skip_step_on_nan

    def run(batches: list[Any]) -> None:
        out = step(batches)
        optimizer.step(out.get("nonfinite") if skip else None)

    # the same batch tensors both times: a graph reads its static input buffers, copied in outside it
    batches = [next(data) for _ in range(parts["num_mb"])]
    with session.warmup():
        run(batches)
    with session.region("train step (forward, backward and optimizer)"):
        run(batches)
