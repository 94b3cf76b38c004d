"""Tensor and sequence parallel: DTensor's ``parallelize_module`` on the ``tp`` dimension, Megatron's plan.

* attention: ``linear_qkv`` colwise, ``linear_proj`` rowwise; each rank runs
  ``heads / tp`` query heads and ``groups / tp`` key/value groups;
* MLP: ``linear_fc1`` colwise, ``linear_fc2`` rowwise;
* embedding: rowwise over the vocabulary; the output layer colwise over it
  (with tied embeddings, the same vocabulary-sharded weight: GPTModel.logits);
* Mamba (hybrid models): ``in_proj`` colwise part by part (z, x, B, C, dt),
  ``out_proj`` rowwise, and the mixer's conv, A, D, dt_bias and gated norm
  sharded by the same rows: each rank runs ``heads / tp`` heads and
  ``groups / tp`` groups of B and C (models/mamba.py ``tp_size``);
* MoE blocks: each rank runs the router (and shared expert) on its own share
  of the tokens -- its sequence shard under sequence parallelism, else its
  slice of the replicated sequence, taken on entry and all-gathered on exit
  (:func:`moe_on_token_shares`). With ``expert_tensor_parallel_size`` 1 the
  experts are not split: the tensor-parallel ranks hold the same experts and
  see other tokens, as data-parallel ranks do. Every gradient of the block is
  then this rank's share; the block is marked (:func:`partial_over_tp`) and
  their gradients summed over the tensor-parallel ranks after the backward
  (parallel/data_parallel.py), as Megatron sums a sequence-parallel router's;
  expert-parallel experts with their expert-data-parallel ranks. With expert
  tensor parallel (``etp`` = ``tp``) the experts are split over the
  tensor-parallel ranks, which exchange their tokens
  (parallel/expert_parallel.py); those parts are left out of the mark;
* ``qk_layernorm``: the query and key norms are replicated but each rank
  normalises its own heads, so their gradients are marked the same way and
  summed over the tensor-parallel ranks (Megatron all-reduces them too);
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

LoRA/DoRA adapters (converters/lora.py, ``peft``) are sharded as Megatron
shards them, each with its base projection's style: under a colwise base,
``lora_A`` is replicated and ``lora_B`` sharded by output rows -- part by
part for a fused projection, as the base weight -- and DoRA's magnitude (one
per output row) with them; under a rowwise base, ``lora_A`` is sharded by
input columns and ``lora_B`` and the magnitude replicated. The adapter then
runs on the same DTensors as the base: a colwise one on the gathered input,
adding its shard of output columns; a rowwise one on the input shard, its
``lora_A`` output a partial sum that ``lora_B`` keeps partial, so the base's
one all-reduce (or reduce-scatter with sequence parallel) sums base and
adapter together. ``lora_A``'s gradient under a colwise base, ``lora_B``'s
under a rowwise one, are partial sums, all-reduced when they are accumulated
(training/optim.py), as a sequence-parallel norm's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInputOutput, SequenceParallel, parallelize_module,
)

from ..cuda_graph.rng import MODEL_PARALLEL_RNG
from ..engines_compat import colwise_with_partition, rowwise_with_partition, rowwise_with_waited_output
from .dims import TP

# the adapter submodules' names (converters/lora.py LoRALinear)
ADAPTER_IN, ADAPTER_OUT = "lora_A", "lora_B"


def fused_parts(module: nn.Module) -> tuple[int, ...] | None:
    """The row counts of the parts a fused projection concatenates (q, k, v or gate, up); None if not fused."""
    return getattr(module, "fused_parts", None)


def tensor_parallel_split(p: DTensor) -> tuple[int, int]:
    """``(dim, ranks)``: the dimension of ``p`` split over the tensor-parallel ranks and over how many of them
    (``(0, 1)`` when not split over tp). A fused projection's rows are dim 0, an expert's gate and up rows dim 1."""
    names = p.device_mesh.mesh_dim_names or ()
    for dim, (name, placement) in enumerate(zip(names, p.placements)):
        if name == TP and isinstance(placement, Shard):
            return placement.dim, p.device_mesh.size(dim)
    return 0, 1


def part_slice(t: torch.Tensor, parts: tuple[int, ...] | None, rank: int, size: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s slice (of ``size``) of ``t`` along ``dim``; ``parts``: ``t`` is parts laid end to end along
    ``dim``, each sliced on its own (a fused projection's q, k, v or gate, up)."""
    chunks = t.split(list(parts), dim) if parts else [t]
    return torch.cat([chunk.chunk(size, dim)[rank] for chunk in chunks], dim)


class FusedColwiseParallel(colwise_with_partition()):
    """Colwise sharding of a fused projection: each rank takes its slice of every part, not a block of rows.

    The module's ``fused_parts`` lists the parts' row counts; every part
    divides evenly over the mesh (rule R25). All ranks hold the same full
    weight at this point (the same seed, or rank 0's broadcast), so each
    slices its rows locally without communication.
    """

    def partition_linear(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if name == ADAPTER_IN:  # a LoRA adapter's lora_A: replicated (distribute_module replicates what is left)
            return
        parts = fused_parts(module)
        if parts is None:
            return super().partition_linear(name, module, device_mesh)
        # the weight (and bias), a DoRA magnitude and an adapter's lora_B: all are rows of the fused parts
        for pname, _ in list(module.named_parameters(recurse=False)):
            _shard_rows(module, pname, device_mesh, parts)


class AdaptedRowwiseParallel(rowwise_with_partition()):
    """``RowwiseParallel`` that leaves a LoRA adapter's ``lora_B`` (and a DoRA magnitude) replicated; the
    weight and an adapter's ``lora_A`` are sharded by input columns as RowwiseParallel shards a weight."""

    def partition_linear(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if name == ADAPTER_OUT:  # replicated by distribute_module, as everything no partition takes
            return
        return super().partition_linear(name, module, device_mesh)


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Shard a GPTModel's layers, embedding and output over ``mesh`` (1-D, the tp dimension), in place."""
    tp = mesh.size()
    seq = Shard(1) if sequence_parallel else Replicate()
    norm = SequenceParallel(use_local_output=True) if sequence_parallel else None
    plan: dict[str, Any] = {}
    # a pipeline stage holds the embedding on the first stage only, the final norm and output layer on the last
    # (parallel/pipeline.py); the last stage's copy of a tied embedding is sharded over the vocabulary as the
    # first stage's embedding is, so both stages' copies hold the same rows on each tensor-parallel rank
    embedding = getattr(model, "embedding", None)
    if isinstance(embedding, nn.Embedding):
        # its output waited for before the decoder layers take it (compiled, they cannot take torch's
        # asynchronous one: engines_compat.rowwise_with_waited_output)
        plan["embedding"] = rowwise_with_waited_output()(input_layouts=Replicate(), output_layouts=seq)
    elif embedding is not None:
        _shard_rows(embedding, "weight", mesh)
    if norm is not None and getattr(model, "final_layernorm", None) is not None:
        plan["final_layernorm"] = norm
    if getattr(model, "output_layer", None) is not None:
        plan["output_layer"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    for i, layer in model.layers.named_children():  # a ModuleList, or a pipeline stage's ModuleDict
        blocks, prefix = layer.blocks, f"layers.{i}.blocks"
        if "attn" in blocks:
            _attention_plan(plan, prefix, blocks["attn"], tp, norm, seq)
        if "mlp" in blocks:
            mlp = blocks["mlp"]
            plan[f"{prefix}.mlp.mlp.linear_fc1"] = FusedColwiseParallel(input_layouts=seq)
            plan[f"{prefix}.mlp.mlp.linear_fc2"] = AdaptedRowwiseParallel(output_layouts=seq)
            mlp.mlp.linear_fc1.fused_parts = (mlp.mlp.linear_fc1.out_features // 2,) * 2
            _adapter_parts(mlp.mlp.linear_fc1)
            if norm is not None:
                plan[f"{prefix}.mlp.pre_mlp_layernorm"] = norm
                mlp.dropout_rng = MODEL_PARALLEL_RNG  # sequence shards differ per rank
        if "moe" in blocks:
            moe = blocks["moe"]
            if not sequence_parallel:
                plan[f"{prefix}.moe"] = moe_on_token_shares()
            moe.combine_stage.dropout_rng = MODEL_PARALLEL_RNG  # each rank's share of the tokens is its own
            moe.partial_over_tp = True
        if "mamba" in blocks:
            _mamba_plan(plan, prefix, blocks["mamba"], mesh, norm, seq)
    model.hidden_placement = seq  # what GPTModel.logits reads the final hidden state as
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, mesh, plan)
    # SequenceParallel (and distribute_module's replication) make new parameters that require a gradient; a
    # frozen one (a LoRA run's base weights, norms included) stays frozen
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)


def _attention_plan(plan: dict[str, Any], prefix: str, attn: nn.Module, tp: int, norm: Any, seq: Any) -> None:
    """Megatron's attention plan: ``linear_qkv`` colwise part by part, ``linear_proj`` rowwise; each rank keeps
    ``heads / tp`` query heads and ``groups / tp`` key/value groups."""
    sa = attn.self_attention
    plan[f"{prefix}.attn.self_attention.linear_qkv"] = FusedColwiseParallel(input_layouts=seq)
    plan[f"{prefix}.attn.self_attention.linear_proj"] = AdaptedRowwiseParallel(output_layouts=seq)
    if norm is not None:
        plan[f"{prefix}.attn.input_layernorm"] = norm
        attn.dropout_rng = MODEL_PARALLEL_RNG  # sequence shards differ per rank
    for qk_norm in (getattr(sa, "q_layernorm", None), getattr(sa, "k_layernorm", None)):
        if qk_norm is not None:
            qk_norm.partial_over_tp = True  # each rank normalises its own heads: its share of the gradient
    sa.linear_qkv.fused_parts = tuple(n * sa.head_dim for n in (sa.heads, sa.groups, sa.groups))
    sa.heads, sa.groups = sa.heads // tp, sa.groups // tp
    _adapter_parts(sa.linear_qkv)


def _adapter_parts(proj: nn.Module) -> None:
    adapter = getattr(proj, ADAPTER_OUT, None)
    if adapter is not None:  # lora_B's rows are the projection's: sharded (and checkpointed) part by part
        adapter.fused_parts = proj.fused_parts


def _mamba_plan(plan: dict[str, Any], prefix: str, block: nn.Module, mesh: DeviceMesh, norm: Any, seq: Any) -> None:
    """Megatron's Mamba plan: each rank runs ``heads / tp`` heads and ``groups / tp`` groups of B and C.
    ``in_proj`` colwise part by part (z, x, B, C, dt), ``out_proj`` rowwise; the mixer's own parameters -- the
    depthwise conv over (x, B, C), A, D, dt_bias and the gated norm's weight -- sharded by the same rows here
    (every rank holds the same full weights at this point), and the mixer runs on the local parts
    (models/mamba.py ``tp_size``)."""
    mixer, ms, tp = block.mixer, block.mixer.ms, mesh.size()
    bc = ms.groups * ms.state
    plan[f"{prefix}.mamba.mixer.in_proj"] = FusedColwiseParallel(input_layouts=seq)
    plan[f"{prefix}.mamba.mixer.out_proj"] = AdaptedRowwiseParallel(output_layouts=seq)
    mixer.in_proj.fused_parts = (ms.d_inner, ms.d_inner, bc, bc, ms.heads)
    _adapter_parts(mixer.in_proj)
    mixer.conv1d.fused_parts = (ms.d_inner, bc, bc)
    for module, name in ((mixer.conv1d, "weight"), (mixer.conv1d, "bias"), (mixer, "A_log"), (mixer, "D"),
                         (mixer, "dt_bias"), (mixer.norm, "weight")):
        _shard_rows(module, name, mesh, fused_parts(module))  # the conv's rows part by part, the others whole
    mixer.tp_size = tp
    if norm is not None:
        plan[f"{prefix}.mamba.input_layernorm"] = norm
        block.dropout_rng = MODEL_PARALLEL_RNG  # sequence shards differ per rank


def _shard_rows(module: nn.Module, name: str, mesh: DeviceMesh, parts: tuple[int, ...] | None = None) -> None:
    """Replace parameter ``name`` of ``module`` by this rank's block of its rows (a DTensor ``Shard(0)``), sliced
    locally: every rank holds the same full weight (one seed). ``parts``: the rows are parts laid end to end,
    each sliced on its own (as :class:`FusedColwiseParallel` slices a fused projection). Attributes set on the
    parameter are kept."""
    param = getattr(module, name)
    local = part_slice(param.detach(), parts, mesh.get_local_rank(), mesh.size()).contiguous()
    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride())
    sharded = nn.Parameter(dt, requires_grad=param.requires_grad)
    sharded.__dict__.update({k: v for k, v in param.__dict__.items() if not k.startswith("_")})
    module.register_parameter(name, sharded)


def moe_on_token_shares() -> PrepareModuleInputOutput:
    """A MoE block on this rank's slice of the replicated sequence (no sequence parallel): sliced on entry, whose
    backward all-gathers the slices' gradients; all-gathered on exit, whose backward keeps this rank's slice of the
    (replicated) gradient."""
    return PrepareModuleInputOutput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                    use_local_input=True, output_layouts=(Shard(1),),
                                    desired_output_layouts=(Replicate(),), use_local_output=True)


def partial_over_tp(model: nn.Module) -> set[int]:
    """The ids of the parameters whose gradient is this rank's share under tensor parallel (of a MoE block or a
    query or key norm, marked by :func:`apply_tensor_parallel`): summed over the tensor-parallel ranks after the
    backward. The modules carry the mark, so it holds for the parameters FSDP2 puts in their place."""
    marked = [m for m in model.modules() if getattr(m, "partial_over_tp", False)]
    # a parameter split over the tensor-parallel ranks (an expert under expert tensor parallel) is left out: each
    # rank's gradient is that of its own part, not a share of a replicated one
    return {id(p) for m in marked for p in m.parameters()
            if not (isinstance(p, DTensor) and tensor_parallel_split(p)[1] > 1)}
