"""Tensor/sequence parallel (DTensor) and FSDP2 under torchrun: graphed runs equal eager, bit for bit.

One torchrun launch of 2 ranks runs this file as its worker (``__main__``
below). Each rank trains every layout of ``LAYOUTS`` twice -- eagerly and with
the full-iteration, optimizer and evaluation graphs -- and writes, per run,
the per-iteration losses, the evaluation losses and a digest of the
parameters it holds (its shard). On the CPU, the graphs run on the replay
backend over gloo (the collectives DTensor and FSDP2 issue are recorded and
re-run); with ``cuda`` (2 GPUs, scripts/gpu-check) they are CUDA graphs over
NCCL. Dropout is on: attention dropout draws from the model-parallel stream,
hidden dropout from the data-parallel one (model-parallel with sequence
parallelism).

A second set of runs with dropout off compares layouts with each other: a
tensor-parallel or FSDP2 run computes what one process computes with the same
global batch, up to the order of floating-point sums.

A third set recomputes activations over the sharded layers (``RECOMPUTE``):
graphed equals eager, and the recomputing run computes the bits of the same
layout without recompute.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from helpers.launch import report_runs, subprocess_env, torchrun, torchrun_reports
from helpers.reports import assert_graphed_equals_eager, core_attention_calls, graphed_states, train_report

pytestmark = pytest.mark.slow

ITERS = 4
COMMON = [f"train.train_iters={ITERS}", "logger.log_interval=1", "model.cuda_graph_warmup_steps=1",
          "train.eval_iters=1", "train.eval_interval=1", "model.use_te_rng_tracker=true"]
# iterations 1-4: one warm-up, captured at 2, replayed at 3 and 4; evaluations after each of them (the last one
# at the end): the evaluation graph warms up at 1, captures at 2 and replays at 3 and 4
REPLAYED = graphed_states(ITERS)  # the states of a graphed run
# the 2-GPU runs: 8 iterations, evaluations at 2, 4, 6, 8 (the evaluation graph warms up twice, captures at 6 and
# replays at 8)
GPU_SCHEDULE = ["train.train_iters=8", "model.cuda_graph_warmup_steps=2", "train.eval_iters=2", "train.eval_interval=2"]
GRAPHED = ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"]
EAGER = ["model.cuda_graph_impl=none"]  # the recipe's default is full_iteration
LAYOUTS = {
    "tp2_sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    "tp2": ["model.tensor_model_parallel_size=2"],
    "fsdp_zero3": ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"],
    "fsdp_zero2": ["ddp.use_distributed_optimizer=true", "model.vocab_size=257"],  # uneven shards: 129 + 128 rows
    "fsdp_zero3_prefetch": ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params",
                            "ddp.overlap_param_gather=true"],
    "dp2_overlap": ["ddp.overlap_grad_reduce=true", "ddp.bucket_size=5000"],  # replicated, several buckets
    "fsdp_zero2_prefetch": ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads",
                            "ddp.overlap_param_gather=true"],
    # a hybrid (Mamba) model over FSDP2 ZeRO-3: its Mamba layers sharded as any other layer
    "fsdp_zero3_hybrid": ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params",
                          "model.hybrid_override_pattern=M-*-", "model.num_layers=4"],
}
NO_DROPOUT = ["model.attention_dropout=0.0", "model.hidden_dropout=0.0"]
# the layouts compared with one process (dropout off): one of each kind of sharding, and the overlap
COMPARED = ("tp2_sp", "tp2", "fsdp_zero3", "dp2_overlap")
# per-layer graphs over tensor-parallel layers (their collectives inside the layer graphs), and inside
# FSDP2's layers (ZeRO-2: the gathers and reduce-scatters eager, between the layer graphs)
PER_LAYER = {"tp2_sp": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"],
             "tp2": ["model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[]"],
             "fsdp_zero2": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"],
             # each layer gathers the next one's parameters into its kept storage before its own forward
             "fsdp_zero2_prefetch": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"],
             # 4 ranks: per-layer graphs over tensor-parallel layers inside FSDP2 (ZeRO-2) layers
             "tp2_sp_zero2": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"]}
# activation recompute over sharded layers: selective recompute of the core attention over tp2_sp with hidden
# dropout on (none inside the recomputed attention: R35) against the same run without recompute, full recompute
# (no dropout: R35) over FSDP2 ZeRO-3 against fsdp_zero3/nodrop, and selective recompute of the attention and MLP
# cores inside ZeRO-2's per-layer graphs (their backward graphs re-run the cores); each eager, graphed
SELECTIVE = ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn]",
             "model.attention_dropout=0.0"]
SELECTIVE_BOTH = ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn,mlp]", *NO_DROPOUT]
FULL_RECOMPUTE = ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1",
                  *NO_DROPOUT]
RECOMPUTE = {"tp2_sp": {"recompute": [*SELECTIVE, *EAGER], "recompute_graphed": [*SELECTIVE, *GRAPHED],
                        "without": ["model.attention_dropout=0.0", *EAGER]},
             "fsdp_zero3": {"recompute": [*FULL_RECOMPUTE, *EAGER], "recompute_graphed": [*FULL_RECOMPUTE, *GRAPHED]},
             "fsdp_zero2": {"recompute": [*SELECTIVE_BOTH, *EAGER],
                            "recompute_layers": [*SELECTIVE_BOTH, *PER_LAYER["fsdp_zero2"]]}}
WITHOUT = {"tp2_sp": "without", "fsdp_zero3": "nodrop"}  # each recompute run's twin without recompute
HYBRID = ["model.hybrid_override_pattern=M-*-", "model.num_layers=4", "model.mamba_num_groups=2"]
# 4 ranks: 2 data-parallel x 2 tensor-parallel, the data-parallel dimension sharded by FSDP2 or replicated
LAYOUTS_2D = {
    "tp2_sp_fsdp2": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true",
                     "ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"],
    "tp2_dp2": ["model.tensor_model_parallel_size=2"],
    "tp2_sp_zero2": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true",
                     "ddp.use_distributed_optimizer=true"],
    # a hybrid (Mamba) model over FSDP2 x tensor parallel: each rank's Mamba heads and groups (tensor_parallel.py
    # _mamba_plan) sharded again over the data-parallel ranks, graphed whole
    "tp2_sp_fsdp2_hybrid": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true",
                            "ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params",
                            *HYBRID],
}


def layouts_worker(out: str, device: str, which: str) -> None:
    """The torchrun worker: every layout of the dict named ``which`` eager, graphed and with layer graphs (and,
    for LAYOUTS, the dropout-free runs compared with one process)."""
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    layouts = globals()[which]
    runs = {f"{name}/{mode}": [*layout, *(GRAPHED if mode == "graphed" else EAGER)]
            for name, layout in layouts.items() for mode in ("eager", "graphed")}
    runs.update({f"{name}/layers": [*layouts[name], *graphs] for name, graphs in PER_LAYER.items()
                 if name in layouts})
    if which == "LAYOUTS":
        runs.update({f"{name}/nodrop": [*layouts[name], *NO_DROPOUT, *EAGER] for name in COMPARED})
        runs["dp2/nodrop"] = [*NO_DROPOUT, *EAGER]
        runs.update({f"{name}/{mode}": [*layouts[name], *extra] for name, modes in RECOMPUTE.items()
                     for mode, extra in modes.items()})

    def run(overrides: list[str]) -> dict:
        with core_attention_calls() as calls:
            result = train(tiny_config(*COMMON, *(GPU_SCHEDULE if device == "cuda" else []), f"train.device={device}",
                                       *overrides), keep_model=True)
        return {**train_report(result), "grad_norms": [r["grad_norm"] for r in result.rows],
                "attention_calls": calls[0]}

    report_runs(Path(out), device, runs, run)


def run_layouts(tmp: Path, device: str, timeout: float, nproc: int = 2, layouts: str = "LAYOUTS") -> list[dict]:
    return torchrun_reports(__file__, "layouts_worker", tmp, nproc, device, layouts, timeout=timeout)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("layouts"), "cpu", timeout=600)


@pytest.mark.ranks4
def test_two_dimensional_layouts_on_four_ranks_equal_eager(tmp_path):
    """dp2 x tp2: FSDP2 over tensor-parallel DTensors (2-D shards) -- a hybrid (Mamba) model's too --, and
    replicated data parallel whose gradient all-reduce runs over each tensor-parallel rank's data-parallel group."""
    reports = run_layouts(tmp_path, "cpu", timeout=600, nproc=4, layouts="LAYOUTS_2D")
    for layout in LAYOUTS_2D:
        for report in reports:
            eager, graphed = report[f"{layout}/eager"], report[f"{layout}/graphed"]
            assert len(eager["losses"]) == ITERS and eager["losses"][-1] < eager["losses"][0]
            assert set(eager["states"]) == {"eager"} and graphed["states"] == REPLAYED
            assert graphed["losses"] == eager["losses"] and graphed["eval"] == eager["eval"], layout
            assert graphed["shard"] == eager["shard"], layout
        assert all(r[f"{layout}/eager"]["losses"] == reports[0][f"{layout}/eager"]["losses"] for r in reports)
        shards = [r[f"{layout}/eager"]["shard"] for r in reports]  # ranks 0, 1 = tp ranks of replica 0
        assert shards[0] != shards[1]
        assert (shards[0] == shards[2]) == (layout == "tp2_dp2")  # replicas agree; FSDP2 shards differ
    for report in reports:
        layers, eager = report["tp2_sp_zero2/layers"], report["tp2_sp_zero2/eager"]
        assert layers["losses"] == eager["losses"] and layers["eval"] == eager["eval"]
        assert layers["shard"] == eager["shard"] and layers["states"] == REPLAYED


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_graphed_layout_equals_eager_bit_for_bit(reports, layout):
    for report in reports:
        eager, graphed = report[f"{layout}/eager"], report[f"{layout}/graphed"]
        assert len(eager["losses"]) == ITERS and len(eager["eval"]) == ITERS
        assert graphed["losses"] == eager["losses"]  # JSON floats: the exact bits
        assert graphed["eval"] == eager["eval"]
        assert graphed["graphs"] == 3  # training, optimizer and evaluation graphs all captured
        assert graphed["shard"] == eager["shard"]
        assert graphed["states"] == REPLAYED
        assert set(eager["states"]) == {"eager"} and eager["graphs"] == 0
        assert eager["losses"][-1] < eager["losses"][0]


@pytest.mark.parametrize("layout", [name for name in PER_LAYER if name in LAYOUTS])
def test_per_layer_graphs_over_sharded_layers_equal_eager(reports, layout):
    for report in reports:
        eager, graphed = report[f"{layout}/eager"], report[f"{layout}/layers"]
        assert graphed["losses"] == eager["losses"] and graphed["eval"] == eager["eval"]
        assert graphed["shard"] == eager["shard"]
        assert graphed["states"] == REPLAYED


@pytest.mark.parametrize("layout", list(RECOMPUTE))
def test_recompute_over_sharded_layers_graphed_equals_eager(reports, layout):
    """The recomputed regions re-run DTensor's collectives and FSDP2's gathers inside the backward, eagerly, inside
    the full-iteration graph and inside ZeRO-2's per-layer graphs: graphed equals eager bit for bit -- losses,
    gradient norms, evaluation losses and each rank's shard -- and the eager run calls the core attention twice
    per training forward (once more in the backward)."""
    for report in reports:
        eager = report[f"{layout}/recompute"]
        assert eager["attention_calls"] == 2 * report[f"{layout}/eager"]["attention_calls"] > 0
        for mode in set(RECOMPUTE[layout]) - {"recompute", "without"}:
            graphed = report[f"{layout}/{mode}"]
            assert graphed["states"] == REPLAYED and graphed["graphs"] > 0, mode
            for key in ("losses", "grad_norms", "eval", "shard"):
                assert graphed[key] == eager[key], (mode, key)


@pytest.mark.parametrize("layout", list(WITHOUT))
def test_recompute_over_sharded_layers_computes_what_the_layout_computes_without(reports, layout):
    """Recompute re-runs the same ops on the same inputs (no dropout inside a recomputed region: R35): the run
    without it, bit for bit."""
    for report in reports:
        recomputed, without = report[f"{layout}/recompute"], report[f"{layout}/{WITHOUT[layout]}"]
        assert recomputed["attention_calls"] == 2 * without["attention_calls"]
        for key in ("losses", "grad_norms", "eval", "shard"):
            assert recomputed[key] == without[key], key


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ranks_agree_on_the_logged_losses(reports, layout):
    for mode in ("eager", "graphed"):
        assert reports[0][f"{layout}/{mode}"]["losses"] == reports[1][f"{layout}/{mode}"]["losses"]
        assert reports[0][f"{layout}/{mode}"]["eval"] == reports[1][f"{layout}/{mode}"]["eval"]


def test_shards_differ_between_ranks(reports):
    """Each rank holds its own part of the parameters (not a replica) in every sharded layout."""
    for layout in LAYOUTS:
        replicas = layout.startswith("dp2")
        assert (reports[0][f"{layout}/eager"]["shard"] == reports[1][f"{layout}/eager"]["shard"]) == replicas, layout
    assert reports[0]["dp2/nodrop"]["shard"] == reports[1]["dp2/nodrop"]["shard"]  # replicas


def test_overlapped_reduction_computes_the_same_bits(reports):
    """ddp.overlap_grad_reduce reduces the same buckets, pre-divided the same way: the same losses and weights."""
    for report in reports:
        assert report["dp2_overlap/nodrop"]["losses"] == report["dp2/nodrop"]["losses"]
        assert report["dp2_overlap/nodrop"]["shard"] == report["dp2/nodrop"]["shard"]


@pytest.fixture(scope="module")
def one_process():
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    return train(tiny_config(*COMMON, *NO_DROPOUT))


@pytest.mark.parametrize("layout", [*COMPARED, "dp2"])
def test_layout_computes_what_one_process_computes(reports, one_process, layout):
    """Dropout off: the same global batch and weights, so only the order of sums differs."""
    two = torch.tensor(reports[0][f"{layout}/nodrop"]["losses"], dtype=torch.float64)
    one = torch.tensor(one_process.losses, dtype=torch.float64)
    assert two.shape == one.shape == (ITERS,)
    torch.testing.assert_close(two, one, rtol=2e-5, atol=0)
    if not layout.startswith("tp2"):
        return  # 2 data-parallel ranks each evaluate eval_iters batches of their own: other batches
    ev2 = torch.tensor([v for _, v in reports[0][f"{layout}/nodrop"]["eval"]], dtype=torch.float64)
    ev1 = torch.tensor([v for _, v in one_process.eval_losses], dtype=torch.float64)
    torch.testing.assert_close(ev2, ev1, rtol=2e-5, atol=0)


@pytest.mark.cuda
def test_layouts_on_two_gpus_graphed_equal_eager(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (the nvidia-h200-x2 machine)")
    reports = run_layouts(tmp_path, "cuda", timeout=900)
    assert_graphed_equals_eager(reports, LAYOUTS)
    for layout in [name for name in PER_LAYER if name in LAYOUTS]:
        for report in reports:
            assert report[f"{layout}/layers"]["losses"] == report[f"{layout}/eager"]["losses"], layout
            assert report[f"{layout}/layers"]["shard"] == report[f"{layout}/eager"]["shard"], layout


def test_documented_cpu_command_trains_tensor_parallel_graphed(tmp_path):
    """docs/parallel.md's CPU launch, through the CLI: 2 gloo ranks, tp2 + sequence parallel, one graph."""
    from graphstep.training.metrics import read_metrics

    metrics = tmp_path / "metrics.jsonl"
    cmd = torchrun(2, "-m", "graphstep", "train", "train.device=cpu", "model.tensor_model_parallel_size=2",
                   "model.sequence_parallel=true", "model.cuda_graph_impl=full_iteration",
                   "model.use_te_rng_tracker=true", "train.train_iters=3", "model.cuda_graph_warmup_steps=1",
                   "logger.log_interval=1",
                   "logger.progress_bar=false", "data.corpus_max_bytes=300000", "data.split=90,10,0",
                   f"logger.metrics_path={metrics}")
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "1 data-parallel x 2 tensor-parallel + sequence-parallel ranks" in output
    rows = read_metrics(metrics)
    assert [r["iteration"] for r in rows] == list(range(1, 4))
    assert [r["state"] for r in rows] == ["eager", "captured", "replayed"]  # 1 warm-up step
