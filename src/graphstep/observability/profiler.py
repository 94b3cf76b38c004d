"""Profile a window of iterations: a PyTorch profiler trace, nsys's capture range, the CUDA memory history.

``StepProfiler`` follows Megatron Bridge's ``profiling`` fields. The loop
calls :meth:`StepProfiler.begin` before its first iteration,
:meth:`StepProfiler.before` and :meth:`StepProfiler.after` around every
iteration and :meth:`StepProfiler.close` in its ``finally``. On the ranks of
``profile_ranks`` only, for iterations ``profile_step_start`` to
``profile_step_end`` (both inclusive, counted as the trainer counts, from 1):

* ``use_pytorch_profiler``: ``torch.profiler.profile`` with a schedule that
  warms up on the iteration before the window and records the window; each
  iteration is a ``ProfilerStep#N`` range, N the iteration number (the
  profiler's step counter starts at the run's first iteration). The trace is
  written by ``tensorboard_trace_handler`` into :func:`trace_dir` as
  ``rank<R>.<time>.pt.trace.json`` -- open it in TensorBoard's profiler
  plugin or Perfetto (ui.perfetto.dev).
* ``use_nsys_profiler``: ``torch.cuda.profiler.start()`` before the window
  and ``stop()`` after it, for ``nsys profile --capture-range=cudaProfilerApi``;
  NVTX ranges name the phases (nvtx.py).
* ``record_memory_history`` (CUDA only): the allocator's history over the
  window, dumped to ``memory_snapshot_path`` (open it at pytorch.org/memory_viz).

Outside the window (and on other ranks) every call returns at once.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerAction

from ..config import Config
from ..cuda_graph.torch_compat import dump_memory_snapshot, record_memory_history, stop_memory_history

log = logging.getLogger("graphstep")


def trace_dir(cfg: Config) -> Path:
    """``logger.tensorboard_dir`` when set, else ``profile/`` beside ``logger.metrics_path`` (or in the cwd)."""
    if cfg.logger.tensorboard_dir:
        return Path(cfg.logger.tensorboard_dir)
    if cfg.logger.metrics_path:
        return Path(cfg.logger.metrics_path).parent / "profile"
    return Path("profile")


class StepProfiler:
    """The profiling window of one rank (see the module docstring)."""

    def __init__(self, cfg: Config, *, rank: int, device: torch.device) -> None:
        pr = cfg.profiling
        on = rank in pr.profile_ranks
        self.start, self.end = pr.profile_step_start, pr.profile_step_end
        self.cuda = device.type == "cuda"
        self.nsys = on and pr.use_nsys_profiler and self.cuda
        self.memory = on and pr.record_memory_history and self.cuda
        self.snapshot = pr.memory_snapshot_path
        self.dir = trace_dir(cfg)
        self.rank = rank
        self.started = False  # the window's device side (nsys range, memory history) began
        self.torch_profiler: torch.profiler.profile | None = None
        if on and pr.use_pytorch_profiler:
            self.torch_profiler = self._torch_profiler(pr.record_shapes, pr.record_memory_history)
        if on and pr.use_nsys_profiler and not self.cuda:
            log.warning("profiling.use_nsys_profiler needs a CUDA device (this run is on %s): no nsys range", device)
        if on and pr.record_memory_history and not self.cuda:
            log.warning("profiling.record_memory_history records the CUDA allocator: nothing to record on %s", device)

    def _torch_profiler(self, record_shapes: bool, profile_memory: bool) -> torch.profiler.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.dir.mkdir(parents=True, exist_ok=True)
        return torch.profiler.profile(
            activities=activities, schedule=self._action, record_shapes=record_shapes,
            profile_memory=profile_memory, with_stack=False,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.dir), worker_name=f"rank{self.rank}"),
        )

    def _action(self, iteration: int) -> ProfilerAction:
        """The profiler's schedule, by iteration number: warm up on the one before the window, record it."""
        if iteration == self.start - 1:
            return ProfilerAction.WARMUP
        if self.start <= iteration < self.end:
            return ProfilerAction.RECORD
        if iteration == self.end:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.NONE

    def begin(self, first_iteration: int) -> None:
        """Start counting at ``first_iteration`` (1, or the one after a resumed checkpoint)."""
        prof = self.torch_profiler
        if prof is not None:
            # The profiler counts steps from 0; start it at the iteration number so that its
            # ProfilerStep#N ranges and its schedule speak of the trainer's iterations.
            prof.step_num = first_iteration
            prof.current_action = self._action(first_iteration)
            prof.start()

    def before(self, iteration: int) -> None:
        if iteration != self.start:
            return
        self.started = True
        if self.memory:
            record_memory_history(max_entries=100_000)
        if self.nsys:
            torch.cuda.profiler.start()

    def after(self, iteration: int) -> None:
        if self.torch_profiler is not None:
            self.torch_profiler.step()  # closes ProfilerStep#iteration; saves the trace after the window
            if iteration == self.end:
                log.info("profiler trace of iterations %d-%d written to %s", self.start, self.end, self.dir)
        if iteration == self.end:
            self._stop_device()

    def _stop_device(self) -> None:
        if not self.started:
            return
        if self.nsys:
            torch.cuda.profiler.stop()
            self.nsys = False
        if self.memory:
            Path(self.snapshot).parent.mkdir(parents=True, exist_ok=True)
            dump_memory_snapshot(self.snapshot)
            stop_memory_history()
            log.info("CUDA memory history of iterations %d-%d written to %s", self.start, self.end, self.snapshot)
            self.memory = False

    def close(self) -> None:
        """Stop whatever is still running (a run that ended inside the window writes what it has)."""
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        self._stop_device()
