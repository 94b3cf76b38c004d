"""The MoE block, in Megatron Core's structure so that graph scopes map one to one.

:class:`MoEBlock` replaces :class:`~graphstep.models.transformer.MLPBlock` in a
decoder layer (block name ``"moe"``). Its forward is a chain of stage
submodules, each a pure tensor function (tensors in, tensors out, static
shapes, no host sync) because the per-layer graph engine captures a
submodule's forward and backward::

    normed, probs, idx[, shared] = router_stage(x)                 # scope moe_router
    expert_in, row, groups = preprocess_stage(normed, probs, idx)  # scope moe_preprocess
    expert_out = experts(expert_in, groups)                        # expert GEMMs: eager
    y = combine_stage(x, expert_out, row, probs[, shared])         # moe_router (post-processing)

* ``router_stage``: pre-MLP RMSNorm, fp32 router, top-k, aux/z losses
  (attached to the gradient, statistics accumulated in place) and the shared
  expert (:mod:`.moe_router`).
* ``preprocess_stage``: the permutation metadata (:mod:`.moe_dispatch`) and
  the permutation itself (each token's row copied to its experts' rows), all
  on the device -- as Megatron Core's ``moe_preprocess`` scope holds its token
  dispatcher's ``dispatch_preprocess``, the permute included. What stays
  eager between the graphs of the partial scopes is the expert GEMMs alone.
* ``experts``: the expert GEMMs over the permuted rows. With Megatron's
  dropless routing this is where the host reads group sizes, so Megatron
  graphs only router + preprocess and runs this eagerly.
  graphstep's sync-free path (``model.moe_sync_free``, the default) keeps
  sizes and offsets on the device, so the whole block (scope ``moe``) and
  the whole iteration can be captured without dropping tokens.
* ``combine_stage``: un-permute, weight by the router probabilities, sum
  over the k choices, add the shared expert, hidden dropout, residual.

Modes: dropless sync-free (``torch._grouped_mm`` where it works, else the
padded ``tiled`` GEMM), dropless with a host sync (``moe_sync_free=false``),
and drop-and-pad (``moe_expert_capacity_factor`` set: every expert gets
exactly ``capacity`` slots; with or without
``moe_pad_expert_input_to_capacity`` the same static layout runs, as the
outputs are the same).

The block does not know whether it is distributed. Expert parallel
(``model.expert_model_parallel_size``) is parallel/expert_parallel.py's
``ExpertParallel`` style, applied to each block from outside: it shards the
stacked expert weights over the expert-parallel ranks and installs the token
exchange (:mod:`.moe_parallel`). With ``moe_token_dispatcher_type=allgather``
the block runs as that style's ``AllGatherMoEBlock`` (all-gather in, its own
experts, reduce-scatter out: dropless and sync-free, so the block and the
whole iteration capture without dropping a token); with ``alltoall`` the
stages above run as on one rank, the preprocess layout unpadded, and the
style's input and output functions on :class:`~.moe_dispatch.GroupedExperts`
send each pair to its expert's rank and back. Those read the split sizes on
the host (``GroupedExperts.sizes_on_host``), so the experts stay eager while
``moe_router`` and ``moe_preprocess`` are graphed; that flag is all the block
reads of it, to pick an unpadded GEMM and to say it is not sync-free.

Model-level helpers for the trainer: :func:`moe_stats`,
:func:`reset_moe_stats`, :func:`update_expert_bias`,
:func:`set_aux_loss_scale`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..config_sections import token_dispatcher
from ..cuda_graph.rng import DATA_PARALLEL_RNG
from ..cuda_graph.torch_compat import foreach_zero_
from .moe_dispatch import (
    GroupedExperts,
    capacity_layout,
    dispatch,
    dropless_layout,
    dropless_rows,
    grouped_mm_works,
    tile_owner,
    tile_size,
)
from .moe_router import TopKRouter, fp32_or_wider
from .transformer import ModelShape, RMSNorm, SwiGLU, hidden_dropout


@dataclass(frozen=True)
class MoEShape:
    """The MoE subset of ``ModelConfig``, validated."""

    num_experts: int
    ffn_hidden_size: int
    topk: int
    score_function: str
    load_balancing_type: str
    aux_loss_coeff: float
    z_loss_coeff: float | None
    enable_expert_bias: bool
    bias_update_rate: float
    shared_expert_size: int | None
    capacity_factor: float | None
    pad_to_capacity: bool
    sync_free: bool
    pre_softmax: bool = False
    dispatcher: str = "allgather"  # across expert-parallel ranks: allgather or alltoall

    @classmethod
    def from_config(cls, m) -> MoEShape:
        if not m.num_moe_experts:
            raise ValueError("model.num_moe_experts must be set (> 0) for a model with MoE layers")
        _check_moe_config(m)
        return cls(
            num_experts=m.num_moe_experts,
            ffn_hidden_size=m.moe_ffn_hidden_size or m.ffn_hidden_size,
            topk=m.moe_router_topk,
            score_function=m.moe_router_score_function,
            load_balancing_type=m.moe_router_load_balancing_type,
            aux_loss_coeff=m.moe_aux_loss_coeff,
            z_loss_coeff=m.moe_z_loss_coeff,
            enable_expert_bias=m.moe_router_enable_expert_bias,
            bias_update_rate=m.moe_router_bias_update_rate,
            shared_expert_size=m.moe_shared_expert_intermediate_size,
            capacity_factor=m.moe_expert_capacity_factor,
            pad_to_capacity=m.moe_pad_expert_input_to_capacity,
            sync_free=m.moe_sync_free,
            pre_softmax=getattr(m, "moe_router_pre_softmax", False),
            dispatcher=token_dispatcher(m.moe_token_dispatcher_type),  # flex runs as alltoall
        )


def _check_moe_config(m) -> None:
    """Every MoE field problem at once, each naming the field to change."""
    errors = []
    if not 1 <= m.moe_router_topk <= m.num_moe_experts:
        errors.append(f"model.moe_router_topk={m.moe_router_topk} must be in [1, num_moe_experts={m.num_moe_experts}]")
    if m.moe_router_score_function not in ("softmax", "sigmoid"):
        got = m.moe_router_score_function
        errors.append(f"model.moe_router_score_function must be softmax or sigmoid, got {got!r}")
    if m.moe_router_load_balancing_type not in ("aux_loss", "none"):
        errors.append(
            f"model.moe_router_load_balancing_type must be aux_loss or none (graphstep implements these), "
            f"got {m.moe_router_load_balancing_type!r}"
        )
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        errors.append("model.moe_router_enable_expert_bias needs model.moe_router_score_function=sigmoid (as Megatron)")
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        errors.append("model.moe_pad_expert_input_to_capacity needs model.moe_expert_capacity_factor")
    if m.moe_expert_capacity_factor is not None and m.moe_expert_capacity_factor <= 0:
        errors.append(f"model.moe_expert_capacity_factor must be > 0, got {m.moe_expert_capacity_factor}")
    if m.recompute_granularity == "selective" and "moe" in m.recompute_modules:
        # Recomputing would re-run the in-place statistics and the aux-loss attachment.
        errors.append("model.recompute_modules=[moe] is not implemented by graphstep's MoE block; remove moe from it")
    if errors:
        raise ValueError("invalid MoE configuration:\n  " + "\n  ".join(errors))


class RouterStage(nn.Module):
    """Scope ``moe_router``: x [b, t, h] -> (normed [N, h], probs [N, k] fp32, idx [N, k] int64[, shared [N, h]])."""

    def __init__(self, s: ModelShape, moe: MoEShape) -> None:
        super().__init__()
        self.pre_mlp_layernorm = RMSNorm(s.hidden_size, s.eps)
        self.router = TopKRouter(s.hidden_size, moe)
        size = moe.shared_expert_size
        self.shared_experts = SwiGLU(s.hidden_size, size) if size else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        normed = self.pre_mlp_layernorm(x).reshape(-1, x.shape[-1])
        probs, idx = self.router(normed)
        if self.shared_experts is None:
            return normed, probs, idx
        return normed, probs, idx, self.shared_experts(normed)


def expert_capacity(num_tokens: int, moe: MoEShape) -> int:
    """Megatron's ``get_capacity`` over the k*N routed pairs; never more than N (one slot per token)."""
    pairs = num_tokens * moe.topk
    return min(num_tokens, math.ceil(pairs / moe.num_experts * moe.capacity_factor))


def layout_align(gemm: str, num_tokens: int, moe: MoEShape) -> int:
    """Rows each expert group is padded to: the tile of the ``tiled`` GEMM, else 1."""
    return tile_size(num_tokens * moe.topk, moe.num_experts) if gemm == "tiled" else 1


class PreprocessStage(nn.Module):
    """Scope ``moe_preprocess``: (normed [N, h], probs [N, k], idx [N, k]) -> (expert_in [P, h], row [N, k], groups).

    ``row[n, j]`` is the expert-input row of token ``n``'s ``j``-th choice; ``groups`` what the expert GEMM
    (:class:`ExpertsStage`) takes: the group ends (``grouped_mm``), the expert of each tile (``tiled``), the group
    sizes (``loop``, read on the host there) or, drop-and-pad, the group ends of the fixed capacity slots.
    ``gemm`` (set by the block before the first call) decides the padding.
    """

    def __init__(self, moe: MoEShape) -> None:
        super().__init__()
        self.moe = moe
        self.gemm = "auto"

    def forward(self, normed: torch.Tensor, probs: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # the router's probabilities as they are (so the stage takes its inputs straight from the router's outputs:
        # cuda_graph/chains.py); the layout reads them without a gradient
        probs = probs.detach()
        N, E, moe = idx.shape[0], self.moe.num_experts, self.moe
        if moe.capacity_factor is not None:
            capacity = expert_capacity(N, moe)
            row, _kept, offsets = capacity_layout(probs, idx, E, capacity)
            return dispatch(normed, row, E * capacity), row, offsets
        align = layout_align(self.gemm, N, moe)
        rows = dropless_rows(N * moe.topk, E, align)
        row, tokens_per_expert, offsets = dropless_layout(idx, E, align)
        expert_in = dispatch(normed, row, rows)
        if self.gemm == "grouped_mm":
            return expert_in, row, offsets
        if self.gemm == "tiled":
            return expert_in, row, tile_owner(offsets, rows, align)
        return expert_in, row, tokens_per_expert


class ExpertsStage(nn.Module):
    """The expert GEMMs: (expert_in [P, h], groups) -> expert_out [P, h] (``groups``: see :class:`PreprocessStage`).

    The GEMMs are a call of the experts module, so that hooks on it run (FSDP2's
    gathers, the all-to-all of parallel/expert_parallel.py).
    """

    def __init__(self, s: ModelShape, moe: MoEShape) -> None:
        super().__init__()
        self.experts = GroupedExperts(moe.num_experts, s.hidden_size, moe.ffn_hidden_size)
        self.moe = moe
        self.gemm = "auto"

    def forward(self, x: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        if self.moe.capacity_factor is not None:
            return self.experts(x, "tiled", None)  # tile t is expert t's capacity slots
        return self.experts(x, self.gemm, groups)


class CombineStage(nn.Module):
    """Post-processing (graphed with ``moe_router``): (x, expert_out, row, probs[, shared]) -> x + dropout(moe(x))."""

    def __init__(self, s: ModelShape, moe: MoEShape) -> None:
        super().__init__()
        self.dropout = s.hidden_dropout
        self.dropout_rng = DATA_PARALLEL_RNG  # model-parallel under tensor parallel (each rank's tokens differ)
        self.drops = moe.capacity_factor is not None

    def forward(
        self, x: torch.Tensor, expert_out: torch.Tensor, row: torch.Tensor, probs: torch.Tensor, *shared: torch.Tensor
    ) -> torch.Tensor:
        y = weighted_sum(expert_out, row, probs, self.drops).to(x.dtype)
        return self.finish(x, y, *shared)

    def finish(self, x: torch.Tensor, y: torch.Tensor, *shared: torch.Tensor) -> torch.Tensor:
        """The block's output from the experts' weighted sum ``y``: shared expert, dropout, residual."""
        if shared:
            y = y + shared[0]
        return x + hidden_dropout(y.view_as(x), self.dropout, self.training, self.dropout_rng)


def weighted_sum(expert_out: torch.Tensor, row: torch.Tensor, probs: torch.Tensor, drops: bool) -> torch.Tensor:
    """Each token's expert outputs, un-permuted, weighted by its router probabilities, summed (fp32 or wider)."""
    if drops:
        expert_out = torch.cat([expert_out, expert_out.new_zeros(1, expert_out.shape[-1])])  # dropped: zero
    picked = expert_out[row]  # [N, k, h], un-permuted
    return (fp32_or_wider(picked) * probs.unsqueeze(-1)).sum(dim=1)


def choose_gemm(moe: MoEShape, device: torch.device, dtype: torch.dtype, unpadded: bool = False) -> str:
    """``grouped_mm`` where it is sync-free here, else ``tiled``; ``loop`` without moe_sync_free.

    ``unpadded`` (the sizes are read on the host anyway: the alltoall dispatcher): ``grouped_mm`` where it works,
    else ``loop``.
    """
    if moe.capacity_factor is not None:
        return "tiled"
    if not moe.sync_free:
        return "loop"
    if grouped_mm_works(device, dtype):
        return "grouped_mm"
    return "loop" if unpadded else "tiled"


class MoEBlock(nn.Module):
    """Scope ``moe``: pre-MLP norm + router + dispatch + experts + shared expert + combine + dropout + residual.

    ``gemm`` picks the expert GEMM: ``auto`` (decided at the first forward
    from the device and dtype), ``grouped_mm``, ``tiled`` or ``loop``.
    """

    def __init__(self, s: ModelShape, moe: MoEShape, *, gemm: str = "auto") -> None:
        super().__init__()
        if gemm not in ("auto", "grouped_mm", "tiled", "loop"):
            raise ValueError(f"MoEBlock gemm must be auto, grouped_mm, tiled or loop, got {gemm!r}")
        self.moe = moe
        self.gemm = gemm
        self.gemm_asked = gemm  # gemm is this once decided; "auto" again decides it at the next forward
        self.router_stage = RouterStage(s, moe)
        self.preprocess_stage = PreprocessStage(moe)
        self.experts = ExpertsStage(s, moe)
        self.combine_stage = CombineStage(s, moe)

    @property
    def sync_free(self) -> bool:
        """Whether the whole block runs without a host sync (rule R11 allows scope ``moe`` then)."""
        if self.experts.experts.sizes_on_host:
            return False  # a hook on the experts reads their group sizes on the host (the alltoall dispatcher)
        return self.moe.capacity_factor is not None or (self.moe.sync_free and self.gemm != "loop")

    def set_aux_loss_scale(self, scale: float) -> None:
        """Backward scale of the aux/z losses, e.g. 1 / micro-batches (eager, once)."""
        self.router_stage.router.set_aux_loss_scale(scale)

    def graph_head(self) -> list[nn.Module]:
        """The stages this forward starts with, one after the other with nothing in between (cuda_graph/scopes.py)."""
        return [self.router_stage, self.preprocess_stage]

    def graph_tail(self) -> list[nn.Module]:
        """The stages this forward ends with, the last returning the block's output (cuda_graph/scopes.py)."""
        return [self.combine_stage]

    def graph_scopes(self) -> dict:
        return {
            "moe": self,
            "moe_router": [self.router_stage, self.combine_stage],
            "moe_preprocess": self.preprocess_stage,
        }

    def _choose_gemm(self, x: torch.Tensor) -> None:
        """Fix the expert GEMM at the first forward, once the device and dtype are known."""
        if self.gemm == "auto":
            self.gemm = choose_gemm(self.moe, x.device, x.dtype, unpadded=self.experts.experts.sizes_on_host)
        self.preprocess_stage.gemm = self.experts.gemm = self.gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts.gemm != self.gemm or self.gemm == "auto":
            self._choose_gemm(x)
        normed, probs, idx, *shared = self.router_stage(x)
        expert_in, row, groups = self.preprocess_stage(normed, probs, idx)
        expert_out = self.experts(expert_in, groups)
        return self.combine_stage(x, expert_out, row, probs, *shared)


# --------------------------------------------------------------------------
# model-level helpers for the trainer


def moe_routers(model: nn.Module | Sequence[TopKRouter]) -> list[TopKRouter]:
    """The routers of every MoE layer, in layer order (a list of routers is taken as it is: the trainer
    finds them once, not with a walk over every module at every step)."""
    if not isinstance(model, nn.Module):
        return list(model)
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def moe_stats(model: nn.Module | Sequence[TopKRouter]) -> dict[str, torch.Tensor]:
    """Device tensors summed over MoE layers and micro-batches since the last reset.

    ``aux_loss`` and ``z_loss`` are without their coefficients (Megatron logs
    ``load_balancing_loss`` and ``z_loss`` the same way; divide by layers and
    micro-batches for its per-layer mean); ``tokens_per_expert`` is
    [moe layers, experts]. Reading them on the host is the caller's sync.
    """
    routers = moe_routers(model)
    if not routers:
        return {}
    return {
        "aux_loss": torch.stack([r.aux_loss_sum for r in routers]).sum(),
        "z_loss": torch.stack([r.z_loss_sum for r in routers]).sum(),
        "tokens_per_expert": torch.stack([r.tokens_per_expert for r in routers]),
    }


@torch.no_grad()
def reset_moe_stats(model: nn.Module | Sequence[TopKRouter]) -> None:
    """Zero the statistics in place, one multi-tensor kernel (capturable: in place on persistent buffers)."""
    stats = [t for r in moe_routers(model) for t in (r.aux_loss_sum, r.z_loss_sum, r.tokens_per_expert)]
    if stats:
        foreach_zero_(stats)


def update_expert_bias(model: nn.Module | Sequence[TopKRouter], group=None) -> None:
    """Aux-loss-free balancing step of every router with an expert bias (eager, after the optimizer step)."""
    for r in moe_routers(model):
        r.update_expert_bias(group)


def set_aux_loss_scale(model: nn.Module | Sequence[TopKRouter], scale: float) -> None:
    """Backward scale of every MoE layer's aux/z losses, e.g. 1 / micro-batches (eager, once)."""
    for r in moe_routers(model):
        r.set_aux_loss_scale(scale)
