"""The resolved CUDA-graph settings the mechanism reads: plain data, no config.

:class:`GraphImpl` is which capture mechanism runs; :class:`CudaGraphSettings`
is the frozen, canonical view of the ``model.cuda_graph_*`` fields (and
``optimizer.optimizer_cuda_graph``) that the trainer and the graph engine
read. They are produced from a config by :func:`graphstep.validation.resolve_cuda_graph_settings`
after normalisation and every rule; this module knows nothing of the config
tree, so the mechanism stays importable on its own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .scopes import SCOPES

SCOPE_NAMES: tuple[str, ...] = SCOPES
MOE_SCOPES: tuple[str, ...] = ("moe", "moe_router", "moe_preprocess")


class GraphImpl(str, enum.Enum):
    """Which capture mechanism ``model.cuda_graph_impl`` selects."""

    NONE = "none"
    LOCAL = "local"
    TRANSFORMER_ENGINE = "transformer_engine"
    FULL_ITERATION = "full_iteration"


IMPL_VALUES: tuple[str, ...] = tuple(i.value for i in GraphImpl)
PER_LAYER: tuple[str, ...] = ("local", "transformer_engine")


@dataclass(frozen=True)
class CudaGraphSettings:
    """The canonical, resolved CUDA-graph view the trainer uses."""

    impl: GraphImpl
    modules: tuple[str, ...]  # per-layer scopes; () = whole layer; always () for NONE / FULL_ITERATION
    warmup_steps: int
    use_single_mempool: bool
    retain_backward_graph: bool
    optimizer_graph: bool
    backend: str
    on_failure: str

    @property
    def enabled(self) -> bool:
        return self.impl is not GraphImpl.NONE

    @property
    def full_iteration(self) -> bool:
        return self.impl is GraphImpl.FULL_ITERATION

    @property
    def per_layer(self) -> bool:
        return self.impl in (GraphImpl.LOCAL, GraphImpl.TRANSFORMER_ENGINE)
