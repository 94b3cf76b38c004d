"""Pipeline parallel (torch.distributed.pipelining) under torchrun: graphed runs equal eager, bit for bit.

One torchrun launch runs this file's ``layouts_worker`` on each rank. Each
rank trains every layout of ``LAYOUTS`` eagerly and with the full-iteration,
optimizer and evaluation graphs -- the whole schedule, sends and receives
included, captured once per rank -- and writes per run the per-iteration
losses, the evaluation losses and a digest of the parameters its stage holds.
On the CPU the graphs run on the replay backend over gloo. Dropout is on:
each stage draws from its own streams (Megatron's seed + 100 x stage).

With dropout off, a pipelined run computes what one process computes with
the same global batch and the same initial weights, up to rounding. The same
launch, on a gloo group of its own, replays a graph of a receive and a send
posted before either is waited on (``exchange``).

A second launch, of 4 ranks, runs ``LAYOUTS_4``: 2 stages combined with
replicated data parallel (overlapped), tensor + sequence parallel, FSDP2,
MoE (also over tensor + sequence parallel and over context parallel) and
hybrid models, expert parallel (an MoE model's experts split over each
stage's 2 ranks, its checkpoint resumed) and recompute (also over the
tensor + sequence parallel and the FSDP2 ZeRO-3 stages), 2 stages x 2
virtual stages (interleaved 1F1B) with tensor + sequence parallel and with
FSDP2 ZeRO-3, and 2 stages x 2 context-parallel ranks (tied embeddings, its
checkpoint resumed; over FSDP2 ZeRO-3; with 2 virtual stages under zero
bubble; with Megatron's a2a type) on SFT rows, whose loss masks keep
other numbers of tokens on the two context-parallel ranks; the 8-rank 3-D
layouts are in test_pipeline_3d.py.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import pytest
import torch

from graphstep.training.moe_hooks import KEYS as MOE_KEYS
from helpers.data import write_sft
from helpers.launch import report_runs, torchrun_reports
from helpers.reports import assert_graphed_equals_eager, graphed_states, train_report

pytestmark = pytest.mark.slow

ITERS = 4
COMMON = [f"train.train_iters={ITERS}", "logger.log_interval=1", "model.cuda_graph_warmup_steps=1",
          "train.eval_iters=3", "train.eval_interval=2", "model.use_te_rng_tracker=true",
          "model.share_embeddings_and_output_weights=false", "model.num_layers=3"]
# iterations: 1 eager, 2 captured, 3 and 4 replayed; evaluations at 2 and 4: the evaluation graph warms up at 2
# and is captured (and replayed) at 4
# per-layer graphs over pipeline stages warm up for 2 iterations (rule R29): 1, 2 eager, 3 captured, 4 replayed
LAYER_WARMUP = ["model.cuda_graph_warmup_steps=2"]
STATES = {"graphed": graphed_states(ITERS), "layers": graphed_states(ITERS, warmup=2)}
GRAPHED = ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"]
# the layouts whose "graphed" run is per-layer graphs (the alltoall dispatcher's host sync keeps a whole-iteration
# graph out: rule R11), with the per-layer warm-up
GRAPHED_AS = {"pp2_ep2_a2a": ["model.cuda_graph_impl=local",
                              "model.cuda_graph_modules=[attn,moe_router,moe_preprocess]", *LAYER_WARMUP]}
EAGER = ["model.cuda_graph_impl=none"]
NO_DROPOUT = ["model.attention_dropout=0.0", "model.hidden_dropout=0.0"]
LAYOUTS = {  # 3 layers: 2 on the first stage, 1 on the last (Bridge's num_layers_in_first_pipeline_stage)
    "pp2_1f1b": ["model.pipeline_model_parallel_size=2", "model.pipeline_schedule=1f1b",
                 "model.num_layers_in_first_pipeline_stage=2"],
    "pp2_gpipe": ["model.pipeline_model_parallel_size=2", "model.pipeline_schedule=gpipe",
                  "model.num_layers_in_last_pipeline_stage=2"],
}
# per-layer graphs on each stage's layers, sends and receives eager; GPipe keeps the step's 4 micro-batches in
# flight (4 slots of layer graphs), 1F1B up to 2 on the first stage and 1 on the last
PER_LAYER = {"pp2_1f1b": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]", *LAYER_WARMUP],
             "pp2_gpipe": ["model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[]", *LAYER_WARMUP]}
# tied embeddings over the two stages (Llama 3.2 1B/3B-style), run in the same launch as LAYOUTS: the first stage's
# embedding and the last stage's copy (for the logits) take the sum of their gradients
TIED = {"pp2_tied": ["model.pipeline_model_parallel_size=2", "model.num_layers_in_first_pipeline_stage=2",
                     "model.share_embeddings_and_output_weights=true"]}
# 4 ranks, one launch (4 processes on CI's 2 cores): 2 pipelines of 2 stages (the gradients all-reduced over each
# stage's data-parallel group), and the stages combined with tensor + sequence parallel, FSDP2, MoE and hybrid models
# and activation recompute; one batch per evaluation. 2 micro-batches of 2 per pipeline and step, as many as stages
# (what a combination adds is in every micro-batch; the 1F1B steady state with more is LAYOUTS'), and one layer per
# stage (the uneven split is LAYOUTS')
PP2 = ["model.pipeline_model_parallel_size=2", "model.num_layers=2", "train.eval_iters=1", "train.global_batch_size=4"]
DP2 = ["train.global_batch_size=8"]  # 2 data-parallel ranks x 2 micro-batches of 2
MOE = ["train.micro_batch_size=2", "model.hidden_dropout=0.1", "model.moe_router_enable_expert_bias=true",
       "model.moe_router_bias_update_rate=0.01", "model.moe_router_score_function=sigmoid",
       "data.corpus_max_bytes=300000", "data.split=90,10,0"]
VPP2 = ["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2", "model.num_layers=4",
        "train.eval_iters=1", "train.global_batch_size=4"]
CP2 = ["model.context_parallel_size=2", "model.cp_comm_type=all_gather"]
# SFT rows padded to 64 tokens (run_layouts writes the file): the loss mask keeps other numbers of tokens on the two
# context-parallel ranks, so only ContextParallel's loss (the count all-reduced over the last stage's ranks) gives
# the mean over the whole sequences
ZERO3 = ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"]
SFT = ["data.dataset=sft", "data.data_path=<out>/sft.jsonl", "data.split=80,20,0", "model.seq_length=64"]
LAYOUTS_4 = {
    # replicated data parallel, the buckets' all-reduces overlapped with each stage's last backward; tied embeddings
    "pp2_dp2": [*PP2, *DP2, "ddp.overlap_grad_reduce=true", "ddp.bucket_size=5000",
                "model.share_embeddings_and_output_weights=true"],
    # 2 stages x 2 tensor-parallel ranks, the stages exchanging sequence shards; tied embeddings: the last stage's
    # copy is sharded over the vocabulary as the first stage's embedding. Dropout off, so its eager run is the one
    # compared with one process (stages x tensor + sequence parallel with dropout: test_pipeline_3d.py)
    "pp2_tp2_sp": [*PP2, "model.tensor_model_parallel_size=2", "model.sequence_parallel=true",
                   "model.share_embeddings_and_output_weights=true", *NO_DROPOUT],
    "pp2_zero2": [*PP2, *DP2, "ddp.use_distributed_optimizer=true"],
    # tied: FSDP2 shards both stages' copies of the embedding alike over the data-parallel ranks
    "pp2_zero3": [*PP2, *DP2, "ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params",
                  "model.share_embeddings_and_output_weights=true"],
    "pp2_moe": [*PP2, *DP2, *MOE],  # 2 MoE layers (qwen3_moe_tiny), one per stage
    # 2 stages x 2 expert-parallel ranks: each stage's MoE blocks all-gather the tokens of that stage's 2 ranks,
    # each rank holding 4 of the 8 experts; aux loss (the recipe's) and expert bias on
    "pp2_ep2": [*PP2, *DP2, *MOE, "model.expert_model_parallel_size=2"],
    # 2 stages x 2 tensor-parallel ranks (sequence parallel): each MoE block routes its rank's share of the tokens
    # and, each expert split over the 2 ranks (expert tensor parallel: null means tp), exchanges them with the other,
    # the expert-bias update sums the token counts over the stage's 2 ranks. Dropout and the load-balancing loss
    # (each rank's is that of its share of the tokens) off: compared with one process
    "pp2_tp2_moe": [*PP2, "model.tensor_model_parallel_size=2", "model.sequence_parallel=true", *MOE, *NO_DROPOUT,
                    "model.moe_aux_loss_coeff=0.0"],
    # 2 stages x 2 context-parallel ranks: each MoE block routes the tokens of its rank's chunks, the expert-bias
    # update sums the counts over the stage's 2 ranks; dropout and the load-balancing loss off (one process)
    "pp2_cp2_moe": [*PP2, *CP2, *MOE, *NO_DROPOUT, "model.moe_aux_loss_coeff=0.0"],
    # expert parallel over the stages' FSDP2 ZeRO-3 ranks (each stage's experts sharded over the ranks holding them),
    # and over virtual stages (4 MoE layers in 4 chunks); dropout and the load-balancing loss off (compared with one
    # process)
    "pp2_ep2_zero3": [*PP2, *DP2, *MOE, "model.expert_model_parallel_size=2", *ZERO3, *NO_DROPOUT,
                      "model.moe_aux_loss_coeff=0.0"],
    "vpp2_ep2": [*VPP2, *DP2, *MOE, "model.expert_model_parallel_size=2",
                 "model.share_embeddings_and_output_weights=false", *NO_DROPOUT, "model.moe_aux_loss_coeff=0.0"],
    # Megatron Bridge's Qwen3-30B-A3B settings over 2 stages: the alltoall dispatcher (its split sizes read on the
    # host) over the distributed optimizer with both overlap flags, graphed as Megatron graphs it (GRAPHED_AS: the
    # attention, router and preprocess; the experts eager); dropout and the load-balancing loss off
    "pp2_ep2_a2a": [*PP2, *DP2, *MOE, "model.expert_model_parallel_size=2", "model.moe_token_dispatcher_type=alltoall",
                    "ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true",
                    "ddp.overlap_param_gather=true", *NO_DROPOUT, "model.moe_aux_loss_coeff=0.0"],
    "pp2_hybrid": [*PP2, *DP2, *MOE, "model.num_layers=4"],  # nemotron_h_tiny's M-*E: M- on the first stage, *E last
    # the hybrid with its MoE layer's experts split over each stage's 2 ranks; dropout and the load-balancing loss
    # off (compared with one process)
    # the hybrid over 2 stages x 2 tensor-parallel ranks with sequence parallel: each rank runs 4 of the 8 Mamba
    # heads and 1 of the 2 groups of B and C (dropout and the load-balancing loss off)
    "pp2_tp2_hybrid": [*PP2, *MOE, "model.num_layers=4", "model.tensor_model_parallel_size=2",
                       "model.sequence_parallel=true", "model.mamba_num_groups=2", *NO_DROPOUT,
                       "model.moe_aux_loss_coeff=0.0"],
    "pp2_ep2_hybrid": [*PP2, *DP2, *MOE, "model.num_layers=4", "model.expert_model_parallel_size=2", *NO_DROPOUT,
                       "model.moe_aux_loss_coeff=0.0"],
    # the hybrid over 2 stages x 2 context-parallel ranks: the first stage's Mamba layer scans the whole sequences
    # of half of its heads on each rank (all-to-alls in and out); dropout and the load-balancing loss off
    "pp2_cp2_hybrid": [*PP2, *CP2, *MOE, "model.num_layers=4", *NO_DROPOUT, "model.moe_aux_loss_coeff=0.0"],
    "pp2_recompute": [*PP2, *DP2, "model.recompute_granularity=selective", "model.recompute_modules=[core_attn]",
                      "model.attention_dropout=0.0"],
    "pp2_full_recompute": [*PP2, *DP2, "model.recompute_granularity=full", *NO_DROPOUT],
    # virtual stages (interleaved 1F1B): 4 layers in 4 chunks, pipeline rank 0 holding chunks 0 and 2, rank 1
    # chunks 1 and 3 (parallel/interleaved.py); x 2 tensor-parallel ranks with sequence parallel, dropout off (its
    # eager run is the one compared with one process), and x FSDP2 ZeRO-3, each chunk a root of its own
    "vpp2_tp2_sp": [*VPP2, "model.tensor_model_parallel_size=2", "model.sequence_parallel=true", *NO_DROPOUT],
    "vpp2_zero3": [*VPP2, *DP2, "ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"],
    # 2 stages x 2 context-parallel ranks (rank = 2 pp + cp): each stage's attention gathers the keys and values of
    # its own 2 ranks, the stages exchange half sequences, the last stage's loss is ContextParallel's; tied
    # embeddings; its checkpoint resumed. And over FSDP2 ZeRO-3, which shards each stage over its 2 cp ranks
    "pp2_cp2": [*PP2, *CP2, *SFT, "model.share_embeddings_and_output_weights=true"],
    "pp2_cp2_zero3": [*PP2, *CP2, *SFT, "ddp.use_megatron_fsdp=true",
                      "ddp.data_parallel_sharding_strategy=optim_grads_params"],
    # Megatron's a2a type (Ulysses) over the stages: each stage's attention exchanges heads for sequence among its
    # 2 context-parallel ranks (dropout off: compared with one process)
    "pp2_cp2_a2a": [*PP2, "model.context_parallel_size=2", "model.cp_comm_type=a2a", *SFT, *NO_DROPOUT],
    # 2 x 2 virtual stages x 2 context-parallel ranks under zero bubble, whose weight gradients come after the
    # input gradients (each attention's reduce-scatter runs with the latter)
    "vpp2_cp2_zb": [*VPP2, *CP2, *SFT, "model.pipeline_schedule=interleaved_zero_bubble",
                    "model.share_embeddings_and_output_weights=false"],
}
# the others: llama3_tiny
RECIPES = {"pp2_moe": "qwen3_moe_tiny", "pp2_ep2": "qwen3_moe_tiny", "pp2_tp2_moe": "qwen3_moe_tiny",
           "pp2_cp2_moe": "qwen3_moe_tiny",
           "pp2_hybrid": "nemotron_h_tiny", "pp2_cp2_hybrid": "nemotron_h_tiny", "pp2_ep2_zero3": "qwen3_moe_tiny",
           "vpp2_ep2": "qwen3_moe_tiny", "pp2_ep2_a2a": "qwen3_moe_tiny",
           "pp2_ep2_hybrid": "nemotron_h_tiny",
           "pp2_tp2_hybrid": "nemotron_h_tiny"}
# the runs besides eager and graphed: a per-layer scope, and without dropout (compared with one process)
MODES_4 = {
    "pp2_dp2": {"nodrop": [*NO_DROPOUT, *EAGER]},
    # graphed with the core attention recomputed in the backward (its DTensor collectives re-run there)
    "pp2_tp2_sp": {"layers": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]", *LAYER_WARMUP],
                   "recompute": [*GRAPHED, "model.recompute_granularity=selective",
                                 "model.recompute_modules=[core_attn]"]},
    "pp2_zero2": {"layers": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]", *LAYER_WARMUP]},
    # graphed with full recompute (no dropout: R35), each recomputed layer gathered again by FSDP2 in the backward
    "pp2_zero3": {"nodrop": [*NO_DROPOUT, *EAGER],
                  "recompute": [*NO_DROPOUT, *GRAPHED, "model.recompute_granularity=full",
                                "model.recompute_method=uniform", "model.recompute_num_layers=1"]},
    "vpp2_zero3": {"nodrop": [*NO_DROPOUT, *EAGER]},
    # per-layer graphs over virtual stages: each chunk of a rank counts its own micro-batches (cuda_graph/layers.py)
    "vpp2_tp2_sp": {"layers": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]", *LAYER_WARMUP]},
    "pp2_tp2_moe": {"layers": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,moe]", *LAYER_WARMUP]},
    "pp2_moe": {"layers": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,moe]", *LAYER_WARMUP],
                "nodrop": [*NO_DROPOUT, *EAGER]},
    # resumed at iteration 2 from the checkpoint its graphed run saved (SAVES), graphed: 3 eager, 4 captured
    "pp2_ep2": {"nodrop": [*NO_DROPOUT, *EAGER], "resumed": [*GRAPHED, "checkpoint.load=<out>/pp2_ep2/iter_0000002"],
                # the whole MoE block graphed per layer, its token all-gathers over the stage's 2 ranks inside
                "layers": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,moe]", *LAYER_WARMUP],
                # graphed with full recompute: each recomputed MoE block all-gathers its tokens again in the backward
                "recompute": [*NO_DROPOUT, *GRAPHED, "model.recompute_granularity=full",
                              "model.recompute_method=uniform", "model.recompute_num_layers=1"]},
    "pp2_hybrid": {"layers": ["model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[mamba,attn,moe]",
                              *LAYER_WARMUP]},
    # per-layer graphs over virtual stages with expert parallel: each chunk's MoE blocks graphed whole
    "vpp2_ep2": {"layers": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,moe]", *LAYER_WARMUP]},
    "pp2_tp2_hybrid": {"layers": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[mamba,mlp,attn]",
                                  *LAYER_WARMUP]},
    "pp2_cp2_hybrid": {"layers": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[mamba,mlp,attn]",
                                  *LAYER_WARMUP]},
    "pp2_cp2": {"layers": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]", *LAYER_WARMUP],
                "nodrop": [*NO_DROPOUT, *EAGER],
                "resumed": [*GRAPHED, "checkpoint.load=<out>/pp2_cp2/iter_0000002"],
                # graphed, the core attention recomputed in the backward (its all-gathered keys and values kept)
                "recompute": [*NO_DROPOUT, *GRAPHED, "model.recompute_granularity=selective",
                              "model.recompute_modules=[core_attn]"]},
    "vpp2_cp2_zb": {"nodrop": [*NO_DROPOUT, *EAGER]},
}

# the graphed runs that also save a checkpoint (at iteration 2, under the launch's output folder)
SAVES = {"pp2_ep2": ["checkpoint.save_interval=2", "checkpoint.save=<out>/pp2_ep2"],
         "pp2_cp2": ["checkpoint.save_interval=2", "checkpoint.save=<out>/pp2_cp2"]}


def layouts_worker(out: str, device: str, which: str) -> None:
    """The torchrun worker: each layout of the dict named ``which`` eager and graphed (for LAYOUTS also without
    dropout and with layer graphs, and on the CPU the exchange of ``exchange``)."""
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    from graphstep.parallel.dims import local_tensor

    layouts = globals()[which]
    runs = {f"{name}/{mode}": (name, [*layout, *(GRAPHED_AS.get(name, GRAPHED) if mode == "graphed" else EAGER),
                                       *(SAVES.get(name, []) if mode == "graphed" else [])])
            for name, layout in layouts.items() for mode in ("eager", "graphed")}
    if which == "LAYOUTS":
        runs.update({f"{name}/nodrop": (name, [*layout, *NO_DROPOUT, *EAGER]) for name, layout in layouts.items()})
        runs.update({f"{name}/layers": (name, [*layouts[name], *graphs]) for name, graphs in PER_LAYER.items()})
        runs.update({f"{name}/{mode}": (name, [*layout, *extra]) for name, layout in TIED.items()
                     for mode, extra in (("eager", EAGER), ("graphed", GRAPHED), ("nodrop", [*NO_DROPOUT, *EAGER]))})
    if which == "LAYOUTS_4":
        runs.update({f"{name}/{mode}": (name, [*layouts[name], *extra]) for name, modes in MODES_4.items()
                     for mode, extra in modes.items()})

    if which == "LAYOUTS" and device == "cpu":
        runs["exchange"] = ("exchange", [])

    def run(spec: tuple[str, list[str]]) -> dict:
        name, overrides = spec
        if name == "exchange":
            return exchange()
        overrides = [o.replace("<out>", str(out)) for o in overrides]
        cfg = tiny_config(*COMMON, f"train.device={device}", *overrides, recipe=RECIPES.get(name, "llama3_tiny"))
        result = train(cfg, keep_model=True)
        embedding = getattr(result.model, "embedding", None)
        return {**train_report(result), "names": [n for n, _ in result.model.named_parameters()],
                "moe": [[row[k] for k in MOE_KEYS] for row in result.rows if MOE_KEYS[0] in row],
                "grad_norm": [row["grad_norm"] for row in result.rows],
                "embedding": None if embedding is None else  # the bits of this stage's (part of the) embedding
                hashlib.sha256(local_tensor(embedding.weight).detach().float().cpu().numpy().tobytes()).hexdigest()}

    report_runs(Path(out), device, runs, run)


def run_layouts(tmp: Path, device: str, timeout: float, nproc: int = 2, layouts: str = "LAYOUTS") -> list[dict]:
    if layouts == "LAYOUTS_4":
        write_sft(tmp / "sft.jsonl")  # the context-parallel layouts' data (SFT)
    return torchrun_reports(__file__, "layouts_worker", tmp, nproc, device, layouts, timeout=timeout)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("pipeline"), "cpu", timeout=600)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_graphed_pipeline_equals_eager_bit_for_bit(reports, layout):
    for report in reports:
        eager, graphed = report[f"{layout}/eager"], report[f"{layout}/graphed"]
        assert len(eager["losses"]) == ITERS and len(eager["eval"]) == ITERS // 2
        assert set(eager["states"]) == {"eager"} and eager["graphs"] == 0
        assert graphed["states"] == STATES["graphed"]
        assert graphed["graphs"] == 3  # training (the whole schedule), optimizer and evaluation graphs
        assert graphed["losses"] == eager["losses"]  # JSON floats: the exact bits
        assert graphed["eval"] == eager["eval"]
        assert graphed["shard"] == eager["shard"]
        assert eager["losses"][-1] < eager["losses"][0]


@pytest.mark.parametrize("layout", list(PER_LAYER))
def test_per_layer_graphs_on_the_stages_equal_eager(reports, layout):
    # forward and backward graph per module and slot: 1F1B's first stage (2 layers x attn, mlp) holds 2 micro-batches
    # in flight, its last (1 layer) 1 -- one slot: its attn and mlp replay as one run (cuda_graph/chains.py); GPipe
    # holds all 4 on both stages (1 and 2 whole layers)
    expected = {"pp2_1f1b": [2 * 4 * 2, 2 * 1 * 1], "pp2_gpipe": [2 * 1 * 4, 2 * 2 * 4]}[layout]
    for report, graphs in zip(reports, expected):
        eager, graphed = report[f"{layout}/eager"], report[f"{layout}/layers"]
        assert graphed["states"] == STATES["layers"]
        assert graphed["losses"] == eager["losses"] and graphed["eval"] == eager["eval"]
        assert graphed["shard"] == eager["shard"]
        assert graphed["graphs"] == graphs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stages_agree_on_the_loss_and_hold_their_own_layers(reports, layout):
    for mode in ("eager", "graphed"):
        assert reports[0][f"{layout}/{mode}"]["losses"] == reports[1][f"{layout}/{mode}"]["losses"]
        assert reports[0][f"{layout}/{mode}"]["eval"] == reports[1][f"{layout}/{mode}"]["eval"]
    first, last = reports[0][f"{layout}/eager"]["names"], reports[1][f"{layout}/eager"]["names"]
    assert first[0] == "embedding.weight" and "output_layer.weight" not in first
    assert last[-1] == "output_layer.weight" and "embedding.weight" not in last
    layers = [{n.split(".")[1] for n in names if n.startswith("layers.")} for names in (first, last)]
    assert layers == ([{"0", "1"}, {"2"}] if layout == "pp2_1f1b" else [{"0"}, {"1", "2"}])


@pytest.mark.parametrize("layout", list(TIED))
def test_tied_embeddings_over_two_stages_graphed_equal_eager_and_stay_equal(reports, layout):
    """Both stages hold ``embedding.weight`` (the last for its logits); graphed equals eager bit for bit, and after
    4 iterations with dropout the two copies are the same bits, eager and graphed."""
    first, last = (report[f"{layout}/eager"] for report in reports)
    assert first["names"][0] == "embedding.weight" and last["names"][0] == "embedding.weight"
    assert "output_layer.weight" not in first["names"] + last["names"]
    for report in reports:
        eager, graphed = report[f"{layout}/eager"], report[f"{layout}/graphed"]
        assert graphed["states"] == STATES["graphed"] and graphed["graphs"] == 3
        assert graphed["losses"] == eager["losses"] and graphed["eval"] == eager["eval"]
        assert graphed["shard"] == eager["shard"]
        assert eager["losses"][-1] < eager["losses"][0]
    for mode in ("eager", "graphed", "nodrop"):
        copies = [report[f"{layout}/{mode}"]["embedding"] for report in reports]
        assert copies[0] == copies[1], mode  # the same bits on both stages
    assert reports[0][f"{layout}/eager"]["embedding"] != reports[0][f"{layout}/nodrop"]["embedding"]  # it trained


@pytest.fixture(scope="module")
def one_process_tied():
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    return train(tiny_config(*COMMON, *NO_DROPOUT, *EAGER, "model.share_embeddings_and_output_weights=true"))


@pytest.mark.parametrize("layout", list(TIED))
def test_tied_pipeline_computes_what_one_tied_process_computes(reports, one_process_tied, layout):
    """Dropout off: the summed gradients of the two copies are the one tied embedding's gradient."""
    two = torch.tensor(reports[1][f"{layout}/nodrop"]["losses"], dtype=torch.float64)
    one = torch.tensor(one_process_tied.losses, dtype=torch.float64)
    assert two.shape == one.shape and len(two) > 0
    torch.testing.assert_close(two, one, rtol=2e-5, atol=0)


@pytest.fixture(scope="module")
def one_process():
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    return train(tiny_config(*COMMON, *NO_DROPOUT, *EAGER))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_computes_what_one_process_computes(reports, one_process, layout):
    """Dropout off: the same weights (every stage builds the whole model from one seed) and batches."""
    for key, pick in (("losses", lambda r: r), ("eval", lambda r: [v for _, v in r])):
        two = torch.tensor(pick(reports[1][f"{layout}/nodrop"][key]), dtype=torch.float64)
        one = torch.tensor(pick(getattr(one_process, "losses" if key == "losses" else "eval_losses")),
                           dtype=torch.float64)
        assert two.shape == one.shape and len(two) > 0
        torch.testing.assert_close(two, one, rtol=2e-5, atol=0)


def _assert_graphed_runs_equal_eager(reports: list[dict], layouts: dict, modes: dict) -> None:
    """Every layout's graphed run, and its per-layer one, equal its eager run on every rank, bit for bit."""
    for layout in layouts:
        for rank, report in enumerate(reports):
            eager = report[f"{layout}/eager"]
            assert set(eager["states"]) == {"eager"} and eager["losses"][-1] < eager["losses"][0], layout
            for mode in ("graphed", *(m for m in modes.get(layout, {}) if m == "layers")):
                graphed = report[f"{layout}/{mode}"]
                assert graphed["states"] == STATES["layers" if layout in GRAPHED_AS else mode], (layout, mode, rank)
                assert graphed["graphs"] > 0
                assert graphed["losses"] == eager["losses"], (layout, mode, rank)
                assert graphed["eval"] == eager["eval"], (layout, mode, rank)
                assert graphed["shard"] == eager["shard"], (layout, mode, rank)
            # every stage and rank logs the same loss
            assert all(r[f"{layout}/eager"]["losses"] == eager["losses"] for r in reports), layout


@pytest.fixture(scope="module")
def reports_4(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("pipeline4"), "cpu", timeout=600, nproc=4, layouts="LAYOUTS_4")


@pytest.mark.ranks4
def test_pipelines_on_four_ranks_equal_eager(reports_4):
    """pp2 x dp2 (each stage's gradients all-reduced over its data-parallel group, overlapped with the stage's last
    backward, inside the graph), pp2 x tp2 with sequence parallel and tied embeddings, pp2 x FSDP2 ZeRO-2 and
    ZeRO-3, MoE (also pp2 x tp2, pp2 x cp2, and pp2 x ep2: the experts split over each stage's 2 ranks, its MoE
    blocks also graphed per layer) and hybrid models and recompute over 2 stages, 2 stages x 2 virtual stages over
    tp2 with sequence parallel and over FSDP2 ZeRO-3, and pp2 x cp2 (also over FSDP2 ZeRO-3, with the a2a type,
    and pp2 x vpp2 x cp2 under zero bubble): the whole-schedule graphs and the per-layer graphs equal eager bit for
    bit."""
    _assert_graphed_runs_equal_eager(reports_4, LAYOUTS_4, MODES_4)
    shards = [r["pp2_dp2/eager"]["shard"] for r in reports_4]  # (pp, dp) = (0,0), (0,1), (1,0), (1,1)
    assert shards[0] == shards[1] and shards[2] == shards[3] and shards[0] != shards[2]
    shards = [r["pp2_zero3/eager"]["shard"] for r in reports_4]  # FSDP2: each data-parallel rank its own shard
    assert len(set(shards)) == 4


@pytest.mark.ranks4
@pytest.mark.parametrize("layout", ["vpp2_tp2_sp", "vpp2_zero3"])
def test_virtual_stages_over_sharded_ranks_hold_their_chunks(reports_4, layout):
    """rank = 2 pp + tp (or dp): pipeline rank 0 holds the embedding and layers 0 and 2 (chunks 0 and 2), rank 1
    layers 1 and 3 and the output layer (chunks 1 and 3), each of the 4 ranks its own shards of them."""
    assert len({r[f"{layout}/eager"]["shard"] for r in reports_4}) == 4
    names = [r[f"{layout}/eager"]["names"] for r in reports_4]
    assert names[0] == names[1] and names[2] == names[3]
    layers = [{n.split(".")[1] for n in held if n.startswith("layers.")} for held in (names[0], names[2])]
    assert layers == [{"0", "2"}, {"1", "3"}]
    assert names[0][0] == "embedding.weight" and "output_layer.weight" not in names[0]
    assert names[2][-1] == "output_layer.weight" and "embedding.weight" not in names[2]


@pytest.mark.ranks4
@pytest.mark.parametrize("layout", ["pp2_moe", "pp2_ep2", "pp2_hybrid"])
def test_moe_metrics_over_stages_are_the_whole_models(reports_4, layout):
    """Every rank logs the MoE metrics of all the model's MoE layers over its own micro-batches (the hybrid's
    first stage holds none; with expert parallel each rank routes its own tokens, whichever rank's experts run
    them): the stages of a pipeline log the same, graphed as eager."""
    for pipeline in ((0, 2), (1, 3)):  # rank = 2 pp + dp (with expert parallel: 2 pp + ep)
        logged = reports_4[pipeline[0]][f"{layout}/eager"]["moe"]
        assert len(logged) == 4 and all(aux > 0 and load >= 1 for aux, _, load in logged)
        for rank in pipeline:
            assert reports_4[rank][f"{layout}/eager"]["moe"] == logged
            assert reports_4[rank][f"{layout}/graphed"]["moe"] == logged
    assert reports_4[0][f"{layout}/eager"]["moe"] != reports_4[1][f"{layout}/eager"]["moe"]  # other data


@pytest.mark.ranks4
@pytest.mark.parametrize("layout", ["pp2_tp2_sp", "pp2_zero3"])
def test_sharded_stages_keep_the_tied_copies_equal(reports_4, layout):
    """rank = 2 pp + tp (or dp): each rank holds its own shards; the last stage's copy of the tied embedding
    holds the same rows, bit for bit, as the first stage's embedding on the same tensor-parallel (FSDP2) rank."""
    for mode in ("eager", "graphed", *MODES_4[layout]):
        runs = [r[f"{layout}/{mode}"] for r in reports_4]
        assert len({run["shard"] for run in runs}) == 4, mode
        copies = [run["embedding"] for run in runs]
        assert copies[0] == copies[2] and copies[1] == copies[3] and copies[0] != copies[1], mode
    first, last = reports_4[0][f"{layout}/eager"]["names"], reports_4[2][f"{layout}/eager"]["names"]
    assert first[0] == last[0] == "embedding.weight" and "output_layer.weight" not in first + last


@pytest.mark.ranks4
@pytest.mark.parametrize("layout,without", [("pp2_tp2_sp", "eager"), ("pp2_zero3", "nodrop"), ("pp2_ep2", "nodrop")])
def test_sharded_stages_recompute_graphed_as_without_recompute(reports_4, layout, without):
    """Selective recompute over pp2 x tp2 (sequence parallel), full recompute over pp2 x FSDP2 ZeRO-3 and over
    pp2 x ep2 (each recomputed MoE block all-gathers its stage's tokens again in the backward), dropout off, the
    whole schedule graphed: the eager run of the same layout without recompute, bit for bit."""
    for report in reports_4:
        recomputed, plain = report[f"{layout}/recompute"], report[f"{layout}/{without}"]
        assert recomputed["states"] == STATES["graphed"] and recomputed["graphs"] > 0
        for key in ("losses", "grad_norm", "eval", "shard"):
            assert recomputed[key] == plain[key], key


def _one_process(layout: str, data: Path):
    """``layout``'s model and data in one process (``data``: the folder of the SFT file)."""
    single = [o.replace("<out>", str(data)) for o in LAYOUTS_4[layout]
              if not o.startswith(("model.pipeline_model_parallel_size", "model.num_layers_in_first",
                                   "model.tensor_model", "model.sequence_parallel", "ddp.",
                                   "model.virtual_pipeline_model_parallel_size", "model.expert_model_parallel_size",
                                   "model.context_parallel_size", "model.cp_comm_type", "model.pipeline_schedule"))]
    return _one_process_run(RECIPES.get(layout, "llama3_tiny"), tuple(single))


@functools.cache  # pp2_dp2 and pp2_zero3 have the same one-process run, and so have pp2_moe and pp2_ep2
def _one_process_run(recipe: str, single: tuple[str, ...]):
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    return train(tiny_config(*COMMON, "train.device=cpu", *single, *NO_DROPOUT, *EAGER, recipe=recipe))


# the dropout-free run of each layout compared with one process (the evaluation losses too where the layout has
# one data-parallel replica: an evaluation reads train.eval_iters micro-batches per replica)
ONE_REPLICA = ("pp2_cp2", "pp2_cp2_a2a")
# the dropout-free run of each layout compared with one process
ONE_PROCESS = {"pp2_dp2": "nodrop", "pp2_tp2_sp": "eager", "pp2_zero3": "nodrop", "pp2_moe": "nodrop",
               "pp2_ep2": "nodrop", "pp2_tp2_moe": "eager", "pp2_cp2_moe": "eager", "pp2_cp2_a2a": "eager",
               "pp2_cp2_hybrid": "eager", "pp2_ep2_zero3": "eager", "vpp2_ep2": "eager",
               "pp2_ep2_a2a": "eager", "pp2_ep2_hybrid": "eager",
               "pp2_tp2_hybrid": "eager",
               "vpp2_tp2_sp": "eager", "vpp2_zero3": "nodrop", "pp2_cp2": "nodrop", "vpp2_cp2_zb": "nodrop"}


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> Path:
    """A folder with the SFT file the context-parallel layouts read (the one run_layouts writes)."""
    folder = tmp_path_factory.mktemp("sft")
    write_sft(folder / "sft.jsonl")
    return folder


@pytest.mark.ranks4
@pytest.mark.parametrize("layout", list(ONE_PROCESS))
def test_pipelines_on_four_ranks_compute_what_one_process_computes(reports_4, sft_data, layout):
    """Dropout off: 2 stages over replicated data parallel with overlap (tied), tensor parallel (tied), FSDP2 (tied)
    or an MoE model (whose expert biases move
    with the token counts of each stage's ranks), its experts split over each stage's ranks or not, its tokens over
    the stage's tensor-parallel ranks,
    2 stages x 2 virtual stages over tensor + sequence parallel or FSDP2 ZeRO-3, and 2 stages x 2 context-parallel
    ranks (tied; with 2 virtual stages under zero bubble) on SFT rows, compute what one process computes with the
    same global batch, to float tolerance: the losses (and, with one data-parallel replica, the evaluation losses),
    and the gradient norm (each element counted once over the mesh,
    each expert once over the stages and expert-parallel ranks, the last stage's copy of a tied embedding not at
    all)."""
    single = _one_process(layout, sft_data)
    one = torch.tensor(single.losses, dtype=torch.float64)
    norms = torch.tensor([row["grad_norm"] for row in single.rows], dtype=torch.float64)
    for report in reports_4:
        run = report[f"{layout}/{ONE_PROCESS[layout]}"]
        four = torch.tensor(run["losses"], dtype=torch.float64)
        assert four.shape == one.shape == (ITERS,)
        torch.testing.assert_close(four, one, rtol=2e-5, atol=0)
        torch.testing.assert_close(torch.tensor(run["grad_norm"], dtype=torch.float64), norms, rtol=1e-4, atol=0)
        if layout in ONE_REPLICA:  # one data-parallel replica reads the evaluation batches one process reads
            got, want = [v for _, v in run["eval"]], [v for _, v in single.eval_losses]
            assert len(got) == len(want) == ITERS // 2
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                                       rtol=2e-5, atol=0)


@pytest.mark.ranks4
def test_context_parallel_stages_recompute_and_resume_exactly(reports_4):
    """pp2 x cp2 (rank = 2 pp + cp): the two context-parallel ranks of a stage hold the same weights (their
    gradients averaged over the stage's dp x cp ranks), and both stages' copies of the tied embedding the same
    bits; over FSDP2 each rank holds its own shard. Without dropout, graphed with the core attention recomputed it
    is the eager run's bit for bit (one process's, to float tolerance: the test above); resumed at iteration 2
    from the checkpoint its graphed run saved (dropout on), it continues bit for bit: the losses, the evaluation
    at 4 and every rank's weights."""
    shards = [r["pp2_cp2/eager"]["shard"] for r in reports_4]
    assert shards[0] == shards[1] and shards[2] == shards[3] and shards[0] != shards[2]
    assert len({r["pp2_cp2/eager"]["embedding"] for r in reports_4}) == 1
    assert len({r["pp2_cp2_zero3/eager"]["shard"] for r in reports_4}) == 4
    for report in reports_4:
        staged, recomputed = (report[f"pp2_cp2/{mode}"] for mode in ("nodrop", "recompute"))
        assert recomputed["states"] == STATES["graphed"]
        assert (recomputed["losses"], recomputed["eval"], recomputed["shard"]) == \
            (staged["losses"], staged["eval"], staged["shard"])
        whole, resumed = report["pp2_cp2/graphed"], report["pp2_cp2/resumed"]
        assert resumed["states"] == ["eager", "captured"] and whole["states"] == STATES["graphed"]
        assert resumed["losses"] == whole["losses"][2:] and len(resumed["losses"]) == 2
        assert resumed["eval"] == whole["eval"][1:] and len(resumed["eval"]) == 1
        assert resumed["shard"] == whole["shard"]


@pytest.mark.ranks4
def test_expert_parallel_stages_hold_their_own_experts_and_resume_exactly(reports_4):
    """pp2 x ep2 (rank = 2 pp + ep): each rank holds its stage's layers and half of their experts, so the 4 ranks'
    weights differ; without dropout it computes what the same model over pp2 x dp2 computes (the expert
    gradients summed over the ranks whose tokens reached them, the norm counting each expert once); and resumed
    at iteration 2 from the checkpoint its graphed run saved (dropout on), it continues bit for bit: the losses,
    the evaluation at 4 and every rank's weights."""
    assert len({r["pp2_ep2/eager"]["shard"] for r in reports_4}) == 4
    first, last = reports_4[0]["pp2_ep2/eager"]["names"], reports_4[2]["pp2_ep2/eager"]["names"]
    assert first == reports_4[1]["pp2_ep2/eager"]["names"] and last == reports_4[3]["pp2_ep2/eager"]["names"]
    layers = [{n.split(".")[1] for n in names if n.startswith("layers.")} for names in (first, last)]
    assert layers == [{"0"}, {"1"}]
    for report in reports_4:
        ep, dp = report["pp2_ep2/nodrop"], report["pp2_moe/nodrop"]
        torch.testing.assert_close(torch.tensor(ep["losses"], dtype=torch.float64),
                                   torch.tensor(dp["losses"], dtype=torch.float64), rtol=2e-5, atol=0)
        torch.testing.assert_close(torch.tensor(ep["grad_norm"], dtype=torch.float64),
                                   torch.tensor(dp["grad_norm"], dtype=torch.float64), rtol=1e-4, atol=0)
        whole, resumed = report["pp2_ep2/graphed"], report["pp2_ep2/resumed"]
        assert resumed["states"] == ["eager", "captured"] and whole["states"] == STATES["graphed"]
        assert resumed["losses"] == whole["losses"][2:] and len(resumed["losses"]) == 2
        assert resumed["eval"] == whole["eval"][1:] and len(resumed["eval"]) == 1
        assert resumed["shard"] == whole["shard"]


@pytest.mark.cuda
def test_pipelines_on_four_gpus_graphed_equal_eager(tmp_path):
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs (the nvidia-h100-x4 machine)")
    reports = run_layouts(tmp_path, "cuda", timeout=900, nproc=4, layouts="LAYOUTS_4")
    _assert_graphed_runs_equal_eager(reports, LAYOUTS_4, MODES_4)


@pytest.mark.cuda
def test_pipeline_on_two_gpus_graphed_equal_eager(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (the nvidia-h200-x2 machine)")
    assert_graphed_equals_eager(run_layouts(tmp_path, "cuda", timeout=900), {**LAYOUTS, **TIED})


def exchange() -> dict:
    """Each rank posts a receive from its peer, then a send to it, then waits on both: the order a pipeline
    schedule uses. A replay that waited on each receive as soon as it re-posted it would block both ranks (the
    group's timeout of 30 s ends the launch)."""
    from datetime import timedelta

    import torch.distributed as dist

    import graphstep

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank(group)
    peer = dist.get_global_rank(group, 1 - rank)
    results = {}
    try:
        for mode in ("eager", "graphed"):
            weight, inbox = torch.full((4,), float(rank + 1)), torch.zeros(4)

            def step(x):
                recv = dist.irecv(inbox, peer, group=group)
                send = dist.isend(x * weight, peer, group=group)
                recv.wait()
                send.wait()
                weight.add_(inbox * 0.5)
                return inbox * 2

            if mode == "graphed":
                step = graphstep.graph_step(step, warmup_steps=1, device="cpu")
            results[mode] = [step(torch.arange(4.0) + i).tolist() for i in range(5)] + [weight.tolist()]
    finally:
        graphstep.close_all()
        dist.destroy_process_group(group)
    return results


def test_replayed_exchange_waits_where_the_capture_waited(reports):
    for report in reports:
        assert report["exchange"]["graphed"] == report["exchange"]["eager"] and len(report["exchange"]["eager"]) == 6
