"""Expert parallel as a DTensor parallel style: each rank holds ``num_moe_experts / ep`` experts of every MoE block.

:class:`ExpertParallel` (``parallelize_module`` applies it to each MoE
block) shards the stacked expert weights over ``ep`` with
``distribute_module`` and installs the token exchange
(models/moe_parallel.py), so the block (models/moe.py) does not know whether
it is distributed:

* ``alltoall``: the exchange is the experts module's input and output
  functions -- the rows go to their experts' ranks before its GEMMs and come
  back after (torchtitan's ``ExpertParallel``, Megatron's all-to-all
  dispatcher).
* ``allgather``: the exchange surrounds more than the experts (the ranks'
  tokens and routing are gathered before the layout, the weighted sums
  reduce-scattered after), so the style owns the block's forward:
  :class:`AllGatherMoEBlock`, the block's class under this dispatcher.

The ``ep`` ranks of one ``edp`` index share their tokens; the ``edp`` ranks
hold the same experts and sum their gradients: over replicas in the training
step (parallel/data_parallel.py, ``ExpertParallelReducer``, with the
tensor-parallel ranks too under tensor parallel), under FSDP2 in its
reduce-scatter, which shards each expert over the ``edp`` ranks
(parallel/fsdp.py: torchtitan's FSDP of the experts over the data-parallel
ranks outside the expert-parallel ones).

Expert tensor parallel (``expert_tensor_parallel_size`` = ``tp``, Megatron's
default) splits each expert over the tensor-parallel ranks as well: ``linear_fc1``
by its gate and up rows, part by part (``fused_parts``, as a dense MLP's
colwise ``linear_fc1``), ``linear_fc2`` by its input columns; the mesh gains
``tp`` (Shard of those dims). The ranks sharing their tokens are then
``(ep, tp)`` (Megatron's ``tp_ep`` group): under the ``allgather`` dispatcher,
whose block this always is with expert tensor parallel, every rank all-gathers
the tokens and routing of the ``ep x tp`` ranks, runs its share of its experts'
columns on the pairs routed to them -- a partial sum of each expert's output --
and the reduce-scatter over the ``ep x tp`` ranks adds the tensor-parallel
ranks' partial sums together with the expert-parallel ranks' experts. The
backward of the all-gather (a reduce-scatter) sums the input and routing
gradients, which are partial over the tensor-parallel ranks too. With one
expert-parallel rank the same block exchanges over ``tp`` alone.

Over pipeline stages the ``(edp, ep)`` mesh of a rank is that of its stage
(the mesh's ``pp`` index fixed), so a stage's MoE blocks exchange tokens among
its own ``ep`` ranks, hold experts of its own layers only, and reduce them over
its own ``edp`` ranks (rule R31: the ``allgather`` dispatcher over replicated
data parallel).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import parallelize_module

from ..engines_compat import module_style
from ..models.moe import MoEBlock, weighted_sum
from ..models.moe_dispatch import (
    GroupedExperts,
    StackedLinear,
    dispatch,
    expert_parallel_layout,
    tile_owner,
    tile_size,
)
from ..models.moe_parallel import (
    AllToAllRoute,
    ExpertPlace,
    alltoall_combine,
    alltoall_dispatch,
    gather,
    gather_tokens,
    scatter_sums,
)
from .dims import EDP, EP, TP
from .tensor_parallel import fused_parts, part_slice


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, tokens: DeviceMesh | None = None) -> None:
    """Apply :class:`ExpertParallel` to every MoE block of ``model``, in place. ``mesh``: the experts' mesh --
    (edp, ep), or (ep,) when FSDP2 shards the experts over edp next; with expert tensor parallel ``tp`` last, or
    (tp,) alone with one expert-parallel rank. ``tokens``: the ranks that share their tokens (``ep``, ``ep_tp``
    or ``tp``), one dimension; None: ``mesh``'s ``ep``."""
    tokens = mesh[EP] if tokens is None else tokens
    for block in [m for m in model.modules() if isinstance(m, MoEBlock)]:
        parallelize_module(block, mesh, ExpertParallel(tokens))


def _place(mesh: DeviceMesh | None) -> ExpertPlace:
    if mesh is None:
        return ExpertPlace(group=None, rank=0, size=1)
    return ExpertPlace(group=mesh.get_group(), rank=mesh.get_local_rank(), size=mesh.size())


class ExpertParallel(module_style()):  # type: ignore[misc, valid-type]
    """The parallel style of a MoE block over ``device_mesh`` (edp, ep), (ep,), (edp, ep, tp) or (tp,): its experts
    sharded over ``ep`` (and split over ``tp``), its tokens exchanged among the ranks of ``tokens`` by the block's
    dispatcher (``model.moe_token_dispatcher_type``; ``allgather`` under expert tensor parallel).

    Every rank built all experts from the same seed; it keeps its slice of
    the stacked expert weights as a DTensor sharded over ``ep`` (and ``tp``)
    and replicated over ``edp`` (the ranks holding the same experts), so the
    optimizer, the gradient norm and checkpoints treat them as any sharded
    parameter, and an expert-parallel run starts from the weights of a plain
    one.
    """

    def __init__(self, tokens: DeviceMesh) -> None:
        super().__init__()
        self.tokens = tokens

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        block = module
        names = device_mesh.mesh_dim_names or ()
        split = TP in names  # expert tensor parallel
        _check(block, split)
        place = _place(device_mesh[EP] if EP in names else None)
        experts = block.experts.experts
        if split:
            experts.linear_fc1.fused_parts = (experts.linear_fc1.weight.shape[1] // 2,) * 2  # gate, up
        if block.moe.dispatcher == "alltoall" and not split:
            exchange = _AllToAllExchange(place)
            distribute_module(experts, device_mesh, _shard_experts(place), exchange.dispatch, exchange.combine)
            experts.sizes_on_host = True
        else:
            distribute_module(experts, device_mesh, _shard_experts(place))
            block.__class__ = AllGatherMoEBlock
            block.expert_place, block.token_place = place, _place(self.tokens)
        block.gemm = block.gemm_asked  # "auto" is decided again at the next forward, for this dispatch
        return block


def _check(block: MoEBlock, split: bool) -> None:
    """What expert parallel cannot run, refused before anything changes."""
    if split and not block.moe.sync_free:
        raise ValueError("expert tensor parallel runs the sync-free expert GEMM: set model.moe_sync_free=true")
    if block.moe.dispatcher not in ("allgather", "alltoall"):
        raise ValueError(f"model.moe_token_dispatcher_type={block.moe.dispatcher!r} is not implemented across "
                         "expert-parallel ranks; set it to allgather or alltoall")
    if block.moe.capacity_factor is not None:
        raise ValueError("expert parallel is dropless: set model.moe_expert_capacity_factor=null")
    if block.moe.dispatcher == "alltoall" and block.gemm_asked == "tiled":
        raise ValueError("the alltoall dispatcher runs the grouped_mm or loop expert GEMM, not tiled")


def _shard_experts(place: ExpertPlace) -> Any:
    """``distribute_module``'s partition: each stacked expert weight as this rank's slice along the experts, a
    DTensor sharded over ``ep`` (Shard(0)) and replicated over ``edp``; under expert tensor parallel also sliced
    over ``tp``: ``linear_fc1`` [E, 2 ffn, h] by rows of gate and of up (Shard(1), its rows in per-rank part order:
    tensor_parallel.py ``fused_parts``), ``linear_fc2`` [E, h, ffn] by columns (Shard(2))."""

    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if not isinstance(module, StackedLinear):
            return
        w, names = module.weight, mesh.mesh_dim_names or ()
        local = w.detach().chunk(place.size, dim=0)[place.rank]
        split = 1 if fused_parts(module) else 2  # fc1's rows or fc2's columns
        placements = {EDP: Replicate(), EP: Shard(0), TP: Shard(split)}
        if TP in names:
            tp = mesh[TP]
            local = part_slice(local, fused_parts(module), tp.get_local_rank(), tp.size(), dim=split)
        dt = DTensor.from_local(local.contiguous(), mesh, [placements[n] for n in names], run_check=False,
                                shape=w.shape, stride=w.stride())
        module.weight = nn.Parameter(dt, requires_grad=w.requires_grad)
        if EP in names:  # its gradient is reduced over the ranks holding the same experts (data_parallel.py)
            module.weight.expert_parallel = True

    return partition


class _AllToAllExchange:
    """The ``alltoall`` dispatcher as the experts module's input and output functions: the rows to their experts'
    ranks before the GEMMs, back after (host split sizes: eager)."""

    def __init__(self, place: ExpertPlace) -> None:
        self.place = place
        self.route: AllToAllRoute | None = None  # the split sizes of the call in flight, for its way back

    def dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        """(this rank's rows sorted by global expert, gemm, groups) -> (the rows of this rank's experts, gemm,
        their groups from the received counts)."""
        x, gemm, groups = inputs
        if gemm == "grouped_mm":  # the offsets of the unpadded layout: ends of the groups
            counts = torch.diff(groups, prepend=groups.new_zeros(1)).to(torch.int64)
        elif gemm == "loop":
            counts = groups
        else:
            raise ValueError(f"the alltoall dispatcher runs the grouped_mm or loop expert GEMM (its groups are "
                             f"not padded to tiles), got gemm={gemm!r}")
        by_expert, per_expert, self.route = alltoall_dispatch(x, counts, self.place)
        if gemm == "loop":
            return by_expert, gemm, per_expert
        return by_expert, gemm, torch.tensor(per_expert, device=x.device).cumsum(0).to(torch.int32)

    def combine(self, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """The experts' outputs back to the ranks the rows came from, in the order they came."""
        route, self.route = self.route, None
        return alltoall_combine(out, route, self.place)


class AllGatherMoEBlock(MoEBlock):
    """A MoE block under the ``allgather`` dispatcher (:class:`ExpertParallel` gives a block this class): all-gather
    in, reduce-scatter out; dropless, sync-free, static shapes.

    The expert-parallel ranks all-gather their tokens and routing; each
    runs its own experts on every pair routed to them (a dropless layout
    with device-side offsets into the grouped GEMM) and sums each token's
    weighted outputs of those experts; a reduce-scatter adds the ranks'
    sums and hands each rank its own tokens back. The backward of the
    all-gather is a reduce-scatter and vice versa, so the router and the
    tokens get their gradients from every rank's experts. The block's stages
    and parameters are the same; only its forward differs.
    """

    expert_place: ExpertPlace  # this rank's experts: its place among the expert-parallel ranks
    token_place: ExpertPlace  # the ranks sharing their tokens: the expert-parallel ones (x tp: expert tensor parallel)

    def graph_head(self) -> list[nn.Module]:
        """The router stage alone: the tokens' all-gather follows it, eagerly (cuda_graph/scopes.py)."""
        return [self.router_stage]

    def graph_tail(self) -> list[nn.Module]:
        """None: the block ends with the reduce-scatter and the combine's last step, eagerly (cuda_graph/scopes.py)."""
        return []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts.gemm != self.gemm or self.gemm == "auto":
            self._choose_gemm(x)
        ep, tokens, moe = self.expert_place, self.token_place, self.moe
        normed, probs, idx, *shared = self.router_stage(x)
        normed_all = gather_tokens(normed, tokens)
        probs_all = gather_tokens(probs, tokens)
        idx_all = gather(idx, tokens)
        local = moe.num_experts // ep.size
        align = tile_size(idx_all.numel(), local) if self.gemm == "tiled" else 1
        row, _counts, offsets, rows = expert_parallel_layout(idx_all, ep.rank * local, local, align)
        expert_in = dispatch(normed_all, row, rows)
        groups = offsets if self.gemm == "grouped_mm" else tile_owner(offsets, rows, align)
        expert_out = self.experts.experts(expert_in, self.gemm, groups)
        # zero for pairs of other ranks' experts; under expert tensor parallel the sum of this rank's columns only
        mine = weighted_sum(expert_out, row, probs_all, drops=True)
        y = scatter_sums(mine, tokens)
        return self.combine_stage.finish(x, y.to(x.dtype), *shared)


def expert_modules(model: nn.Module) -> list[GroupedExperts]:
    """The expert-parallel experts of every MoE block (GroupedExperts), in layer order."""
    return [m.experts.experts for m in model.modules()
            if isinstance(m, MoEBlock) and is_expert_parameter(m.experts.experts.linear_fc1.weight)]


def is_expert_parameter(p: torch.Tensor) -> bool:
    return getattr(p, "expert_parallel", False)
