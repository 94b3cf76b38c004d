"""Expert parallel pieces in one process: the layout of one rank's experts, rules R31 and R11 (the alltoall
dispatcher's host sync), and the expert-parallel MoE block on a one-rank mesh -- with the allgather dispatcher
equal to the plain block and captured whole equal to eager, with the alltoall dispatcher equal to the plain block
(cpu and cuda twins)."""

from __future__ import annotations

import pytest
import torch

import graphstep
from graphstep.config import Config, ModelConfig, apply_overrides

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


@pytest.mark.parametrize("align", [1, 4])
def test_one_ranks_layout_holds_the_pairs_routed_to_its_experts_and_drops_the_others(align):
    from graphstep.models.moe_dispatch import dispatch, dropless_layout, expert_parallel_layout

    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(24)])  # 24 tokens, top-2 of 8 experts
    h = torch.randn(24, 5, generator=g)
    whole_row, whole_counts, whole_offsets = dropless_layout(idx, 8, align)
    whole = dispatch(h, whole_row, int(whole_offsets[-1]))
    for rank, first in enumerate((0, 4)):
        row, counts, offsets, P = expert_parallel_layout(idx, first, 4, align)
        local = (idx >= first) & (idx < first + 4)
        assert torch.equal(counts, whole_counts[first:first + 4])
        assert torch.equal(row[~local], torch.full_like(row[~local], P))  # other ranks' pairs: dropped
        x = dispatch(h, row, P)
        ends = offsets.tolist()
        starts = [0] + ends[:-1]
        for e in range(4):  # expert e's group holds exactly the tokens the whole layout gives it, in order
            n = int(counts[e])
            ws = int(whole_offsets[first + e - 1]) if first + e > 0 else 0
            assert torch.equal(x[starts[e]:starts[e] + n], whole[ws:ws + n])
        assert not x[ends[-1]:].any()  # the rows after this rank's experts stay zero


PP2 = ("model.pipeline_model_parallel_size=2", "model.num_layers=4")


def _rules(*overrides: str, world: int = 2) -> list:
    from graphstep.validation import validate_config

    cfg = apply_overrides(Config(), ["model.num_moe_experts=4", "model.moe_ffn_hidden_size=32", *overrides])
    return [v for v in validate_config(cfg, world_size=world) if v.rule == "R31"]


@pytest.mark.parametrize("overrides,world,words", [
    (["model.expert_model_parallel_size=2", "model.num_moe_experts=null"], 2, "needs an MoE model"),
    (["model.expert_model_parallel_size=3"], 3, "does not divide over 3"),
    (["model.expert_model_parallel_size=2"], 3, "do not divide into groups of 2"),
    (["model.expert_model_parallel_size=2", "model.moe_expert_capacity_factor=1.0"], 2, "dropless"),
    (["model.expert_model_parallel_size=2", "model.moe_sync_free=false"], 2, "sync-free"),
    (["model.expert_model_parallel_size=2", "model.tensor_model_parallel_size=2",
      "model.moe_token_dispatcher_type=alltoall"], 4, "alltoall dispatcher with model.tensor_model_parallel_size=2"),
    (["model.expert_model_parallel_size=2", "ddp.overlap_grad_reduce=true"], 2,
     "ddp.overlap_grad_reduce with expert parallel over replicated data parallel is not implemented"),
    (["model.expert_model_parallel_size=2", "ddp.use_distributed_optimizer=true", "model.cuda_graph_impl=local",
      "model.use_te_rng_tracker=true", "model.cuda_graph_modules=[attn,moe]"], 2, "per-layer graphs of the MoE block"),
    (["model.expert_model_parallel_size=2", "model.cuda_graph_impl=local", "model.use_te_rng_tracker=true",
      "model.cuda_graph_modules=[attn,moe_router]"], 2, "with the allgather dispatcher"),
    (["model.expert_tensor_parallel_size=2"], 1, "split over 1 or all model.tensor_model_parallel_size=1"),
    # expert tensor parallel (null: the tensor-parallel size, as Megatron reads it)
    (["model.tensor_model_parallel_size=2", "model.expert_tensor_parallel_size=4"], 4, "split over 1 or all"),
    (["model.tensor_model_parallel_size=2", "model.moe_expert_capacity_factor=1.0"], 2, "(null: model.tensor_model_"
     "parallel_size=2) splits each expert over the tensor-parallel ranks: it is dropless"),
    (["model.tensor_model_parallel_size=2", "model.expert_tensor_parallel_size=2", "model.moe_sync_free=false"], 2,
     "sync-free grouped GEMM only"),
    (["model.tensor_model_parallel_size=2", "model.moe_ffn_hidden_size=33"], 2, "33 hidden columns do not divide"),
    (["model.tensor_model_parallel_size=2", "model.moe_token_dispatcher_type=alltoall", "model.cuda_graph_impl=local",
      "model.use_te_rng_tracker=true", "model.cuda_graph_modules=[attn,moe_router,moe_preprocess]"], 2,
     "the moe_router and moe_preprocess scopes are not implemented"),
])
def test_expert_parallel_rule_refuses_with_the_reason(overrides, world, words):
    found = _rules(*overrides, world=world)
    assert len(found) == 1 and words in found[0].message, found


def test_accepted_expert_parallel_layouts_break_no_rule():
    assert _rules("model.expert_model_parallel_size=2") == []
    # over pipeline stages, plain or virtual, either dispatcher, over replicated data parallel or FSDP2
    assert _rules("model.expert_model_parallel_size=2", *PP2, "model.moe_token_dispatcher_type=alltoall",
                  "ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true", world=4) == []
    assert _rules("model.expert_model_parallel_size=2", *PP2, "model.virtual_pipeline_model_parallel_size=2",
                  "model.share_embeddings_and_output_weights=false", "ddp.use_megatron_fsdp=true",
                  "ddp.data_parallel_sharding_strategy=optim_grads_params", world=4) == []
    assert _rules("model.expert_model_parallel_size=2", world=4) == []
    assert _rules("model.expert_model_parallel_size=4", world=4, ) == []
    assert _rules("model.expert_model_parallel_size=2", "model.cuda_graph_impl=local", "model.use_te_rng_tracker=true",
                  "model.cuda_graph_modules=[attn,moe]") == []
    # with tensor parallel (each tensor-parallel rank runs the MoE blocks on its share of the tokens), FSDP2 (the
    # experts sharded over the ranks holding them; per-layer graphs of the attention only) and recompute
    assert _rules("model.expert_model_parallel_size=2", "model.tensor_model_parallel_size=2", world=4) == []
    assert _rules("model.expert_model_parallel_size=2", "model.tensor_model_parallel_size=2",
                  "model.sequence_parallel=true", "model.cuda_graph_impl=local", "model.use_te_rng_tracker=true",
                  "model.cuda_graph_modules=[attn,moe]", world=4) == []
    assert _rules("model.expert_model_parallel_size=2", "ddp.use_distributed_optimizer=true", world=4) == []
    assert _rules("model.expert_model_parallel_size=2", "ddp.use_megatron_fsdp=true", "model.cuda_graph_impl=local",
                  "ddp.data_parallel_sharding_strategy=optim_grads", "model.use_te_rng_tracker=true",
                  "model.cuda_graph_modules=[attn]") == []
    # the alltoall dispatcher over FSDP2 (the distributed optimizer, ZeRO-2: Megatron's per-layer graphs too; ZeRO-3),
    # and ddp.overlap_grad_reduce where FSDP2 reduce-scatters during the backward
    assert _rules(*ALLTOALL, "ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true",
                  "ddp.overlap_param_gather=true", "model.cuda_graph_impl=transformer_engine",
                  "model.use_te_rng_tracker=true", "model.cuda_graph_scope=[attn,moe_router,moe_preprocess]") == []
    assert _rules(*ALLTOALL, "ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params",
                  "ddp.overlap_grad_reduce=true", world=4) == []
    assert _rules("model.expert_model_parallel_size=2", "ddp.use_distributed_optimizer=true",
                  "ddp.overlap_grad_reduce=true", world=4) == []
    assert _rules("model.expert_model_parallel_size=2", "model.recompute_granularity=full",
                  "model.recompute_method=uniform", "model.recompute_num_layers=1") == []
    # expert tensor parallel: null and tp mean it; 1 keeps whole experts (Megatron's partial graphs with alltoall
    # and one expert-parallel rank, a capacity factor)
    tp2 = ("model.tensor_model_parallel_size=2", "model.sequence_parallel=true")
    assert _rules(*tp2, "model.cuda_graph_impl=local", "model.use_te_rng_tracker=true",
                  "model.cuda_graph_modules=[attn,moe]") == []
    assert _rules(*tp2, "model.expert_model_parallel_size=2", "model.expert_tensor_parallel_size=2", world=4) == []
    assert _rules(*tp2, "model.expert_tensor_parallel_size=1", "model.moe_expert_capacity_factor=1.0") == []
    assert _rules(*tp2, "model.expert_tensor_parallel_size=1", "model.moe_token_dispatcher_type=alltoall",
                  "model.cuda_graph_impl=local", "model.use_te_rng_tracker=true",
                  "model.cuda_graph_modules=[attn,moe_router,moe_preprocess]") == []
    # over pipeline stages (EP x PP x DP): eager, and the whole iteration in one graph
    assert _rules("model.expert_model_parallel_size=2", *PP2, world=4) == []
    assert _rules("model.expert_model_parallel_size=2", *PP2, world=8) == []
    assert _rules("model.expert_model_parallel_size=2", *PP2, "model.cuda_graph_impl=full_iteration",
                  "model.use_te_rng_tracker=true", "model.cuda_graph_warmup_steps=1", world=4) == []
    # ... per-layer graphs of the MoE blocks, and recompute (tests/distributed/test_pipeline.py, pp2_ep2)
    assert _rules("model.expert_model_parallel_size=2", *PP2, "model.cuda_graph_impl=local",
                  "model.use_te_rng_tracker=true", "model.cuda_graph_modules=[attn,moe]",
                  "model.cuda_graph_warmup_steps=2", world=4) == []
    assert _rules("model.expert_model_parallel_size=2", *PP2, "model.cuda_graph_impl=full_iteration",
                  "model.use_te_rng_tracker=true", "model.cuda_graph_warmup_steps=1", "model.recompute_granularity=full",
                  "model.recompute_method=uniform", "model.recompute_num_layers=1", "model.attention_dropout=0.0",
                  "model.hidden_dropout=0.0", world=4) == []


def test_expert_parallel_over_stages_passes_every_rule_and_refuses_what_other_rules_own():
    """pp2 x ep2 breaks no rule at all, graphed whole, nor with tensor parallel as well (pp2 x ep2 x tp2, the 8-rank
    launch of test_pipeline_3d.py), without expert parallel (pp2 x tp2 MoE) or over virtual stages (the 4-rank
    pipeline launch's vpp2_ep2)."""
    layout = ("model.expert_model_parallel_size=2", *PP2, "train.micro_batch_size=1", "train.global_batch_size=8",
              "model.cuda_graph_impl=full_iteration", "model.cuda_graph_warmup_steps=1")
    assert _all_rules(*layout, world=4) == []
    assert _all_rules(*layout, "model.tensor_model_parallel_size=2", "model.sequence_parallel=true", world=8) == []
    assert _all_rules(*layout[1:], "model.tensor_model_parallel_size=2", world=4) == []  # pp2 x tp2 MoE
    assert _all_rules(*layout, "model.virtual_pipeline_model_parallel_size=2", "model.num_layers=4",
                      "model.share_embeddings_and_output_weights=false", world=4) == []


def _all_rules(*overrides: str, world: int = 2) -> list:
    from graphstep.validation import validate_config

    cfg = apply_overrides(Config(), ["model.num_moe_experts=4", "model.moe_ffn_hidden_size=32",
                                     "model.use_te_rng_tracker=true", "rerun_state_machine.check_for_nan_in_loss=false",
                                     "ddp.check_for_nan_in_grad=false", *overrides])
    return validate_config(cfg, env={}, device_capability=(9, 0), world_size=world)


ALLTOALL = ("model.expert_model_parallel_size=2", "model.moe_token_dispatcher_type=alltoall")


@pytest.mark.parametrize("graphs,words", [
    (["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,moe]"], "model.cuda_graph_modules has moe"),
    (["model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[moe]"], "has moe"),
    (["model.cuda_graph_impl=local"], "(the whole layer) includes the MoE block"),
    (["model.cuda_graph_impl=full_iteration"], "model.cuda_graph_impl=full_iteration captures the MoE block"),
])
def test_alltoall_dispatcher_keeps_the_moe_block_out_of_graphs(graphs, words):
    """R11: the all-to-all split sizes are read on the host, so neither the block nor the iteration is captured."""
    found = _all_rules(*ALLTOALL, *graphs)
    assert [v.rule for v in found] == ["R11"], found
    assert words in found[0].message and "reads its all-to-all split sizes on the host" in found[0].message
    assert "model.cuda_graph_modules=[attn,moe_router,moe_preprocess]" in found[0].fix
    assert "model.moe_token_dispatcher_type=allgather" in found[0].fix
    assert {"model.moe_token_dispatcher_type", "model.expert_model_parallel_size"} <= set(found[0].fields)
    allgather = [o for o in ALLTOALL if "dispatcher" not in o]  # the same graphs with the sync-free dispatcher
    assert _all_rules(*allgather, *graphs) == []


def test_flex_dispatcher_is_judged_and_run_as_alltoall():
    """Megatron's flex dispatcher (DeepEP/HybridEP kernels) runs as graphstep's alltoall: the same rules (R11 keeps
    its block out of graphs, Megatron's partial graphs pass), the same MoE block, and one note in the log."""
    from graphstep.models import build_model
    from graphstep.models.moe import MoEBlock
    from graphstep.validation import accepted_notes

    flex = ("model.expert_model_parallel_size=2", "model.moe_token_dispatcher_type=flex")
    found = _all_rules(*flex, "model.cuda_graph_impl=full_iteration")
    assert [v.rule for v in found] == ["R11"] and "alltoall dispatcher" in found[0].message, found
    assert _all_rules(*flex, "model.cuda_graph_impl=local",
                      "model.cuda_graph_modules=[attn,moe_router,moe_preprocess]") == []
    cfg = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, seq_length=16,
                      vocab_size=64, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                      moe_token_dispatcher_type="flex")
    blocks = [b for b in build_model(cfg, "cpu").modules() if isinstance(b, MoEBlock)]
    assert blocks and {b.moe.dispatcher for b in blocks} == {"alltoall"}
    notes = accepted_notes(apply_overrides(Config(), ["model.num_moe_experts=4", "model.moe_token_dispatcher_type=flex"]))
    assert any(n.startswith("model.moe_token_dispatcher_type=flex: runs as alltoall") for n in notes), notes



def test_alltoall_dispatcher_takes_megatrons_partial_graphs_and_eager_runs():
    assert _all_rules(*ALLTOALL, "model.cuda_graph_impl=local",
                      "model.cuda_graph_modules=[attn,moe_router,moe_preprocess]") == []
    assert _all_rules(*ALLTOALL, "model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn]") == []
    assert _all_rules(*ALLTOALL, "train.global_batch_size=16", world=4) == []
    assert _all_rules(*ALLTOALL, "model.cuda_graph_impl=none") == []
    # one expert-parallel rank: nothing crosses ranks, the block is the sync-free one and captures whole
    assert _all_rules("model.moe_token_dispatcher_type=alltoall", "model.cuda_graph_impl=full_iteration", world=1) == []


def _one_rank_runs(device: str, dispatcher: str, names: tuple[str, ...]) -> dict:
    """Six SGD steps of a 2-layer MoE model per name in ``names``: ``plain`` (every expert in the block), ``eager``
    (apply_expert_parallel on a (1, 1) mesh), ``graphed`` (that step captured whole). Per run: the losses, the
    gradient buffers of the last step, the MoE blocks and the final weights by name."""
    from torch.distributed.device_mesh import init_device_mesh

    from graphstep.cuda_graph.rng import initialize_rng_tracker
    from graphstep.models import build_model
    from graphstep.models.moe import MoEBlock
    from graphstep.training.optim import GradBuffers
    from graphstep.parallel.dims import EDP, EP, TP, local_tensor
    from graphstep.parallel.expert_parallel import apply_expert_parallel
    from graphstep.training.step import TrainStep

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, seq_length=16,
                      vocab_size=64, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, hidden_dropout=0.1,
                      moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type=dispatcher)

    def make(expert_parallel: bool):
        tracker = initialize_rng_tracker(0, device)
        model = build_model(cfg, device, dtype=dtype)
        if expert_parallel == "etp":  # expert tensor parallel's partition and block, on one rank of each
            apply_expert_parallel(model, init_device_mesh(device, (1, 1, 1), mesh_dim_names=(EDP, EP, TP)))
        elif expert_parallel:
            apply_expert_parallel(model, init_device_mesh(device, (1, 1), mesh_dim_names=(EDP, EP)))
        grads = GradBuffers(model)
        train_step = TrainStep(model, grads)

        def step(batches):
            out = train_step(batches)
            with torch.no_grad():
                for local, grad in zip(grads.locals, grads.grads):
                    local.sub_(0.1 * grad.to(local.dtype))
            return out["loss"]

        return step, tracker, grads, model

    g = torch.Generator().manual_seed(5)
    data = [[{"tokens": torch.randint(0, 64, (2, 16), generator=g).to(device),
              "labels": torch.randint(0, 64, (2, 16), generator=g).to(device)} for _ in range(2)] for _ in range(6)]
    runs = {}
    for name in names:
        step, tracker, grads, model = make(expert_parallel="etp" if name.startswith("etp") else name != "plain")
        if name.endswith("graphed"):
            step = graphstep.graph_step(step, warmup_steps=2, device=device, generators=tracker.generators)
        losses = [step(b).clone() for b in data]
        weights = {n: local_tensor(p).detach().float().clone() for n, p in model.named_parameters()}
        blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
        runs[name] = (losses, [t.detach().float().clone() for t in grads.locals], blocks, weights)
    return runs


def _close(device: str) -> dict:
    return dict(rtol=2e-2, atol=2e-2) if device == "cuda" else dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_expert_parallel_block_on_one_rank_equals_the_block_and_graphs_equal_eager(one_rank_group, device):
    """apply_expert_parallel on a (1, 1) mesh: the all-gather / grouped-GEMM / reduce-scatter path, DTensor
    experts, GradBuffers and an SGD step. Its losses equal the plain block's to rounding, and the step captured
    whole equals it eagerly bit for bit (bf16 and torch._grouped_mm on an sm90+ GPU)."""
    runs = _one_rank_runs(device, "allgather", ("plain", "eager", "graphed"))
    assert all(torch.equal(a, b) for a, b in zip(runs["eager"][0], runs["graphed"][0])), runs
    assert all(torch.equal(a, b) for a, b in zip(runs["eager"][1], runs["graphed"][1]))
    torch.testing.assert_close(torch.stack(runs["eager"][0]).float(), torch.stack(runs["plain"][0]).float(),
                               **_close(device))
    assert len({float(loss) for loss in runs["eager"][0]}) == len(runs["eager"][0])  # the weights moved every step


@pytest.mark.parametrize("device", DEVICES)
def test_expert_tensor_parallel_block_on_one_rank_equals_the_block_and_graphs_equal_eager(one_rank_group, device):
    """apply_expert_parallel on an (edp, ep, tp) = (1, 1, 1) mesh: the experts as (Replicate, Shard(0), Shard(1|2))
    DTensors, linear_fc1 marked fused (gate, up) for checkpoints, the block exchanging over its token ranks. Equal
    to the plain block to rounding, captured whole equal to eager bit for bit (the multi-rank split: the 4-rank
    launch of tests/distributed/test_expert_parallel.py)."""
    from torch.distributed.tensor import Shard

    runs = _one_rank_runs(device, "allgather", ("plain", "etp", "etp_graphed"))
    assert all(torch.equal(a, b) for a, b in zip(runs["etp"][0], runs["etp_graphed"][0])), runs
    assert all(torch.equal(a, b) for a, b in zip(runs["etp"][1], runs["etp_graphed"][1]))
    torch.testing.assert_close(torch.stack(runs["etp"][0]).float(), torch.stack(runs["plain"][0]).float(),
                               **_close(device))
    experts = runs["etp"][2][0].experts.experts
    assert experts.linear_fc1.weight.placements[2] == Shard(1) and experts.linear_fc2.weight.placements[2] == Shard(2)
    assert experts.linear_fc1.fused_parts == (32, 32)
    assert len({float(loss) for loss in runs["etp"][0]}) == len(runs["etp"][0])


@pytest.mark.parametrize("device", DEVICES)
def test_alltoall_block_on_one_rank_equals_the_block(one_rank_group, device):
    """The alltoall dispatcher on a (1, 1) mesh: count exchange, host split sizes, token all-to-all there and back
    (autograd), the per-expert GEMMs on the received rows (torch._grouped_mm with offsets from the received counts
    on an sm90+ GPU in bf16), DTensor experts. Losses and gradients equal the plain block's to rounding."""
    runs = _one_rank_runs(device, "alltoall", ("plain", "eager"))
    blocks = runs["eager"][2]
    assert blocks and all(b.experts.experts.sizes_on_host and not b.sync_free for b in blocks)
    grouped = device == "cuda" and torch.cuda.get_device_capability() >= (9, 0)
    assert {b.gemm for b in blocks} == {"grouped_mm" if grouped else "loop"}
    assert not any(b.experts.experts.sizes_on_host for b in runs["plain"][2])
    torch.testing.assert_close(torch.stack(runs["eager"][0]).float(), torch.stack(runs["plain"][0]).float(),
                               **_close(device))
    eager, plain = runs["eager"][3], runs["plain"][3]
    assert eager.keys() == plain.keys() and any(".experts.experts." in n for n in eager)
    for name in eager:  # six SGD steps: every gradient went into these
        torch.testing.assert_close(eager[name], plain[name], **_close(device), msg=name)
    assert len({float(loss) for loss in runs["eager"][0]}) == len(runs["eager"][0])  # the weights moved every step


def test_alltoall_block_refuses_what_it_cannot_run(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh

    from graphstep.models.moe import MoEBlock, MoEShape
    from graphstep.models.transformer import ModelShape
    from graphstep.parallel.dims import EDP, EP
    from graphstep.parallel.expert_parallel import apply_expert_parallel

    def block(gemm: str = "auto", **kw) -> MoEBlock:
        m = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                        moe_ffn_hidden_size=32, moe_token_dispatcher_type="alltoall", **kw)
        return MoEBlock(ModelShape.from_config(m), MoEShape.from_config(m), gemm=gemm)

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=(EDP, EP))
    with pytest.raises(ValueError, match="grouped_mm or loop expert GEMM, not tiled"):
        apply_expert_parallel(block("tiled"), mesh)
    with pytest.raises(ValueError, match="model.moe_expert_capacity_factor=null"):
        apply_expert_parallel(block(moe_expert_capacity_factor=1.0), mesh)
