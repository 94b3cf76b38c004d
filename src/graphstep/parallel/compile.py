"""``apply_compile(model, mode, settings)``: torch.compile inside the trainer's graphs (a step of parallelize).

What is compiled depends on who owns the graphs (``compile.components=[model]``):

* ``cuda_graph_impl=none`` or ``full_iteration``: the whole model, as
  ``torch.compile(model, mode=...)`` (what the bench's ``compile+full_iteration``
  row does); the full-iteration graph then captures Inductor's kernels -- the
  compile itself happens in the eager warm-up iterations before the capture;
* ``local`` / ``transformer_engine``: the forward of each module the per-layer
  graphs capture (cuda_graph/layers.py ``select_modules``), compiled in place
  before the engine wraps it; a compiled whole model would have Dynamo trace
  the engine's dispatcher, so the model around the graphed scopes stays eager;
* over a parallel layout (tensor, context, expert or pipeline parallel, FSDP2),
  without per-layer graphs: the forward of each decoder layer, compiled in
  place, as torchtitan compiles each transformer block before FSDP2 wraps it.
  The engines' hooks stay outside the compiled code and run eagerly around it
  (FSDP2's all-gathers and frees, pipeline stages' sends and receives) while
  Dynamo traces the layer's DTensor operations, its context-parallel gathers
  and expert-parallel exchanges (graph breaks where a collective is not
  traceable) and its recompute regions; the embedding, final norm, output
  layer and loss stay eager. Parameter names do not change (no wrapper
  module), so checkpoints and shard names read as without compile. Rule R27
  keeps graphs out of such runs until they are checked against eager on a GPU.

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


def apply_compile(model: nn.Module, mode: str, settings: CudaGraphSettings, *, by_layer: bool = False,
                  backend: str = "inductor") -> nn.Module:
    """Compile ``model`` for ``settings`` (see the module docstring); returns the module the steps call.
    ``by_layer``: the model runs over a parallel layout -- compile each decoder layer's forward in place.
    ``backend``: torch.compile's (``compile.backend``); ``mode`` applies to Inductor only."""
    kwargs = {"mode": mode} if backend == "inductor" else {"backend": backend}
    if settings.per_layer or by_layer:
        if settings.per_layer:
            from ..cuda_graph.layers import select_modules

            modules = [module for _name, module in select_modules(model, settings.modules)]
        else:
            modules = [layer for _, layer in model.layers.named_children()]
        for module in modules:
            # an instance attribute: hooks (FSDP2's, the per-layer engine's patch) stay around it, eager
            module.forward = torch.compile(module.forward, **kwargs)
        return model
    return torch.compile(model, **kwargs)


def describe_compile(mode: str, settings: CudaGraphSettings, *, by_layer: bool = False,
                     backend: str = "inductor") -> str:
    what = "the graphed scope modules" if settings.per_layer else "each decoder layer" if by_layer else "the model"
    return f"torch.compile of {what}, " + (f"mode={mode}" if backend == "inductor" else f"backend={backend}")


def compile_mode_of(cfg: Config, override: str | None = None) -> str | None:
    """The torch.compile mode of a run: ``override`` (the bench's), else ``compile.mode`` with ``compile.enable``."""
    if override is not None:
        return override
    return cfg.compile.mode if cfg.compile.enable else None
