"""Checkpoints of sharded and pipelined runs: exact resume at the same layout, and resharding to and from one
process.

A torchrun launch of 2 gloo ranks (this file's ``checkpoint_worker``) trains each
layout of ``LAYOUTS`` for 5 iterations with the full-iteration graph (one
warm-up iteration: captured at 2, replayed from 3) and dropout on, saving at
iteration 3 (after a replay) and 5, and resumes from its iteration-3
checkpoint (iterations 4 and 5: warm-up and capture): the resumed iterations'
losses and the final weights must equal the uninterrupted run's bit for bit
(each rank's RNG streams are in the checkpoint, and a pipeline stage's set-up
on the resumed run's first step draws nothing). The pipeline runs eagerly
too. The single process (the test itself) loads each layout's final
checkpoint and compares weights.

With dropout off, runs of different layouts compute the same thing up to the
order of floating-point sums: a single process trains 7 iterations, saving at
iteration 3; each layout resumes from that checkpoint and trains iterations 4
and 5, saving at 5; the single process resumes from each layout's
iteration-5 checkpoint and trains 6 and 7. Every resumed run's losses are the
uninterrupted single process's, to fp32 rounding (the learning rate is in its
20-iteration warm-up throughout: the same for 5 and 7 iterations).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.launch import report_runs, torchrun_reports
from helpers.reports import load_weights, natural_digests, whole_model_digests

pytestmark = pytest.mark.slow

LAYOUTS = {
    "tp2_sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    "fsdp_zero3": ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"],
    "pp2": ["model.pipeline_model_parallel_size=2"],  # each stage saves its own layers, under whole-model names
}
# 4 ranks: FSDP2 over tensor-parallel shards (2-D DTensors, the fused projections among them). Stages over
# tensor-parallel ranks (each stage saving its layers' shards under whole-model names) are test_checkpoint_layouts.py's
# pp2_tp2_sp: exact resume, a one-process continuation and its checkpoint loaded by one process
LAYOUTS_2D = {
    "tp2_sp_fsdp2": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true",
                     "ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"],
}
COMMON = ["train.train_iters=5", "logger.log_interval=1", "model.attention_dropout=0.0", "model.hidden_dropout=0.0",
          "checkpoint.save_interval=3", "model.use_te_rng_tracker=true",
          "model.share_embeddings_and_output_weights=false"]  # untied (tied over 2 stages: test_pipeline.py)
GRAPHED = ["model.cuda_graph_impl=full_iteration", "model.cuda_graph_warmup_steps=1"]
DROPOUT = ["model.attention_dropout=0.1", "model.hidden_dropout=0.1"]
EAGER = ["model.cuda_graph_impl=none"]
DROPOUT_RUNS = {"pp2_eager": ("pp2", EAGER)}  # besides each layout graphed: the pipeline eager too
ONE_ITERS = "train.train_iters=7"  # the one process's run, around the layouts' iterations 4 and 5


def checkpoint_worker(out: str, one_ckpt: str, which: str) -> None:
    """The torchrun worker: each layout of the dict named ``which`` trained with dropout and saves, and resumed
    from its own checkpoint; each graphed one also resumed, dropout off, from one process's checkpoint."""
    out_dir, layouts = Path(out), globals()[which]
    runs = {**{n: (n, GRAPHED) for n in layouts}, **{n: r for n, r in DROPOUT_RUNS.items() if r[0] in layouts}}

    def run(name: str) -> dict:
        layout, graphs = runs[name]
        report = _dropout_resume(out_dir / name, [*graphs, *layouts[layout]])
        if name in layouts:  # the 2-rank layouts save it at 5, for the test process to resume
            report["from_one"] = _from_one(one_ckpt, [*GRAPHED, *layouts[layout]],
                                           out_dir / f"{name}-from-one" if which == "LAYOUTS" else None)
        return report

    report_runs(out_dir, "cpu", {name: name for name in runs}, run)


def _dropout_resume(save: Path, overrides: list[str]) -> dict:
    """Dropout on: an uninterrupted run saving at 3 and 5, and a run resumed at 3; losses and final weights."""
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    whole = train(tiny_config(*COMMON, *DROPOUT, *overrides, f"checkpoint.save={save}"), keep_model=True)
    resumed = train(tiny_config(*COMMON, *DROPOUT, *overrides, f"checkpoint.load={save}/iter_0000003"),
                    keep_model=True)
    return {"whole": whole.losses, "resumed": resumed.losses, "digest": natural_digests(whole.model),
            "resumed_digest": natural_digests(resumed.model)}


def _from_one(one_ckpt: str, overrides: list[str], save: Path | None) -> list[float]:
    """Dropout off: iterations 4 and 5 resumed from one process's iteration-3 checkpoint, saving at 5 (``save``)."""
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    return train(tiny_config(*COMMON, *overrides, f"checkpoint.load={one_ckpt}",
                             *([f"checkpoint.save={save}"] if save else []))).losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    tmp = tmp_path_factory.mktemp("ckpt")
    one = train(tiny_config(*COMMON, ONE_ITERS, f"checkpoint.save={tmp / 'one'}"))
    return tmp, one, launch(tmp, tmp / "one" / "iter_0000003", 2, "LAYOUTS")


def launch(out: Path, one_ckpt: Path, nproc: int, layouts: str) -> list[dict]:
    """``nproc`` ranks of this file's worker over the layouts named; each rank's report."""
    out.mkdir(exist_ok=True)
    return torchrun_reports(__file__, "checkpoint_worker", out, nproc, one_ckpt, layouts, timeout=600)


def _close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) == 2
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               rtol=2e-5, atol=0)


@pytest.mark.parametrize("run", [*LAYOUTS, *DROPOUT_RUNS])
def test_resume_at_the_same_layout_is_exact(runs, run):
    """Dropout on, graphed (and the pipeline eager too): every resumed iteration's loss and the final weights equal
    the uninterrupted run's, on every rank."""
    _, _, reports = runs
    for report in reports:
        case = report[run]
        assert len(case["whole"]) == 5 and len(case["resumed"]) == 2
        assert case["resumed"] == case["whole"][3:]  # bit for bit
        assert case["resumed_digest"] == case["digest"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_run_resumes_from_a_one_process_checkpoint(runs, layout):
    _, one, reports = runs
    assert len(one.losses) == 7
    _close(reports[0][layout]["from_one"], one.losses[3:5])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_process_resumes_from_a_sharded_checkpoint(runs, layout):
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    tmp, one, _ = runs
    resumed = train(tiny_config(*COMMON, ONE_ITERS, f"checkpoint.load={tmp / (layout + '-from-one')}/iter_0000005"))
    _close(resumed.losses, one.losses[5:])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_process_loads_the_sharded_weights_bit_for_bit(runs, layout):
    """The final checkpoint of a sharded run, loaded by one process: the same weights as the run ended with."""
    from helpers.runs import tiny_config

    tmp, _, reports = runs
    loaded = load_weights(tiny_config(*COMMON, f"checkpoint.load={tmp / layout}/iter_0000005"))
    assert natural_digests(loaded) == whole_model_digests(reports, layout)
    if layout.startswith("pp"):
        assert not set(reports[0][layout]["digest"]) & set(reports[1][layout]["digest"])  # the stages' own layers


@pytest.mark.ranks4
def test_two_dimensional_layout_checkpoints_round_trip(runs):
    """dp2 x tp2 with FSDP2 over the tensor-parallel shards, on 4 ranks: exact resume (dropout on), a one-process
    checkpoint resumed, and its final weights loaded by one process bit for bit."""
    from helpers.runs import tiny_config

    tmp, one, _ = runs
    reports = launch(tmp / "2d", tmp / "one" / "iter_0000003", 4, "LAYOUTS_2D")
    for layout in LAYOUTS_2D:
        for report in reports:
            case = report[layout]  # dropout on, graphed: exact
            assert len(case["resumed"]) == 2 and case["resumed"] == case["whole"][3:]
            assert case["resumed_digest"] == case["digest"]
        _close(reports[0][layout]["from_one"], one.losses[3:5])
        loaded = load_weights(tiny_config(*COMMON, f"checkpoint.load={tmp / '2d' / layout}/iter_0000005"))
        assert natural_digests(loaded) == whole_model_digests(reports, layout)
        assert whole_model_digests(reports, layout) == reports[3][layout]["digest"]  # each rank: a shard of each
