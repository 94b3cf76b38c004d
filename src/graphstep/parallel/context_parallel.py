"""Context parallel: each sequence split over the ``cp`` ranks, keys and values all-gathered inside attention.

``model.context_parallel_size`` = ``cp`` with ``model.cp_comm_type=all_gather``
(Megatron Core's name; graphstep's one implementation, also what null means):

* **Data.** Each context-parallel rank holds 2 of the ``2 x cp`` chunks of
  every sequence, ``r`` and ``2 x cp - 1 - r`` (data/context_parallel.py:
  Megatron's load balancing of causal attention); the data loader gives it
  only those tokens, labels and loss-mask values.
* **Positions.** Rotary embeddings rotate each query and key by its position
  in the whole sequence (:meth:`ContextParallel.positions`).
* **Attention.** Every layer all-gathers the keys and values of the ``cp``
  ranks (one all-gather of both, after the rotation) and each rank attends
  with its own queries to all of them under the causal mask of its positions:
  a query at position ``i`` sees the keys at positions ``<= i``, wherever they
  were gathered from (:meth:`ContextParallel.mask`, an additive mask made once
  per shape and dtype, so per-layer graphs read it at a fixed address). The
  all-gather is an autograd function whose backward reduce-scatters the keys'
  and values' gradients back to the ranks they came from (summed over the
  ranks whose queries used them). Megatron's ``all_gather`` type does the same
  (``AttnFuncWithCPAndKVAllGather``); its ``p2p`` ring, ``a2a`` (Ulysses) and
  ``a2a+p2p`` types are refused by rule R30.
* **Mamba** (hybrid models): the scan runs along whole sequences, so each
  Mamba mixer exchanges its conv input and dt by one all-to-all for the whole
  sequences of ``1 / cp`` of its heads, and its output back
  (:meth:`ContextParallel.sequences_of_parts`, models/mamba.py).
* **Loss.** A rank's loss is ``cp x`` (the summed token losses it holds) /
  (the loss-mask tokens of the whole sequences, summed over the ``cp`` ranks
  with one all-reduce): averaged over the context-parallel ranks, as the
  trainer averages losses and gradients over ``dp x cp`` ranks (Megatron's
  gradient reduction group), it is the mean over every token of the
  sequences, and its gradient the gradient of that mean
  (:meth:`ContextParallel.loss`; Megatron's ``loss[0] * cp_size``).

Everything is device work at static shapes, with collectives on the
context-parallel group: a full-iteration graph captures the all-gathers,
reduce-scatters and count all-reduces of every layer; per-layer ``attn``
graphs hold their layer's all-gather and, in the backward graph, its
reduce-scatter. Tensor parallelism composes: each rank gathers the key/value
heads it holds (the mesh is ``(..., cp, tp)``), and with sequence parallelism
the projections all-gather the rank's chunks over ``tp`` first. FSDP2 shards
over the ``dp x cp`` ranks (``dp_cp``, parallel/dims.py), as torchtitan does.

Pipeline stages, plain or virtual, compose too (Megatron Bridge's Llama 3
70B layout, TP x PP x VPP x CP): the mesh is ``(pp, dp, cp, tp)``, so every
stage's attention gathers over its own context-parallel group, and the
stages exchange the rank's ``seq / cp`` tokens of every sample. The last
stage computes :meth:`ContextParallel.loss` inside the schedule's loss
function (parallel/pipeline.py ``_StageLoss``), and each stage reduces its
gradients over its own ``dp x cp`` ranks. An interleaved rank's chunks run
through views of its model (parallel/interleaved.py ``chunk_view``) that
keep ``context`` and share the attention modules holding it.

Collectives are c10d ones waited at once (models/moe_parallel.py says why:
gloo's functional reduce-scatter is not reliable).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..data.context_parallel import context_parallel_positions
from ..models.mamba import MambaMixer
from ..models.transformer import Attention, GPTModel


class ContextParallel:
    """This rank's place among the context-parallel ranks, and what the model's attention and loss need of it.

    The model calls it (``GPTModel.context``, ``Attention.context``, set by
    :func:`apply_context_parallel`); positions and masks are made on the device
    by the first call of a shape (a warm-up step, or the capture itself with no
    warm-up: kernels only, no host copy) and read from then on, at the same
    addresses.
    """

    def __init__(self, group: Any, rank: int, size: int, comm: str = "all_gather") -> None:
        if comm not in ("all_gather", "a2a"):
            raise ValueError(f"context parallel communication {comm!r}: graphstep runs all_gather and a2a (rule R30)")
        self.group, self.rank, self.size, self.comm = group, rank, size, comm
        self._positions: dict[tuple, torch.Tensor] = {}  # (local length, device) -> [1, local] int64
        # (local length, device, dtype) -> [local, cp x local] (all_gather) or [cp x local, cp x local] (a2a)
        self._masks: dict[tuple, torch.Tensor] = {}

    def positions(self, local: int, device: torch.device) -> torch.Tensor:
        """The positions in the whole sequence of the ``local`` tokens this rank holds, ``[1, local]``."""
        key = (local, device)
        if key not in self._positions:
            self._positions[key] = context_parallel_positions(local * self.size, self.rank, self.size, device)[None]
        return self._positions[key]

    def mask(self, local: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The additive causal mask (0 or -inf) of the queries the attention holds over the keys it holds, which
        arrive in rank order, each rank's two chunks: ``[local, cp x local]``, this rank's queries (all_gather), or
        ``[cp x local, cp x local]``, every rank's queries of this rank's heads (a2a)."""
        key = (local, device, dtype)
        if key not in self._masks:
            seq = local * self.size
            keys = torch.cat([context_parallel_positions(seq, r, self.size, device) for r in range(self.size)])
            queries = keys if self.comm == "a2a" else context_parallel_positions(seq, self.rank, self.size, device)
            allowed = keys[None, :] <= queries[:, None]
            self._masks[key] = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed,
                                                                                                 float("-inf"))
        return self._masks[key]

    def exchange(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the attention computes over (``[batch, heads, local, dim]`` in): all_gather -- this rank's queries,
        every rank's keys and values (:meth:`gather_kv`); a2a (Ulysses) -- every rank's queries, keys and values of
        ``1 / cp`` of the heads, ``[batch, heads / cp, cp x local, dim]``, exchanged by one all-to-all each
        (:meth:`heads_back` returns the attention's output to this rank's tokens and all heads)."""
        if self.comm == "a2a":
            return tuple(_AllToAll.apply(t, self, True) for t in (q, k, v))
        return (q, *self.gather_kv(k, v))

    def heads_back(self, out: torch.Tensor) -> torch.Tensor:
        """The attention's output as this rank's tokens and every head (a2a: the all-to-all back); all_gather: as it
        is."""
        return _AllToAll.apply(out, self, False) if self.comm == "a2a" else out

    def sequences_of_parts(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Mamba's exchange (models/mamba.py): ``parts[j]`` (``[batch, local, width]``, this rank's tokens of heads
        part ``j``) goes to rank ``j``, which gets every rank's tokens of its part as whole sequences in order,
        ``[batch, cp x local, width]`` (one all-to-all; the gradient takes the inverse)."""
        recv = _Exchange.apply(torch.stack(parts), self)  # [cp, batch, local, width]: rank i's tokens
        halves = recv.unflatten(2, (2, -1))  # rank i holds chunks i and 2 cp - 1 - i
        last = 2 * self.size - 1
        return torch.cat([halves[k, :, 0] if k < self.size else halves[last - k, :, 1] for k in range(last + 1)],
                         dim=1)

    def tokens_of_parts(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`sequences_of_parts`: this rank's part of the whole sequences, ``[batch, cp x
        local, width]``, to this rank's tokens of every part, ``[batch, local, cp x width]`` (parts in rank order)."""
        chunks = t.unflatten(1, (2 * self.size, -1))
        last = 2 * self.size - 1
        send = torch.stack([torch.cat([chunks[:, i], chunks[:, last - i]], dim=1) for i in range(self.size)])
        recv = _Exchange.apply(send, self)  # [cp, batch, local, width]: part j of this rank's tokens
        return recv.permute(1, 2, 0, 3).flatten(2)

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every context-parallel rank's keys and values (``[batch, groups, local, dim]`` each) concatenated along
        the sequence in rank order, with one all-gather; their gradients are reduce-scattered back."""
        kv = torch.stack([k, v]).movedim(3, 0)  # [local, 2, batch, groups, dim]: the sequence first, for c10d
        gathered = _GatherSequence.apply(kv, self).movedim(0, 3)  # [2, batch, groups, cp x local, dim]
        return gathered[0], gathered[1]

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
        """``cp x`` this rank's summed token losses / the loss-mask tokens of the whole sequences (see the module
        docstring): its mean over the context-parallel ranks is the mean token loss."""
        losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        if loss_mask is None:  # every token counts: cp x local sum / (cp x local tokens)
            return losses.mean()
        mask = loss_mask.flatten().to(losses.dtype)
        count = mask.sum()
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=self.group)  # on the device: no host read
        return (losses * mask).sum() * self.size / count.clamp(min=1.0)


def _gather(t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    out = t.new_empty((cp.size * t.shape[0], *t.shape[1:]))
    _c10d("all_gather_single", "all_gather_into_tensor")(out, t.contiguous(), group=cp.group)
    return out


def _scatter_sum(t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    out = t.new_empty((t.shape[0] // cp.size, *t.shape[1:]))
    _c10d("reduce_scatter_single", "reduce_scatter_tensor")(out, t.contiguous(), group=cp.group)
    return out


def _c10d(name: str, older: str) -> Any:
    """``torch.distributed.<name>``, or its older name on the torch versions that have only that."""
    return getattr(dist, name, None) or getattr(dist, older)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over the context-parallel ranks; the gradient is reduce-scattered (summed)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        ctx.cp = cp
        return _gather(t, cp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _scatter_sum(grad, ctx.cp), None


def _heads_to_sequence(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """``[batch, heads, local, dim]`` -> ``[batch, heads / cp, cp x local, dim]``: head group ``j`` of every rank's
    tokens on rank ``j``, the tokens in rank order (one all-to-all)."""
    b, h, n, d = x.shape
    send = x.reshape(b, cp.size, h // cp.size, n, d).movedim(1, 0)  # [cp, b, h / cp, n, d]: to rank j
    recv = _exchange(send, cp)  # recv[i]: rank i's tokens of this rank's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp.size, cp.size * n, d)


def _sequence_to_heads(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """The inverse of :func:`_heads_to_sequence`: ``[batch, heads / cp, cp x local, dim]`` -> ``[batch, heads,
    local, dim]``, rank ``i``'s tokens back to rank ``i`` (one all-to-all)."""
    b, g, m, d = x.shape
    n = m // cp.size
    send = x.reshape(b, g, cp.size, n, d).permute(2, 0, 1, 3, 4)  # [cp, b, g, n, d]: tokens of rank i
    recv = _exchange(send, cp)  # recv[j]: head group j of this rank's tokens
    return recv.movedim(0, 1).reshape(b, cp.size * g, n, d)


class _AllToAll(torch.autograd.Function):
    """Heads to sequence (``to_sequence``) or back over the context-parallel ranks; the gradient takes the inverse
    exchange."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, cp: ContextParallel, to_sequence: bool) -> torch.Tensor:
        ctx.cp, ctx.to_sequence = cp, to_sequence
        return (_heads_to_sequence if to_sequence else _sequence_to_heads)(t, cp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (_sequence_to_heads if ctx.to_sequence else _heads_to_sequence)(grad, ctx.cp), None, None


class _Exchange(torch.autograd.Function):
    """``[cp, ...]``: slot ``j`` to rank ``j``, slot ``i`` of the result from rank ``i`` (one all-to-all of equal
    parts, its own inverse: the gradient takes the same exchange)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        ctx.cp = cp
        return _exchange(t, cp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _exchange(grad, ctx.cp), None


def _exchange(t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Slot ``j`` of ``t`` (``[cp, ...]``) to rank ``j``; slot ``i`` of the result from rank ``i``."""
    send = t.contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=cp.group)
    return recv


def cp_comm(cp_comm_type: Any) -> str:
    """The communication a ``model.cp_comm_type`` value (a name, one per layer, or null) asks for: ``a2a`` when it
    names a2a, else ``all_gather`` (rule R30 refuses the others and mixed lists)."""
    kinds = cp_comm_type if isinstance(cp_comm_type, list) else [cp_comm_type]
    return "a2a" if any(k == "a2a" for k in kinds) else "all_gather"


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh, comm: str = "all_gather") -> ContextParallel:
    """Make ``model`` (a GPTModel) run its sequence chunks over ``mesh`` (1-D, the cp dimension), in place;
    ``comm``: ``all_gather`` or ``a2a`` (:meth:`ContextParallel.exchange`)."""
    if not isinstance(model, GPTModel):
        raise TypeError(f"context parallel runs graphstep's GPTModel, not {type(model).__name__} (rule R30)")
    cp = ContextParallel(mesh.get_group(), mesh.get_local_rank(), mesh.size(), comm)
    model.context = cp
    for module in model.modules():
        if isinstance(module, (Attention, MambaMixer)):
            module.context = cp
    return cp
