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
from ..models.transformer import Attention, GPTModel


class ContextParallel:
    """This rank's place among the context-parallel ranks, and what the model's attention and loss need of it.

    The model calls it (``GPTModel.context``, ``Attention.context``, set by
    :func:`apply_context_parallel`); positions and masks are made on the device
    by the first call of a shape (a warm-up step, or the capture itself with no
    warm-up: kernels only, no host copy) and read from then on, at the same
    addresses.
    """

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self._positions: dict[tuple, torch.Tensor] = {}  # (local length, device) -> [1, local] int64
        self._masks: dict[tuple, torch.Tensor] = {}  # (local length, device, dtype) -> [local, cp x local]

    def positions(self, local: int, device: torch.device) -> torch.Tensor:
        """The positions in the whole sequence of the ``local`` tokens this rank holds, ``[1, local]``."""
        key = (local, device)
        if key not in self._positions:
            self._positions[key] = context_parallel_positions(local * self.size, self.rank, self.size, device)[None]
        return self._positions[key]

    def mask(self, local: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The additive causal mask ``[local, cp x local]`` (0 or -inf) of this rank's queries over the gathered
        keys, which arrive in rank order, each rank's two chunks."""
        key = (local, device, dtype)
        if key not in self._masks:
            seq = local * self.size
            queries = context_parallel_positions(seq, self.rank, self.size, device)
            keys = torch.cat([context_parallel_positions(seq, r, self.size, device) for r in range(self.size)])
            allowed = keys[None, :] <= queries[:, None]
            self._masks[key] = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed,
                                                                                                 float("-inf"))
        return self._masks[key]

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


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh) -> ContextParallel:
    """Make ``model`` (a GPTModel) run its sequence chunks over ``mesh`` (1-D, the cp dimension), in place."""
    if not isinstance(model, GPTModel):
        raise TypeError(f"context parallel runs graphstep's GPTModel, not {type(model).__name__} (rule R30)")
    cp = ContextParallel(mesh.get_group(), mesh.get_local_rank(), mesh.size())
    model.context = cp
    for module in model.modules():
        if isinstance(module, Attention):
            module.context = cp
    return cp
