"""The 3-D layout under torchrun: 2 pipeline stages x 2 data-parallel x 2 tensor-parallel ranks, graphed equal eager.

One torchrun launch of 8 ranks runs this file's ``layouts_worker``: each rank
trains every layout of ``LAYOUTS`` eagerly and with the full-iteration,
optimizer and evaluation graphs -- the whole schedule, its sends and receives,
the tensor-parallel collectives and the data-parallel reduction (the bucketed
all-reduce, or FSDP2's gathers and reduce-scatters) captured once per rank --
and writes the per-iteration losses, the evaluation losses, a digest of the
shards it holds and the names of its parameters. One layout adds 2 virtual
stages per pipeline rank (the interleaved 1F1B schedule, each chunk an FSDP2
root of its own) to tensor + sequence parallel and the distributed optimizer:
Megatron Bridge's large recipes (TP x PP x VPP over sharded data parallel).
Another puts 2 context-parallel ranks in place of the data-parallel ones:
Bridge's Llama 3 70B layout (TP x PP x VPP x CP, the distributed optimizer)
in small, also run with per-layer graphs. And an MoE model over 2 stages x 2
expert-parallel x 2 tensor-parallel ranks, also compared with one process. On
the CPU the graphs run on the replay backend over gloo. The 4-rank combinations (2 stages with tensor
parallel, FSDP2, context parallel, MoE, hybrid models, recompute) are in
test_pipeline.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.data import write_sft
from helpers.launch import report_runs, torchrun_reports
from helpers.reports import graphed_states, train_report

pytestmark = pytest.mark.slow

ITERS = 4  # 8 processes on CI's 2 cores: eager, captured, replayed, replayed
# evaluations at 2 and 4: the evaluation graph warms up at 2 and is captured (and replayed) at 4
COMMON = [f"train.train_iters={ITERS}", "logger.log_interval=1", "model.cuda_graph_warmup_steps=1",
          "train.eval_iters=1", "train.eval_interval=2", "model.use_te_rng_tracker=true",
          "model.share_embeddings_and_output_weights=false", "model.num_layers=3",
          "model.pipeline_model_parallel_size=2", "model.num_layers_in_first_pipeline_stage=2",
          "model.tensor_model_parallel_size=2", "train.global_batch_size=8"]  # 2 micro-batches of 2 per pipeline
GRAPHED = ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"]
EAGER = ["model.cuda_graph_impl=none"]
# 2 virtual stages per pipeline rank: 4 layers in 4 chunks of 1, pipeline rank 0 holding chunks 0 and 2, rank 1
# chunks 1 and 3
VPP2 = ["model.num_layers=4", "model.num_layers_in_first_pipeline_stage=null",
        "model.virtual_pipeline_model_parallel_size=2"]
LAYOUTS = {  # rank = 4 pp + 2 dp + tp
    "pp2_zero3_tp2_sp": ["model.sequence_parallel=true", "ddp.use_megatron_fsdp=true",
                         "ddp.data_parallel_sharding_strategy=optim_grads_params"],
    # virtual stages: the 2 micro-batches per pipeline run in 1 round of 2. The distributed optimizer (Bridge's
    # ddp.use_distributed_optimizer=true) is FSDP2 ZeRO-2 here
    "pp2_vpp2_zero2_tp2_sp": [*VPP2, "model.sequence_parallel=true", "ddp.use_distributed_optimizer=true"],
    # Megatron Bridge's Llama 3 70B layout in small (TP x PP x VPP x CP, sequence parallel, the distributed
    # optimizer): rank = 4 pp + 2 cp + tp, one data-parallel replica, the optimizer state sharded over the 2
    # context-parallel ranks, 2 micro-batches of 2; SFT rows (the file under the launch's folder), whose loss masks
    # keep other numbers of tokens on the two context-parallel ranks
    "pp2_vpp2_cp2_zero2_tp2_sp": [*VPP2, "model.sequence_parallel=true", "model.context_parallel_size=2",
                                  "ddp.use_distributed_optimizer=true", "train.global_batch_size=4",
                                  "data.dataset=sft", "data.data_path=<out>/sft.jsonl", "data.split=80,20,0",
                                  "model.seq_length=64"],
    # an MoE model (qwen3_moe_tiny, expert bias on) over pp2 x ep2 x tp2 with sequence parallel: rank = 4 pp + 2 ep
    # + tp, each stage's experts split over its 2 expert-parallel ranks, the tokens over its 2 tensor-parallel ranks,
    # the expert-bias counts summed over the stage's 4 ranks. Dropout and the load-balancing loss off: compared
    # with one process too
    "pp2_ep2_tp2_moe": ["recipe=qwen3_moe_tiny", "model.expert_model_parallel_size=2", "model.sequence_parallel=true",
                        "train.micro_batch_size=2", "model.moe_router_enable_expert_bias=true",
                        "model.moe_router_bias_update_rate=0.01", "model.moe_router_score_function=sigmoid",
                        "model.moe_aux_loss_coeff=0.0", "model.attention_dropout=0.0", "model.hidden_dropout=0.0",
                        "data.corpus_max_bytes=300000", "data.split=90,10,0"],
}
# also run with per-layer graphs (over stages they warm up for 2 steps: rule R29), dropout on
LAYERS = ("pp2_vpp2_cp2_zero2_tp2_sp",)  # virtual stages x tp2 with per-layer graphs: test_pipeline.py's vpp2_tp2_sp
PER_LAYER = ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]", "model.cuda_graph_warmup_steps=2"]


def layouts_worker(out: str, device: str) -> None:
    """The torchrun worker: each layout eager and graphed (those of ``COMPARED`` also without dropout)."""
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    runs = {f"{name}/{mode}": [*layout, *(GRAPHED if mode == "graphed" else EAGER)]
            for name, layout in LAYOUTS.items() for mode in ("eager", "graphed")}
    runs.update({f"{name}/layers": [*LAYOUTS[name], *PER_LAYER] for name in LAYERS})

    def run(overrides: list[str]) -> dict:
        recipe = [o.split("=", 1)[1] for o in overrides if o.startswith("recipe=")] or ["llama3_tiny"]
        overrides = [o.replace("<out>", out) for o in overrides if not o.startswith("recipe=")]
        result = train(tiny_config(*COMMON, f"train.device={device}", *overrides, recipe=recipe[0]), keep_model=True)
        return {**train_report(result), "names": [n for n, _ in result.model.named_parameters()],
                "grad_norm": [row["grad_norm"] for row in result.rows]}

    report_runs(Path(out), device, runs, run)


def run_layouts(tmp: Path, device: str, timeout: float) -> list[dict]:
    write_sft(tmp / "sft.jsonl")
    return torchrun_reports(__file__, "layouts_worker", tmp, 8, device, timeout=timeout)


def _assert_graphed_equals_eager(reports: list[dict]) -> None:
    for layout in LAYOUTS:
        for rank, report in enumerate(reports):
            eager, graphed = report[f"{layout}/eager"], report[f"{layout}/graphed"]
            assert set(eager["states"]) == {"eager"} and eager["losses"][-1] < eager["losses"][0], layout
            assert graphed["states"] == ["eager", "captured", "replayed", "replayed"], (layout, rank)
            assert graphed["losses"] == eager["losses"] and graphed["eval"] == eager["eval"], (layout, rank)
            assert graphed["shard"] == eager["shard"], (layout, rank)
            assert eager["losses"] == reports[0][f"{layout}/eager"]["losses"], (layout, rank)  # one loss logged
            if layout in LAYERS:
                layers = report[f"{layout}/layers"]
                assert layers["states"] == graphed_states(ITERS, warmup=2), (layout, rank)
                assert (layers["losses"], layers["eval"], layers["shard"]) == \
                    (eager["losses"], eager["eval"], eager["shard"]), (layout, rank)


@pytest.mark.ranks8
def test_three_dimensional_layouts_on_eight_ranks_equal_eager(tmp_path):
    """pp2 x dp2 x tp2 over FSDP2 ZeRO-3 (with sequence parallel), pp2 x vpp2 x dp2 x tp2 and pp2 x vpp2 x cp2 x
    tp2 over the distributed optimizer (with sequence parallel), and an MoE model over pp2 x ep2 x tp2: the whole
    schedule
    graphed, and for the context-parallel one the per-layer graphs, equal eager bit for bit on every rank, and
    every rank holds the part of the model its place says."""
    reports = run_layouts(tmp_path, "cpu", timeout=600)
    _assert_graphed_equals_eager(reports)
    assert len({r["pp2_zero3_tp2_sp/eager"]["shard"] for r in reports}) == 8  # FSDP2: each rank its own
    vpp = [r["pp2_vpp2_zero2_tp2_sp/eager"] for r in reports]
    assert len({r["shard"] for r in vpp}) == 8
    names = [r["names"] for r in vpp]  # pipeline rank 0: ranks 0-3, chunks 0 and 2; rank 1: ranks 4-7, 1 and 3
    assert all(n == names[0] for n in names[:4]) and all(n == names[4] for n in names[4:])
    layers = [{n.split(".")[1] for n in held if n.startswith("layers.")} for held in (names[0], names[4])]
    assert layers == [{"0", "2"}, {"1", "3"}]
    assert names[0][0] == "embedding.weight" and "output_layer.weight" not in names[0]
    assert names[4][-1] == "output_layer.weight" and "embedding.weight" not in names[4]
    _assert_context_parallel_stages(reports)
    _assert_expert_and_tensor_parallel_stages(reports)


def _assert_expert_and_tensor_parallel_stages(reports: list[dict]) -> None:
    """pp2 x ep2 x tp2 MoE (rank = 4 pp + 2 ep + tp): the stage's 4 ranks hold 4 different shards (half of the
    experts each, the attention split over tp), and without dropout and the load-balancing loss it computes what
    one process computes with the same global batch: the losses and gradient norms to float tolerance."""
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    layout = "pp2_ep2_tp2_moe"
    assert len({r[f"{layout}/eager"]["shard"] for r in reports}) == 8
    single = [o for o in (*COMMON, *LAYOUTS[layout]) if not o.startswith((
        "recipe=", "model.pipeline_model_parallel_size", "model.num_layers_in_first", "model.tensor_model",
        "model.sequence_parallel", "model.expert_model_parallel_size"))]
    one = train(tiny_config(*single, "train.device=cpu", *EAGER, recipe="qwen3_moe_tiny"))
    for report in reports:
        run = report[f"{layout}/eager"]
        torch.testing.assert_close(torch.tensor(run["losses"], dtype=torch.float64),
                                   torch.tensor(one.losses, dtype=torch.float64), rtol=2e-5, atol=0)
        torch.testing.assert_close(torch.tensor(run["grad_norm"], dtype=torch.float64),
                                   torch.tensor([r["grad_norm"] for r in one.rows], dtype=torch.float64),
                                   rtol=1e-4, atol=0)


def _assert_context_parallel_stages(reports: list[dict]) -> None:
    """pp2 x vpp2 x cp2 x tp2 over the distributed optimizer (rank = 4 pp + 2 cp + tp): each rank holds its own
    shards (FSDP2 ZeRO-2 over the 2 context-parallel ranks, of its tensor-parallel shards), each pipeline rank its
    chunks' layers. What it computes without dropout is shown in pieces, each against one process: virtual stages
    with context parallel (``vpp2_cp2_zb``) and with tensor parallel (``vpp2_tp2_sp``) in test_pipeline.py, context
    with tensor parallel (``cp2_tp2_sp``) in test_context_parallel.py."""
    layout = "pp2_vpp2_cp2_zero2_tp2_sp"
    assert len({r[f"{layout}/eager"]["shard"] for r in reports}) == 8
    layers = [{n.split(".")[1] for n in reports[r][f"{layout}/eager"]["names"] if n.startswith("layers.")}
              for r in (0, 4)]
    assert layers == [{"0", "2"}, {"1", "3"}]


@pytest.mark.cuda
def test_three_dimensional_layouts_on_eight_gpus_equal_eager(tmp_path):
    if torch.cuda.device_count() < 8:
        pytest.skip("needs 8 GPUs (the nvidia-h100-x8 machine)")
    _assert_graphed_equals_eager(run_layouts(tmp_path, "cuda", timeout=900))
