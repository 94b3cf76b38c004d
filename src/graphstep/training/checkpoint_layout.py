"""What a sharded parameter puts in a checkpoint, so that a run of any layout can load it.

``torch.distributed.checkpoint`` (DCP) saves a DTensor as its shards with
their global offsets and loads it into any other sharding -- FSDP2's shards
of 2 ranks into 1 rank's whole tensor, tensor-parallel shards into FSDP2's.
That holds as long as the DTensor's global tensor is the parameter in its
natural layout, which is true of every parameter but one kind: a *fused*
projection sharded for tensor parallelism (``linear_qkv``, ``linear_fc1``:
training/parallel.py's ``FusedColwiseParallel``), whose rows each rank holds
part by part, so its DTensor's global rows are ordered per rank. For those
the checkpoint holds the natural tensor (q, k, v or gate, up, whole) on every
rank -- gathered when saving, sliced back into the local part after loading --
under the same key a one-GPU run uses. Every other DTensor is saved as it is,
and the optimizer's local state tensors are saved as DTensors shaped like
their parameter.

:class:`LayoutEntries` builds those entries for a DCP state dict; after
``dcp.load`` filled it, :meth:`LayoutEntries.finish_load` copies the fused
parameters' natural tensors into the local shards.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from .parallel import TP, fused_parts
from ..engines_compat import dtensor_local


def tensor_parallel_ranks(p: DTensor) -> int:
    """Over how many tensor-parallel ranks ``p``'s rows are split (1 when not row-sharded over tp)."""
    names = p.device_mesh.mesh_dim_names or ()
    for dim, (name, placement) in enumerate(zip(names, p.placements)):
        if name == TP and isinstance(placement, Shard) and placement.dim == 0:
            return p.device_mesh.size(dim)
    return 1


def to_natural(rows: torch.Tensor, parts: tuple[int, ...], ranks: int) -> torch.Tensor:
    """Per-rank part order (rank 0's slice of each part, then rank 1's ...) -> parts whole, in order."""
    blocks = [block.split([n // ranks for n in parts]) for block in rows.chunk(ranks)]
    return torch.cat([torch.cat([blocks[r][i] for r in range(ranks)]) for i in range(len(parts))])


def to_per_rank(rows: torch.Tensor, parts: tuple[int, ...], ranks: int) -> torch.Tensor:
    """The inverse of :func:`to_natural`."""
    slices = [part.chunk(ranks) for part in rows.split(list(parts))]
    return torch.cat([slices[i][r] for r in range(ranks) for i in range(len(parts))])


class LayoutEntries:
    """Checkpoint entries of a run's parameters and optimizer state, for any layout."""

    def __init__(self) -> None:
        self._after_load: list[Callable[[], None]] = []

    def entry(self, value: torch.Tensor, like: torch.Tensor, parts: tuple[int, ...] | None) -> torch.Tensor:
        """What the checkpoint holds for ``value``: a parameter, or a local state tensor of parameter ``like``."""
        if not isinstance(like, DTensor):
            return value
        dt = value if isinstance(value, DTensor) else DTensor.from_local(
            value, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())
        ranks = tensor_parallel_ranks(like)
        if parts is None or ranks == 1:
            return dt
        with torch.no_grad():
            natural = to_natural(dt.detach().full_tensor(), parts, ranks)
        local = dtensor_local(dt)

        def scatter() -> None:  # after loading: this rank's share of the natural tensor, in place
            with torch.no_grad():
                per_rank = to_per_rank(natural, parts, ranks)
                local.copy_(distribute_tensor(per_rank, like.device_mesh, like.placements, src_data_rank=None)
                            .to_local())

        self._after_load.append(scatter)
        return natural

    def model(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` with the fused tensor-parallel parameters in their natural layout."""
        owners = {f"{prefix}.{name}" if prefix else name: fused_parts(module)
                  for prefix, module in model.named_modules() for name, _ in module.named_parameters(recurse=False)}
        return {key: self.entry(t, t, owners.get(key)) for key, t in model.state_dict().items()}

    def finish_load(self) -> None:
        for scatter in self._after_load:
            scatter()
        self._after_load.clear()
