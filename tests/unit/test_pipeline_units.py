"""Pipeline parallel pieces in one process: the layer split, a stage's model, the layout rules R28-R30, and
torch's schedule over one stage captured whole and with per-layer graphs holding several micro-batches in
flight (cpu and cuda twins)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import graphstep
from graphstep.config import ModelConfig

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
SHAPE = dict(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=64,
             share_embeddings_and_output_weights=False)


def test_layers_split_as_bridge_splits_them():
    from graphstep.parallel.pipeline import stage_layers

    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(5, 3, first=1) == [range(0, 1), range(1, 3), range(3, 5)]
    assert stage_layers(5, 2, last=1) == [range(0, 4), range(4, 5)]
    assert stage_layers(6, 3, first=1, last=1) == [range(0, 1), range(1, 5), range(5, 6)]
    for bad in ((5, 2, None, None), (3, 4, None, None), (4, 2, 1, 1), (4, 3, 3, None)):
        with pytest.raises(ValueError, match="do not split"):
            stage_layers(*bad[:2], first=bad[2], last=bad[3])


def test_a_stage_keeps_its_layers_under_their_whole_model_names():
    from graphstep.models.transformer import GPTModel, ModelShape
    from graphstep.parallel.pipeline import keep_stage

    torch.manual_seed(0)
    whole = GPTModel(ModelShape.from_config(ModelConfig(**SHAPE)))
    torch.manual_seed(0)
    first = keep_stage(GPTModel(ModelShape.from_config(ModelConfig(**SHAPE))), range(0, 3), first=True, last=False)
    torch.manual_seed(0)
    last = keep_stage(GPTModel(ModelShape.from_config(ModelConfig(**SHAPE))), range(3, 4), first=False, last=True)
    names = dict(whole.named_parameters())
    for stage in (first, last):
        for name, p in stage.named_parameters():
            assert torch.equal(p, names[name]), name  # the whole model's weights, under its names
    assert {n for n, _ in first.named_parameters()} | {n for n, _ in last.named_parameters()} == set(names)
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(last.stage_forward(first.stage_forward(tokens)), whole.logits(tokens),
                                   rtol=0, atol=0)


def _rules(*overrides: str, world: int = 2) -> list:
    from graphstep.config import Config, apply_overrides
    from graphstep.validation import validate_config

    cfg = Config()
    apply_overrides(cfg, ["model.share_embeddings_and_output_weights=false", "model.num_layers=4",
                          "train.micro_batch_size=2", "train.global_batch_size=8", *overrides])
    return [v for v in validate_config(cfg, world_size=world) if v.rule in ("R28", "R29", "R30")]


@pytest.mark.parametrize("overrides,world,rule,words", [
    (["model.pipeline_model_parallel_size=2"], 3, "R28", "does not divide the world size 3"),
    (["model.pipeline_model_parallel_size=3"], 3, "R28", "do not split evenly"),
    (["model.pipeline_model_parallel_size=3"], 3, "R28", 'pipeline_model_parallel_layout="Et*2|t|tL"'),
    (["model.pipeline_model_parallel_size=2", "model.num_layers_in_first_pipeline_stage=0"], 2, "R28", "at least one"),
    (["model.virtual_pipeline_model_parallel_size=2"], 1, "R28", "at least 2 pipeline ranks"),
    (["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=0"], 2, "R28",
     "not a positive number"),
    (["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2",
      "model.pipeline_schedule=gpipe"], 2, "R28", "interleaved schedules are 1F1B and zero bubble"),
    (["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2",
      "train.global_batch_size=6"], 2, "R28", "not a multiple of 2"),
    (["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2",
      "model.share_embeddings_and_output_weights=true"], 2, "R28", "two chunks"),
    (["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2",
      "model.pipeline_schedule=interleaved_zero_bubble", "model.cuda_graph_impl=local", "model.use_te_rng_tracker=true",
      "model.cuda_graph_warmup_steps=2"], 2, "R28", "input and weight gradients in one replay"),
    (["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2",
      "model.pipeline_schedule=interleaved_zero_bubble", "model.cuda_graph_impl=transformer_engine",
      "model.use_te_rng_tracker=true", "model.cuda_graph_warmup_steps=2"], 2, "R28",
     "model.pipeline_schedule=interleaved_1f1b (per-layer graphs)"),
    (["model.pipeline_model_parallel_size=2", "model.pipeline_schedule=interleaved_zero_bubble"], 2, "R28",
     "each rank holds one stage"),
    (["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2",
      "model.num_layers_in_first_pipeline_stage=1", "model.num_layers=3"], 2, "R28", "virtual stages"),
    (["model.pipeline_model_parallel_size=2", "model.pipeline_model_parallel_layout=Ett|tL"], 2, "R28",
     "places 3 decoder layers"),
    (["model.pipeline_model_parallel_size=2", "model.pipeline_model_parallel_layout=Ett|ttL",
      "model.num_layers_in_first_pipeline_stage=2"], 2, "R28", "must stay unset"),
    (["model.pipeline_model_parallel_size=2", "model.pipeline_model_parallel_layout=Et|t|ttL"], 2, "R28",
     "not a multiple"),
    (["model.pipeline_model_parallel_size=2", "model.account_for_embedding_in_pipeline_split=true"], 2, "R28",
     "do not split evenly"),
    (["model.pipeline_model_parallel_size=2", "model.account_for_loss_in_pipeline_split=true",
      "model.num_layers_in_last_pipeline_stage=1"], 2, "R28", "do not combine"),
    (["model.pipeline_model_parallel_size=4", "model.share_embeddings_and_output_weights=true"], 4, "R28", "ties"),
    (["model.pipeline_model_parallel_size=2", "model.pipeline_dtype=fp32", "model.params_dtype=bf16"], 2, "R28",
     "pipeline_dtype"),
    (["model.pipeline_model_parallel_size=2", "train.global_batch_size=2"], 2, "R28", "1F1B"),
    (["model.pipeline_schedule=zb"], 1, "R28", "not a schedule"),
    (["model.pipeline_model_parallel_size=2", "model.cuda_graph_impl=full_iteration", "model.use_te_rng_tracker=true",
      "model.cuda_graph_warmup_steps=0"], 2, "R29", "shapes"),
    (["model.pipeline_model_parallel_size=2", "model.cuda_graph_impl=local", "model.use_te_rng_tracker=true",
      "model.cuda_graph_warmup_steps=1"], 2, "R29", "shape inference"),
    (["model.pipeline_model_parallel_size=2", "model.cuda_graph_retain_backward_graph=true"], 2, "R29",
     "retain_graph"),
    (["model.pipeline_model_parallel_size=2", "model.context_parallel_size=2"], 2, "R30",
     "2 pipeline-stage x 2 context-parallel ranks do not divide the world size 2"),
])
def test_pipeline_rules_refuse_with_the_reason(overrides, world, rule, words):
    found = _rules(*overrides, world=world)
    assert [v.rule for v in found] == [rule], found
    assert words in found[0].message + found[0].fix


def test_accepted_pipeline_layouts_break_no_rule():
    assert _rules("model.pipeline_model_parallel_size=2") == []
    assert _rules("model.pipeline_model_parallel_size=2", "model.pipeline_schedule=gpipe", "train.global_batch_size=2") == []
    assert _rules("model.pipeline_model_parallel_size=2", world=4) == []  # 2 pipelines
    assert _rules("model.pipeline_model_parallel_size=2", "model.share_embeddings_and_output_weights=true") == []
    assert _rules("model.pipeline_model_parallel_size=2", "model.cuda_graph_impl=local", "model.use_te_rng_tracker=true",
                  "model.cuda_graph_modules=[attn,mlp]") == []
    assert _rules("model.pipeline_model_parallel_size=3", "model.num_layers=5", "model.num_layers_in_first_pipeline_"
                  "stage=1", "model.num_layers_in_last_pipeline_stage=2", world=3) == []
    vpp = ["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2"]
    assert _rules(*vpp) == []
    assert _rules(*vpp, "model.pipeline_schedule=interleaved_zero_bubble") == []
    assert _rules(*vpp, "model.pipeline_schedule=interleaved_1f1b", "model.cuda_graph_impl=full_iteration",
                  "model.use_te_rng_tracker=true") == []
    assert _rules(*vpp, "model.pipeline_schedule=interleaved_zero_bubble", "model.cuda_graph_impl=full_iteration",
                  "model.use_te_rng_tracker=true") == []
    # per-layer graphs over virtual stages under interleaved 1F1B (tests/distributed/test_interleaved.py)
    for impl in ("local", "transformer_engine"):
        for schedule in ("1f1b", "interleaved_1f1b"):
            assert _rules(*vpp, f"model.pipeline_schedule={schedule}", f"model.cuda_graph_impl={impl}",
                          "model.cuda_graph_modules=[attn,mlp]", "model.use_te_rng_tracker=true",
                          "model.cuda_graph_warmup_steps=2") == []
    assert _rules("model.pipeline_model_parallel_size=2", "model.pipeline_model_parallel_layout=Et|t|t|tL") == []
    assert _rules("model.pipeline_model_parallel_size=2", "model.pipeline_model_parallel_layout=Ett|ttL") == []
    assert _rules(*vpp, "model.num_layers=6", "model.account_for_embedding_in_pipeline_split=true",
                  "model.account_for_loss_in_pipeline_split=true") == []
    assert _rules("model.pipeline_model_parallel_layout=EttttL", world=1) == []
    # virtual stages over tensor + sequence parallel, FSDP2 ZeRO-3 and ZeRO-2 (tests/distributed/test_pipeline.py),
    # and over both together (tests/distributed/test_pipeline_3d.py: the distributed optimizer)
    tp_sp = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
    assert _rules(*vpp, *tp_sp, world=4) == []
    for fsdp in (["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"],
                 ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads"],
                 ["ddp.use_distributed_optimizer=true"]):
        assert _rules(*vpp, *fsdp, "train.global_batch_size=16", world=4) == []
        assert _rules(*vpp, *tp_sp, *fsdp, "train.global_batch_size=16", world=8) == []
    # MoE and hybrid models (tests/distributed/test_interleaved.py)
    assert _rules(*vpp, "model.num_moe_experts=4", "model.moe_router_topk=2") == []
    assert _rules(*vpp, "model.hybrid_override_pattern=M-*-") == []
    # and activation recompute (tests/distributed/test_interleaved.py), under either interleaved schedule
    for schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        assert _rules(*vpp, f"model.pipeline_schedule={schedule}", "model.recompute_granularity=full",
                      "model.attention_dropout=0.0", "model.hidden_dropout=0.0") == []
        assert _rules(*vpp, f"model.pipeline_schedule={schedule}", "model.recompute_granularity=selective",
                      "model.recompute_modules=[core_attn]", "model.attention_dropout=0.0") == []


@pytest.mark.parametrize("overrides,world", [
    (["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"], 4),
    (["model.tensor_model_parallel_size=2", "model.share_embeddings_and_output_weights=true"], 4),
    (["ddp.use_distributed_optimizer=true"], 4),
    (["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"], 4),
    (["model.tensor_model_parallel_size=2", "ddp.use_megatron_fsdp=true",
      "ddp.data_parallel_sharding_strategy=optim_grads_params", "train.global_batch_size=16"], 8),
    (["model.num_moe_experts=4", "model.moe_router_topk=2"], 2),
    (["model.hybrid_override_pattern=M-*-"], 2),
    (["model.recompute_granularity=selective", "model.recompute_modules=[core_attn]", "model.attention_dropout=0.0"], 2),
    (["model.recompute_granularity=full", "model.attention_dropout=0.0", "model.hidden_dropout=0.0"], 2),
    (["ddp.overlap_grad_reduce=true"], 4),
])
def test_pipeline_stages_combine_with_parallel_layouts_moe_hybrid_recompute_and_overlap(overrides, world):
    """No layout rule refuses these (the graphed runs are in tests/distributed/test_pipeline.py)."""
    assert _rules("model.pipeline_model_parallel_size=2", *overrides, world=world) == []


@pytest.mark.parametrize("world,rank,expected", [(2, 1, (1, 0, 0)), (4, 1, (0, 1, 0)), (4, 2, (1, 0, 0)),
                                                 (4, 3, (1, 1, 0))])
def test_a_rank_finds_its_stage_and_replica(world, rank, expected):
    from graphstep.training.distributed import DataParallel
    from graphstep.parallel.dims import ParallelDims

    dp = DataParallel(rank=rank, world_size=world, layout=ParallelDims(dp_replicate=world // 2, pp=2))
    assert (dp.pp_rank, dp.dp_rank, dp.tp_rank) == expected
    assert dp.dp_size == world // 2
    assert "2 pipeline-stage x" in dp.layout.describe()


def _sgd_one_stage(model, device: str, schedule: str):
    """``model`` as the one stage of torch's ``schedule`` over 3 micro-batches, trained by PipelineTrainStep on
    graphstep's gradient buffers with a plain SGD update: batches -> loss."""
    from graphstep.training.optim import GradBuffers
    from graphstep.parallel.pipeline import Pipeline
    from graphstep.training.step import PipelineTrainStep

    grads = GradBuffers(model)
    pipe = Pipeline(model, stage_index=0, stages=1, group=dist.group.WORLD, device=torch.device(device),
                    schedule=schedule, num_micro_batches=3)
    train_step = PipelineTrainStep(pipe, grads)

    def step(batches):
        out = train_step(batches)
        with torch.no_grad():
            torch._foreach_add_([p.data for p in grads.params], grads.grads, alpha=-0.1)
        return out["loss"]

    return step


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_one_stage_schedule_captured_whole_equals_eager(one_rank_group, device, schedule):
    """torch's schedule over one stage (no sends): PipelineTrainStep with GradBuffers and an SGD update, 3
    micro-batches with loss masks, dropout from the tracker, captured as one graph: losses and weights bit-equal
    to eager."""
    from graphstep.cuda_graph.rng import initialize_rng_tracker
    from graphstep.models.transformer import GPTModel, ModelShape

    def make():
        tracker = initialize_rng_tracker(0, device)
        model = GPTModel(ModelShape.from_config(ModelConfig(**SHAPE, hidden_dropout=0.1, attention_dropout=0.1)))
        model.to(device).train()
        return model, _sgd_one_stage(model, device, schedule), tracker

    g = torch.Generator().manual_seed(5)
    data = [[{"tokens": torch.randint(0, 64, (2, 16), generator=g).to(device),
              "labels": torch.randint(0, 64, (2, 16), generator=g).to(device),
              "loss_mask": (torch.rand(2, 16, generator=g) > 0.2).float().to(device)} for _ in range(3)]
            for _ in range(6)]
    runs = {}
    for name in ("eager", "graphed"):
        model, step, tracker = make()
        if name == "graphed":
            step = graphstep.graph_step(step, warmup_steps=2, device=device, generators=tracker.generators)
        losses = [step(batches).clone() for batches in data]
        runs[name] = (losses, [p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(runs["eager"][0], runs["graphed"][0])), runs
    assert all(torch.equal(a, b) for a, b in zip(runs["eager"][1], runs["graphed"][1]))
    assert runs["eager"][0][-1] < runs["eager"][0][0]


@pytest.mark.parametrize("device", DEVICES)
def test_a_stage_set_up_again_on_resume_draws_no_dropout_masks(one_rank_group, device):
    """A resume in one process: a new stage and schedule over the weights and RNG streams an uninterrupted stage
    had after step 2 continue exactly as it does -- steps 3 and 4 bit-equal, losses and weights. torch sets the
    new stage up on its first step with a real forward (dropout on); were that forward to draw from the tracker's
    streams, every step after a resume would differ from the uninterrupted run."""
    from graphstep.cuda_graph.rng import get_rng_tracker, initialize_rng_tracker
    from graphstep.models.transformer import GPTModel, ModelShape

    def generators() -> list[torch.Generator]:
        defaults = [torch.default_generator] + ([torch.cuda.default_generators[0]] if device == "cuda" else [])
        return get_rng_tracker().generators() + defaults

    g = torch.Generator().manual_seed(5)
    data = [[{"tokens": torch.randint(0, 64, (2, 16), generator=g).to(device),
              "labels": torch.randint(0, 64, (2, 16), generator=g).to(device)} for _ in range(3)]
            for _ in range(4)]
    shape = ModelShape.from_config(ModelConfig(**SHAPE, hidden_dropout=0.1, attention_dropout=0.1))
    initialize_rng_tracker(0, device)
    model = GPTModel(shape).to(device).train()
    resumed_model = GPTModel(shape).to(device).train()
    step = _sgd_one_stage(model, device, "1f1b")
    losses = [step(batches).clone() for batches in data[:2]]
    saved = [p.detach().clone() for p in model.parameters()], [gen.get_state() for gen in generators()]
    losses += [step(batches).clone() for batches in data[2:]]

    with torch.no_grad():  # what a checkpoint load does: weights and every generator's state, in place
        for p, w in zip(resumed_model.parameters(), saved[0]):
            p.copy_(w)
    for gen, state in zip(generators(), saved[1]):
        gen.set_state(state)
    resumed_step = _sgd_one_stage(resumed_model, device, "1f1b")
    resumed = [resumed_step(batches).clone() for batches in data[2:]]
    assert all(torch.equal(a, b) for a, b in zip(losses[2:], resumed)), (losses, resumed)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed_model.parameters()))


@pytest.mark.parametrize("schedule,slots", [("gpipe", 3), ("1f1b", 1)])
@pytest.mark.parametrize("device", DEVICES)
def test_per_layer_graphs_hold_every_micro_batch_in_flight(one_rank_group, device, schedule, slots):
    """Per-layer attn and mlp graphs under torch's schedule over one stage. GPipe runs the 3 forwards of a step
    before their backwards: the warm-up counts 3 micro-batches in flight, capture makes 3 slots of graphs, and
    micro-batch i replays slot i; 1F1B over one stage keeps one in flight (one slot). Losses and weights equal
    eager bit for bit."""
    from graphstep.cuda_graph.layers import LayerGraphs, select_modules
    from graphstep.cuda_graph.registry import get_backend
    from graphstep.cuda_graph.rng import initialize_rng_tracker
    from graphstep.models.transformer import GPTModel, ModelShape

    def make(graphed: bool):
        tracker = initialize_rng_tracker(0, device)
        model = GPTModel(ModelShape.from_config(ModelConfig(**SHAPE, hidden_dropout=0.1, attention_dropout=0.1)))
        model.to(device).train()
        layers = LayerGraphs(select_modules(model, ["attn", "mlp"]), get_backend(device),
                             generators=tracker.generators) if graphed else None
        train = _sgd_one_stage(model, device, schedule)

        def step(i, batches):
            if layers is not None:
                if i == 2:
                    layers.capture()
                layers.start_step()
            return train(batches)

        return model, step, layers

    g = torch.Generator().manual_seed(5)
    data = [[{"tokens": torch.randint(0, 64, (2, 16), generator=g).to(device),
              "labels": torch.randint(0, 64, (2, 16), generator=g).to(device)} for _ in range(3)]
            for _ in range(6)]
    runs = {}
    for graphed in (False, True):
        model, step, layers = make(graphed)
        losses = [step(i, batches).clone() for i, batches in enumerate(data)]
        runs[graphed] = (losses, [p.detach().clone() for p in model.parameters()])
    assert layers.captured and len(layers.slots) == slots and layers.state == "replayed"
    assert all(torch.equal(a, b) for a, b in zip(runs[False][0], runs[True][0])), runs
    assert all(torch.equal(a, b) for a, b in zip(runs[False][1], runs[True][1]))


# an interleaved order of two chunks over 4 micro-batches, in the manner of interleaved 1F1B's warm-up: chunk A's
# forwards of micro-batches 0 and 1, then chunk B's of the same two; A runs all 4 forwards before its first backward
INTERLEAVED = ["FA0", "FA1", "FB0", "FB1", "FA2", "BB0", "FA3", "BB1", "BA0", "FB2", "BA1", "FB3", "BB2", "BA2", "BB3",
               "BA3"]


@pytest.mark.parametrize("device", DEVICES)
def test_layer_graph_chains_count_their_own_micro_batches(device):
    """Per-layer attn and mlp graphs over two chunks of one model (layers 0-1 and 2-3, the second fed the first's
    detached output as a pipeline receive would), run in INTERLEAVED's order with dropout, gradients in graphstep's
    buffers: each chunk is a chain of its own, so its micro-batch i replays slot i mod 4 (chunk A holds 4 in
    flight, B 2); losses and weights equal eager bit for bit. Counted from the first module alone, chunk B's
    micro-batches 0 and 1 would both replay the slot of chunk A's micro-batch 1."""
    import torch.nn.functional as F

    from graphstep.cuda_graph.errors import GraphUsageError
    from graphstep.cuda_graph.layers import LayerGraphs, select_modules
    from graphstep.cuda_graph.registry import get_backend
    from graphstep.cuda_graph.rng import initialize_rng_tracker
    from graphstep.models.transformer import GPTModel, ModelShape
    from graphstep.training.optim import GradBuffers

    g = torch.Generator().manual_seed(5)
    data = [[tuple(torch.randint(0, 64, (2, 16), generator=g).to(device) for _ in range(2)) for _ in range(4)]
            for _ in range(4)]  # 4 steps of 4 micro-batches: (tokens, labels)

    made: list[LayerGraphs] = []  # closed at the end: the backend is the process's

    def run(graphed: bool, chains: list[int] | None = None) -> tuple[list, list]:
        tracker = initialize_rng_tracker(0, device)
        model = GPTModel(ModelShape.from_config(ModelConfig(**SHAPE, hidden_dropout=0.1, attention_dropout=0.1)))
        model.to(device).train()
        grads = GradBuffers(model)
        layers = LayerGraphs(select_modules(model, ["attn", "mlp"]), get_backend(device), generators=tracker.generators,
                             chains=chains) if graphed else None
        made.extend([layers] if layers is not None else [])
        losses = []
        for i, batches in enumerate(data):
            if layers is not None:
                if i == 2:
                    layers.capture()
                layers.start_step()
            grads.zero()
            held, total = {}, torch.zeros((), device=device)
            for op in INTERLEAVED:
                mb = int(op[2])
                tokens, labels = batches[mb]
                if op.startswith("FA"):
                    h = model.embedding(tokens)
                    for layer in model.layers[:2]:
                        h = layer(h)
                    held[op] = h
                elif op.startswith("FB"):
                    x = held[f"FA{mb}"].detach().requires_grad_()
                    h = x
                    for layer in model.layers[2:]:
                        h = layer(h)
                    logits = F.linear(model.final_layernorm(h), model.output_layer.weight)
                    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten()) / len(batches)
                    held[op] = (x, loss)
                    total += loss.detach()
                elif op.startswith("BB"):
                    held[f"FB{mb}"][1].backward()
                else:
                    held[f"FA{mb}"].backward(held[f"FB{mb}"][0].grad)
            with torch.no_grad():
                torch._foreach_add_([p.data for p in grads.params], grads.grads, alpha=-0.1)
            losses.append(total)
        if layers is not None:
            assert layers.captured and len(layers.slots) == 4 and layers.state == "replayed"
            assert "2 chains" in layers.describe()
        return losses, [p.detach().clone() for p in model.parameters()]

    eager = run(False)
    graphed = run(True, [0] * 4 + [1] * 4)  # attn and mlp of layers 0 and 1, then of layers 2 and 3
    assert all(torch.equal(a, b) for a, b in zip(eager[0], graphed[0])), (eager[0], graphed[0])
    assert all(torch.equal(a, b) for a, b in zip(eager[1], graphed[1]))
    try:
        with pytest.raises(GraphUsageError, match="before the backward of the previous call"):
            run(True)  # one chain: chunk B's micro-batch 1 replays the slot its micro-batch 0 still holds
    finally:
        for layers in made:
            layers.close()


def test_library_layer_graphs_with_marked_steps_capture_at_a_step_start():
    """graphstep.graph_layers with start_step() before each step: all forwards of a step, then one backward (3
    micro-batches in flight). The capture happens at the first step start after warmup_steps forwards, with 3
    sets of graphs; losses and weights equal eager bit for bit."""
    from graphstep.models.transformer import GPTModel, ModelShape

    def make(graphed: bool):
        torch.manual_seed(0)
        model = GPTModel(ModelShape.from_config(ModelConfig(**SHAPE)))
        layers = graphstep.graph_layers(model, ["layers.*.blocks.attn", "layers.*.blocks.mlp"], warmup_steps=6,
                                        backend="replay") if graphed else None
        params = list(model.parameters())

        def step(batches):
            if layers is not None:
                layers.start_step()
            losses = [model(t, t) for t in batches]
            (sum(losses) / len(losses)).backward()
            with torch.no_grad():
                for p in params:
                    p.sub_(0.1 * p.grad)
                    p.grad = None
            return torch.stack([loss.detach() for loss in losses])

        return model, step, layers

    g = torch.Generator().manual_seed(3)
    data = [[torch.randint(0, 64, (2, 16), generator=g) for _ in range(3)] for _ in range(5)]
    runs = []
    for graphed in (False, True):
        model, step, layers = make(graphed)
        runs.append(([step(b) for b in data], [p.detach().clone() for p in model.parameters()]))
        if graphed:
            assert layers.captured and len(layers.slots) == 3 and layers.state == "replayed"
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    graphstep.close_all()
