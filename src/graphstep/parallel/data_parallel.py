"""Data-parallel replicas: the bucketed all-reduce of the flat gradient buffer, with or without overlap.

:func:`grad_reducer` picks the reducer a layout needs (none with one
replica, or with FSDP2, which reduce-scatters in the backward); the
training step calls it after the last backward (training/step.py): inside
the full-iteration graph when there is one, eagerly after the backward
graphs with per-layer graphs.

:class:`GradReducer` averages the flat fp32 gradient buffer after the last
backward; :class:`OverlappedGradReducer` (``ddp.overlap_grad_reduce``)
starts each bucket during the last backward.

Overlap. With overlap, a bucket's
all-reduce starts during the *last* micro-batch's backward, as soon as every
parameter whose gradient lies in the bucket has been accumulated into it
(a post-accumulate-grad hook registered after the buffer's own), so the
communication of the last layers' gradients runs while autograd computes the
first layers'. Over pipeline stages the schedule runs the backwards, so the
step arms the reducer before the schedule and a bucket starts once each of
its gradients has been accumulated once per micro-batch: in the stage's last
backward too. After the backward, the buckets that never became ready (a
parameter without a gradient in this step) start in bucket order, and every
bucket is waited on. The sums are those of the reducer without overlap --
the same buckets, pre-divided the same way -- so the results are the same
bits.

The collectives are asynchronous (``async_op=True``): on NCCL they run on
the process group's own stream, which waits on the compute stream when a
bucket starts and is waited on by it at the end; inside a full-iteration
capture these waits fork the communication stream from the capture stream
and join it back, so the graph holds the overlap too. Buckets start in the
order their last gradients arrive, which autograd makes the same on every
rank of one model.

With FSDP2 there is no replicated reduction: FSDP2 reduce-scatters each
layer's gradients on its own stream as soon as the layer's backward is done,
overlapped by construction.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from ..config import DDPConfig
from .dims import DP, TP, ParallelDims, WorldMesh

log = logging.getLogger("graphstep")

DEFAULT_BUCKET_ELEMENTS = 40_000_000


class GradReducer:
    """Average the flat fp32 gradient buffer over ranks: one all-reduce per bucket.

    The buckets are fixed views of the buffer, so the collectives capture
    into a graph at static addresses. Averaging pre-divides the buffer by the
    number of ranks (exact for powers of two) and sums, unless
    ``average_in_collective`` asks for ``ReduceOp.AVG`` and the backend has it
    (NCCL does; gloo does not, and pre-divides instead).
    """

    def __init__(self, flat: torch.Tensor, world_size: int, *, bucket_size: int | None = None,
                 average_in_collective: bool = False, backend: str | None = None, group: Any = None) -> None:
        size = bucket_size or max(DEFAULT_BUCKET_ELEMENTS, 1_000_000 * world_size)  # Megatron's default
        assert size >= 1, f"ddp.bucket_size={bucket_size}: rule V refuses a bucket below 1 element"
        self.flat = flat
        self.world_size = world_size
        self.buckets = [flat[i : i + size] for i in range(0, flat.numel(), size)]
        self.in_collective = average_in_collective and backend == "nccl"
        if average_in_collective and not self.in_collective:
            log.info("ddp.average_in_collective=true: the %s backend has no ReduceOp.AVG; pre-dividing the "
                     "gradients by %d instead", backend, world_size)
        self.op = dist.ReduceOp.AVG if self.in_collective else dist.ReduceOp.SUM
        self.group = group

    def __call__(self) -> None:
        if not self.in_collective:
            self.flat.div_(self.world_size)
        for bucket in self.buckets:
            dist.all_reduce(bucket, op=self.op, group=self.group)

    def describe(self) -> str:
        how = "ReduceOp.AVG" if self.in_collective else f"pre-divided by {self.world_size}, summed"
        return f"{len(self.buckets)} bucket(s) of up to {self.buckets[0].numel():,} fp32 elements, {how}"


class ExpertParallelReducer:
    """Data parallel with expert-parallel experts (``model.expert_model_parallel_size``).

    The dense gradients (GradBuffers keeps them first in the flat buffer) are
    averaged over every data-parallel rank (of this rank's pipeline stage) as
    by :class:`GradReducer`. An expert's
    gradient already sums the losses of its expert-parallel ranks (their
    tokens reached it through the all-gather); it is summed over the ranks
    holding the same experts (``edp_group``; None when no other rank holds
    them) and divided by all ranks, which is the mean over the global batch
    that the dense gradients get.
    """

    def __init__(self, grads: Any, world_size: int, edp_group: Any, **kwargs: Any) -> None:
        n = grads.dense_numel
        self.dense = GradReducer(grads.flat[:n], world_size, **kwargs)
        self.expert_grads, self.world_size = grads.flat[n:], world_size
        self.experts = None if edp_group is None else GradReducer(
            self.expert_grads, world_size, **{**kwargs, "average_in_collective": False, "group": edp_group})

    def describe(self) -> str:
        experts = (f"experts: {self.experts.describe()} over their expert-data-parallel group"
                   if self.experts is not None else f"experts: divided by {self.world_size}, each rank's own")
        return f"dense: {self.dense.describe()}; {experts}"

    def __call__(self) -> None:
        self.dense()
        if self.experts is not None:
            self.experts()
        else:  # every rank holds other experts: nothing to sum
            self.expert_grads.div_(self.world_size)


class PartialGradReducer:
    """Replicated parameters whose gradient is each tensor-parallel rank's share (parallel/tensor_parallel.py,
    ``partial_over_tp``): the MoE blocks', each rank having run them on its own share of the tokens (router,
    norm, shared expert; the experts too without expert parallel), and the query and key norms', each rank
    normalising its own heads. Their gradients are summed over the tensor-parallel ranks -- after ``then``, the
    data-parallel reduction (None: one replica) -- as Megatron sums a sequence-parallel router's and the qk norms'.
    """

    def __init__(self, shares: torch.Tensor, tp_group: Any, then: Any = None) -> None:
        self.shares, self.group, self.then = shares, tp_group, then
        if hasattr(then, "arm"):  # an overlapped data-parallel reduction starts during the last backward
            self.arm = then.arm

    def __call__(self) -> None:
        if self.then is not None:
            self.then()
        dist.all_reduce(self.shares, group=self.group)

    def describe(self) -> str:
        first = f"{self.then.describe()}; " if self.then is not None else ""
        return f"{first}partial gradients ({self.shares.numel():,} fp32 elements) summed over tensor-parallel ranks"


class OverlappedGradReducer(GradReducer):
    """A :class:`GradReducer` whose buckets start during the last backward (see the module docstring)."""

    def __init__(self, grads: Any, world_size: int, **kwargs: Any) -> None:
        super().__init__(grads.flat, world_size, **kwargs)
        starts = [b.storage_offset() - grads.flat.storage_offset() for b in self.buckets]
        ends = [s + b.numel() for s, b in zip(starts, self.buckets)]
        self.param_buckets: dict[int, list[int]] = {}
        offset = 0
        for p, g in zip(grads.params, grads.grads):
            lo, hi = offset, offset + g.numel()
            offset = hi
            self.param_buckets[id(p)] = [b for b, (s, e) in enumerate(zip(starts, ends)) if lo < e and hi > s]
        self.needed = [0] * len(self.buckets)  # gradients each bucket waits for
        for owned in self.param_buckets.values():
            for b in owned:
                self.needed[b] += 1
        self.pending: list[int] = []
        self.works: list[Any] = []
        self.armed = False
        for p in grads.params:
            p.register_post_accumulate_grad_hook(self._ready)

    def arm(self, accumulations: int = 1) -> None:
        """Before the last micro-batch's backward: count the gradients each bucket still waits for. A pipeline's
        schedule runs every backward of the step itself, so its step arms before the schedule with
        ``accumulations`` = the micro-batches: a bucket starts once each of its gradients has been accumulated
        that many times, i.e. in the stage's last backward."""
        self.pending = [n * accumulations for n in self.needed]
        self.works = [None] * len(self.buckets)
        self.armed = True

    def _ready(self, p: Any) -> None:
        if not self.armed:
            return
        for b in self.param_buckets[id(p)]:
            self.pending[b] -= 1
            if self.pending[b] == 0:
                self._start(b)

    def _start(self, b: int) -> None:
        bucket = self.buckets[b]
        if not self.in_collective:
            bucket.div_(self.world_size)
        self.works[b] = dist.all_reduce(bucket, op=self.op, group=self.group, async_op=True)

    def __call__(self) -> None:
        if not self.armed:  # called without arm(): reduce everything now, as the plain reducer does
            self.arm()
        for b, work in enumerate(self.works):
            if work is None:
                self._start(b)
        for work in self.works:
            work.wait()
        self.armed = False

    def describe(self) -> str:
        return super().describe() + ", overlapped with the last backward"


def grad_reducer(grads: Any, ddp: DDPConfig, dims: ParallelDims, mesh: WorldMesh | None,
                 backend: str | None) -> GradReducer | ExpertParallelReducer | PartialGradReducer | None:
    """The reduction of ``grads`` (the trainer's GradBuffers) over the data-parallel replicas of ``dims`` and
    their context-parallel ranks (Megatron reduces over dp x cp: each context-parallel rank's gradient is its
    tokens' share, parallel/context_parallel.py) -- None with one such rank, or with FSDP2, which
    reduce-scatters in the backward -- and, under tensor parallel, of the partial gradients (MoE blocks, query
    and key norms) over the tensor-parallel ranks."""
    reducer = _replica_reducer(grads, ddp, dims, mesh, backend)
    shares = grads.flat[grads.tp_partials]
    if dims.tp > 1 and shares.numel():
        return PartialGradReducer(shares, mesh.group(TP), then=reducer)
    return reducer


def _replica_reducer(grads: Any, ddp: DDPConfig, dims: ParallelDims, mesh: WorldMesh | None,
                     backend: str | None) -> GradReducer | ExpertParallelReducer | None:
    if dims.grad_ranks <= 1 or dims.fsdp is not None:
        return None
    ranks = dims.grad_ranks
    kwargs = dict(bucket_size=ddp.bucket_size, average_in_collective=ddp.average_in_collective, backend=backend,
                  group=grad_group(dims, mesh))
    if dims.ep > 1:
        # the ranks holding the same experts: the edp ranks, and the context- and tensor-parallel ranks, which ran
        # the experts on their own share of the tokens (parallel/dims.py, expert_dp; not the tensor-parallel ones
        # under expert tensor parallel, which hold other parts of the experts)
        edp = mesh.group(dims.holders_dim) if dims.expert_holders > 1 else None
        return ExpertParallelReducer(grads, ranks, edp, **kwargs)
    if ddp.overlap_grad_reduce:
        return OverlappedGradReducer(grads, ranks, **kwargs)
    return GradReducer(grads.flat, ranks, **kwargs)


def dp_group(dims: ParallelDims, mesh: WorldMesh | None) -> Any:
    """The data-parallel ranks of this rank's stage and tensor-parallel rank: the mesh's ``dp`` group, or None
    (the default group) when they are the whole world."""
    return mesh.group(DP) if mesh is not None and dims.dp < dims.ranks else None


def grad_group(dims: ParallelDims, mesh: WorldMesh | None) -> Any:
    """The data-parallel and context-parallel ranks of this rank's stage and tensor-parallel rank, over which
    gradients and losses are averaged: the mesh's ``dp_cp`` group (``dp`` with one context-parallel rank), or
    None (the default group) when they are the whole world."""
    return mesh.group(dims.grad_dim) if mesh is not None and dims.grad_ranks < dims.ranks else None
