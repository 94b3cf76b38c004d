"""Expert parallel: each rank holds ``num_moe_experts / ep`` experts of every MoE block.

The ``ep`` ranks of one ``edp`` index share their tokens (the exchanges are
the block's, models/moe_parallel.py); the ``edp`` ranks hold the same experts
and sum their gradients: over replicas in the training step
(parallel/data_parallel.py, ``ExpertParallelReducer``, with the
tensor-parallel ranks too under tensor parallel), under FSDP2 in its
reduce-scatter, which shards each expert over the ``edp`` ranks
(parallel/fsdp.py: torchtitan's FSDP of the experts over the data-parallel
ranks outside the expert-parallel ones).

Over pipeline stages the ``(edp, ep)`` mesh of a rank is that of its stage
(the mesh's ``pp`` index fixed), so a stage's MoE blocks exchange tokens among
its own ``ep`` ranks, hold experts of its own layers only, and reduce them over
its own ``edp`` ranks (rule R31: the ``allgather`` dispatcher over replicated
data parallel).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .dims import EP


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Give each rank ``num_moe_experts / ep`` experts of every MoE block, in place (``mesh``: (edp, ep), or (ep,)
    when FSDP2 shards the experts over edp next).

    Every rank built all experts from the same seed; it keeps its slice of
    the stacked expert weights as a DTensor sharded over ``ep`` and replicated
    over ``edp`` (the ranks holding the same experts), so the optimizer, the
    gradient norm and checkpoints treat them as any sharded parameter. The
    block all-gathers its expert-parallel ranks' tokens (models/moe.py).
    """
    from ..models.moe import ExpertParallel, MoEBlock

    ep_mesh = mesh[EP]
    place = ExpertParallel(group=ep_mesh.get_group(), rank=ep_mesh.get_local_rank(), size=ep_mesh.size())
    for block in model.modules():
        if not isinstance(block, MoEBlock):
            continue
        block.expert_parallel = place
        for linear in (block.experts.experts.linear_fc1, block.experts.experts.linear_fc2):
            w = linear.weight
            local = w.detach().chunk(place.size, dim=0)[place.rank].contiguous()
            placements = [Replicate(), Shard(0)] if mesh.ndim == 2 else [Shard(0)]
            dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=w.shape, stride=w.stride())
            linear.weight = nn.Parameter(dt, requires_grad=w.requires_grad)
            linear.weight.expert_parallel = True  # its gradient is reduced over its edp group (data_parallel.py)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The expert-parallel experts of every MoE block (GroupedExperts), in layer order."""
    from ..models.moe import MoEBlock

    return [m.experts.experts for m in model.modules() if isinstance(m, MoEBlock) and m.expert_parallel is not None]


def is_expert_parameter(p: torch.Tensor) -> bool:
    return getattr(p, "expert_parallel", False)
