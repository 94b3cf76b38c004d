"""Expert-parallel token exchanges: the collectives of the ``allgather`` and ``alltoall`` token dispatchers.

parallel/expert_parallel.py's ``ExpertParallel`` style installs them around
the MoE block's experts; the block itself (models/moe.py) has no
expert-parallel code.

``model.expert_model_parallel_size`` = ``ep`` splits the experts over ``ep``
ranks: rank ``r`` holds experts ``[r * local, (r + 1) * local)``. Both
dispatchers are dropless; they differ in what crosses the wire and whether
the host reads anything (docs/parallel.md, "Expert parallel"):

* ``allgather`` (:func:`gather_tokens`, :func:`scatter_sums`, around the
  experts in parallel/expert_parallel.py's ``AllGatherMoEBlock``): every
  rank all-gathers the ranks' tokens and routing, runs its experts on the
  pairs routed to them in a static layout and reduce-scatters the weighted
  sums. No shape depends on
  the routing and nothing is read on the host: the block captures whole.
* ``alltoall`` (:func:`alltoall_dispatch` and :func:`alltoall_combine`, the
  input and output functions of the experts module; Megatron Core's
  ``MoEAlltoAllTokenDispatcher``): each rank sorts its own pairs by global
  expert (the ``moe_preprocess`` stage, on the device), the ranks exchange
  their per-expert counts, the host reads them as the all-to-all split sizes
  (the host sync), the pairs travel to the rank of their expert, run there
  sorted by local expert, and travel back in the order they came. Only the
  ``k x N`` routed rows move, but their number is read on the host, so this
  part runs eagerly between the graphed router and preprocess stages.

The exchanges are c10d collectives waited at once: with gloo, the functional
reduce-scatter corrupted the heap now and then (2 of 14 four-rank runs,
inside its wait), the c10d one -- FSDP2's -- never did. On NCCL the
all-gather and reduce-scatter are captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ExpertPlace:
    """This rank's place among the expert-parallel ranks of a MoE block (parallel/expert_parallel.py makes it)."""

    group: Any  # the process group of the ranks that share their tokens
    rank: int
    size: int


# --------------------------------------------------------------------------
# allgather: all-gather in, reduce-scatter out


def gather(t: torch.Tensor, ep: ExpertPlace) -> torch.Tensor:
    """The expert-parallel ranks' ``t`` concatenated along dim 0, in rank order (no gradient)."""
    out = t.new_empty((ep.size * t.shape[0], *t.shape[1:]))
    _c10d("all_gather_single", "all_gather_into_tensor")(out, t.contiguous(), group=ep.group)
    return out


def _scatter_sum(t: torch.Tensor, ep: ExpertPlace) -> torch.Tensor:
    """This rank's chunk (along dim 0) of the sum of the expert-parallel ranks' ``t``."""
    out = t.new_empty((t.shape[0] // ep.size, *t.shape[1:]))
    _c10d("reduce_scatter_single", "reduce_scatter_tensor")(out, t.contiguous(), group=ep.group)
    return out


def _c10d(name: str, older: str) -> Any:
    """``torch.distributed.<name>``, or its older name on the torch versions that have only that."""
    return getattr(dist, name, None) or getattr(dist, older)


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0; the gradient is reduce-scattered back to the ranks the rows came from."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, ep: ExpertPlace) -> torch.Tensor:
        ctx.ep = ep
        return gather(t, ep)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _scatter_sum(grad, ctx.ep), None


class _ScatterSums(torch.autograd.Function):
    """Reduce-scatter along dim 0; the gradient is all-gathered."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, ep: ExpertPlace) -> torch.Tensor:
        ctx.ep = ep
        return _scatter_sum(t, ep)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gather(grad, ctx.ep), None


def gather_tokens(t: torch.Tensor, ep: ExpertPlace) -> torch.Tensor:
    """All-gather ``t`` over the expert-parallel ranks; its gradient is reduce-scattered."""
    return _GatherTokens.apply(t, ep)


def scatter_sums(t: torch.Tensor, ep: ExpertPlace) -> torch.Tensor:
    """Sum ``t`` over the expert-parallel ranks and keep this rank's chunk; its gradient is all-gathered."""
    return _ScatterSums.apply(t, ep)


# --------------------------------------------------------------------------
# alltoall: the routed rows travel to their expert's rank and back


def _all_to_all(t: torch.Tensor, out_splits: list[int], in_splits: list[int], ep: ExpertPlace) -> torch.Tensor:
    """Rows ``in_splits[r]`` of ``t`` go to rank ``r``; ``out_splits[r]`` rows come from rank ``r``, in rank order."""
    out = t.new_empty((sum(out_splits), *t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=ep.group)
    return out


class _AllToAll(torch.autograd.Function):
    """All-to-all along dim 0 with host split sizes; the gradient takes the reverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, out_splits: list[int], in_splits: list[int],
                ep: ExpertPlace) -> torch.Tensor:
        ctx.splits, ctx.ep = (out_splits, in_splits), ep
        return _all_to_all(t, out_splits, in_splits, ep)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.ep), None, None, None


def _regroup(t: torch.Tensor, sizes: list[list[int]]) -> torch.Tensor:
    """Rows in chunks ``sizes[i][j]``, ``i`` major, reordered ``j`` major: ``[i0j0, i0j1, ..] -> [i0j0, i1j0, ..]``.

    Megatron's ``sort_chunks_by_idxs``: split and cat, whose backward is the reverse reordering.
    """
    rows, cols = len(sizes), len(sizes[0])
    chunks = torch.split(t, [n for row in sizes for n in row])
    return torch.cat([chunks[i * cols + j] for j in range(cols) for i in range(rows)])


def _transpose(sizes: list[list[int]]) -> list[list[int]]:
    return [list(col) for col in zip(*sizes)]


@dataclass(frozen=True)
class AllToAllRoute:
    """How one call's rows travel: the split sizes of the all-to-all there and back (host ints) and the received
    counts ``got[rank s][my expert e]``, by which the rows are regrouped by expert and back."""

    got: list[list[int]]
    send_splits: list[int]
    recv_splits: list[int]


def alltoall_dispatch(x: torch.Tensor, tokens_per_expert: torch.Tensor,
                      ep: ExpertPlace) -> tuple[torch.Tensor, list[int], AllToAllRoute]:
    """This rank's pairs to the ranks of their experts: (rows for this rank's experts sorted by local expert,
    their counts per local expert (host ints), the route back for :func:`alltoall_combine`) (eager: host sync).

    ``x`` holds this rank's (token, choice) pairs sorted by global expert and
    ``tokens_per_expert [E]`` their counts (``moe_preprocess``, align 1).
    """
    local = tokens_per_expert.numel() // ep.size
    received = torch.empty_like(tokens_per_expert)
    dist.all_to_all_single(received, tokens_per_expert.contiguous(), group=ep.group)  # [ep x local]: rank s -> my e
    # THE host sync of the alltoall dispatcher: the split sizes of the token all-to-all live on the
    # host (c10d takes Python ints), so this part of the block can never be inside a CUDA graph.
    counts = torch.cat([tokens_per_expert, received]).tolist()
    sent = [counts[r * local:(r + 1) * local] for r in range(ep.size)]  # [rank r][its expert e]: my pairs
    got = [counts[(ep.size + s) * local:(ep.size + s + 1) * local] for s in range(ep.size)]  # [rank s][my expert e]
    route = AllToAllRoute(got, [sum(c) for c in sent], [sum(c) for c in got])
    rows = _AllToAll.apply(x, route.recv_splits, route.send_splits, ep)  # by source rank, then my expert
    by_expert = _regroup(rows, got)  # by my expert, then source rank
    return by_expert, [sum(c) for c in _transpose(got)], route


def alltoall_combine(out: torch.Tensor, route: AllToAllRoute, ep: ExpertPlace) -> torch.Tensor:
    """The experts' outputs of :func:`alltoall_dispatch`'s rows back to the ranks they came from: row ``i`` is the
    output of the expert that row ``i`` of that call's ``x`` was routed to."""
    back = _regroup(out, _transpose(route.got))  # by source rank again, in the order the rows came
    return _AllToAll.apply(back, route.send_splits, route.recv_splits, ep)
