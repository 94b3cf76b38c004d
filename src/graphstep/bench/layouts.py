"""Multi-rank bench rows: a layout prefix on a one-process row, and the layout it sets over the world.

``<prefix><row>`` runs a one-process graphstep row -- ``eager``,
``full_iteration``, ``local[attn,mlp]``, ... (bench/run.py) -- over a
layout as large as the world (torchrun's ``WORLD_SIZE``; 1 without torchrun).
With N ranks:

===============  =================================================================  =============
prefix           layout                                                             at N = 1
===============  =================================================================  =============
``fsdp_``        FSDP2 ZeRO-3 over N data-parallel ranks                            one-rank mesh
``zero2_``       FSDP2 ZeRO-2 over N data-parallel ranks (per-layer graphs, R27)    one-rank mesh
``dp_``          N replicated data-parallel ranks                                   refused
``dp_overlap_``  the same with ``ddp.overlap_grad_reduce=true``                     refused
``tp_``          N tensor-parallel ranks with sequence parallel                     refused
``pp_``          N pipeline stages, 1F1B, embedding and output layer untied (R28)   refused
``ep_``          N expert-parallel ranks (MoE models)                               refused
``vpp_``         N pipeline ranks x 2 virtual stages each (interleaved 1F1B), untied   refused
``cp_``          N context-parallel ranks (``cp_comm_type=all_gather``; dense models)   refused
``pp_tp_``       2 pipeline stages x N/2 tensor-parallel ranks with sequence parallel refused
``pp_fsdp_``     2 pipeline stages x FSDP2 ZeRO-3 over N/2 data-parallel ranks      refused
``ep_tp_``       N/2 expert-parallel x 2 tensor-parallel ranks (MoE models; the      refused
                 experts split over tp too, ``expert_tensor_parallel_size`` null)
``3d_``          2 pipeline stages x FSDP2 ZeRO-3 over N/4 x 2 tensor-parallel      refused
===============  =================================================================  =============

The combined layouts need ``MIN_RANKS`` ranks (4, ``3d_`` 8) and a world size
that divides as the table says; elsewhere a row is refused with the sizes it needs.

``tp_[attn,mlp]`` is short for ``tp_local[attn,mlp]`` (per-layer graphs).
An ``ep_`` row that graphs Megatron's partial MoE scopes (``moe_router``,
``moe_preprocess``) also sets ``model.moe_token_dispatcher_type=alltoall``,
the dispatcher those scopes are made for.

The batch (:func:`batch_overrides`): every data-parallel replica runs the
recipe's micro-batches, so the global batch is the recipe's times the
data-parallel ranks (``dp_``, ``fsdp_``, ``ep_``) and each rank does the
work of the one-GPU row; tensor-parallel ranks share one replica's batch;
1F1B needs at least one micro-batch per stage (R28), so ``pp_`` raises the
micro-batches per step to N when the recipe has fewer, and ``vpp_`` to a
multiple of N (the interleaved schedule runs them in rounds of N).
"""

from __future__ import annotations

import re
import shlex

from ..config import Config, ConfigError
from ..parallel.dims import ParallelDims

FSDP = ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"]
ZERO2 = ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads"]
# the longest match first: dp_overlap_ before dp_, pp_tp_ and pp_fsdp_ before pp_, ep_tp_ before ep_
PREFIXES = ("fsdp_", "zero2_", "dp_overlap_", "dp_", "tp_", "pp_tp_", "pp_fsdp_", "pp_", "vpp_", "cp_", "ep_tp_",
            "ep_", "3d_")
TORCHRUN_ONLY = PREFIXES[2:]  # refused at 1 rank
# combined layouts: (the fewest ranks, the world size's divisor: a multiple of the fixed dimensions' product)
MIN_RANKS = {"pp_tp_": (4, 4), "pp_fsdp_": (4, 4), "ep_tp_": (4, 4), "3d_": (8, 8)}
ONE_RANK_MESH = ("fsdp_", "zero2_")  # at world size 1: FSDP2 on the trainer's one-rank mesh
PARTIAL_MOE_SCOPES = {"moe_router", "moe_preprocess"}

DP_ROWS = ["dp_eager", "dp_full_iteration", "dp_overlap_full_iteration"]
FSDP_ROWS = ["fsdp_eager", "fsdp_full_iteration", "zero2_eager", "zero2_[attn,mlp]"]
TP_ROWS = ["tp_eager", "tp_full_iteration", "tp_[attn,mlp]"]
PP_ROWS = ["pp_eager", "pp_full_iteration", "pp_local[attn,mlp]"]
VPP_ROWS = ["vpp_eager", "vpp_full_iteration"]
CP_ROWS = ["cp_eager", "cp_full_iteration", "cp_[attn,mlp]"]
EP_ROWS = ["ep_eager", "ep_full_iteration", "ep_[attn,moe]", "ep_[attn,moe_router,moe_preprocess]"]
DENSE_COMBINED_ROWS = ["pp_tp_eager", "pp_tp_full_iteration", "pp_fsdp_eager", "pp_fsdp_full_iteration"]
MOE_COMBINED_ROWS = ["ep_tp_eager", "ep_tp_full_iteration"]
THREE_D_ROWS = ["3d_eager", "3d_full_iteration"]


def split_prefix(name: str) -> tuple[str, str]:
    """``tp_[attn,mlp]`` -> ``("tp_", "local[attn,mlp]")``; a row without a layout prefix -> ``("", name)``."""
    for prefix in PREFIXES:
        if name.startswith(prefix):
            inner = name[len(prefix):]
            return prefix, "local" + inner if inner.startswith("[") else inner
    return "", name


def needs_torchrun(name: str) -> bool:
    return split_prefix(name)[0] in TORCHRUN_ONLY


def layout_overrides(prefix: str, inner: str, world_size: int) -> list[str]:
    """The overrides that put the one-process row ``inner`` on ``prefix``'s layout over ``world_size`` ranks."""
    if prefix in TORCHRUN_ONLY and world_size < 2:
        raise ConfigError(f"{prefix} rows need 2 or more ranks (torchrun), the world size is {world_size}")
    least, divisor = MIN_RANKS.get(prefix, (1, 1))
    if world_size < least or world_size % divisor:
        raise ConfigError(f"{prefix} rows need a multiple of {divisor} ranks, at least {least} (torchrun "
                          f"--nproc_per_node {least}); the world size is {world_size}")
    n = world_size
    if prefix == "fsdp_":
        return list(FSDP)
    if prefix == "zero2_":
        return list(ZERO2)
    if prefix == "dp_":
        return []
    if prefix == "dp_overlap_":
        return ["ddp.overlap_grad_reduce=true"]
    if prefix == "tp_":
        return [f"model.tensor_model_parallel_size={n}", "model.sequence_parallel=true"]
    if prefix == "pp_":
        return _stages(n)
    if prefix == "vpp_":
        return [*_stages(n), "model.virtual_pipeline_model_parallel_size=2"]
    if prefix == "cp_":
        return [f"model.context_parallel_size={n}", "model.cp_comm_type=all_gather"]
    if prefix == "pp_tp_":
        return [*_stages(2), f"model.tensor_model_parallel_size={n // 2}", "model.sequence_parallel=true"]
    if prefix == "pp_fsdp_":
        return [*_stages(2), *FSDP]
    if prefix == "3d_":
        return [*_stages(2), *FSDP, "model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
    if prefix == "ep_tp_":
        return [f"model.expert_model_parallel_size={n // 2}", "model.tensor_model_parallel_size=2"]
    if prefix == "ep_":
        scopes = re.fullmatch(r"(?:local|te)\[([a-z_,]*)\]", inner)
        partial = scopes is not None and bool(PARTIAL_MOE_SCOPES & set(scopes.group(1).split(",")))
        return [f"model.expert_model_parallel_size={n}"] + (["model.moe_token_dispatcher_type=alltoall"]
                                                            if partial else [])
    raise ValueError(f"unknown layout prefix {prefix!r}")


def _stages(n: int) -> list[str]:
    """``n`` pipeline stages under 1F1B, the embedding and output layer untied."""
    return [f"model.pipeline_model_parallel_size={n}", "model.pipeline_schedule=1f1b",
            "model.share_embeddings_and_output_weights=false"]


def batch_overrides(cfg: Config, world_size: int) -> list[str]:
    """The global batch a row's layout (``cfg``: the recipe with the row's overrides) runs on ``world_size``
    ranks: the recipe's per data-parallel replica, and 1F1B's micro-batch per stage (empty: unchanged)."""
    t = cfg.train
    layout = ParallelDims.from_config(cfg, world_size)
    per_replica = t.global_batch_size
    if layout.pp > 1 and cfg.model.pipeline_schedule == "1f1b":
        per_replica = max(per_replica, layout.pp * t.micro_batch_size)
        if (cfg.model.virtual_pipeline_model_parallel_size or 1) > 1:  # interleaved: micro-batches in rounds of pp
            per_replica = -(-per_replica // (layout.pp * t.micro_batch_size)) * layout.pp * t.micro_batch_size
    batch = per_replica * layout.dp
    return [] if batch == t.global_batch_size else [f"train.global_batch_size={batch}"]


def multi_rank_rows(cfg: Config, world_size: int = 2) -> list[str]:
    """The rows that fit the recipe under torchrun: replicated data parallel for every model; FSDP2, tensor
    and pipeline parallel for dense models; expert parallel for MoE models (hybrid models: the rules take
    none of the others; dense models also interleaved pipelines and context parallel); from 4 ranks the
    combined layouts too, from 8 the 3-D one."""
    m = cfg.model

    def fits(prefix: str) -> bool:
        least, divisor = MIN_RANKS[prefix]
        return world_size >= least and world_size % divisor == 0

    if m.hybrid_override_pattern:
        return list(DP_ROWS)
    if m.num_moe_experts:
        return DP_ROWS + EP_ROWS + (MOE_COMBINED_ROWS if fits("ep_tp_") else [])
    return (DP_ROWS + FSDP_ROWS + TP_ROWS + PP_ROWS + VPP_ROWS + CP_ROWS
            + (DENSE_COMBINED_ROWS if fits("pp_tp_") else [])
            + (THREE_D_ROWS if fits("3d_") else []))


def check_world(rows: list[str], world_size: int, recipe: str) -> None:
    """Refuse, before anything is measured, rows that cannot run at this world size."""
    if world_size <= 1:
        multi = [r for r in rows if needs_torchrun(r)]
        if multi:
            listed = shlex.quote(",".join(multi))
            raise ConfigError(
                f"{_rows(multi)} over several GPUs, one process per GPU, and this is one process (no WORLD_SIZE "
                "from torchrun). Run them with torchrun, one process per GPU (--nproc_per_node N for N >= 2 GPUs): "
                f"`torchrun --nproc_per_node 2 -m graphstep bench --recipe {recipe} --rows {listed}`")
        return
    single = [r for r in rows if not split_prefix(r)[0]]
    if single:
        raise ConfigError(
            f"{_rows(single)} on one GPU in one process, but torchrun started {world_size} processes and every "
            f"row runs over all of them. Run them without torchrun (`graphstep bench --recipe {recipe} --rows "
            f"{shlex.quote(','.join(single))}`), or under torchrun pick rows with a layout prefix "
            f"({', '.join(PREFIXES)}), e.g. {','.join(DP_ROWS)}")


def _rows(names: list[str]) -> str:
    return f"bench row {names[0]} runs" if len(names) == 1 else f"bench rows {', '.join(names)} run"
