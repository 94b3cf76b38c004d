"""Context parallel under torchrun: graphed runs equal eager bit for bit, and a context-parallel run computes what
one process computes with the same global batch.

One torchrun launch of 4 gloo ranks runs every layout of ``LAYOUTS`` (``layouts_worker``), each eagerly and with
the full-iteration, optimizer and evaluation graphs, some also with per-layer graphs, and, with dropout off, once
more to compare with one process:

* ``cp2_dp2``: 2 data-parallel replicas x 2 context-parallel ranks (gradients and losses averaged over all 4);
* ``cp2_tp2_sp``: 2 context-parallel x 2 tensor-parallel ranks with sequence parallel (each rank gathers the
  key/value heads it holds);
* ``cp2_fsdp2``: FSDP2 ZeRO-3 over 2 data-parallel x 2 context-parallel ranks (sharded over all 4);
* ``cp2_zero2``: the same with ZeRO-2 (the distributed optimizer), with per-layer graphs too;
* ``cp2_dp2_recompute``: full activation recompute (the backward re-runs each layer's all-gather), dropout off
  (rule R35), buckets of 5000 elements: the same bits as ``cp2_dp2`` without dropout, with the same buckets;
  and, graphed, ``cp2_tp2_sp`` with selective recompute and ``cp2_fsdp2`` with full recompute: the same bits as
  their runs without dropout;
* ``cp2_dp2`` with ``ddp.overlap_grad_reduce`` (dropout off): the same bits as without overlap;
* ``cp2_dp2`` saved at iteration 2 and resumed (graphed, dropout on): the same bits as without the stop;
* ``cp2_a2a``: Megatron's ``a2a`` type (Ulysses) over 2 data-parallel x 2 context-parallel ranks: the queries,
  keys and values of each layer exchanged by all-to-all so that each rank attends over the whole sequences with
  half of the heads, the output exchanged back (the backward: the inverse all-to-alls); with per-layer graphs too,
  each attention graph holding its all-to-alls; and ``cp2_a2a_tp2_sp``, the same over tensor + sequence parallel
  (4 key/value heads), also compared with one process;
* ``cp2_dp2_moe``: an MoE model (qwen3_moe_tiny, expert bias on) over 2 data-parallel x 2 context-parallel
  ranks: each rank routes the tokens of its chunks, the expert-bias update sums the token counts of all 4,
  graphed whole and per layer (``[attn,moe]``); with dropout and the load-balancing loss off (each rank's is
  that of its share of the tokens) it computes what one process computes, and graphed with full recompute
  the same bits as eager without it; ``cp2_ep2_moe``, the same with expert parallel over the 2 data-parallel
  ranks (each MoE block exchanging tokens with the rank holding the same chunks, each rank holding half of the
  experts, an expert's gradient summed with its other context-parallel rank's), graphed whole, and
  ``cp2_ep2_zero3_moe`` over FSDP2 ZeRO-3 (the experts sharded over the ranks holding them), both also equal to
  one process without dropout;
* ``cp2_dp2_hybrid``: a Nemotron-H style hybrid (Mamba, MLP, attention, MoE) over 2 data-parallel x 2
  context-parallel ranks: each Mamba layer runs its scan along the whole sequences of half of its heads
  (all-to-alls in and out), graphed whole and per layer (``[attn,mlp,mamba]``), and with dropout and the
  load-balancing loss off it computes what one process computes.

Each rank writes, per run, the per-iteration losses, the evaluation losses and a digest of the parameters it
holds. On the CPU the graphs run on the replay backend over gloo (the key/value all-gathers, their
reduce-scatters in the backward and the token-count all-reduces are recorded and re-run); with ``cuda``
(4 GPUs) they are CUDA graphs over NCCL.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.launch import report_runs, torchrun_reports
from helpers.reports import graphed_states, train_report

pytestmark = [pytest.mark.slow, pytest.mark.ranks4]

ITERS = 4
COMMON = [f"train.train_iters={ITERS}", "logger.log_interval=1", "model.cuda_graph_warmup_steps=1",
          "train.eval_iters=1", "train.eval_interval=2", "model.use_te_rng_tracker=true"]
# iterations: 1 eager, 2 captured, 3 and 4 replayed; evaluations at 2 and 4: the evaluation graph warms up at 2
# and is captured (and replayed) at 4
GRAPHED = ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"]
EAGER = ["model.cuda_graph_impl=none"]
NO_DROPOUT = ["model.attention_dropout=0.0", "model.hidden_dropout=0.0"]
CP2 = ["model.context_parallel_size=2", "model.cp_comm_type=all_gather"]
BUCKETS = ["ddp.bucket_size=5000"]  # several buckets (the default is one of 40M elements)
MOE = ["recipe=qwen3_moe_tiny", "train.micro_batch_size=2", "model.hidden_dropout=0.1",
       "model.moe_router_enable_expert_bias=true", "model.moe_router_bias_update_rate=0.01",
       "model.moe_router_score_function=sigmoid", "data.corpus_max_bytes=300000", "data.split=90,10,0"]
LAYOUTS = {
    "cp2_dp2": CP2,
    "cp2_tp2_sp": [*CP2, "model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    "cp2_fsdp2": [*CP2, "ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"],
    "cp2_zero2": [*CP2, "ddp.use_distributed_optimizer=true"],
    "cp2_dp2_recompute": [*CP2, "model.recompute_granularity=full", *NO_DROPOUT, *BUCKETS],
    # Ulysses (cp_comm_type=a2a): each rank attends over every rank's tokens with half of the heads (2 of 4 query
    # heads, 1 of 2 key/value heads), the queries, keys and values exchanged by all-to-all, the output exchanged back
    "cp2_a2a": ["model.context_parallel_size=2", "model.cp_comm_type=a2a"],
    # a2a over tensor + sequence parallel: each tensor-parallel rank's 2 heads and 2 key/value heads (4 key/value
    # heads in all: num_query_groups=4) split again over the 2 context-parallel ranks
    "cp2_a2a_tp2_sp": ["model.context_parallel_size=2", "model.cp_comm_type=a2a", "model.num_query_groups=4",
                       "model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    "cp2_dp2_moe": [*CP2, *MOE],
    # expert parallel over the 2 data-parallel ranks of each context-parallel rank: each MoE block all-gathers the
    # tokens of the ranks holding the same chunks, each rank holding 4 of the 8 experts, whose gradients are summed
    # with the other context-parallel rank's copy (the expert_dp view); replicated and under FSDP2 ZeRO-3 (the
    # experts sharded over their 2 holders)
    "cp2_ep2_moe": [*CP2, *MOE, "model.expert_model_parallel_size=2"],
    "cp2_ep2_zero3_moe": [*CP2, *MOE, "model.expert_model_parallel_size=2", "ddp.use_megatron_fsdp=true",
                          "ddp.data_parallel_sharding_strategy=optim_grads_params"],
    # a hybrid model (Mamba, MLP, attention, MoE): each Mamba layer exchanges its conv input and dt for the whole
    # sequences of half of its 8 heads (their one group's B and C on both ranks) and its output back
    "cp2_dp2_hybrid": [*CP2, "recipe=nemotron_h_tiny", "train.micro_batch_size=2", "model.hidden_dropout=0.1",
                       "data.corpus_max_bytes=300000", "data.split=90,10,0"],
    # the same over tensor + sequence parallel: each tensor-parallel rank's 4 Mamba heads and 1 of the 2 groups,
    # split again over the 2 context-parallel ranks (the group's B and C on both)
    "cp2_tp2_hybrid": [*CP2, "recipe=nemotron_h_tiny", "train.micro_batch_size=2", "model.hidden_dropout=0.1",
                       "data.corpus_max_bytes=300000", "data.split=90,10,0", "model.tensor_model_parallel_size=2",
                       "model.sequence_parallel=true", "model.mamba_num_groups=2"],
}
# per-layer graphs: each attention graph holds its all-gather, its backward graph the reduce-scatter
PER_LAYER = {"cp2_dp2": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"],
             "cp2_tp2_sp": ["model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[]"],
             # inside FSDP2's layers: its gathers and reduce-scatters eager between the layer graphs
             "cp2_zero2": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"],
             "cp2_dp2_moe": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,moe]"],
             "cp2_a2a": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"],
             # each Mamba graph holds its layer's two all-to-alls, its backward graph their inverses
             "cp2_dp2_hybrid": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp,mamba]"]}
COMPARED = ("cp2_dp2", "cp2_tp2_sp", "cp2_fsdp2", "cp2_a2a")  # with dropout off, against one process
MOE_LAYOUTS = ("cp2_dp2_moe", "cp2_ep2_moe", "cp2_ep2_zero3_moe")  # with dropout off, against one MoE process
# graphed with activation recompute, dropout off: selective recompute of the core attention over tensor parallel,
# full recompute over FSDP2 ZeRO-3 (each layer gathered again in the backward); against the layout's nodrop run
RECOMPUTED = {"cp2_tp2_sp": ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn]"],
              "cp2_fsdp2": ["model.recompute_granularity=full", "model.recompute_method=uniform",
                            "model.recompute_num_layers=1"],
              "cp2_dp2_moe": ["model.recompute_granularity=full"]}
NODROP = {"cp2_dp2": BUCKETS,  # cp2_dp2's dropout-free run: the reference of the overlap and recompute runs too
          "cp2_dp2_moe": ["model.moe_aux_loss_coeff=0.0"], "cp2_ep2_moe": ["model.moe_aux_loss_coeff=0.0"],
          "cp2_ep2_zero3_moe": ["model.moe_aux_loss_coeff=0.0"], "cp2_dp2_hybrid": ["model.moe_aux_loss_coeff=0.0"],
          "cp2_tp2_hybrid": ["model.moe_aux_loss_coeff=0.0"]}


def layouts_worker(out: str, device: str) -> None:
    """The torchrun worker: every layout eager and graphed, the per-layer graphs, and the dropout-free runs."""
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    runs = {f"{name}/{mode}": [*layout, *(GRAPHED if mode == "graphed" else EAGER)]
            for name, layout in LAYOUTS.items() for mode in ("eager", "graphed")}
    runs.update({f"{name}/layers": [*LAYOUTS[name], *graphs] for name, graphs in PER_LAYER.items()})
    runs.update({f"{name}/nodrop": [*LAYOUTS[name], *NODROP.get(name, []), *NO_DROPOUT, *EAGER]
                 for name in (*COMPARED, *MOE_LAYOUTS, "cp2_dp2_hybrid", "cp2_tp2_hybrid", "cp2_a2a_tp2_sp")})
    runs["cp2_dp2_overlap/nodrop"] = [*runs["cp2_dp2/nodrop"], "ddp.overlap_grad_reduce=true"]
    runs.update({f"{name}/recompute": [*LAYOUTS[name], *NODROP.get(name, []), *NO_DROPOUT, *GRAPHED, *recompute]
                 for name, recompute in RECOMPUTED.items()})
    # a checkpoint at iteration 2 of the graphed cp2_dp2 run, and a run resumed from it (dropout on)
    save = Path(out) / "cp2_dp2-checkpoints"
    runs["cp2_dp2/graphed"] += [f"checkpoint.save={save}", "checkpoint.save_interval=2"]
    runs["cp2_dp2/resumed"] = [*LAYOUTS["cp2_dp2"], *GRAPHED, f"checkpoint.load={save}/iter_0000002"]
    def run(overrides: list[str]) -> dict:
        recipe = [o.split("=", 1)[1] for o in overrides if o.startswith("recipe=")] or ["llama3_tiny"]
        overrides = [o for o in overrides if not o.startswith("recipe=")]
        result = train(tiny_config(*COMMON, f"train.device={device}", *overrides, recipe=recipe[0]), keep_model=True)
        return {**train_report(result), "grad_norms": [r["grad_norm"] for r in result.rows]}

    report_runs(Path(out), device, runs, run)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return torchrun_reports(__file__, "layouts_worker", tmp_path_factory.mktemp("cp"), 4, "cpu", timeout=900)


@pytest.fixture(scope="module")
def one_process():
    """The same global batches on one process, dropout off: what every context-parallel layout computes."""
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    return train(tiny_config(*COMMON, *NO_DROPOUT, *EAGER))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_graphed_context_parallel_equals_eager_bit_for_bit(reports, layout):
    for report in reports:
        eager, graphed = report[f"{layout}/eager"], report[f"{layout}/graphed"]
        assert len(eager["losses"]) == ITERS and len(eager["eval"]) == ITERS // 2
        assert graphed["losses"] == eager["losses"]  # JSON floats: the exact bits
        assert graphed["eval"] == eager["eval"]
        assert graphed["shard"] == eager["shard"]
        assert graphed["graphs"] == 3  # training, optimizer and evaluation graphs all captured
        assert graphed["states"] == graphed_states(ITERS)
        assert set(eager["states"]) == {"eager"} and eager["losses"][-1] < eager["losses"][0]


@pytest.mark.parametrize("layout", list(PER_LAYER))
def test_per_layer_graphs_over_context_parallel_attention_equal_eager(reports, layout):
    for report in reports:
        eager, layers = report[f"{layout}/eager"], report[f"{layout}/layers"]
        assert layers["losses"] == eager["losses"] and layers["eval"] == eager["eval"]
        assert layers["shard"] == eager["shard"]
        assert layers["states"] == graphed_states(ITERS)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_logs_the_same_losses_and_holds_its_part(reports, layout):
    """The loss is averaged over every data-parallel and context-parallel rank: all 4 log the same. Context-parallel
    ranks hold the same parameters (replicated, as data-parallel replicas), tensor-parallel and FSDP2 ranks their
    own shards, expert-parallel ranks their own experts."""
    for mode in ("eager", "graphed"):
        assert all(r[f"{layout}/{mode}"]["losses"] == reports[0][f"{layout}/{mode}"]["losses"] for r in reports)
        assert all(r[f"{layout}/{mode}"]["eval"] == reports[0][f"{layout}/{mode}"]["eval"] for r in reports)
    shards = [r[f"{layout}/eager"]["shard"] for r in reports]
    if layout in ("cp2_tp2_sp", "cp2_a2a_tp2_sp", "cp2_tp2_hybrid"):  # ranks 0, 1: the tp ranks of cp rank 0; 2, 3
        # those of cp 1
        assert shards[0] != shards[1] and shards[0] == shards[2] and shards[1] == shards[3]
    elif layout in ("cp2_fsdp2", "cp2_zero2", "cp2_ep2_zero3_moe"):  # sharded over dp x cp: four different shards
        assert len(set(shards)) == 4
    elif layout == "cp2_ep2_moe":  # rank = 2 ep + cp: a rank's experts are its context-parallel peer's, not the other's
        assert shards[0] == shards[1] and shards[2] == shards[3] and shards[0] != shards[2]
    else:
        assert len(set(shards)) == 1


@pytest.mark.parametrize("layout", COMPARED)
def test_context_parallel_computes_what_one_process_computes(reports, one_process, layout):
    """Dropout off, the same global batch and weights: only the order of sums differs (each rank attends over its
    chunks, and the loss sums the ranks' shares). The gradient norms say the gradients are the same too (Adam's
    steps hide a wrong gradient's size from the losses of a few iterations: a backward that kept only the rank's
    own share of the gathered keys' and values' gradients moved the losses by about 2e-5, the norms by far more)."""
    cp = torch.tensor(reports[0][f"{layout}/nodrop"]["losses"], dtype=torch.float64)
    one = torch.tensor(one_process.losses, dtype=torch.float64)
    assert cp.shape == one.shape == (ITERS,)
    torch.testing.assert_close(cp, one, rtol=2e-6, atol=0)
    norms = torch.tensor(reports[0][f"{layout}/nodrop"]["grad_norms"], dtype=torch.float64)
    torch.testing.assert_close(norms, torch.tensor([r["grad_norm"] for r in one_process.rows], dtype=torch.float64),
                               rtol=1e-5, atol=0)
    if layout != "cp2_tp2_sp":
        return  # 2 data-parallel ranks each evaluate eval_iters batches of their own: other batches
    ev_cp = torch.tensor([v for _, v in reports[0][f"{layout}/nodrop"]["eval"]], dtype=torch.float64)
    ev_one = torch.tensor([v for _, v in one_process.eval_losses], dtype=torch.float64)
    torch.testing.assert_close(ev_cp, ev_one, rtol=2e-5, atol=0)


def test_a2a_over_tensor_parallel_computes_what_one_process_computes(reports):
    """cp2 x tp2 with sequence parallel and Megatron's a2a type, dropout off: each rank attends over the whole
    sequences with one of its tensor-parallel rank's two head pairs; the losses and gradient norms are one
    process's (the same model: 4 key/value heads) to float tolerance."""
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    one = train(tiny_config(*COMMON, "model.num_query_groups=4", *NO_DROPOUT, *EAGER))
    # the 4th iteration's norm was 1.03e-5 (relative) off on this machine, the losses within 2e-6: float32 sums in
    # other orders over 3 Adam steps
    _assert_runs_match_one_process(reports, "cp2_a2a_tp2_sp/nodrop", one, losses=2e-6, norms=2e-5)


@pytest.fixture(scope="module")
def moe_one_process():
    """The MoE layouts' model and global batches on one process, dropout and the load-balancing loss off."""
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    single = [o for o in MOE if not o.startswith("recipe=")]
    return train(tiny_config(*COMMON, *single, "model.moe_aux_loss_coeff=0.0", *NO_DROPOUT, *EAGER,
                             recipe="qwen3_moe_tiny"))


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_an_moe_model_over_context_parallel_ranks_computes_what_one_process_computes(reports, moe_one_process,
                                                                                     layout):
    """cp2 x dp2 MoE, and cp2 x ep2 replicated and over FSDP2 ZeRO-3, dropout and the load-balancing loss off:
    each rank routes its own chunks' tokens (with expert parallel to the experts of the ranks holding the same
    chunks), the expert biases move with the token counts summed over the 4 ranks, an expert's gradient sums over
    the ranks holding it, and the losses and gradient norms are one process's with the same global batch, to
    float tolerance."""
    _assert_runs_match_one_process(reports, f"{layout}/nodrop", moe_one_process, losses=2e-5, norms=1e-4)


@pytest.mark.parametrize("layout", ["cp2_dp2_hybrid", "cp2_tp2_hybrid"])
def test_a_hybrid_model_over_context_parallel_ranks_computes_what_one_process_computes(reports, layout):
    """cp2 x dp2 and cp2 x tp2 (sequence parallel) Nemotron-H style hybrid, dropout and the load-balancing loss off:
    each Mamba layer runs its scan along the whole sequences of half of its (tensor-parallel rank's) heads on each
    rank, and the losses and gradient norms are one process's with the same global batch, to float tolerance
    (chunks in the wrong order, or a head's B and C from the wrong group, change the scan's outputs at the first
    layer)."""
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    single = [o for o in LAYOUTS[layout] if not o.startswith(("recipe=", "model.context_parallel_size",
                                                               "model.cp_comm_type", "model.tensor_model",
                                                               "model.sequence_parallel"))]
    one = train(tiny_config(*COMMON, *single, *NODROP[layout], *NO_DROPOUT, *EAGER, recipe="nemotron_h_tiny"))
    _assert_runs_match_one_process(reports, f"{layout}/nodrop", one, losses=2e-5, norms=1e-4)


def _assert_runs_match_one_process(reports: list[dict], run: str, one, *, losses: float, norms: float) -> None:
    """Every rank's ``run``: the losses and gradient norms of the one-process result ``one``, to these rtols."""
    for report in reports:
        torch.testing.assert_close(torch.tensor(report[run]["losses"], dtype=torch.float64),
                                   torch.tensor(one.losses, dtype=torch.float64), rtol=losses, atol=0)
        torch.testing.assert_close(torch.tensor(report[run]["grad_norms"], dtype=torch.float64),
                                   torch.tensor([r["grad_norm"] for r in one.rows], dtype=torch.float64),
                                   rtol=norms, atol=0)


def test_a_context_parallel_run_resumes_bit_for_bit(reports):
    """Saved at iteration 2 and resumed (graphed, dropout on): each rank continues its own RNG streams -- the
    context-parallel ranks' differ -- and the data where it stopped, so iterations 3-4 are the same bits."""
    for report in reports:
        whole, resumed = report["cp2_dp2/graphed"], report["cp2_dp2/resumed"]
        assert len(resumed["losses"]) == ITERS - 2
        assert resumed["losses"] == whole["losses"][2:] and resumed["eval"] == whole["eval"][1:]
        assert resumed["shard"] == whole["shard"]


def test_overlapped_reduction_over_dp_x_cp_computes_the_same_bits(reports):
    """ddp.overlap_grad_reduce starts each bucket's all-reduce over the dp x cp ranks during the last backward: the
    same buckets, pre-divided the same way, so the same losses and weights as without overlap (the same bucket
    size: gloo sums 4 ranks' buckets of other sizes in other orders)."""
    for report in reports:
        overlap, plain = report["cp2_dp2_overlap/nodrop"], report["cp2_dp2/nodrop"]
        assert overlap["losses"] == plain["losses"] and overlap["shard"] == plain["shard"]


def test_recompute_with_context_parallel_computes_what_it_computes_without(reports):
    """Full recompute re-runs each layer's forward, all-gather included, in the backward: the same numbers (the
    same buckets, dropout off in both)."""
    for report in reports:
        recomputed, plain = report["cp2_dp2_recompute/eager"], report["cp2_dp2/nodrop"]
        assert recomputed["losses"] == plain["losses"] and recomputed["shard"] == plain["shard"]


@pytest.mark.parametrize("layout", list(RECOMPUTED))
def test_recompute_over_sharded_context_parallel_layouts_graphed_computes_the_same_bits(reports, layout):
    """cp2 x tp2 with the core attention recomputed, cp2 x FSDP2 ZeRO-3 and cp2 x dp2 MoE with full recompute,
    graphed: the recomputed regions re-run the key/value all-gathers, DTensor's collectives, FSDP2's gathers and
    the MoE blocks inside the captured backward, and the run equals the layout's eager run without recompute bit
    for bit."""
    for report in reports:
        recomputed, plain = report[f"{layout}/recompute"], report[f"{layout}/nodrop"]
        assert recomputed["states"] == graphed_states(ITERS) and recomputed["graphs"] == 3
        for key in ("losses", "grad_norms", "eval", "shard"):
            assert recomputed[key] == plain[key], key


@pytest.mark.cuda
def test_context_parallel_on_four_gpus_graphed_equals_eager(tmp_path):
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs (the nvidia-h100-x4 machine)")
    reports = torchrun_reports(__file__, "layouts_worker", tmp_path, 4, "cuda", timeout=900)
    for layout in LAYOUTS:
        for report in reports:
            assert report[f"{layout}/graphed"]["losses"] == report[f"{layout}/eager"]["losses"], layout
            assert report[f"{layout}/graphed"]["shard"] == report[f"{layout}/eager"]["shard"], layout
    for layout in PER_LAYER:
        for report in reports:
            assert report[f"{layout}/layers"]["losses"] == report[f"{layout}/eager"]["losses"], layout
            assert report[f"{layout}/layers"]["shard"] == report[f"{layout}/eager"]["shard"], layout
