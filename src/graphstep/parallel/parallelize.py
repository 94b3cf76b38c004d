"""``parallelize(model, dims, mesh, cfg, ...)``: every parallel engine applied to a built model, in one order.

The model comes in whole (a pipeline stage already cut from it:
parallel/pipeline.py ``split_stage``), converted (converters/: FP8, LoRA) and
on its device; it leaves with its parameters as the layout holds them and is
returned as the module the training steps call. Each step is an ``apply_*``
function of its own module; the order, and why, is in :func:`parallelize`.
Everything here runs eagerly before any graph exists; a full-iteration graph
then captures the collectives DTensor and FSDP2 issue (on the CPU replay
backend too: cuda_graph/replay.py records the plain-tensor work under the
DTensor wrappers and FSDP2's storage resizes).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import Config
from ..cuda_graph.settings import CudaGraphSettings
from .compile import apply_compile, compile_mode_of
from .context_parallel import apply_context_parallel, cp_comm
from .dims import CP, EDP, EP, EP_TP, PP, TP, ParallelDims, WorldMesh
from .expert_parallel import apply_expert_parallel
from .fsdp import apply_fsdp
from .interleaved import chunk_view
from .pipeline import model_chunks
from .tensor_parallel import apply_tensor_parallel


def parallelize(model: nn.Module, dims: ParallelDims, mesh: WorldMesh | None, cfg: Config, *,
                param_dtype: torch.dtype, settings: CudaGraphSettings, compile_mode: str | None = None) -> nn.Module:
    """Apply ``dims`` to ``model`` in place over ``mesh`` (None: one rank, or plain data parallel) and compile it
    as ``cfg.compile`` says (``compile_mode``: the bench's mode instead). Returns the module the steps call:
    ``model``, or its compiled wrapper.

    The rules (validation/parallel_rules.py, R25-R31) admit only the combinations that work today: expert parallel
    (and expert tensor parallel) with tensor parallel or FSDP2 (not both), or over pipeline stages with replicated
    data parallel (each stage's
    ``mesh[EP]`` is that stage's expert-parallel ranks) or context parallel, compile
    over any layout without graphs (each decoder layer compiled).
    """
    if mesh is None and dims.needs_mesh:
        raise RuntimeError(f"the layout {dims.describe()} needs a device mesh (parallel/dims.py build_mesh)")
    # The order, and why:
    # 1. Tensor (and sequence) parallel first: it rewrites the projections into DTensors sharded over tp and the
    #    attention's head counts, so every later step sees the model as each rank runs it.
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh[TP], sequence_parallel=dims.sequence_parallel)
    # 2. Context parallel next: the attention of each rank, with the heads tensor parallel left it, gathers the
    #    keys and values of the other context-parallel ranks' chunks, and the loss counts the whole sequences.
    if dims.cp > 1:
        apply_context_parallel(model, mesh[CP], cp_comm(cfg.model.cp_comm_type))
    # 3. Expert parallel: the ExpertParallel style on each MoE block -- each rank keeps its experts, sharded over
    #    ep, and the style installs the token exchange (after tensor parallel, as Megatron's expert tensor parallel
    #    would shard the experts it keeps; before FSDP2, which shards over edp the experts each rank kept).
    #    Expert tensor parallel (etp = tp) splits each expert over tp too, and the ep x tp ranks share tokens.
    if dims.ep > 1 or dims.etp > 1:
        apply_expert_parallel(model, *_expert_meshes(dims, mesh))
    # 4. Activation recompute is built into the model's layers (models/transformer.py reads
    #    model.recompute_granularity when it builds them), so it already wraps the sharded layers here: a
    #    recomputed forward re-runs their collectives too. FSDP2 (step 6) wraps each layer from outside, as
    #    torchtitan shards its checkpointed blocks: a region recomputed inside a layer's backward finds the
    #    parameters the layer's pre-backward hook gathered, and a layer full recompute re-enters is gathered
    #    by its pre-forward hook.
    # 5. Compile after recompute (Dynamo traces the checkpointed layers) and before FSDP2, torchtitan's order: over
    #    a layout each decoder layer's forward is compiled in place, so FSDP2's hooks (step 6) and a pipeline
    #    stage's transfers run eagerly around compiled layers (parallel/compile.py); one process compiles the
    #    whole model.
    mode = compile_mode_of(cfg, compile_mode)
    step_model = model if mode is None else apply_compile(model, mode, settings, by_layer=compile_by_layer(dims),
                                                          backend=cfg.compile.backend)
    # 6. FSDP2 last: it wraps the modules as they will run and turns every parameter into its shard over the
    #    data-parallel ranks (a tensor-parallel one into a (dp, tp) DTensor). Replicated data parallel has no
    #    step here: the training step all-reduces the flat gradient buffer (parallel/data_parallel.py), which
    #    exists only once the parameters are final.
    #    Expert-parallel experts are sharded over the ranks holding the same experts only (edp, with context
    #    parallel (edp, cp): the expert_dp view); the other parameters over the data-parallel and
    #    context-parallel ranks (dp_cp; dp with one cp rank).
    #    With virtual pipeline stages each of the rank's chunks is a root of its own (parallel/interleaved.py).
    if dims.fsdp is not None:
        experts = None if dims.ep == 1 else mesh[dims.holders_dim]
        apply_fsdp(model, mesh[dims.grad_dim], dims.fsdp, param_dtype, prefetch=dims.prefetch,
                   experts_mesh=experts, roots=_chunk_roots(model, dims, mesh, cfg))
    return step_model


def _expert_meshes(dims: ParallelDims, mesh: WorldMesh) -> tuple:
    """(the experts' mesh, the ranks sharing their tokens) for :func:`apply_expert_parallel`."""
    if dims.ep == 1:  # expert tensor parallel alone: the experts split over tp, the tp ranks' tokens shared
        return mesh[TP], mesh[TP]
    if dims.etp > 1:
        return mesh[(EDP, EP, TP)], mesh[EP_TP]
    return (mesh[EP] if dims.fsdp is not None else mesh[(EDP, EP)]), mesh[EP]


def compile_by_layer(dims: ParallelDims) -> bool:
    """Whether compile takes the model layer by layer (any parallel layout but replicated data parallel)."""
    return dims.tp > 1 or dims.cp > 1 or dims.ep > 1 or dims.pp > 1 or dims.fsdp is not None


def _chunk_roots(model: nn.Module, dims: ParallelDims, mesh: WorldMesh, cfg: Config) -> list[nn.Module] | None:
    """The views of this pipeline rank's chunks when it holds several (virtual stages), the ones its interleaved
    pipeline runs (parallel/interleaved.py ``chunk_view``); None otherwise."""
    if dims.pp == 1:
        return None
    stage = mesh[PP].get_local_rank()
    mine = [c for c in model_chunks(cfg.model, dims.pp) if c.index % dims.pp == stage]
    return [chunk_view(model, c) for c in mine] if len(mine) > 1 else None
