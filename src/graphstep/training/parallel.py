"""Large models on torch's own engines: the device mesh, tensor/sequence parallel and FSDP2.

A run's *layout* (:class:`Layout`, from the config and the world size) is
data-parallel x tensor-parallel ranks on a 2-D :class:`DeviceMesh` named
``("dp", "tp")`` -- torchrun's ranks in order, so the tensor-parallel ranks of
one data-parallel replica are neighbours (one node's NVLink). Rules R25-R27
(validation/parallel_rules.py) decide which layouts a config may ask for.

Tensor parallel (``model.tensor_model_parallel_size``) is DTensor's
``parallelize_module`` on the ``tp`` dimension, Megatron's plan:

* attention: ``linear_qkv`` colwise, ``linear_proj`` rowwise; each rank runs
  ``heads / tp`` query heads and ``groups / tp`` key/value groups;
* MLP: ``linear_fc1`` colwise, ``linear_fc2`` rowwise;
* embedding: rowwise over the vocabulary; the output layer colwise over it
  (with tied embeddings, the same vocabulary-sharded weight: GPTModel.logits);
* ``sequence_parallel``: the norms, dropout and residual stream run on
  sequence shards (``SequenceParallel``; the projections all-gather and
  reduce-scatter the sequence), and hidden dropout draws from the tracker's
  model-parallel stream, which differs per tensor-parallel rank; without it
  the residual stream is replicated and draws from the data-parallel stream.

``linear_qkv`` and ``linear_fc1`` are *fused*: rows of q, k and v, or of gate
and up. Colwise sharding gives each rank its slice of every part
(:class:`FusedColwiseParallel`), so the local matmul yields the rank's own
q/k/v heads and gate/up columns. The DTensor's rows are then ordered per
rank; :func:`fused_parts` says how to read them back part by part.

Sharded data parallel (``ddp.use_megatron_fsdp`` with a sharding strategy, or
``ddp.use_distributed_optimizer``) is FSDP2's ``fully_shard`` on the ``dp``
dimension: every decoder layer, then the model. Parameters stay fp32 shards
-- the optimizer's main weights, updated in place -- and FSDP2 casts them to
the model dtype when it all-gathers (``MixedPrecisionPolicy``); gradients are
reduce-scattered in fp32. ``optim_grads_params`` reshards a layer's
parameters after its forward (ZeRO-3) -- every layer but the last, whose
backward comes right after --, ``optim_grads`` keeps them to the backward
(ZeRO-2); the root module is never resharded after forward (its parameters
are the first used by backward).

Everything here runs eagerly before the graphs exist; a full-iteration graph
then captures the collectives DTensor and FSDP2 issue (on the CPU replay
backend too: cuda_graph/replay.py records the plain-tensor work under the
DTensor wrappers and FSDP2's storage resizes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module,
)

from ..config import Config
from ..cuda_graph.rng import MODEL_PARALLEL_RNG
from ..engines_compat import colwise_with_partition, dtensor_local

PP, DP, TP = "pp", "dp", "tp"
EDP, EP = "edp", "ep"  # expert parallel: the data-parallel ranks as (expert-data-parallel, expert-parallel)


@dataclass(frozen=True)
class Layout:
    """Pipeline x data-parallel x tensor-parallel ranks, and how the data-parallel dimension is sharded."""

    dp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    fsdp: str | None = None  # None (replicated), "optim_grads" (ZeRO-2) or "optim_grads_params" (ZeRO-3)
    prefetch: bool = False  # FSDP2 explicit forward prefetch (ddp.overlap_param_gather)
    pp: int = 1  # pipeline stages (training/pipeline.py)
    ep: int = 1  # expert-parallel ranks among the data-parallel ones (each holds num_moe_experts / ep experts)

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> "Layout":
        """The layout of a validated config (R25-R29) on ``world_size`` ranks."""
        d, tp, pp = cfg.ddp, cfg.model.tensor_model_parallel_size, cfg.model.pipeline_model_parallel_size
        if d.use_megatron_fsdp:
            fsdp = None if d.data_parallel_sharding_strategy == "no_shard" else d.data_parallel_sharding_strategy
        else:
            fsdp = "optim_grads" if d.use_distributed_optimizer or cfg.optimizer.use_distributed_optimizer else None
        return cls(dp=max(1, world_size // (tp * pp)), tp=tp, sequence_parallel=cfg.model.sequence_parallel,
                   fsdp=fsdp, prefetch=d.overlap_param_gather, pp=pp, ep=cfg.model.expert_model_parallel_size)

    @property
    def needs_mesh(self) -> bool:
        """Tensor, pipeline or expert parallel, or FSDP2: ranks are placed on a device mesh (even with one rank)."""
        return self.tp > 1 or self.fsdp is not None or self.pp > 1 or self.ep > 1

    @property
    def ranks(self) -> int:
        return self.pp * self.dp * self.tp

    def describe(self) -> str:
        """e.g. ``4 data-parallel (FSDP2 optim_grads_params) x 2 tensor-parallel + sequence-parallel ranks``."""
        parts = [f"{self.pp} pipeline-stage"] if self.pp > 1 else []
        parts.append(f"{self.dp} data-parallel" + (f" (FSDP2 {self.fsdp})" if self.fsdp else "")
                     + (f" ({self.ep} expert-parallel)" if self.ep > 1 else ""))
        if self.tp > 1:
            parts.append(f"{self.tp} tensor-parallel" + (" + sequence-parallel" if self.sequence_parallel else ""))
        return " x ".join(parts) + (" rank" if self.ranks == 1 else " ranks")


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The ``(dp, tp)`` mesh -- ``(pp, dp, tp)`` with pipeline stages -- over the default process group."""
    world = dist.get_world_size()
    if layout.ranks != world:
        raise RuntimeError(f"the layout {layout.describe()} needs {layout.ranks} ranks, the process group has {world}")
    if layout.pp > 1:
        return init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=(PP, DP, TP))
    if layout.ep > 1:  # neighbouring ranks share their tokens (one node's NVLink)
        return init_device_mesh(device_type, (layout.dp // layout.ep, layout.ep), mesh_dim_names=(EDP, EP))
    return init_device_mesh(device_type, (layout.dp, layout.tp), mesh_dim_names=(DP, TP))


# --------------------------------------------------------------------------
# tensor parallel


def fused_parts(module: nn.Module) -> tuple[int, ...] | None:
    """The row counts of the parts a fused projection concatenates (q, k, v or gate, up); None if not fused."""
    return getattr(module, "fused_parts", None)


class FusedColwiseParallel(colwise_with_partition()):
    """Colwise sharding of a fused projection: each rank takes its slice of every part, not a block of rows.

    The module's ``fused_parts`` lists the parts' row counts; every part
    divides evenly over the mesh (rule R25). All ranks hold the same full
    weight at this point (the same seed, or rank 0's broadcast), so each
    slices its rows locally without communication.
    """

    def partition_linear(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        parts = fused_parts(module)
        if parts is None:
            return super().partition_linear(name, module, device_mesh)
        rank, size = device_mesh.get_local_rank(), device_mesh.size()
        for pname, param in list(module.named_parameters(recurse=False)):
            local = torch.cat([chunk.chunk(size, dim=0)[rank] for chunk in param.detach().split(list(parts), dim=0)])
            dt = DTensor.from_local(local.contiguous(), device_mesh, [Shard(0)], run_check=False,
                                    shape=param.shape, stride=param.stride())
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Shard a GPTModel's layers, embedding and output over ``mesh`` (1-D, the tp dimension), in place."""
    tp = mesh.size()
    seq = Shard(1) if sequence_parallel else Replicate()
    norm = SequenceParallel(use_local_output=True) if sequence_parallel else None
    plan: dict[str, Any] = {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
    }
    if norm is not None:
        plan["final_layernorm"] = norm
    if getattr(model, "output_layer", None) is not None:
        plan["output_layer"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    for i, layer in model.layers.named_children():  # a ModuleList, or a pipeline stage's ModuleDict
        attn, mlp = layer.blocks["attn"], layer.blocks["mlp"]
        prefix = f"layers.{i}.blocks"
        plan[f"{prefix}.attn.self_attention.linear_qkv"] = FusedColwiseParallel(input_layouts=seq)
        plan[f"{prefix}.attn.self_attention.linear_proj"] = RowwiseParallel(output_layouts=seq)
        plan[f"{prefix}.mlp.mlp.linear_fc1"] = FusedColwiseParallel(input_layouts=seq)
        plan[f"{prefix}.mlp.mlp.linear_fc2"] = RowwiseParallel(output_layouts=seq)
        if norm is not None:
            plan[f"{prefix}.attn.input_layernorm"] = norm
            plan[f"{prefix}.mlp.pre_mlp_layernorm"] = norm
            attn.dropout_rng = mlp.dropout_rng = MODEL_PARALLEL_RNG  # sequence shards differ per rank
        sa = attn.self_attention
        sa.linear_qkv.fused_parts = tuple(n * sa.head_dim for n in (sa.heads, sa.groups, sa.groups))
        sa.heads, sa.groups = sa.heads // tp, sa.groups // tp
        mlp.mlp.linear_fc1.fused_parts = (mlp.mlp.linear_fc1.out_features // 2,) * 2
    model.hidden_placement = seq  # what GPTModel.logits reads the final hidden state as
    parallelize_module(model, mesh, plan)


# --------------------------------------------------------------------------
# FSDP2


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, strategy: str, param_dtype: torch.dtype, *,
               prefetch: bool = False) -> None:
    """``fully_shard`` every decoder layer, then the model, on ``mesh`` (the dp dimension), in place.

    ``prefetch`` (``ddp.overlap_param_gather``): each layer starts the next layer's all-gather before its own
    forward, instead of FSDP2's implicit prefetch.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    layers = [layer for _, layer in model.layers.named_children()]
    for i, layer in enumerate(layers):
        # ZeRO-3 reshards a layer after its forward -- but not the last, whose backward comes next (torchtitan's choice)
        reshard = strategy == "optim_grads_params" and i < len(layers) - 1
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    if prefetch:
        for layer, following in zip(layers, layers[1:]):
            layer.set_modules_to_forward_prefetch([following])


def reshard_all(model: nn.Module) -> None:
    """Free every FSDP2 module's unsharded parameters (after a forward-only step; backward does it itself)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


# --------------------------------------------------------------------------
# expert parallel


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Give each rank ``num_moe_experts / ep`` experts of every MoE block, in place (``mesh``: (edp, ep)).

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
            dt = DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False, shape=w.shape,
                                    stride=w.stride())
            linear.weight = nn.Parameter(dt, requires_grad=w.requires_grad)
            linear.weight.expert_parallel = True  # its gradient is reduced over its edp group (grad_reduce.py)


def is_expert_parameter(p: torch.Tensor) -> bool:
    return getattr(p, "expert_parallel", False)


def parallelize(model: nn.Module, layout: Layout, mesh: DeviceMesh | None, param_dtype: torch.dtype) -> nn.Module:
    """Tensor or expert parallel, then FSDP2, as ``layout`` says (the model unchanged without a mesh)."""
    if mesh is None or not layout.needs_mesh:
        return model
    if layout.ep > 1:
        apply_expert_parallel(model, mesh)
    if layout.tp > 1:
        apply_tensor_parallel(model, mesh[TP], sequence_parallel=layout.sequence_parallel)
    if layout.fsdp is not None:
        apply_fsdp(model, mesh[DP], layout.fsdp, param_dtype, prefetch=layout.prefetch)
    return model


# --------------------------------------------------------------------------
# what the optimizer needs of a sharded parameter


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The part of ``p`` this rank holds (``p`` itself when it is not a DTensor); shares its storage."""
    return dtensor_local(p) if isinstance(p, DTensor) else p


def counted_here(p: torch.Tensor, mesh: DeviceMesh | None) -> bool:
    """Whether this rank counts ``p``'s local gradient in the global norm: each element once over the mesh.

    A gradient replicated over a mesh dimension (a replicated parameter, or any
    parameter over replicated data-parallel ranks) is counted on that
    dimension's rank 0 only; a sharded one on every rank (and every pipeline
    stage counts its own parameters).
    """
    if mesh is None:
        return True
    sharded: set[str] = {PP}  # each pipeline stage holds other parameters
    if isinstance(p, DTensor):  # a parameter is replicated or sharded (Shard, or FSDP2's _StridedShard) per dimension
        sharded = {n for n, pl in zip(p.device_mesh.mesh_dim_names or (), p.placements) if not pl.is_replicate()}
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    return all(c == 0 for name, c in zip(mesh.mesh_dim_names or (), coordinate) if name not in sharded)
