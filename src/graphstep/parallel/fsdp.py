"""FSDP2: ``fully_shard`` on the ``dp`` view of the mesh (``ddp.use_megatron_fsdp`` with a sharding strategy,
or ``ddp.use_distributed_optimizer``).

Every decoder layer, then the model. Parameters stay fp32 shards -- the
optimizer's main weights, updated in place -- and FSDP2 casts them to the
model dtype when it all-gathers (``MixedPrecisionPolicy``); gradients are
reduce-scattered in fp32. ``optim_grads_params`` reshards a layer's
parameters after its forward (ZeRO-3) -- every layer but the last, whose
backward comes right after --, ``optim_grads`` keeps them to the backward
(ZeRO-2); the root module is never resharded after forward (its parameters
are the first used by backward). Per-layer graphs over FSDP2 modules keep the
gathered parameters in place (cuda_graph/fsdp.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..engines_compat import fsdp_one_rank_reduce_divides

PARAMETER_MARKS = ("tied_copy",)  # what graphstep marks on a parameter and FSDP2's shard keeps (parallel/pipeline.py)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, strategy: str, param_dtype: torch.dtype, *,
               prefetch: bool = False, experts_mesh: DeviceMesh | None = None,
               roots: list[nn.Module] | None = None) -> None:
    """``fully_shard`` every decoder layer, then the model, on ``mesh`` (the dp dimension), in place.

    ``roots``: the modules to shard last in place of the model -- an interleaved pipeline rank's chunk views
    (parallel/interleaved.py), each a root of its own over its layers and its embedding or final norm and output
    layer, as torchtitan shards each virtual stage's model; ``prefetch`` then stays within each chunk.

    ``prefetch`` (``ddp.overlap_param_gather``): each layer starts the next layer's all-gather before its own
    forward, instead of FSDP2's implicit prefetch. ``experts_mesh`` (the edp dimension, with expert parallel):
    each layer's expert-parallel experts are their own FSDP2 module on it, sharded over the ranks holding the same
    experts; their reduce-scatter divides by every data-parallel rank, as the other gradients' does (an expert's
    gradient already sums the losses of its expert-parallel ranks): torchtitan's gradient divide factor.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .expert_parallel import expert_modules

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    # fully_shard replaces every parameter by a new one (its shard): the marks graphstep sets on parameters (the
    # last pipeline stage's tied copy, parallel/pipeline.py) are carried over by name
    marks = {name: {k: getattr(p, k) for k in PARAMETER_MARKS if hasattr(p, k)} for name, p in model.named_parameters()}
    layers = [layer for _, layer in model.layers.named_children()]
    for i, layer in enumerate(layers):
        # ZeRO-3 reshards a layer after its forward -- but not the last, whose backward comes next (torchtitan's choice)
        reshard = strategy == "optim_grads_params" and i < len(layers) - 1
        for experts in expert_modules(layer) if experts_mesh is not None else ():
            fully_shard(experts, mesh=experts_mesh, reshard_after_forward=reshard, mp_policy=mp)
            experts.set_gradient_divide_factor(float(mesh.size()))
            # a sum, then the division: gloo has no PREMUL_SUM. Not on one rank where FSDP2 divides the copy it
            # makes instead of a reduce-scatter (torch 2.13): a forced sum would divide a second time after it
            if experts_mesh.size() > 1 or not fsdp_one_rank_reduce_divides():
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    shard_roots = roots if roots is not None else [model]
    for root in shard_roots:
        fully_shard(root, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    if roots is not None:
        model.__dict__["_fsdp_roots"] = roots  # not submodules: the chunk views share the model's modules
    for name, p in model.named_parameters():
        for key, value in marks.get(name, {}).items():
            setattr(p, key, value)
    # FSDP2 reduce-scatters a layer's gradients after the stream autograd runs the layer's backward on: an adapter's
    # gradients made on a stream of their own inside a capture (converters/lora.py) would not be ordered before it
    from ..converters.lora import LoRALinear

    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.adapter_stream = False
    if prefetch:
        for root in shard_roots:
            runs = [layer for _, layer in root.layers.named_children()]
            for layer, following in zip(runs, runs[1:]):
                layer.set_modules_to_forward_prefetch([following])


def reshard_all(model: nn.Module) -> None:
    """Free every FSDP2 module's unsharded parameters (after a forward-only step; backward does it itself)."""
    from torch.distributed.fsdp import FSDPModule

    for module in [*model.modules(), *model.__dict__.get("_fsdp_roots", [])]:
        if isinstance(module, FSDPModule):
            module.reshard()
