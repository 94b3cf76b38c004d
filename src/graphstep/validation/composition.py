"""Which layouts combine with which graph settings: the table in docs/parallel.md, read off the rules.

Each row is a layout (one engine, or several composed) on the ranks it needs;
each column a way to run it (eager, the whole iteration in one graph,
per-layer graphs, activation recompute, torch.compile). A cell is what
``validate_config`` says of that config at that world size: ``yes`` when
no rule refuses it, else the rules that do. The rules refuse every
combination the tests do not show bit-equal to eager (graphed) or to one
process (eager), so the table is what graphstep runs today.

``python -m graphstep.validation.composition`` prints the table;
tests/unit/test_composition.py checks that docs/parallel.md holds it as printed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config, apply_overrides
from ..recipes import get_recipe
from . import validate_config

FSDP3 = ("ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params")
FSDP2_ZERO2 = ("ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads")
DIST_OPT = ("ddp.use_distributed_optimizer=true",)  # Megatron Bridge's sharding: FSDP2 ZeRO-2
TP2 = ("model.tensor_model_parallel_size=2", "model.sequence_parallel=true")
PP2 = ("model.pipeline_model_parallel_size=2", "model.share_embeddings_and_output_weights=false")
VPP = (*PP2, "model.virtual_pipeline_model_parallel_size=2")
CP2 = ("model.context_parallel_size=2", "model.cp_comm_type=all_gather")
EP2 = ("model.expert_model_parallel_size=2",)
ALLTOALL = ("model.moe_token_dispatcher_type=alltoall",)


@dataclass(frozen=True)
class Layout:
    """A row: ``name`` as the table shows it, the recipe, its ranks and the overrides that ask for it; ``scopes``:
    its per-layer graphs where they are not the recipe's (PER_LAYER_SCOPES)."""

    name: str
    world: int
    overrides: tuple[str, ...]
    recipe: str = "llama3_tiny"
    scopes: str | None = None


LAYOUTS = (
    Layout("data parallel (dp2)", 2, ()),
    Layout("FSDP2 ZeRO-3 (dp2)", 2, FSDP3),
    Layout("FSDP2 ZeRO-2 (dp2)", 2, FSDP2_ZERO2),
    Layout("tensor + sequence parallel (tp2)", 2, TP2),
    Layout("pipeline (pp2)", 2, PP2),
    Layout("pipeline, tied embeddings (pp2)", 2, ("model.pipeline_model_parallel_size=2",)),
    Layout("interleaved pipeline (pp2 x vpp2)", 2, VPP),
    Layout("context parallel (cp2)", 2, CP2),
    Layout("pp2 x dp2", 4, PP2),
    Layout("pp2 x tp2", 4, (*PP2, *TP2)),
    Layout("pp2 x FSDP2 ZeRO-3 (dp2)", 4, (*PP2, *FSDP3)),
    Layout("pp2 x vpp2 x tp2", 4, (*VPP, *TP2)),
    Layout("pp2 x vpp2 x FSDP2 ZeRO-3 (dp2)", 4, (*VPP, *FSDP3)),
    Layout("cp2 x tp2", 4, (*CP2, *TP2)),
    Layout("cp2 x FSDP2 ZeRO-3 (dp2)", 4, (*CP2, *FSDP3)),
    Layout("pp2 x cp2", 4, (*PP2, *CP2)),
    Layout("pp2 x vpp2 x cp2 x tp2", 8, (*VPP, *CP2, *TP2)),
    Layout("3-D: pp2 x FSDP2 ZeRO-3 (dp2) x tp2", 8, (*PP2, *FSDP3, *TP2)),
    Layout("3-D: pp2 x vpp2 x distributed optimizer (dp2) x tp2", 8, (*VPP, *DIST_OPT, *TP2)),
    Layout("MoE, expert parallel (ep2)", 2, EP2, "qwen3_moe_tiny"),
    Layout("MoE, ep2 x tp2, experts split over tp (expert tensor parallel)", 4, (*EP2, *TP2), "qwen3_moe_tiny"),
    Layout("MoE, ep2 x tp2, whole experts (expert_tensor_parallel_size=1)", 4,
           (*EP2, *TP2, "model.expert_tensor_parallel_size=1"), "qwen3_moe_tiny"),
    Layout("MoE, tp2, experts split over tp", 2, TP2, "qwen3_moe_tiny"),
    Layout("MoE, ep2 x FSDP2 ZeRO-3", 2, (*EP2, *FSDP3), "qwen3_moe_tiny"),
    # Megatron Bridge's Qwen3-30B-A3B settings: alltoall over the distributed optimizer, both overlap flags, graphs
    # of the attention, router and preprocess (the dispatch reads its split sizes on the host: R11)
    Layout("MoE, ep2 alltoall x distributed optimizer", 2, (*EP2, *ALLTOALL, *DIST_OPT, "ddp.overlap_grad_reduce=true",
                                                             "ddp.overlap_param_gather=true"), "qwen3_moe_tiny",
           "[attn,moe_router,moe_preprocess]"),
    Layout("MoE over pp2", 2, PP2, "qwen3_moe_tiny"),
    Layout("MoE, pp2 x tp2", 4, (*PP2, *TP2), "qwen3_moe_tiny"),
    Layout("MoE, pp2 x ep2", 4, (*PP2, *EP2), "qwen3_moe_tiny"),
    Layout("MoE, pp2 x ep2 x FSDP2 ZeRO-3", 4, (*PP2, *EP2, *FSDP3), "qwen3_moe_tiny"),
    Layout("MoE, pp2 x vpp2 x ep2", 4, (*VPP, *EP2, "model.num_layers=4"), "qwen3_moe_tiny"),
    Layout("MoE, pp2 x ep2 alltoall x distributed optimizer", 4, (*PP2, *EP2, *ALLTOALL, *DIST_OPT),
           "qwen3_moe_tiny", "[attn,moe_router,moe_preprocess]"),
    Layout("MoE, cp2", 2, CP2, "qwen3_moe_tiny"),
    Layout("MoE, cp2 x ep2", 4, (*CP2, *EP2), "qwen3_moe_tiny"),
    Layout("hybrid (Mamba) over pp2", 2, PP2, "nemotron_h_tiny"),
    Layout("hybrid (Mamba), cp2", 2, CP2, "nemotron_h_tiny"),
    Layout("hybrid (Mamba), pp2 x cp2", 4, (*PP2, *CP2), "nemotron_h_tiny"),
    Layout("hybrid (Mamba), ep2", 2, EP2, "nemotron_h_tiny"),
    Layout("hybrid (Mamba), pp2 x ep2 x FSDP2 ZeRO-3", 4, (*PP2, *EP2, *FSDP3), "nemotron_h_tiny"),
    Layout("hybrid (Mamba), tp2", 2, (*TP2, "model.mamba_num_groups=2"), "nemotron_h_tiny"),
    Layout("hybrid (Mamba), pp2 x tp2", 4, (*PP2, *TP2, "model.mamba_num_groups=2"), "nemotron_h_tiny"),
    Layout("hybrid (Mamba), cp2 x tp2", 4, (*CP2, *TP2, "model.mamba_num_groups=2"), "nemotron_h_tiny"),
    Layout("hybrid (Mamba, no MoE layer), FSDP2 ZeRO-3 (dp2) x tp2", 4,
           (*FSDP3, *TP2, "model.mamba_num_groups=2", "model.hybrid_override_pattern=M-*-",
            "model.num_moe_experts=null"), "nemotron_h_tiny"),
)

GRAPHS = ("model.use_te_rng_tracker=true", "model.cuda_graph_warmup_steps=2")
COLUMNS = (
    ("eager", ("model.cuda_graph_impl=none",)),
    ("full_iteration", ("model.cuda_graph_impl=full_iteration", *GRAPHS)),
    ("per-layer graphs", ("model.cuda_graph_impl=local", *GRAPHS)),
    ("full_iteration + recompute", ("model.cuda_graph_impl=full_iteration", *GRAPHS,
                                    "model.recompute_granularity=selective")),
    ("compile", ("model.cuda_graph_impl=none", "compile.enable=true")),
)
PER_LAYER_SCOPES = {"llama3_tiny": "[attn,mlp]", "qwen3_moe_tiny": "[attn,moe]", "nemotron_h_tiny": "[attn,mlp,mamba]"}


def layout_config(layout: Layout, column: tuple[str, ...]) -> Config:
    """The recipe with the layout's and the column's overrides, its batch large enough for every schedule."""
    cfg = get_recipe(layout.recipe)
    overrides = ["train.micro_batch_size=1", f"train.global_batch_size={4 * layout.world}", *layout.overrides,
                 *column]
    if "model.cuda_graph_impl=local" in column:
        overrides.append(f"model.cuda_graph_modules={layout.scopes or PER_LAYER_SCOPES[layout.recipe]}")
    return apply_overrides(cfg, overrides)


def cell(layout: Layout, column: tuple[str, ...]) -> str:
    """``yes``, or the rules that refuse the combination (``R28, R29``)."""
    rules = sorted({v.rule for v in validate_config(layout_config(layout, column), world_size=layout.world)},
                   key=lambda r: (len(r), r))
    return "yes" if not rules else ", ".join(rules)


def composition_table() -> str:
    """The Markdown table: one row per layout, one column per way to run it."""
    head = "| layout | ranks | " + " | ".join(name for name, _ in COLUMNS) + " |"
    lines = [head, "|---|---|" + "---|" * len(COLUMNS)]
    for layout in LAYOUTS:
        cells = " | ".join(cell(layout, overrides) for _, overrides in COLUMNS)
        lines.append(f"| {layout.name} | {layout.world} | {cells} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(composition_table(), end="")
