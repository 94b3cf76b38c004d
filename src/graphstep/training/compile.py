"""``apply_compile(model, mode, settings)``: torch.compile inside the trainer's graphs.

What is compiled depends on who owns the graphs (``compile.components=[model]``):

* ``cuda_graph_impl=none`` or ``full_iteration``: the whole model, as
  ``torch.compile(model, mode=...)`` (what the bench's ``compile+full_iteration``
  row does); the full-iteration graph then captures Inductor's kernels -- the
  compile itself happens in the eager warm-up iterations before the capture;
* ``local`` / ``transformer_engine``: the forward of each module the per-layer
  graphs capture (cuda_graph/layers.py ``select_modules``), compiled in place
  before the engine wraps it; a compiled whole model would have Dynamo trace
  the engine's dispatcher, so the model around the graphed scopes stays eager.

The loss is computed inside the model's forward (GPTModel.forward), so it is
compiled with the model; ``compile.components=[loss]`` is refused by rule R20,
and so are Inductor's own CUDA graphs (``reduce-overhead``, ``max-autotune``)
together with graphstep's, and compiled graphs on the CPU replay backend (its
recording mode makes Dynamo run the model uncompiled).

Equality contract: compiled + graphed is bit-equal to compiled eager (the same
kernels, replayed); compiled differs from uncompiled by rounding (Inductor
fuses and reorders floating-point work).

:class:`CompileTimeReport` wraps the training step and logs, once, how long
Dynamo and Inductor spent compiling during the first step (forward and the
lazily compiled backward), from Dynamo's compile start/end callbacks.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
from torch import nn

from ..cuda_graph.settings import CudaGraphSettings
from ..engines_compat import dynamo_callbacks

log = logging.getLogger("graphstep")


def apply_compile(model: nn.Module, mode: str, settings: CudaGraphSettings) -> nn.Module:
    """Compile ``model`` for ``settings`` (see the module docstring); returns the module the steps call."""
    if settings.per_layer:
        from ..cuda_graph.layers import select_modules

        for _name, module in select_modules(model, settings.modules):
            # an instance attribute: the per-layer engine keeps it as the module's own forward and patches over it
            module.forward = torch.compile(module.forward, mode=mode)
        return model
    return torch.compile(model, mode=mode)


def describe_compile(mode: str, settings: CudaGraphSettings) -> str:
    what = "the graphed scope modules" if settings.per_layer else "the model"
    return f"torch.compile of {what}, mode={mode}"


class CompileTimer:
    """Seconds Dynamo spends compiling while inside ``with``: its compile start/end callbacks, outermost pairs."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.compiles = 0
        self._depth = 0
        self._t0 = 0.0

    def _start(self, _args: Any) -> None:
        if self._depth == 0:
            self._t0 = time.perf_counter()
        self._depth += 1

    def _end(self, _args: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._t0
            self.compiles += 1

    def __enter__(self) -> "CompileTimer":
        callback_handler = dynamo_callbacks()
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        return self

    def __exit__(self, *exc: Any) -> None:
        callback_handler = dynamo_callbacks()
        callback_handler.remove_start_callback(self._start)
        callback_handler.remove_end_callback(self._end)


class CompileTimeReport:
    """The training step, whose first call logs "compiled in X s"; every attribute is the step's."""

    def __init__(self, step: Callable[..., Any], what: str) -> None:
        self.__dict__.update(step=step, what=what, reported=False, compile_seconds=None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.reported:
            return self.step(*args, **kwargs)
        with CompileTimer() as timer:
            out = self.step(*args, **kwargs)
        self.__dict__.update(reported=True, compile_seconds=timer.seconds)
        log.info("%s: compiled in %.1f s (%d compilations in the first training step)",
                 self.what, timer.seconds, timer.compiles)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["step"], name)
