"""Context parallel in one process: which tokens a rank holds (data/context_parallel.py), the attention and loss of
a rank's chunks against the whole sequence's (parallel/context_parallel.py, the collectives stood in for), and
rule R30. tests/distributed/test_context_parallel.py runs it over gloo ranks."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from graphstep.data.context_parallel import context_parallel_positions, context_parallel_shard


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_each_rank_holds_a_chunk_and_its_mirror_and_the_ranks_hold_every_token_once(cp):
    seq, chunk = 16, 16 // (2 * cp)
    held = [context_parallel_positions(seq, r, cp) for r in range(cp)]
    assert torch.equal(torch.cat(held).sort().values, torch.arange(seq))
    for r, positions in enumerate(held):
        mirror = 2 * cp - 1 - r
        assert positions.tolist() == [*range(r * chunk, (r + 1) * chunk), *range(mirror * chunk, (mirror + 1) * chunk)]
    # load balance: every rank's queries see as many causal keys (positions <= their own) as the others'
    assert len({int((positions + 1).sum()) for positions in held}) == 1


def test_a_sequence_that_does_not_cut_into_equal_chunks_is_refused():
    with pytest.raises(ValueError, match="2 x 4 equal chunks"):
        context_parallel_positions(12, 0, 4)
    with pytest.raises(ValueError, match="cp_rank=2 is not a rank"):
        context_parallel_positions(16, 2, 2)


def test_a_micro_batch_is_cut_into_the_rank_s_chunks_of_every_sequence():
    tokens = torch.arange(2 * 8).view(2, 8)
    batch = {"tokens": tokens, "labels": tokens + 100, "loss_mask": tokens.float()}
    assert context_parallel_shard(batch, 0, 1) is batch
    rank1 = context_parallel_shard(batch, 1, 2)
    assert rank1["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert torch.equal(rank1["labels"], rank1["tokens"] + 100) and torch.equal(rank1["loss_mask"],
                                                                               rank1["tokens"].float())
    with pytest.raises(ValueError, match="cu_seqlens"):
        context_parallel_shard({**batch, "cu_seqlens": torch.zeros(2, 2)}, 0, 2)


def test_the_loader_gives_each_context_parallel_rank_its_chunks_of_the_data_parallel_rank_s_samples():
    from graphstep.data.loader import build_data
    from helpers.runs import tiny_config

    cfg = tiny_config()
    whole = next(build_data(cfg, dp_rank=1, dp_size=2))
    for r in range(2):
        part = next(build_data(cfg, dp_rank=1, dp_size=2, cp_rank=r, cp_size=2))
        index = context_parallel_positions(cfg.model.seq_length, r, 2)
        assert part["tokens"].shape == (cfg.train.micro_batch_size, cfg.model.seq_length // 2)
        assert all(torch.equal(part[k], whole[k][:, index]) for k in whole)


class _Exchange:
    """The context-parallel ranks as threads of one process: ``all(rank, t)`` is every rank's ``t``, in rank order
    (what the all-gather and the count all-reduce exchange)."""

    def __init__(self, size: int) -> None:
        self.size, self.slots, self.barrier = size, [None] * size, threading.Barrier(size)

    def all(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = t
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody writes the next exchange's slot before everyone has read this one
        return out


def _stand_in(rank: int, exchange: _Exchange):
    from graphstep.parallel.context_parallel import ContextParallel

    class StandIn(ContextParallel):
        def gather_kv(self, k, v):
            kvs = exchange.all(rank, (k, v))
            return torch.cat([kv[0] for kv in kvs], 2), torch.cat([kv[1] for kv in kvs], 2)

    return StandIn((exchange, rank), rank, exchange.size)


def _fake_all_reduce(t, op=None, group=None):
    exchange, rank = group
    t.copy_(sum(exchange.all(rank, t.clone())))


def _run_ranks(model, cp: int, tokens, labels, loss_mask):
    """Every rank's forward (logits, and loss with ``labels``) on its chunks, in threads that meet in attention."""
    from graphstep.models.transformer import Attention

    exchange, seq = _Exchange(cp), tokens.shape[-1]
    out: list = [None] * cp

    def rank_main(r: int) -> None:
        index = context_parallel_positions(seq, r, cp)
        replica = copy.deepcopy(model)
        cp_rank = _stand_in(r, exchange)
        replica.context = cp_rank  # what apply_context_parallel sets, without a device mesh
        for module in replica.modules():
            if isinstance(module, Attention):
                module.context = cp_rank
        out[r] = (replica(tokens[:, index]), replica(tokens[:, index], labels[:, index], loss_mask[:, index]))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_each_rank_s_logits_and_loss_share_are_the_whole_sequence_s(cp, monkeypatch):
    """Rotary positions, the gathered keys' causal mask and grouped-query heads over 2 layers: a rank's chunks give
    the logits the whole sequence gives at the rank's positions, and the ranks' losses average to the whole
    sequence's mean token loss under an uneven loss mask (to float tolerance: other sums)."""
    from graphstep.models import build_model
    from graphstep.parallel import context_parallel
    from helpers.runs import tiny_config

    monkeypatch.setattr(context_parallel.dist, "all_reduce", _fake_all_reduce)
    torch.manual_seed(0)
    cfg = tiny_config("model.attention_dropout=0.0", "model.hidden_dropout=0.0")
    model = build_model(cfg.model, "cpu").eval()
    seq = cfg.model.seq_length
    tokens, labels = (torch.randint(0, cfg.model.vocab_size, (2, seq)) for _ in range(2))
    loss_mask = (torch.rand(2, seq) < 0.6).float()  # the ranks hold different numbers of counted tokens
    with torch.no_grad():
        whole_logits, whole_loss = model(tokens), model(tokens, labels, loss_mask)
        ranks = _run_ranks(model, cp, tokens, labels, loss_mask)
    for r, (logits, _) in enumerate(ranks):
        torch.testing.assert_close(logits, whole_logits[:, context_parallel_positions(seq, r, cp)],
                                   rtol=1e-5, atol=1e-5)
    shares = torch.stack([loss for _, loss in ranks])
    assert not torch.allclose(shares, shares.mean())  # each rank's share differs: its tokens and mask differ
    torch.testing.assert_close(shares.mean(), whole_loss, rtol=1e-6, atol=0)


def _rules(*overrides: str, world: int = 4) -> list:
    from graphstep.validation import validate_config
    from helpers.runs import graph_config

    cfg = graph_config("train.micro_batch_size=1", "train.global_batch_size=8", "model.seq_length=64", *overrides)
    return [v for v in validate_config(cfg, world_size=world) if v.rule not in ("R35",)]


@pytest.mark.parametrize("overrides,world,words,fix", [
    (["model.context_parallel_size=0"], 4, "not a positive number", "context_parallel_size=1"),
    (["model.context_parallel_size=3", "model.seq_length=66"], 4, "do not divide the world size 4", "multiple of 3"),
    (["model.context_parallel_size=2", "model.tensor_model_parallel_size=2"], 2,
     "2 context-parallel x 2 tensor-parallel ranks do not divide the world size 2", "multiple of 4"),
    (["model.context_parallel_size=2", "model.seq_length=66"], 4, "2 x 2 equal chunks", "multiple of 4"),
    (["model.context_parallel_size=2", "model.tensor_model_parallel_size=4", "model.sequence_parallel=true",
      "model.seq_length=68"], 8, "34 tokens", "multiple of 16"),
    (["model.context_parallel_size=2", "model.cp_comm_type=p2p"], 4, "ring attention", "cp_comm_type=all_gather"),
    (["model.context_parallel_size=2", "model.cp_comm_type=[a2a,all_gather]"], 4, "mixes a2a", "cp_comm_type=a2a"),
    (["model.context_parallel_size=2", "model.cp_comm_type=a2a", "model.num_attention_heads=6",
      "model.num_query_groups=3", "model.hidden_size=96"], 4, "do not both divide by 1 tensor-parallel x 2",
     "cp_comm_type=all_gather"),
    (["model.context_parallel_size=2", "model.cp_comm_type=a2a+p2p"], 4, "hierarchical", "all_gather"),
    (["model.cp_comm_type=ring"], 4, "not a context-parallel communication type", "all_gather"),
    (["model.context_parallel_size=2", "model.pipeline_model_parallel_size=2", "model.tensor_model_parallel_size=2"],
     4, "2 pipeline-stage x 2 context-parallel x 2 tensor-parallel ranks do not divide the world size 4",
     "multiple of 8"),
    # a hybrid model's Mamba layers: whole sequences of 1 / cp of the heads (and whole groups, or a shared one)
    (["model.context_parallel_size=3", "model.seq_length=66", "model.hybrid_override_pattern=M-M-",
      "model.num_layers=4"], 6, "the 8 Mamba heads", "multiple of 3"),
    (["model.context_parallel_size=6", "model.seq_length=72", "model.hybrid_override_pattern=M-M-",
      "model.num_layers=4", "model.hidden_size=48", "model.kv_channels=12", "model.mamba_head_dim=8",
      "model.mamba_num_groups=4"], 6, "(model.mamba_num_groups=4) and the 6 context-parallel ranks", "multiple of 6"),
    (["model.context_parallel_size=2", "data.seq_length_buckets=[32,64]"], 4, "seq_length_buckets",
     "data.seq_length_buckets=null"),
])
def test_rule_r30_refuses_what_context_parallel_does_not_do_with_the_reason_and_fix(overrides, world, words, fix):
    found = [v for v in _rules(*overrides, world=world) if v.rule == "R30"]
    assert len(found) == 1, found
    assert words in found[0].message and fix in found[0].fix, found[0]
    assert found[0].fix.startswith(("set ", "launch ")), found[0]


@pytest.mark.parametrize("overrides,world", [
    (["model.context_parallel_size=2"], 2),
    (["model.context_parallel_size=2", "model.cp_comm_type=all_gather"], 4),
    (["model.context_parallel_size=2", "model.cp_comm_type=[all_gather,all_gather]"], 4),
    (["model.context_parallel_size=2", "model.cp_comm_type=a2a"], 4),  # Ulysses
    (["model.context_parallel_size=2", "model.cp_comm_type=a2a", "model.tensor_model_parallel_size=2",
      "model.sequence_parallel=true"], 4),
    (["model.cp_comm_type=p2p"], 4),  # Megatron's default name, harmless without context parallel
    (["model.context_parallel_size=2", "model.tensor_model_parallel_size=2", "model.sequence_parallel=true"], 4),
    (["model.context_parallel_size=2", "ddp.use_megatron_fsdp=true",
      "ddp.data_parallel_sharding_strategy=optim_grads_params", "model.cuda_graph_impl=full_iteration"], 4),
    (["model.context_parallel_size=2", "model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"], 4),
    (["model.context_parallel_size=4", "model.recompute_granularity=full", "model.cuda_graph_impl=full_iteration",
      "model.attention_dropout=0.0", "model.hidden_dropout=0.0"], 4),
    # an MoE model, alone and over stages (its token counts summed over the stage's ranks)
    (["model.context_parallel_size=2", "model.num_moe_experts=4", "model.moe_ffn_hidden_size=64"], 4),
    (["model.context_parallel_size=2", "model.num_moe_experts=4", "model.moe_ffn_hidden_size=64",
      "model.pipeline_model_parallel_size=2", "model.cuda_graph_impl=full_iteration"], 4),
    # an MoE model with expert parallel over the data-parallel ranks of each context-parallel rank, replicated or
    # over FSDP2
    (["model.context_parallel_size=2", "model.num_moe_experts=4", "model.moe_ffn_hidden_size=64",
      "model.expert_model_parallel_size=2", "model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,moe]"], 4),
    (["model.context_parallel_size=2", "model.num_moe_experts=4", "model.moe_ffn_hidden_size=64",
      "model.expert_model_parallel_size=2", "ddp.use_megatron_fsdp=true",
      "ddp.data_parallel_sharding_strategy=optim_grads_params", "model.cuda_graph_impl=full_iteration"], 4),
    # a hybrid model: the Mamba heads split over the ranks, B and C of one group shared (cp2), or whole groups
    (["model.context_parallel_size=2", "model.hybrid_override_pattern=M-*-", "model.num_layers=4",
      "model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp,mamba]"], 4),
    (["model.context_parallel_size=2", "model.hybrid_override_pattern=M-*-", "model.num_layers=4",
      "model.mamba_num_groups=4", "model.pipeline_model_parallel_size=2", "model.cuda_graph_impl=full_iteration"], 4),
    # over pipeline stages: plain, per-layer graphs (warmed up for 2 iterations: R29), FSDP2, and virtual stages
    # with tensor + sequence parallel (Megatron Bridge's Llama 3 70B layout in small)
    (["model.context_parallel_size=2", "model.pipeline_model_parallel_size=2",
      "model.share_embeddings_and_output_weights=true"], 4),
    (["model.context_parallel_size=2", "model.pipeline_model_parallel_size=2", "model.cuda_graph_impl=local",
      "model.cuda_graph_modules=[attn,mlp]", "model.cuda_graph_warmup_steps=2"], 4),
    (["model.context_parallel_size=2", "model.pipeline_model_parallel_size=2", "ddp.use_megatron_fsdp=true",
      "ddp.data_parallel_sharding_strategy=optim_grads_params", "model.cuda_graph_impl=full_iteration"], 8),
    (["model.context_parallel_size=2", "model.pipeline_model_parallel_size=2", "model.num_layers=4",
      "model.virtual_pipeline_model_parallel_size=2", "model.tensor_model_parallel_size=2",
      "model.sequence_parallel=true", "model.share_embeddings_and_output_weights=false",
      "model.cuda_graph_impl=full_iteration"], 8),
])
def test_context_parallel_layouts_that_work_break_no_rule(overrides, world):
    assert _rules(*overrides, world=world) == []


def test_context_parallel_ranks_read_the_data_of_their_data_parallel_rank():
    """V13 counts data-parallel ranks without the context-parallel ones: 8 ranks of cp2 x tp2 are 2 replicas."""
    found = _rules("model.context_parallel_size=2", "model.tensor_model_parallel_size=2", "train.global_batch_size=3",
                   world=8)
    assert [v.rule for v in found] == ["V13"] and "x 2 data-parallel rank(s)" in found[0].message


def test_over_pipeline_stages_the_last_stage_s_loss_is_context_parallel_s_and_chunks_keep_the_context():
    """The schedule's loss function on the last stage computes ``ContextParallel.loss`` for the step's micro-batches
    (their loss masks, in order) and a plain token loss for torch's shape-inference call on a copy of the labels
    (no collective there); the views that run an interleaved rank's chunks keep ``context`` on the view and share
    the attention modules that hold it."""
    from graphstep.config import apply_overrides
    from graphstep.models import build_model
    from graphstep.models.transformer import Attention, token_loss
    from graphstep.parallel.context_parallel import ContextParallel
    from graphstep.parallel.interleaved import chunk_view
    from graphstep.parallel.pipeline import _StageLoss, model_chunks, split_stage
    from helpers.runs import tiny_config

    class Doubled(ContextParallel):  # a loss told apart from the token loss, without a process group
        def loss(self, logits, labels, loss_mask):
            return 2 * token_loss(logits, labels, loss_mask)

    cp = Doubled(None, 0, 2)
    torch.manual_seed(0)
    logits, labels = torch.randn(4, 8, 16), torch.randint(0, 16, (4, 8))
    mask = (torch.rand(4, 8) < 0.6).float()
    total, stage_loss = torch.zeros(()), _StageLoss(cp)
    stage_loss.start([{"loss_mask": mask[:2]}, {"loss_mask": mask[2:]}], labels, total, 2)
    shape_inference = stage_loss(logits[:2], labels[:2].clone())
    assert torch.equal(shape_inference, token_loss(logits[:2], labels[:2])) and stage_loss.index == 0
    halves = [stage_loss(logits[i:i + 2], labels[i:i + 2]) for i in (0, 2)]
    expected = [2 * token_loss(logits[i:i + 2], labels[i:i + 2], mask[i:i + 2]) for i in (0, 2)]
    assert all(torch.equal(h, e / 2) for h, e in zip(halves, expected)) and stage_loss.index == 2
    assert torch.equal(total, expected[0] + expected[1])

    cfg = apply_overrides(tiny_config(), ["model.num_layers=4", "model.pipeline_model_parallel_size=2",
                                          "model.virtual_pipeline_model_parallel_size=2"])
    model = split_stage(build_model(cfg.model, "cpu"), cfg.model, 2, 0)
    model.context = cp  # what apply_context_parallel sets, without a device mesh
    attentions = [module for module in model.modules() if isinstance(module, Attention)]
    for module in attentions:
        module.context = cp
    views = [chunk_view(model, c) for c in model_chunks(cfg.model, 2) if c.index % 2 == 0]
    assert len(views) == 2 and all(view.context is cp for view in views)
    held = [module for view in views for module in view.modules() if isinstance(module, Attention)]
    assert len(held) == len(attentions) == 2 and all(module.context is cp for module in held)
    assert {id(module) for module in held} == {id(module) for module in attentions}
