"""``apply_compile(model, mode, settings)``: torch.compile inside the trainer's graphs (a step of parallelize).

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

The trainer logs how long the first step spent compiling (training/compile.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import Config
from ..cuda_graph.settings import CudaGraphSettings


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


def compile_mode_of(cfg: Config, override: str | None = None) -> str | None:
    """The torch.compile mode of a run: ``override`` (the bench's), else ``compile.mode`` with ``compile.enable``."""
    if override is not None:
        return override
    return cfg.compile.mode if cfg.compile.enable else None
