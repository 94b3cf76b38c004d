"""Named ranges around the phases of an iteration: data, warm-up, capture, replay, optimizer.

Under nsys (``profiling.use_nsys_profiler`` on a CUDA machine) they are NVTX
ranges (``torch.cuda.nvtx.range_push/pop``); under the PyTorch profiler they
are ``record_function`` ranges, shown in the trace above the kernels or the
graph launch. With neither, :func:`open_ranges` returns None and the loop
wraps nothing: no cost at all.

:meth:`PhaseRanges.instrument` wraps a runner's ``train_step`` and
``optimizer_step`` (training/graphs.py's Runner) and the data iterator. The
name of a training step's range is decided before the step runs, from its
graph: ``warm-up`` (eager, a capture to come), ``capture`` (the graph's
``will_capture``), ``replay`` (captured), or ``eager`` (no graph).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from ..config import Config


class PhaseRanges:
    """Push/pop named ranges with NVTX (nsys) or ``record_function`` (the PyTorch profiler)."""

    def __init__(self, nvtx: bool) -> None:
        self.nvtx = nvtx

    @contextlib.contextmanager
    def range(self, name: str) -> Iterator[None]:
        if self.nvtx:
            torch.cuda.nvtx.range_push(name)
            try:
                yield
            finally:
                torch.cuda.nvtx.range_pop()
        else:
            with torch.profiler.record_function(name):
                yield

    def wrap(self, fn: Callable[..., Any], name: str | Callable[[], str]) -> Callable[..., Any]:
        def ranged(*args: Any, **kwargs: Any) -> Any:
            with self.range(name() if callable(name) else name):
                return fn(*args, **kwargs)

        return ranged

    def data(self, data: Iterator[Any]) -> Iterator[Any]:
        """``data`` with each ``next()`` inside a ``data`` range."""
        while True:
            with self.range("data"):
                try:
                    item = next(data)
                except StopIteration:
                    return
            yield item

    def instrument(self, runner: Any) -> None:
        """Wrap the runner's training and optimizer steps in phase ranges (in place)."""
        graph = runner.graphs[0] if runner.graphs else None
        runner.train_step = self.wrap(runner.train_step, lambda: "train step: " + phase(graph))
        runner.optimizer_step = self.wrap(runner.optimizer_step, "optimizer")


def phase(graph: Any) -> str:
    """What the next call of ``graph``'s step will be: eager, warm-up, capture or replay."""
    if graph is None:
        return "eager"
    if getattr(graph, "will_capture", False):
        return "capture"
    if getattr(graph, "captured", False):
        return "replay"
    return "warm-up"


def open_ranges(cfg: Config, rank: int) -> PhaseRanges | None:
    """The ranges this rank marks, or None when it profiles with neither nsys nor the PyTorch profiler."""
    pr = cfg.profiling
    if rank not in pr.profile_ranks:
        return None
    if pr.use_nsys_profiler and torch.cuda.is_available():
        return PhaseRanges(nvtx=True)
    if pr.use_pytorch_profiler:
        return PhaseRanges(nvtx=False)
    return None
