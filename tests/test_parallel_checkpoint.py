"""Checkpoints of sharded and pipelined runs: exact resume at the same layout, and resharding to and from one
process.

A torchrun launch of 2 gloo ranks (this file's ``__main__``) trains each
layout of ``LAYOUTS`` for 6 iterations with the full-iteration graph, saving
at iteration 3 and 6; resumes from its own iteration-3 checkpoint; and
resumes from a checkpoint a single process saved at iteration 3. The single
process (the test itself) then resumes from each layout's iteration-3
checkpoint, and loads each layout's final checkpoint to compare weights.
Dropout is off there, so runs of different layouts compute the same thing up
to the order of floating-point sums. The same launch trains each layout again
with dropout on, saves at iteration 3 and resumes from it: the resumed
iterations' losses and the final weights must equal the uninterrupted run's
bit for bit (each rank's RNG streams are in the checkpoint, and a pipeline
stage's set-up on the resumed run's first step draws nothing).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_distributed import subprocess_env, torchrun  # noqa: E402

LAYOUTS = {
    "tp2_sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    "fsdp_zero3": ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"],
    "pp2": ["model.pipeline_model_parallel_size=2"],  # each stage saves its own layers, under whole-model names
}
LAYOUTS_2D = {  # 4 ranks: FSDP2 over tensor-parallel shards (2-D DTensors, the fused projections among them)
    "tp2_sp_fsdp2": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true",
                     "ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"],
}
COMMON = ["train.train_iters=6", "logger.log_interval=1", "model.attention_dropout=0.0", "model.hidden_dropout=0.0",
          "checkpoint.save_interval=3", "model.use_te_rng_tracker=true",
          "model.share_embeddings_and_output_weights=false"]  # pipeline stages do not tie (R28)
GRAPHED = ["model.cuda_graph_impl=full_iteration", "model.cuda_graph_warmup_steps=1"]
DROPOUT = ["model.attention_dropout=0.1", "model.hidden_dropout=0.1"]
EAGER = ["model.cuda_graph_impl=none"]
DROPOUT_RUNS = {"pp2_eager": ("pp2", EAGER)}  # besides each layout graphed: the pipeline eager too


def natural_digests(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter this rank's model holds, in its natural layout (gathered when sharded), hashed by name."""
    from graphstep.training.checkpoint_layout import LayoutEntries

    out = {}
    for key, t in sorted(LayoutEntries().model(model).items()):
        whole = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[key] = hashlib.sha256(whole.detach().float().contiguous().numpy().tobytes()).hexdigest()
    return out


def whole_model_digests(reports: list[dict], layout: str) -> dict[str, str]:
    """The union of the ranks' parameters (pipeline stages hold different ones); ranks holding one agree."""
    merged: dict[str, str] = {}
    for report in reports:
        for key, digest in report[layout]["digest"].items():
            assert merged.setdefault(key, digest) == digest, key
    return merged


def load_weights(cfg) -> torch.nn.Module:
    """One process's model of ``cfg`` holding the weights of ``cfg.checkpoint.load`` (a final checkpoint: a
    resume from it would have nothing left to train, which the trainer refuses)."""
    from graphstep.training.build import build_run
    from graphstep.training.checkpoint import TrainingState, load_checkpoint
    from graphstep.training.distributed import DataParallel

    def restore(model: torch.nn.Module, optimizer) -> int:
        return load_checkpoint(Path(cfg.checkpoint.load), TrainingState(model, optimizer, data=None), DataParallel(),
                               finetune=True, config=cfg)

    run = build_run(cfg, device=torch.device("cpu"), restore=restore)
    run.close()
    return run.model


def _worker(out: Path, one_ckpt: str, layouts: dict[str, list[str]]) -> None:
    import torch.distributed as dist

    from conftest import tiny_config
    from graphstep.training.loop import train

    dist.init_process_group("gloo")
    report: dict[str, dict] = {}
    try:
        for name, layout in layouts.items():
            save = out / name
            whole = train(tiny_config(*COMMON, *GRAPHED, *layout, f"checkpoint.save={save}"), keep_model=True)
            own = train(tiny_config(*COMMON, *GRAPHED, *layout, f"checkpoint.load={save}/iter_0000003",
                                    f"checkpoint.save={out / (name + '-own')}"))
            other = train(tiny_config(*COMMON, *GRAPHED, *layout, f"checkpoint.load={one_ckpt}",
                                      f"checkpoint.save={out / (name + '-from-one')}"))
            report[name] = {"whole": whole.losses, "own": own.losses, "from_one": other.losses,
                            "digest": natural_digests(whole.model)}
        for name, (layout, graphs) in {**{n: (n, GRAPHED) for n in layouts}, **DROPOUT_RUNS}.items():
            if layout in layouts:
                report[f"{name}/dropout"] = _dropout_resume(out / f"{name}-dropout", [*graphs, *layouts[layout]])
    finally:
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


def _dropout_resume(save: Path, overrides: list[str]) -> dict:
    """Dropout on: an uninterrupted run saving at 3, and a run resumed from it; losses and final weights."""
    from conftest import tiny_config
    from graphstep.training.loop import train

    whole = train(tiny_config(*COMMON, *DROPOUT, *overrides, f"checkpoint.save={save}"), keep_model=True)
    resumed = train(tiny_config(*COMMON, *DROPOUT, *overrides, f"checkpoint.load={save}/iter_0000003",
                                f"checkpoint.save={save}-resumed"), keep_model=True)
    return {"whole": whole.losses, "resumed": resumed.losses, "whole_digest": natural_digests(whole.model),
            "resumed_digest": natural_digests(resumed.model)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import tiny_config
    from graphstep.training.loop import train

    tmp = tmp_path_factory.mktemp("ckpt")
    one = train(tiny_config(*COMMON, f"checkpoint.save={tmp / 'one'}"))
    return tmp, one, launch(tmp, tmp / "one" / "iter_0000003", 2, "LAYOUTS")


def launch(out: Path, one_ckpt: Path, nproc: int, layouts: str) -> list[dict]:
    """``nproc`` ranks of this file's worker over the layouts named; each rank's report."""
    out.mkdir(exist_ok=True)
    cmd = torchrun(nproc, str(Path(__file__).resolve()), str(out), str(one_ckpt), layouts)
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=600, cwd=out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def _close(a: list[float], b: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               rtol=2e-5, atol=0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_at_the_same_layout_is_exact(runs, layout):
    _, _, reports = runs
    for report in reports:
        case = report[layout]
        assert len(case["whole"]) == 6 and len(case["own"]) == 3
        assert case["own"] == case["whole"][3:]  # bit for bit, graphed


@pytest.mark.parametrize("run", [*LAYOUTS, *DROPOUT_RUNS])
def test_resume_with_dropout_is_exact(runs, run):
    """Dropout on: every resumed iteration's loss and the final weights equal the uninterrupted run's, on every rank."""
    _, _, reports = runs
    for report in reports:
        case = report[f"{run}/dropout"]
        assert len(case["whole"]) == 6 and len(case["resumed"]) == 3
        assert case["resumed"] == case["whole"][3:]  # bit for bit
        assert case["resumed_digest"] == case["whole_digest"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_run_resumes_from_a_one_process_checkpoint(runs, layout):
    _, one, reports = runs
    _close(reports[0][layout]["from_one"], one.losses[3:])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_process_resumes_from_a_sharded_checkpoint(runs, layout):
    from conftest import tiny_config
    from graphstep.training.loop import train

    tmp, _, reports = runs
    resumed = train(tiny_config(*COMMON, f"checkpoint.load={tmp / layout}/iter_0000003",
                                f"checkpoint.save={tmp / (layout + '-to-one')}"))
    _close(resumed.losses, reports[0][layout]["whole"][3:])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_process_loads_the_sharded_weights_bit_for_bit(runs, layout):
    """The final checkpoint of a sharded run, loaded by one process: the same weights as the run ended with."""
    from conftest import tiny_config

    tmp, _, reports = runs
    loaded = load_weights(tiny_config(*COMMON, f"checkpoint.load={tmp / layout}/iter_0000006"))
    assert natural_digests(loaded) == whole_model_digests(reports, layout)
    if layout.startswith("pp"):
        assert not set(reports[0][layout]["digest"]) & set(reports[1][layout]["digest"])  # the stages' own layers


def test_two_dimensional_layout_checkpoints_round_trip(runs):
    """dp2 x tp2 with FSDP2 over the tensor-parallel shards, on 4 ranks: exact resume (dropout off and on), a
    one-process checkpoint resumed, and its final weights loaded by one process bit for bit."""
    from conftest import tiny_config

    tmp, one, _ = runs
    reports = launch(tmp / "2d", tmp / "one" / "iter_0000003", 4, "LAYOUTS_2D")
    for layout in LAYOUTS_2D:
        for report in reports:
            assert report[layout]["own"] == report[layout]["whole"][3:]
            dropout = report[f"{layout}/dropout"]  # dropout on: exact too
            assert len(dropout["resumed"]) == 3 and dropout["resumed"] == dropout["whole"][3:]
            assert dropout["resumed_digest"] == dropout["whole_digest"]
        _close(reports[0][layout]["from_one"], one.losses[3:])
        loaded = load_weights(tiny_config(*COMMON, f"checkpoint.load={tmp / '2d' / layout}/iter_0000006"))
        assert natural_digests(loaded) == whole_model_digests(reports, layout) == reports[3][layout]["digest"]


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), sys.argv[2], globals()[sys.argv[3]])
