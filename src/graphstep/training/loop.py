"""``train(cfg)``: warm-up, capture, replay; evaluation, logging and teardown.

The loop reads top to bottom:

1. validate the config (every rule at once; ``model.hf_path`` first sets
   the model shape from its config.json); join torchrun's process group
   when launched by it (training/distributed.py) and pick the device; then,
   before anything is built, check that every output path is writable
   (training/rundir.py), that the run fits in the device's memory
   (training/memory.py), and lock the output directories against a second
   run -- each a one-line ``RunSetupError`` (exit 2) on every rank;
2. this rank's shard of the data, then the run (``build_run``,
   training/build.py -- the same build the doctor and the bench use): seed
   (per rank, as Megatron does), the model (with ``model.hf_path``, its
   weights copied in before the optimizer takes its fp32 master copy),
   parallelized, gradient buffers, optimizer; the resume from
   ``checkpoint.load`` in place (training/checkpoint.py), before any graph exists;
3. then, in the same ``build_run``, the run's steps and graphs (per-layer
   graphs, full-iteration graph, optimizer graph), so graphs warm up and
   capture counting from the resume iteration;
4. per iteration: forward/backward of all micro-batches (gradients and loss
   averaged over ranks), optimizer step, per-iteration scalars queued on the
   device; on logging steps, one host read of the queued scalars, a log line
   and metrics rows (rank 0 writes them, to TensorBoard and W&B too); the
   profiling window and its phase ranges (observability/); with
   ``train.manual_gc``, garbage collections only between steps (training/manual_gc.py);
5. evaluation every ``train.eval_interval``; a checkpoint every
   ``checkpoint.save_interval`` and at the end;
6. teardown in ``finally``: the run's graphs (and only them: a graph made
   outside the run keeps replaying) freed before anything else goes away --
   at the normal end, after the final evaluation, on exceptions and on
   SIGINT/SIGTERM (which stop every rank after the same step) -- and the
   process group destroyed last, once no graph holds a collective.

Tests and tools reach into a run through :class:`RunHooks` (e.g. a test that
kills the process at iteration N); the loop itself reads no test switches.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..config import Config
from ..cuda_graph.devices import GiB, default_device, normalize_device
from ..cuda_graph.settings import CudaGraphSettings
from ..validation import apply_env_vars, resolve_cuda_graph_settings
from ..data import build_data
from ..models.hf import with_hf_shape
from ..observability import MetricWriters, StepProfiler, open_ranges
from .build import Run, RunOptions, build_run
from .checkpoint import Checkpointer, TrainingState
from .manual_gc import ManualGC
from .console import Console
from .memory import check_memory_fits
from .distributed import DataParallel, group_world_size, init_data_parallel
from .flops import flops_per_step, peak_tflops
from .metrics import MetricsRecorder
from .moe_hooks import KEYS as MOE_KEYS
from .rundir import RunLock, RunSetupError, check_outputs_writable, output_dirs

log = logging.getLogger("graphstep")



@dataclass
class RunHooks:
    """Callbacks into a run (tests use them to inject failures; tools, to observe). Each gets the iteration.

    ``after_iteration(n)``: after iteration n is complete -- metrics recorded, evaluation and
    checkpoint of n done. ``before_checkpoint_rename(n)``: inside the save of iteration n, every
    file written, before the folder is renamed into place (see training/checkpoint.py).
    ``on_capture_error(exc, failed)``: every graph's hook for a capture that fails (GraphedStep's);
    ``graphstep train`` passes the doctor's diagnosis, ``graphstep.doctor.capture_error_hook``, which
    names the line that broke the capture (the trainer does not import the doctor, which sits above it).
    """

    after_iteration: Callable[[int], None] | None = None
    before_checkpoint_rename: Callable[[int], None] | None = None
    on_capture_error: Callable[..., None] | None = None


@dataclass
class TrainResult:
    """What a run did: every metrics row, evaluation losses and the capture summary."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    iterations: int = 0
    stopped_by_signal: bool = False
    capture_seconds: float = 0.0
    graphs: int = 0
    describe: str = "eager"
    nonfinite_iterations: list[int] = field(default_factory=list)
    model: torch.nn.Module | None = None  # kept when train(..., keep_model=True)

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.rows]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return default_device()
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RunSetupError(f"train.device={name} but this machine has no CUDA device; "
                            "use train.device=cpu or auto")
    return normalize_device(name)


class _StopFlag:
    """SIGINT/SIGTERM set a flag; the loop stops after the current step."""

    def __init__(self, enabled: bool) -> None:
        self.set = False
        self.signal: int | None = None
        self._old: dict[int, Any] = {}
        self.enabled = enabled

    def __enter__(self) -> "_StopFlag":
        if self.enabled:
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    self._old[sig] = signal.signal(sig, self._handle)
                except ValueError:  # not the main thread
                    pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.set:  # a second signal: stop now
            raise KeyboardInterrupt
        self.set, self.signal = True, signum
        log.warning("received %s: stopping after the current step", signal.Signals(signum).name)

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _memory(device: torch.device) -> str:
    if device.type == "cuda":
        return (f"mem {torch.cuda.max_memory_allocated(device) / GiB:.2f}/"
                f"{torch.cuda.max_memory_reserved(device) / GiB:.2f} GiB")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return f"rss {rss / GiB:.2f} GiB"


def train(cfg: Config, *, keep_model: bool = False, hooks: RunHooks | None = None) -> TrainResult:
    """Train as ``cfg`` says; returns the metrics of every iteration (and the model if asked)."""
    for line in apply_env_vars(cfg):  # 0: Bridge's env_vars, before CUDA, NCCL or a rule reads the environment
        log.info("env_vars: %s (the environment did not set it)", line)
    cfg = with_hf_shape(cfg)  # model.hf_path: a copy of cfg with the checkpoint's shape, before any rule
    settings = resolve_cuda_graph_settings(cfg, world_size=group_world_size())  # 1: every rule, all violations at once
    dp = init_data_parallel(cfg, settings)  # one rank unless torchrun started us
    try:
        return _train(cfg, settings, dp, keep_model, hooks or RunHooks())
    finally:
        dp.close()  # 6: last -- _train's own finally has freed every graph by now


def _train(cfg: Config, settings: CudaGraphSettings, dp: DataParallel, keep_model: bool,
           hooks: RunHooks) -> TrainResult:
    device = pick_device(cfg.train.device)
    lock = _preflight(cfg, dp, device)
    try:
        return _run(cfg, settings, dp, keep_model, device, hooks)
    finally:
        lock.release()  # on every exit: normal end, exception, SIGINT/SIGTERM (a clean stop)


def _preflight(cfg: Config, dp: DataParallel, device: torch.device) -> RunLock:
    """Writable outputs, enough memory, the run lock (rank 0): every rank fails together, before building."""
    lock = RunLock([d for _, d in output_dirs(cfg)] if dp.is_main else [])
    error: RunSetupError | None = None
    try:
        check_outputs_writable(cfg, metrics=dp.is_main)
        replicas = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1  # ranks share RAM
        check_memory_fits(cfg, device, replicas=replicas, layout=dp.layout)
        lock.__enter__()
    except RunSetupError as exc:
        error = exc
    if dp.any(error is not None):
        lock.release()
        raise error or RunSetupError("another data-parallel rank could not start this run (its message says why)")
    return lock


def _run(cfg: Config, settings: CudaGraphSettings, dp: DataParallel, keep_model: bool,
         device: torch.device, hooks: RunHooks) -> TrainResult:
    data, valid = _build_data(cfg, dp, device)
    restore = _Restore(cfg, dp, data, valid, device, hooks)
    run = build_run(cfg, RunOptions(device, dp=dp, settings=settings, restore=restore,  # 2, 3 (training/build.py)
                                    on_capture_error=hooks.on_capture_error))
    try:
        result = _iterate(cfg, run, data, valid, restore.checkpointer, hooks)  # 4, 5
    finally:  # 6
        run.close()
    if keep_model:
        result.model = run.model
    return result


def _build_data(cfg: Config, dp: DataParallel, device: torch.device) -> tuple[Any, Any]:
    """This rank's training data, and its validation data when the run evaluates."""
    pin = device.type == "cuda"
    data = build_data(cfg, split="train", pin_memory=pin, **dp.data_shard())
    valid = (build_data(cfg, split="valid", pin_memory=pin, **dp.data_shard())
             if cfg.train.eval_iters > 0 else None)
    return data, valid


class _Restore:
    """``build_run``'s restore step: the checkpointer over the built model and optimizer, resumed in place."""

    def __init__(self, cfg: Config, dp: DataParallel, data: Any, valid: Any, device: torch.device,
                 hooks: RunHooks) -> None:
        self.cfg, self.dp, self.data, self.valid, self.device, self.hooks = cfg, dp, data, valid, device, hooks
        self.checkpointer: Checkpointer | None = None

    def __call__(self, model: torch.nn.Module, optimizer: Any) -> int:
        state = TrainingState(model, optimizer, self.data, self.valid, self.device)
        self.checkpointer = Checkpointer(self.cfg.checkpoint, self.dp, state, self.cfg,
                                         before_rename=self.hooks.before_checkpoint_rename)
        return self.checkpointer.resume()


def _iterate(cfg: Config, run: Run, data: Any, valid: Any, ckpt: Checkpointer, hooks: RunHooks) -> TrainResult:
    tr, dp, device, runner = cfg.train, run.dp, run.device, run.runner
    start = run.start_iteration
    keys = ["loss", "grad_norm", "lr"] + (["nonfinite"] if run.checks_nonfinite else []) \
        + (list(MOE_KEYS) if run.moe.logged else [])
    recorder = MetricsRecorder(keys, device, cfg.logger.log_interval, cfg.logger.metrics_path if dp.is_main else None,
                               resume_after=start)
    console = Console(enabled=cfg.logger.progress_bar and sys.stderr.isatty() and dp.is_main,
                      total=max(0, tr.train_iters - start))
    result = TrainResult(describe=runner.describe, iterations=start)
    tokens_per_iter = tr.global_batch_size * cfg.model.seq_length
    # observability: writers get the rows the recorder reads (no sync of their own); the profiler
    # and the phase ranges act only inside the profiling window, on profile_ranks, when asked for
    writers = MetricWriters(cfg, enabled=dp.is_main, tokens_per_iteration=tokens_per_iter, device=device,
                            flops_per_iteration=flops_per_step(cfg, run.model) / dp.world_size,
                            peak_tflops=peak_tflops(device))
    profiler = StepProfiler(cfg, rank=dp.rank, device=device)
    ranges = open_ranges(cfg, dp.rank)
    if ranges is not None:
        ranges.instrument(runner)
        data = ranges.data(data)
    reducer = getattr(run.train_step, "reduce_grads", None)
    log.info("training %s: %d parameters, %s, device %s, graphs: %s%s", _name(cfg), _count(run.model),
             next(run.model.parameters()).dtype, device, runner.describe,
             f", {dp.layout.describe()}" + (f" ({reducer.describe()})" if reducer is not None else "")
             if dp.enabled or dp.layout.needs_mesh else "")
    collector = ManualGC(tr)  # train.manual_gc: collections only between steps (training/manual_gc.py)
    try:
        with _StopFlag(tr.exit_signal_handler) as stop, console, collector:
            t_log = time.perf_counter()
            profiler.begin(start + 1)
            for it in range(start + 1, tr.train_iters + 1):  # 4
                profiler.before(it)
                out, opt = run.iteration(data)
                state = runner.state()
                if state == "captured":
                    _log_capture(runner)
                    writers.capture(it, runner.reports)
                if cfg.rerun_state_machine.check_for_nan_in_loss or cfg.ddp.check_for_nan_in_grad:
                    _host_nan_check(cfg, it, out["loss"], opt["grad_norm"])  # host syncs, eager only (R6)
                recorder.record(it, state, _scalars(run, out, opt))
                profiler.after(it)
                console.advance()
                stopping = stop.enabled and dp.any(stop.set)  # every rank stops after the same step
                last = it == tr.train_iters or stopping
                if it % cfg.logger.log_interval == 0 or last:
                    rows = recorder.flush()
                    dt = (time.perf_counter() - t_log) / len(rows)
                    t_log = time.perf_counter()
                    for r in rows:
                        r["step_ms"] = dt * 1e3
                    result.rows += rows
                    writers.write_rows(rows)
                    writers.capture(it, runner.reports)  # evaluation graphs too
                    _report(console, rows, dt, tokens_per_iter, device, tr.train_iters, result)
                if valid is not None and tr.eval_interval and it % tr.eval_interval == 0 and not last:
                    _evaluate(runner, valid, tr.eval_iters, it, console, result, collector)  # 5
                ckpt.after_iteration(it, last=last)
                collector.after_iteration(it)
                if hooks.after_iteration is not None:
                    hooks.after_iteration(it)
                result.iterations = it
                if stopping:
                    result.stopped_by_signal = True
                    break
            if valid is not None and not result.stopped_by_signal:
                _evaluate(runner, valid, tr.eval_iters, result.iterations, console, result, collector)
    finally:  # 6: the caller closes the run right after
        profiler.close()
        recorder.close()
        writers.close()
        result.graphs = len(runner.reports)
        result.capture_seconds = sum(r.seconds for r in runner.reports)
    if dp.is_main:
        console.summary(result, _memory(device), cfg.logger.metrics_path)
    return result


def _scalars(run: Run, out: dict[str, torch.Tensor], opt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The iteration's device scalars for the metrics (read on logging steps only)."""
    scalars = {"loss": out["loss"], "grad_norm": opt["grad_norm"], "lr": opt["lr"]}
    nonfinite = run.nonfinite(out, opt)
    if nonfinite is not None:
        scalars["nonfinite"] = nonfinite
    if run.moe.logged:
        scalars.update(run.moe.metrics())
    return scalars


def _name(cfg: Config) -> str:
    m = cfg.model
    kind = "MoE" if m.num_moe_experts else ("hybrid" if m.hybrid_override_pattern else "dense")
    return f"{kind} {m.num_layers} layers d={m.hidden_size} seq={m.seq_length}"


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _log_capture(runner) -> None:
    reports = runner.reports  # this run's captures
    if not reports:
        return
    seconds = sum(r.seconds for r in reports)
    alloc, reserved = runner.backend.memory()
    log.info("captured %d graph(s) in %.2f s, allocated %.2f GiB, reserved %.2f GiB (%s backend)",
             len(reports), seconds, alloc / GiB, reserved / GiB, runner.backend.name)


def _host_nan_check(cfg: Config, it: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
    # Megatron's host-side checks: each reads a device value (a sync), which
    # is why rule R6 forbids them with the full-iteration graph.
    if cfg.rerun_state_machine.check_for_nan_in_loss and not torch.isfinite(loss).item():
        raise FloatingPointError(f"iteration {it}: the loss is {loss.item()} (rerun_state_machine.check_for_nan_in_loss)")
    if cfg.ddp.check_for_nan_in_grad and not torch.isfinite(grad_norm).item():
        raise FloatingPointError(f"iteration {it}: the gradient norm is {grad_norm.item()} (ddp.check_for_nan_in_grad)")


def _report(console: Console, rows: list[dict], dt: float, tokens: int, device, total: int, result) -> None:
    last = rows[-1]
    bad = [r["iteration"] for r in rows if r.get("nonfinite")]  # no flag without train.check_for_nan_on_device
    result.nonfinite_iterations += bad
    console.line(
        f"iter {last['iteration']:>6}/{total} | loss {_fmt(last['loss'])} | lr {last['lr']:.3e} | "
        f"grad norm {_fmt(last['grad_norm'], 3)} | {dt * 1e3:8.1f} ms/step | {tokens / dt / 1e3:8.1f}k tok/s | "
        f"{_memory(device)} | {last['state']}"
        + (f" | aux {last['moe_aux_loss']:.4f} z {last['moe_z_loss']:.4f} load {last['moe_load_imbalance']:.2f}"
           if "moe_aux_loss" in last else "")
    )
    if bad:
        log.warning("non-finite loss or gradients at iteration(s) %s", ", ".join(map(str, bad)))


def _fmt(v: Any, digits: int = 4) -> str:
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _evaluate(runner, valid, iters: int, it: int, console: Console, result: TrainResult,
              collector: ManualGC) -> None:
    collector.before_eval()
    loss = float(runner.evaluate(valid, iters))  # a host read, on evaluation steps only
    collector.after_eval()
    result.eval_losses.append((it, loss))
    console.line(f"eval at iter {it}: loss {loss:.4f}")
