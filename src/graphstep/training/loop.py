"""``train(cfg)``: warm-up, capture, replay; evaluation, logging and teardown.

The loop reads top to bottom:

1. validate the config (every rule at once; ``model.hf_path`` first sets
   the model shape from its config.json); join torchrun's process group
   when launched by it (training/distributed.py) and pick the device; then,
   before anything is built, check that every output path is writable
   (training/rundir.py), that the run fits in the device's memory
   (training/memory.py), and lock the output directories against a second
   run -- each a one-line ``RunSetupError`` (exit 2) on every rank;
2. seed (per rank, as Megatron does), build the model -- with
   ``model.hf_path``, whose config.json set the shape in step 1, its weights
   are copied in before the optimizer takes its fp32 master copy
   (models/hf.py) -- gradient buffers, optimizer and this rank's shard of the
   data; resume from ``checkpoint.load`` in place (training/checkpoint.py);
3. ``prepare`` the runner (eager functions, per-layer graphs, full-iteration
   graph, optimizer graph -- training/prepare.py); built after the resume, so
   graphs warm up and capture counting from the resume iteration;
4. per iteration: forward/backward of all micro-batches (gradients and loss
   averaged over ranks), optimizer step, per-iteration scalars queued on the
   device; on logging steps, one host read of the queued scalars, a log line
   and metrics rows (rank 0 writes them);
5. evaluation every ``train.eval_interval``; a checkpoint every
   ``checkpoint.save_interval`` and at the end;
6. teardown in ``finally``: graphs freed before anything else goes away --
   at the normal end, after the final evaluation, on exceptions and on
   SIGINT/SIGTERM (which stop every rank after the same step) -- and the
   process group destroyed last, once no graph holds a collective.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import Config
from ..cuda_graph.rng import initialize_rng_tracker
from ..cuda_graph.settings import CudaGraphSettings, resolve_cuda_graph_settings
from ..data import build_data
from ..data.buckets import parse_buckets
from ..models import build_model
from ..models.hf import load_hf_weights, with_hf_shape
from .checkpoint import Checkpointer, TrainingState, kill_at_iteration_if_asked
from .console import Console
from .memory import check_memory_fits
from .distributed import DataParallel, init_data_parallel
from .metrics import MetricsRecorder
from .moe_hooks import KEYS as MOE_KEYS
from .moe_hooks import MoEHooks
from .optim import GradBuffers, build_optimizer
from .prepare import prepare
from .rundir import RunLock, RunSetupError, check_outputs_writable, output_dirs
from .step import EvalStep, TrainStep

log = logging.getLogger("graphstep")

GiB = 1024**3


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
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RunSetupError(f"train.device={name} but this machine has no CUDA device; "
                            "use train.device=cpu or auto")
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


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


def train(cfg: Config, *, keep_model: bool = False) -> TrainResult:
    """Train as ``cfg`` says; returns the metrics of every iteration (and the model if asked)."""
    cfg = with_hf_shape(cfg)  # model.hf_path: a copy of cfg with the checkpoint's shape, before any rule
    settings = resolve_cuda_graph_settings(cfg)  # 1: every rule, all violations at once
    dp = init_data_parallel(cfg, settings)  # one rank unless torchrun started us
    try:
        return _train(cfg, settings, dp, keep_model)
    finally:
        dp.close()  # 6: last -- _train's own finally has freed every graph by now


def _train(cfg: Config, settings: CudaGraphSettings, dp: DataParallel, keep_model: bool) -> TrainResult:
    device = pick_device(cfg.train.device)
    lock = _preflight(cfg, dp, device)
    try:
        return _run(cfg, settings, dp, keep_model, device)
    finally:
        lock.release()  # on every exit: normal end, exception, SIGINT/SIGTERM (a clean stop)


def _preflight(cfg: Config, dp: DataParallel, device: torch.device) -> RunLock:
    """Writable outputs, enough memory, the run lock (rank 0): every rank fails together, before building."""
    lock = RunLock([d for _, d in output_dirs(cfg)] if dp.is_main else [])
    error: RunSetupError | None = None
    try:
        check_outputs_writable(cfg, metrics=dp.is_main)
        replicas = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1  # ranks share RAM
        check_memory_fits(cfg, device, replicas=replicas)
        lock.__enter__()
    except RunSetupError as exc:
        error = exc
    if dp.any(error is not None):
        lock.release()
        raise error or RunSetupError("another data-parallel rank could not start this run (its message says why)")
    return lock


def _run(cfg: Config, settings: CudaGraphSettings, dp: DataParallel, keep_model: bool,
         device: torch.device) -> TrainResult:
    tr = cfg.train
    num_mb = tr.global_batch_size // (tr.micro_batch_size * dp.world_size)

    initialize_rng_tracker(cfg.rng.seed, device, graph_safe=cfg.model.use_te_rng_tracker, dp_rank=dp.rank,  # 2
                           data_parallel_random_init=cfg.rng.data_parallel_random_init)
    model = build_model(cfg.model, device)
    if cfg.model.hf_path:
        load_hf_weights(model, cfg.model.hf_path, cfg.model)  # in place, before the optimizer copies the weights
    model.train()
    if cfg.rng.data_parallel_random_init:
        dp.broadcast_parameters(model)  # different seeds per rank, the same starting weights (Megatron)
    grads = GradBuffers(model)
    optimizer = build_optimizer(cfg, model, grads)
    pin = device.type == "cuda"
    data = build_data(cfg, split="train", dp_rank=dp.rank, dp_size=dp.world_size, pin_memory=pin)
    valid = (build_data(cfg, split="valid", dp_rank=dp.rank, dp_size=dp.world_size, pin_memory=pin)
             if tr.eval_iters > 0 else None)
    ckpt = Checkpointer(cfg.checkpoint, dp, TrainingState(model, optimizer, data, valid, device), cfg)
    start = ckpt.resume()  # in place, before any graph exists
    moe = MoEHooks(model, num_mb)
    step = TrainStep(model, grads, reduce_grads=dp.grad_reducer(grads, cfg.ddp), reduce_loss=dp.loss_reducer(),
                     before_step=moe.before_step if moe.enabled else None,
                     retain_graph=settings.retain_backward_graph)
    runner = prepare(  # 3
        model, step, EvalStep(model, device, reduce_loss=dp.loss_reducer()), optimizer, settings,
        device=device, num_micro_batches=num_mb, skip_on_nonfinite=tr.skip_step_on_nan,
        capture_barrier=dp.barrier if dp.enabled else None, buckets=parse_buckets(cfg),
    )
    keys = ["loss", "grad_norm", "lr", "nonfinite"] + (list(MOE_KEYS) if moe.enabled else [])
    recorder = MetricsRecorder(keys, device, cfg.logger.log_interval, cfg.logger.metrics_path if dp.is_main else None,
                               resume_after=start)
    console = Console(enabled=cfg.logger.progress_bar and sys.stderr.isatty() and dp.is_main,
                      total=max(0, tr.train_iters - start))
    result = TrainResult(describe=runner.describe, iterations=start)
    tokens_per_iter = tr.global_batch_size * cfg.model.seq_length
    log.info("training %s: %d parameters, %s, device %s, graphs: %s%s", _name(cfg), _count(model),
             next(model.parameters()).dtype, device, runner.describe,
             f", {dp.world_size} data-parallel ranks ({step.reduce_grads.describe()})" if dp.enabled else "")
    try:
        with _StopFlag(tr.exit_signal_handler) as stop, console:
            t_log = time.perf_counter()
            for it in range(start + 1, tr.train_iters + 1):  # 4
                out = runner.train_step(data)
                opt = runner.optimizer_step(out)
                if moe.enabled:
                    moe.after_optimizer_step()
                state = runner.state()
                if state == "captured":
                    _log_capture(runner, device)
                nonfinite = torch.maximum(out["nonfinite"], opt["found_nonfinite"])
                if cfg.rerun_state_machine.check_for_nan_in_loss or cfg.ddp.check_for_nan_in_grad:
                    _host_nan_check(cfg, it, out["loss"], opt["grad_norm"])  # host syncs, eager only (R6)
                recorder.record(it, state, {"loss": out["loss"], "grad_norm": opt["grad_norm"], "lr": opt["lr"],
                                            "nonfinite": nonfinite, **(moe.metrics() if moe.enabled else {})})
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
                    _report(console, rows, dt, tokens_per_iter, device, tr.train_iters, result)
                if valid is not None and tr.eval_interval and it % tr.eval_interval == 0 and not last:
                    _evaluate(runner, valid, tr.eval_iters, it, console, result)  # 5
                ckpt.after_iteration(it, last=last)
                kill_at_iteration_if_asked(it)  # tests of exact resume (GRAPHSTEP_TEST_KILL_AT_ITER)
                result.iterations = it
                if stopping:
                    result.stopped_by_signal = True
                    break
            if valid is not None and not result.stopped_by_signal:
                _evaluate(runner, valid, tr.eval_iters, result.iterations, console, result)
    finally:  # 6
        recorder.close()
        result.graphs = len(runner.backend.reports) if runner.backend is not None else 0
        result.capture_seconds = sum(r.seconds for r in runner.backend.reports) if runner.backend else 0.0
        runner.close()
    if dp.is_main:
        console.summary(result, _memory(device), cfg.logger.metrics_path)
    if keep_model:
        result.model = model
    return result


def _name(cfg: Config) -> str:
    m = cfg.model
    kind = "MoE" if m.num_moe_experts else ("hybrid" if m.hybrid_override_pattern else "dense")
    return f"{kind} {m.num_layers} layers d={m.hidden_size} seq={m.seq_length}"


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _log_capture(runner, device: torch.device) -> None:
    reports = runner.backend.reports if runner.backend is not None else []
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
    bad = [r["iteration"] for r in rows if r["nonfinite"]]
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


def _evaluate(runner, valid, iters: int, it: int, console: Console, result: TrainResult) -> None:
    loss = float(runner.evaluate(valid, iters))  # a host read, on evaluation steps only
    result.eval_losses.append((it, loss))
    console.line(f"eval at iter {it}: loss {loss:.4f}")
