"""The memory check per rank of a layout (training/memory.py): FSDP2 and tensor parallel shrink the
estimate as the module docstring's formula says, and a run too large for one device is told the
smallest FSDP2 layout that fits. Shapes only (meta device): no GPU, no processes, no training."""

from __future__ import annotations

import re

import pytest
import torch

from graphstep.config import apply_overrides
from graphstep.recipes import get_recipe
from graphstep.training import memory
from graphstep.training.memory import (
    GiB, HEADROOM, ZERO3, candidate_layouts, check_memory_fits, estimate_memory, parameter_counts,
)
from graphstep.parallel.dims import ParallelDims
from graphstep.training.rundir import RunSetupError
from graphstep.validation import validate_config

CUDA = torch.device("cuda")  # never touched: the estimate needs only the dtype's element size
H200 = 141 * GiB
BF16 = 2
ZERO3_ARGS = ["ddp.use_megatron_fsdp=true", f"ddp.data_parallel_sharding_strategy={ZERO3}"]


def ceil_div(n: int, k: int) -> int:
    return -(-n // k)


@pytest.fixture(scope="module")
def llama3_8b():
    return get_recipe("llama3_8b")


@pytest.fixture(scope="module")
def counts(llama3_8b):
    return parameter_counts(llama3_8b)


def logits_bytes(cfg, e: int) -> int:
    """The logits term of one sample: gathered whole on every rank."""
    return cfg.model.seq_length * cfg.model.vocab_size * (e + 8)


def test_parameter_counts_split_into_layers_and_root(llama3_8b, counts):
    m = llama3_8b.model
    assert counts.root == 2 * m.vocab_size * m.hidden_size + m.hidden_size  # embedding, output layer, final norm
    assert counts.root + m.num_layers * counts.largest_layer == counts.parameters


def test_fsdp_zero3_on_8_ranks_shards_the_static_memory(llama3_8b, counts):
    cfg = get_recipe("llama3_8b")
    apply_overrides(cfg, ZERO3_ARGS)
    one, eight = ParallelDims.from_config(cfg, 1), ParallelDims.from_config(cfg, 8)
    assert eight == ParallelDims(dp_shard=8, fsdp=ZERO3) and one == ParallelDims(dp_shard=1, fsdp=ZERO3)
    p, b = counts.parameters, counts.buffers
    gathered = (2 * counts.largest_layer + counts.root) * BF16  # two layers and the root module, in bf16
    est = estimate_memory(cfg, CUDA, eight)
    shard = ceil_div(p, 8)
    assert (est.weights, est.gradients, est.optimizer) == (shard * 4 + gathered + b * BF16, shard * 4, shard * 8)
    # against the same ZeRO-3 layout on one rank: the fp32 shards shrink 8-fold, the gathered copy does not
    single = estimate_memory(cfg, CUDA, one)
    fixed = gathered + b * BF16
    assert single.static - fixed == 16 * p and est.static - fixed == 16 * shard
    # against one unsharded replica: bf16 weights + fp32 grads + master, m, v
    replica = estimate_memory(cfg, CUDA)
    assert replica.static == p * (BF16 + 4 + 12) + b * BF16
    assert replica.static / est.static == pytest.approx((p * 18 + b * BF16) / (shard * 16 + fixed))
    assert est.activations_per_sample == replica.activations_per_sample  # data parallel leaves activations alone


def test_fsdp_zero2_keeps_every_layer_gathered(llama3_8b, counts):
    est = estimate_memory(llama3_8b, CUDA, ParallelDims(dp_shard=8, fsdp="optim_grads"))
    shard = ceil_div(counts.parameters, 8)
    assert est.weights == shard * 4 + counts.parameters * BF16 + counts.buffers * BF16


def test_tensor_parallel_2_halves_the_static_memory(llama3_8b, counts):
    p, b = counts.parameters, counts.buffers
    assert p % 2 == 0
    one = estimate_memory(llama3_8b, CUDA)
    two = estimate_memory(llama3_8b, CUDA, ParallelDims(tp=2))
    assert (two.gradients, two.optimizer) == (one.gradients // 2, one.optimizer // 2)
    assert two.static - b * BF16 == (one.static - b * BF16) // 2  # buffers (RoPE tables) are not split
    fsdp1, fsdp2 = (estimate_memory(llama3_8b, CUDA, ParallelDims(dp_shard=4, tp=tp, fsdp=ZERO3)) for tp in (1, 2))
    assert fsdp2.static - b * BF16 == ceil_div(fsdp1.static - b * BF16, 2)


def test_sequence_parallel_halves_the_block_activations_not_the_logits(llama3_8b):
    logits = logits_bytes(llama3_8b, BF16)
    one = estimate_memory(llama3_8b, CUDA).activations_per_sample
    sp = estimate_memory(llama3_8b, CUDA, ParallelDims(tp=2, sequence_parallel=True)).activations_per_sample
    no_sp = estimate_memory(llama3_8b, CUDA, ParallelDims(tp=2)).activations_per_sample
    assert sp - logits == (one - logits) // 2
    assert sp < no_sp < one  # without sequence parallel the residual stream stays whole


def _suggested(message: str) -> tuple[ParallelDims, list[str], int]:
    """The layout, overrides and rank count a refusal names."""
    overrides = re.search(r"add (.*?) and launch", message).group(1).split()
    nodes = re.search(r"--nnodes (\d+)", message)
    ranks = int(re.search(r"--nproc_per_node (\d+)", message).group(1)) * (int(nodes.group(1)) if nodes else 1)

    def size(name: str) -> int:
        return next((int(o.split("=")[1]) for o in overrides if o.startswith(f"model.{name}=")), 1)

    tp, pp, cp, ep = (size(n) for n in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                        "context_parallel_size", "expert_model_parallel_size"))
    dp = ranks // (tp * pp * cp)
    layout = ParallelDims(pp=pp, dp_shard=dp, cp=cp, tp=tp, ep=ep,
                          sequence_parallel="model.sequence_parallel=true" in overrides, fsdp=ZERO3 if dp > 1 else None)
    return layout, overrides, ranks


def moved_estimate(cfg, layout: ParallelDims):
    """The estimate of ``cfg`` asked for ``layout`` with the fields the advice would set."""
    return estimate_memory(memory.with_fields(cfg, memory.layout_fields(cfg, layout)), CUDA, layout)


def test_llama3_8b_on_one_h200_is_told_the_smallest_layout_that_fits(monkeypatch, llama3_8b):
    monkeypatch.setattr(memory, "available_memory", lambda device: H200)
    budget = HEADROOM * H200
    with pytest.raises(RunSetupError) as info:
        check_memory_fits(llama3_8b, CUDA)
    message = str(info.value)
    assert ParallelDims().describe() in message and "per rank" in message
    assert f"data_parallel_sharding_strategy={ZERO3}" in message and "nproc_per_node" in message
    assert "not yet available" not in message
    layout, _overrides, ranks = _suggested(message)
    assert layout.describe() in message
    assert moved_estimate(llama3_8b, layout).total <= budget
    smaller = [c for c in candidate_layouts(llama3_8b) if c.ranks < ranks]
    assert all(moved_estimate(llama3_8b, c).total > budget for c in smaller)
    assert not torch.cuda.is_initialized()


def test_the_suggested_layout_passes_the_check_and_the_layout_rules(monkeypatch, llama3_8b):
    monkeypatch.setattr(memory, "available_memory", lambda device: H200)
    with pytest.raises(RunSetupError) as info:
        check_memory_fits(llama3_8b, CUDA)
    layout, overrides, ranks = _suggested(str(info.value))
    cfg = get_recipe("llama3_8b")
    apply_overrides(cfg, overrides)
    assert ParallelDims.from_config(cfg, ranks) == layout
    estimate = check_memory_fits(cfg, CUDA, layout=layout)
    assert estimate is not None and estimate.layout == layout
    layout_rules = memory.LAYOUT_RULES
    assert [v for v in validate_config(cfg, env={}, world_size=ranks) if v.rule in layout_rules] == []


def test_recompute_is_kept_over_the_advised_layout_and_advised_over_a_sharded_one(monkeypatch, llama3_8b):
    """R27 takes activation recompute with FSDP2 and tensor parallel: the advice keeps a run's full recompute, whose
    estimate needs fewer GPUs (llama3_8b on 80 GiB: 2 FSDP2 ranks, where 2 x 2 tensor-parallel ranks are needed
    without it), and a sharded run whose sample does not fit beside its weights is told full recompute."""
    monkeypatch.setattr(memory, "available_memory", lambda device: 80 * GiB)
    cfg = apply_overrides(get_recipe("llama3_8b"), ["model.recompute_granularity=full"])
    with pytest.raises(RunSetupError) as info:
        check_memory_fits(cfg, CUDA)
    layout, overrides, ranks = _suggested(str(info.value))
    assert (ranks, layout.tp, layout.fsdp) == (2, 1, ZERO3) and not any("recompute" in o for o in overrides)
    assert moved_estimate(cfg, layout).total <= HEADROOM * 80 * GiB < moved_estimate(llama3_8b, layout).total
    monkeypatch.setattr(memory, "available_memory", lambda device: 60 * GiB)
    sharded = apply_overrides(get_recipe("llama3_8b"), [*ZERO3_ARGS, "model.tensor_model_parallel_size=2",
                                                        "model.sequence_parallel=true"])
    with pytest.raises(RunSetupError, match="do not fit beside the weights and optimizer state: "
                                            "model.recompute_granularity=full or a shorter model.seq_length"):
        check_memory_fits(sharded, CUDA, layout=ParallelDims(dp_shard=2, tp=2, sequence_parallel=True, fsdp=ZERO3))


def test_long_sequences_are_offered_stages_with_context_parallel():
    """Llama 3 70B at 128k tokens on 80 GiB GPUs: the smallest layout that fits splits the sequence over 8
    context-parallel ranks and the layers over 2 pipeline stages (R30 takes context parallel with stages); no
    layout without stages fits on as few GPUs."""
    cfg = apply_overrides(get_recipe("llama3_70b"), ["model.seq_length=131072"])
    budget = HEADROOM * 80 * GiB
    layout, estimate = memory.suggest_layout(cfg, CUDA, budget)
    assert (layout.pp, layout.cp, layout.tp, layout.dp, layout.fsdp) == (2, 8, 8, 2, ZERO3)
    assert estimate.total <= budget and moved_estimate(cfg, layout).total == estimate.total
    fields = memory.layout_fields(cfg, layout)
    assert fields["model.virtual_pipeline_model_parallel_size"] is None and fields["model.pipeline_schedule"] == "1f1b"
    counts = parameter_counts(cfg)
    no_stages = [c for c in candidate_layouts(cfg) if c.ranks <= layout.ranks and c.pp == 1]
    assert no_stages and all(memory._estimate(memory.with_fields(cfg, memory.layout_fields(cfg, c)), CUDA, c,
                                              counts).total > budget for c in no_stages)


def test_nothing_fits_says_so(monkeypatch, llama3_8b):
    monkeypatch.setattr(memory, "available_memory", lambda device: GiB)  # not even sharded 1024 ways
    with pytest.raises(RunSetupError, match=r"no layout of up to 1024 such devices fits"):
        check_memory_fits(llama3_8b, CUDA)


def test_more_than_8_ranks_are_nodes_of_8(monkeypatch, llama3_8b):
    sixteen = [c for c in candidate_layouts(llama3_8b) if c.ranks == 16]
    budget = min(moved_estimate(llama3_8b, c).total for c in sixteen)  # the best 16-rank layout just fits
    monkeypatch.setattr(memory, "available_memory", lambda device: int(budget / HEADROOM) + 1)
    with pytest.raises(RunSetupError) as info:
        check_memory_fits(llama3_8b, CUDA)
    assert "launch on 16 GPUs, 2 nodes x 8 (torchrun --nnodes 2 --nproc_per_node 8)" in str(info.value)


def test_moe_models_are_offered_fsdp2_with_expert_parallel(monkeypatch):
    cfg = get_recipe("qwen3_moe_tiny")
    four = ParallelDims(dp_shard=4, ep=4, fsdp=ZERO3)
    layouts = candidate_layouts(cfg)
    assert four in layouts and all(c.tp == c.pp == c.cp == 1 and c.ep > 1 for c in layouts)
    budget = moved_estimate(cfg, four).total
    assert moved_estimate(cfg, ParallelDims(dp_shard=2, ep=2, fsdp=ZERO3)).total > budget  # 2 ranks do not fit
    monkeypatch.setattr(memory, "available_memory", lambda device: int(budget / HEADROOM) + 1)
    with pytest.raises(RunSetupError) as info:
        check_memory_fits(cfg, CUDA)
    layout, overrides, ranks = _suggested(str(info.value))
    assert layout == four and "model.expert_model_parallel_size=4" in overrides
    apply_overrides(cfg, overrides)
    assert [v for v in validate_config(cfg, env={}, world_size=ranks) if v.rule in memory.LAYOUT_RULES] == []


@pytest.mark.parametrize("overrides,asks", [
    ([], "model.expert_model_parallel_size="),  # M-*E: with an MoE layer, FSDP2 x expert parallel
    (["model.hybrid_override_pattern=M-*-", "model.num_moe_experts=null", "model.mamba_num_groups=2"],
     "ddp.use_megatron_fsdp=true"),  # no MoE layer: as a dense model (tensor parallel only where the heads divide)
])
def test_hybrid_models_are_offered_a_sharded_layout_the_rules_accept(monkeypatch, overrides, asks):
    cfg = apply_overrides(get_recipe("nemotron_h_tiny"), overrides)
    eight = [c for c in candidate_layouts(cfg) if c.ranks == 8]  # a budget that 8 ranks fit, one does not
    budget = min(moved_estimate(cfg, c).total for c in eight)
    assert estimate_memory(cfg, CUDA).total > budget
    monkeypatch.setattr(memory, "available_memory", lambda device: int(budget / HEADROOM) + 1)
    with pytest.raises(RunSetupError) as info:
        check_memory_fits(cfg, CUDA)
    layout, suggested, ranks = _suggested(str(info.value))
    assert layout.ranks > 1 and asks in " ".join(suggested)
    apply_overrides(cfg, suggested)
    assert [v for v in validate_config(cfg, env={}, world_size=ranks) if v.rule in memory.LAYOUT_RULES] == []


def test_expert_parallel_ranks_hold_their_share_of_the_experts():
    cfg = get_recipe("qwen3_30b_a3b")
    counts = parameter_counts(cfg)
    assert 0 < counts.experts < counts.parameters
    whole, split = estimate_memory(cfg, CUDA, ParallelDims(dp_replicate=8)), estimate_memory(cfg, CUDA, ParallelDims(dp_replicate=8, ep=8))
    local = counts.parameters - counts.experts + ceil_div(counts.experts, 8)
    assert split.gradients == local * 4 and whole.gradients == counts.parameters * 4
    assert split.activations == whole.activations


CPU = torch.device("cpu")  # llama3_tiny in fp32: 4 bytes per element, no master copy


# llama3_tiny by hand: 4 layers of 184576 parameters (qkv 128 x 256, proj 128 x 128, fc1 128 x 704, fc2 352 x 128,
# two norms of 128), a tied 256 x 128 embedding (32768) and the final norm (128); 32768 buffer elements.
# Activations per token and layer in fp32: attention 4 * 2h + h = 1152 + 4 * (3h + 3kv) = 2304 (kv = 64), MLP
# 1152 + 4 * 4f = 5632: 10240; times 128 tokens: 1310720 per sample and layer. Logits: 128 * 256 * (4 + 8) = 393216.
LAYER, EMB, BUF, LAYER_ACT, LOGITS = 184576, 32768, 32768, 1310720, 393216


def tiny(*overrides: str):
    return apply_overrides(get_recipe("llama3_tiny"), list(overrides))


def test_pipeline_1f1b_first_rank_keeps_pp_micro_batches_of_its_layers():
    # 2 stages, 2 micro-batches per step (16 / 8): rank 0 holds layers 0-1 and the embedding, keeps 2 in flight;
    # rank 1 layers 2-3 and the tied copy + final norm, 1 in flight plus the logits
    est = estimate_memory(tiny(), CPU, ParallelDims(pp=2))
    assert (est.stage, est.parameters, est.in_flight) == (0, 2 * LAYER + EMB, 2.0)
    assert est.activations_per_sample == 2 * LAYER_ACT * 2
    assert (est.weights, est.gradients, est.optimizer) == ((401920 + BUF) * 4, 401920 * 4, 401920 * 8)


def test_interleaved_first_rank_keeps_megatrons_share():
    # v = 2 virtual stages of one layer: rank 0 holds chunks 0 and 2 (layers 0, 2); 4 micro-batches per step.
    # Megatron: pp * (1 + (pp - 1) / (pp * v)) = 2 * (1 + 1/4) = 2.5 micro-batches of the rank's 2 layers
    est = estimate_memory(tiny("model.virtual_pipeline_model_parallel_size=2", "train.global_batch_size=32"), CPU,
                          ParallelDims(pp=2))
    assert (est.stage, est.in_flight, est.activations_per_sample) == (0, 2.5, int(2 * LAYER_ACT * 2.5))
    # with 2 micro-batches per step the warm-up is capped at m * v = 4 chunk forwards: 2 micro-batches
    capped = estimate_memory(tiny("model.virtual_pipeline_model_parallel_size=2"), CPU, ParallelDims(pp=2))
    assert capped.in_flight == 2.0


def test_gpipe_keeps_every_micro_batch_and_the_last_rank_is_heaviest():
    est = estimate_memory(tiny("model.pipeline_schedule=gpipe", "train.global_batch_size=32"), CPU, ParallelDims(pp=2))
    assert (est.stage, est.parameters, est.in_flight) == (1, 2 * LAYER + EMB + 128, 4.0)
    assert est.activations_per_sample == 4 * (2 * LAYER_ACT + LOGITS)


def test_an_uneven_split_counts_the_heavier_rank():
    est = estimate_memory(tiny("model.num_layers_in_first_pipeline_stage=1"), CPU, ParallelDims(pp=2))
    assert (est.stage, est.parameters, est.in_flight) == (1, 3 * LAYER + EMB + 128, 1.0)
    assert est.activations_per_sample == 3 * LAYER_ACT + LOGITS


def test_context_parallel_halves_the_tokens_and_keeps_the_gathered_keys_and_values():
    est = estimate_memory(tiny(), CPU, ParallelDims(cp=2))
    gathered = 4 * 2 * 64 * 128  # fp32 keys and values of the whole sequence, per attention layer
    assert est.activations_per_sample == 4 * (LAYER_ACT // 2 + gathered) + LOGITS // 2


def test_pipeline_by_tensor_parallel_by_fsdp2():
    # rank 0 of 2 stages x 2 FSDP2 ZeRO-3 ranks x 2 tensor-parallel + sequence-parallel ranks, micro-batch 4:
    # 401920 parameters sharded 4 ways, the gathered copy (2 layers + embedding = the whole stage) split over tp
    est = estimate_memory(tiny("train.micro_batch_size=4"), CPU,
                          ParallelDims(pp=2, dp_shard=2, tp=2, sequence_parallel=True, fsdp=ZERO3))
    shard = 401920 // 4
    assert (est.weights, est.gradients, est.optimizer) == (shard * 4 + 401920 // 2 * 4 + BUF * 4, shard * 4, shard * 8)
    per_token = (1152 + 2304) // 2 + (1152 + 5632) // 2  # everything split over the sequence-parallel ranks
    assert est.activations_per_sample == 2 * 128 * per_token * 2  # 16 / (4 x 2) = 2 micro-batches in flight


def test_per_layer_graphs_are_advised_one_full_iteration_graph_where_the_layout_rules_ask_it(monkeypatch):
    # qwen3_30b_a3b graphs attn, moe_router and moe_preprocess per layer: R27 (FSDP2 ZeRO-3) and R31 (those
    # scopes with expert parallel) refuse them over the advised layout, so the advice graphs the whole iteration
    cfg = get_recipe("qwen3_30b_a3b")
    assert cfg.model.cuda_graph_impl == "transformer_engine"
    monkeypatch.setattr(memory, "available_memory", lambda device: 80 * GiB)
    with pytest.raises(RunSetupError) as info:
        check_memory_fits(cfg, CUDA)
    layout, overrides, ranks = _suggested(str(info.value))
    assert layout.ep == ranks == 4 and "model.cuda_graph_impl=full_iteration" in overrides
    apply_overrides(cfg, overrides)
    assert [v for v in validate_config(cfg, env={}, world_size=ranks) if v.rule in memory.LAYOUT_RULES] == []
    assert moved_estimate(get_recipe("qwen3_30b_a3b"), layout).total <= HEADROOM * 80 * GiB
