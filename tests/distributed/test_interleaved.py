"""Interleaved pipelines (virtual stages) and Bridge's stage-split fields under torchrun: graphed equals eager.

One torchrun launch of 2 gloo ranks runs ``layouts_worker``: each layout of
``LAYOUTS`` eagerly and with the full-iteration graph (the whole interleaved
schedule, sends and receives included, in one graph per rank; the optimizer
and evaluation graphs too), the layouts of ``PER_LAYER`` with per-layer
graphs (each chunk's layers graphed, sends and receives eager), and with
dropout off the interleaved pipeline and the one-stage-per-rank pipeline of
the same model. Each rank writes per
run the per-iteration losses, the evaluation losses, a digest of the
parameters it holds and their names, and every send and receive the
schedules posted (``_batch_p2p``) with the process group it went on. The
graphed ``vpp2`` run (dropout on) saves at iteration 2, and a run resumes
from there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.launch import report_runs, torchrun_reports
from helpers.reports import assert_graphed_equals_eager, graphed_states, train_report

pytestmark = pytest.mark.slow

ITERS = 4
# iterations: 1 eager, 2 captured, 3 and 4 replayed; evaluations at 2 and 4: the evaluation graph warms up at 2
# and is captured (and replayed) at 4
COMMON = [f"train.train_iters={ITERS}", "logger.log_interval=1", "model.cuda_graph_warmup_steps=1",
          "train.eval_iters=2", "train.eval_interval=2", "model.use_te_rng_tracker=true",
          "model.share_embeddings_and_output_weights=false", "model.pipeline_model_parallel_size=2"]
GRAPHED = ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"]
EAGER = ["model.cuda_graph_impl=none"]
NO_DROPOUT = ["model.attention_dropout=0.0", "model.hidden_dropout=0.0"]
MODEL_DATA = ["model.seq_length=32", "data.corpus_max_bytes=300000", "data.split=90,10,0",
              "train.micro_batch_size=2", "train.global_batch_size=8"]  # the MoE and hybrid recipes, as TINY
LAYOUTS = {  # 2 ranks x 2 virtual stages = 4 chunks; rank 0 holds chunks 0 and 2, rank 1 chunks 1 and 3
    "vpp2": ["model.num_layers=4", "model.virtual_pipeline_model_parallel_size=2"],
    "vpp2_zero_bubble": ["model.num_layers=4", "model.virtual_pipeline_model_parallel_size=2",
                         "model.pipeline_schedule=interleaved_zero_bubble"],
    # Bridge's layout string: 4 stages (so 2 virtual stages per rank), the last holding only the loss
    "layout": ["model.num_layers=4", "model.pipeline_model_parallel_layout=Ett|t|t|L"],
    # 2 layers + the embedding + the loss counted as layers: one each over the 4 chunks
    "account": ["model.num_layers=2", "model.virtual_pipeline_model_parallel_size=2",
                "model.account_for_embedding_in_pipeline_split=true", "model.account_for_loss_in_pipeline_split=true"],
    # an MoE model (qwen3_moe_tiny, 4 MoE layers: aux loss, its router statistics in every chunk) and a hybrid one
    # (nemotron_h_tiny's M-*E: Mamba and attention on rank 0, MLP and MoE on rank 1) over the 4 chunks
    "vpp2_moe": ["recipe=qwen3_moe_tiny", *MODEL_DATA, "model.num_layers=4",
                 "model.virtual_pipeline_model_parallel_size=2"],
    "vpp2_hybrid": ["recipe=nemotron_h_tiny", *MODEL_DATA, "model.virtual_pipeline_model_parallel_size=2"],
}
# per-layer graphs over the chunks' layers, interleaved 1F1B; two warm-up steps (R29: the order and the micro-batches
# in flight come from the last one). Each chunk counts its own micro-batches (cuda_graph/layers.py, chains).
LAYER_WARMUP = ["model.cuda_graph_warmup_steps=2"]
PER_LAYER = {"vpp2": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]", *LAYER_WARMUP],
             "layout": ["model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[]", *LAYER_WARMUP]}
# the graphed modules of each rank: vpp2 graphs attn and mlp of 2 layers per rank, layout whole layers (0, 1, 3 on
# rank 0; 2 on rank 1, whose chunk 3 holds only the loss)
LAYER_MODULES = {"vpp2": [4, 4], "layout": [3, 1]}
# slots (sets of graphs, one per micro-batch in flight in a chunk): interleaved 1F1B over 2 ranks with 4 micro-batches
# runs all 4 forwards of chunk 0 on rank 0 before their first backward, and 3 of chunk 1 on rank 1
SLOTS = [4, 3]
# which whole-model layers each rank holds
HELD = {"vpp2": [{0, 2}, {1, 3}], "vpp2_zero_bubble": [{0, 2}, {1, 3}], "layout": [{0, 1, 3}, {2}],
        "account": [{1}, {0}], "vpp2_moe": [{0, 2}, {1, 3}], "vpp2_hybrid": [{0, 2}, {1, 3}]}
# dropout off: the interleaved pipeline and one stage per rank (layers 0-1 and 2-3) compute the same model
SAME_MODEL = {name: LAYOUTS[name] for name in ("vpp2", "vpp2_zero_bubble")} | {"pp2": ["model.num_layers=4"]}
# activation recompute over virtual stages, dropout off (R35): full recompute under interleaved 1F1B, the core
# attention recomputed under zero bubble (whose input-gradient pass recomputes it and whose weight-gradient pass
# reads what that pass kept), each compared with the same layout's eager run without recompute ("nodrop")
FULL_RECOMPUTE = ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"]
RECOMPUTE = {"vpp2": FULL_RECOMPUTE,
             "vpp2_zero_bubble": ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn]"]}


def layouts_worker(out: str, device: str) -> None:
    """The torchrun worker: every layout eager and graphed, then the dropout-free pair; each run's sends and
    receives with their groups, and the directed groups the run built."""
    import torch.distributed.pipelining.schedules as schedules

    import graphstep.training.build as build
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    runs = {f"{name}/{mode}": [*layout, *(GRAPHED if mode == "graphed" else EAGER)]
            for name, layout in LAYOUTS.items() for mode in ("eager", "graphed")}
    runs.update({f"{name}/layers": [*LAYOUTS[name], *graphs] for name, graphs in PER_LAYER.items()})
    runs.update({f"{name}/nodrop": [*layout, *NO_DROPOUT, *EAGER] for name, layout in SAME_MODEL.items()})
    runs.update({f"{name}/recompute": [*LAYOUTS[name], *NO_DROPOUT, *GRAPHED, *rc] for name, rc in RECOMPUTE.items()})
    runs["vpp2/recompute_eager"] = [*LAYOUTS["vpp2"], *NO_DROPOUT, *EAGER, *FULL_RECOMPUTE]
    # the graphed vpp2 run saves at iteration 2; a run resumes from there
    save = Path(out) / "vpp2-ckpt"
    runs["vpp2/graphed"] += [f"checkpoint.save={save}", "checkpoint.save_interval=2"]
    runs["vpp2/resumed"] = [*LAYOUTS["vpp2"], *GRAPHED, f"checkpoint.load={save}/iter_0000002",
                            f"checkpoint.save={save}-resumed", "checkpoint.save_interval=2"]
    posted: list[list] = []
    built: dict[str, str] = {}
    kinds: list[str] = []
    batch_p2p, make_groups, make_pipeline = schedules._batch_p2p, build.directed_p2p_groups, build._pipeline

    def recording_batch_p2p(ops, desc=None):
        posted.extend(["send" if op.op is torch.distributed.isend else "recv", op.peer, op.group.group_name]
                      for op in ops)
        return batch_p2p(ops, desc)

    def recording_groups(mesh):
        groups = make_groups(mesh)
        built.update({f"{src}->{dst}": g.group_name for (src, dst), g in groups.items()})
        return groups

    def recording_pipeline(*args, **kwargs):
        pipeline = make_pipeline(*args, **kwargs)
        kinds.append(type(pipeline.train_schedule).__name__)
        return pipeline

    schedules._batch_p2p, build.directed_p2p_groups = recording_batch_p2p, recording_groups
    build._pipeline = recording_pipeline

    def run(overrides: list[str]) -> dict:
        from helpers.reports import core_attention_calls, natural_digests

        posted.clear()
        built.clear()
        kinds.clear()
        recipe = next((o.split("=", 1)[1] for o in overrides if o.startswith("recipe=")), "llama3_tiny")
        overrides = [o for o in overrides if not o.startswith("recipe=")]
        with core_attention_calls() as calls:
            result = train(tiny_config(*COMMON, f"train.device={device}", *overrides, recipe=recipe),
                           keep_model=True)
        saved = any(o.startswith("checkpoint.save=") for o in overrides)  # the whole model's weights, by name
        return {**train_report(result), "names": [n for n, _ in result.model.named_parameters()],
                "attention_calls": calls[0],
                "posted": list(posted), "directed": dict(built), "schedule": kinds[0],
                "digest": natural_digests(result.model) if saved else None}

    report_runs(Path(out), device, runs, run)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return torchrun_reports(__file__, "layouts_worker", tmp_path_factory.mktemp("interleaved"), 2, "cpu",
                            timeout=600)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_graphed_interleaved_pipeline_equals_eager_bit_for_bit(reports, layout):
    for report in reports:
        eager, graphed = report[f"{layout}/eager"], report[f"{layout}/graphed"]
        assert len(eager["losses"]) == ITERS and len(eager["eval"]) == ITERS // 2
        assert set(eager["states"]) == {"eager"} and eager["graphs"] == 0
        assert graphed["states"] == graphed_states(ITERS)
        assert graphed["graphs"] == 3  # training (the whole schedule), optimizer and evaluation graphs
        assert graphed["losses"] == eager["losses"]  # JSON floats: the exact bits
        assert graphed["eval"] == eager["eval"]
        assert graphed["shard"] == eager["shard"]  # this rank's final parameters
        assert eager["losses"][-1] < eager["losses"][0]
    assert reports[0][f"{layout}/eager"]["losses"] == reports[1][f"{layout}/eager"]["losses"]


@pytest.mark.parametrize("layout", list(PER_LAYER))
def test_per_layer_graphs_over_virtual_stages_equal_eager_bit_for_bit(reports, layout):
    """Per-layer graphs on the layers of a rank's two chunks, dropout on: every chunk counts the micro-batches it
    runs on its own (interleaved 1F1B runs chunk 0's forwards of micro-batches 0 and 1 before chunk 2's of
    micro-batch 0), so micro-batch i of a chunk replays slot i mod slots; losses, evaluation losses (eager layers)
    and every rank's final parameters are the eager run's bits."""
    for rank, report in enumerate(reports):
        eager, graphed = report[f"{layout}/eager"], report[f"{layout}/layers"]
        assert graphed["states"] == graphed_states(ITERS, warmup=2)
        assert graphed["graphs"] == 2 * LAYER_MODULES[layout][rank] * SLOTS[rank]  # forward and backward per slot
        assert graphed["losses"] == eager["losses"]  # JSON floats: the exact bits
        assert graphed["eval"] == eager["eval"]
        assert graphed["shard"] == eager["shard"]


@pytest.mark.parametrize("layout", [*LAYOUTS, "pp2"])
def test_the_schedule_is_torchs_interleaved_one(reports, layout):
    expected = {"vpp2_zero_bubble": "ScheduleInterleavedZeroBubble", "pp2": "Schedule1F1B"}
    for report in reports:
        run = report[f"{layout}/nodrop" if layout == "pp2" else f"{layout}/graphed"]
        assert run["schedule"] == expected.get(layout, "ScheduleInterleaved1F1B")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_holds_its_chunks_layers(reports, layout):
    first, last = (report[f"{layout}/eager"]["names"] for report in reports)
    assert first[0] == "embedding.weight" and "output_layer.weight" not in first
    assert last[-1] == "output_layer.weight" and "embedding.weight" not in last
    held = [{int(n.split(".")[1]) for n in names if n.startswith("layers.")} for names in (first, last)]
    assert held == HELD[layout]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_send_and_receive_goes_on_the_group_of_its_direction(reports, layout):
    """One communicator per directed pair of ranks: rank 0 -> 1 and 1 -> 0 are two groups, and every transfer the
    schedules post (activations and gradients, training and evaluation, eager and captured) is on its own."""
    for rank, report in enumerate(reports):
        peer = 1 - rank
        for mode in ("eager", "graphed", *(["layers"] if layout in PER_LAYER else [])):
            run = report[f"{layout}/{mode}"]
            directed = run["directed"]
            assert set(directed) == {"0->1", "1->0"} and directed["0->1"] != directed["1->0"]
            assert len(run["posted"]) > 8 * ITERS  # 4 micro-batches x 2 boundaries per rank, both ways
            for kind, to, group in run["posted"]:
                assert to == peer
                assert group == directed[f"{rank}->{peer}" if kind == "send" else f"{peer}->{rank}"], (kind, group)
    # the two ranks built the same groups under the same names
    assert reports[0][f"{layout}/eager"]["directed"] == reports[1][f"{layout}/eager"]["directed"]


def test_interleaved_computes_what_one_stage_per_rank_computes(reports):
    """Dropout off, the same weights and batches: 4 chunks of 1 layer or 2 stages of 2 layers, the same model.
    Each layer, the loss and each parameter's gradient sum over the micro-batches are computed in the same order
    in both, so on the CPU the losses are the same bits (allclose would be the claim where kernels differ)."""
    for report in reports:
        interleaved, plain = report["vpp2/nodrop"], report["pp2/nodrop"]
        assert len(interleaved["losses"]) == ITERS and interleaved["losses"] != report["vpp2/eager"]["losses"]
        assert interleaved["losses"] == plain["losses"] and interleaved["eval"] == plain["eval"]


def test_an_interleaved_run_resumes_exactly(reports):
    """Each rank saves its chunks' layers under whole-model names and its RNG streams; resumed at iteration 2 with
    dropout on, the graphed run continues with the uninterrupted run's losses and ends with its weights, bit for
    bit (the stages' set-up on the resumed first step draws no dropout masks)."""
    for report in reports:
        whole, resumed = report["vpp2/graphed"], report["vpp2/resumed"]
        assert len(whole["losses"]) == ITERS and resumed["losses"] == whole["losses"][2:]
        assert resumed["eval"] == whole["eval"][1:]
        assert resumed["digest"] == whole["digest"] and whole["digest"]


def test_zero_bubble_computes_what_interleaved_1f1b_computes(reports):
    """Dropout off: zero bubble's split backward (weight gradients later, written into ``param.grad`` by torch and
    moved into the gradient buffers after the schedule) trains the same weights as interleaved 1F1B."""
    for report in reports:
        zero_bubble, one_f_one_b = report["vpp2_zero_bubble/nodrop"], report["vpp2/nodrop"]
        assert zero_bubble["losses"] == one_f_one_b["losses"] and zero_bubble["shard"] == one_f_one_b["shard"]


@pytest.mark.parametrize("layout", list(RECOMPUTE))
def test_recompute_over_virtual_stages_graphed_equals_the_run_without_recompute(reports, layout):
    """Recompute inside the graphed interleaved schedule: losses, evaluation losses and every rank's final
    parameters are the bits of the same layout run eagerly without recompute. Eagerly, full recompute calls the
    core attention of each of a rank's 2 layers once more in the backward of every training micro-batch (4 per
    step); the stages' set-up forwards, which have no backward, are counted in both runs."""
    for report in reports:
        recomputed, plain = report[f"{layout}/recompute"], report[f"{layout}/nodrop"]
        assert recomputed["states"] == graphed_states(ITERS) and recomputed["graphs"] == 3
        assert (recomputed["losses"], recomputed["eval"], recomputed["shard"]) == \
            (plain["losses"], plain["eval"], plain["shard"])
        eager, eager_plain = report["vpp2/recompute_eager"], report["vpp2/nodrop"]
        assert (eager["losses"], eager["shard"]) == (eager_plain["losses"], eager_plain["shard"])
        assert eager_plain["attention_calls"] + ITERS * 4 * 2 <= eager["attention_calls"] \
            <= 2 * eager_plain["attention_calls"]


@pytest.mark.cuda
def test_interleaved_on_two_gpus_graphed_equals_eager(tmp_path):
    """On NCCL, where one communicator per pair could deadlock or misorder a captured interleaved schedule: every
    layout graphed (whole, and per layer) equals eager bit for bit, every transfer on the group of its direction."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (the nvidia-h200-x2 machine)")
    reports = torchrun_reports(__file__, "layouts_worker", tmp_path, 2, "cuda", timeout=900)
    assert_graphed_equals_eager(reports, LAYOUTS)
    for layout in PER_LAYER:
        test_per_layer_graphs_over_virtual_stages_equal_eager_bit_for_bit(reports, layout)
    for layout in LAYOUTS:
        test_every_send_and_receive_goes_on_the_group_of_its_direction(reports, layout)
