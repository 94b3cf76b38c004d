"""TensorBoard, W&B, profiler traces and phase ranges (graphstep.observability), through the real trainer.

The scalars a writer writes are the metrics rows the JSONL file holds, at the
same iterations; the profiler's trace holds the configured iterations and no
others. What validation refuses before a run (a missing optional package, a
profiling window or ranks outside the run: rules V16, V17, V21) is tested in
tests/unit/test_value_rules_inputs.py.
"""

from __future__ import annotations

import glob
import os
import json
from pathlib import Path

import pytest
import torch

from helpers.runs import tiny_config
from graphstep.observability import MetricWriters, open_ranges
from graphstep.training.loop import train
from graphstep.training.metrics import read_metrics

FULL = ["model.cuda_graph_impl=full_iteration"]
GPU = ["train.device=cuda", "model.params_dtype=bf16"]


def _event_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator", reason="the tensorboard package is not installed")
    acc = accumulator.EventAccumulator(str(directory), size_guidance={accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _assert_equal_to_jsonl(scalars: dict[str, list[tuple[int, float]]], rows: list[dict], every: int = 1) -> None:
    """Each of Megatron's tags holds the JSONL column at the same iterations, equal as float32."""
    for tag, key in (("lm loss", "loss"), ("grad-norm", "grad_norm"), ("learning-rate", "lr")):
        want = [(r["iteration"], r[key]) for r in rows if r["iteration"] % every == 0]
        got = scalars[tag]
        assert [s for s, _ in got] == [i for i, _ in want], tag
        for (it, value), (_, expected) in zip(got, want):
            a, b = torch.tensor(value, dtype=torch.float32), torch.tensor(expected, dtype=torch.float32)
            assert torch.equal(a, b), f"{tag} at iteration {it}: {value!r} != {expected!r}"


def _trace_events(directory: Path) -> list[dict]:
    traces = glob.glob(str(directory / "*.pt.trace.json"))
    assert len(traces) == 1, traces
    with open(traces[0]) as fh:
        return json.load(fh)["traceEvents"]


def _profiler_steps(events: list[dict]) -> list[str]:
    return sorted({e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")})


# --------------------------------------------------------------------------
# TensorBoard


@pytest.mark.slow
def test_tensorboard_scalars_equal_the_jsonl_rows_and_hold_the_capture(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed")
    tb = tmp_path / "tb"
    cfg = tiny_config(*FULL, "train.train_iters=8", "logger.log_interval=1", f"logger.tensorboard_dir={tb}",
                      "logger.log_timers_to_tensorboard=true", "logger.log_memory_to_tensorboard=true",
                      tmp_path=tmp_path)
    result = train(cfg)
    rows = read_metrics(cfg.logger.metrics_path)
    assert len(rows) == 8
    scalars = _event_scalars(tb)
    _assert_equal_to_jsonl(scalars, rows)
    step_ms = {r["iteration"]: r["step_ms"] for r in result.rows}
    assert [s for s, _ in scalars["step-time-ms"]] == list(range(1, 9))
    for it, value in scalars["step-time-ms"]:
        assert value == pytest.approx(step_ms[it], rel=1e-6)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    for it, value in scalars["tokens-per-sec"]:
        assert value == pytest.approx(tokens / (step_ms[it] / 1e3), rel=1e-5)
    from graphstep.models import build_model
    from graphstep.training.flops import flops_per_step

    flops = flops_per_step(cfg, build_model(cfg.model, "cpu"))  # one rank: the model FLOPs of the iteration
    for it, value in scalars["throughput-tflops-per-gpu"]:
        assert value == pytest.approx(flops / (step_ms[it] / 1e3) / 1e12, rel=1e-5)
    assert "mfu" not in scalars  # no known peak for a CPU
    assert [s for s, _ in scalars["memory/max-rss-gib"]] == list(range(1, 9))
    assert all(v > 0 for _, v in scalars["memory/max-rss-gib"])
    capture = [r["iteration"] for r in rows if r["state"] == "captured"]
    assert capture == [cfg.model.cuda_graph_warmup_steps + 1]
    assert scalars["graphs/captured"] == [(capture[0], 1.0)]
    assert scalars["graphs/capture-seconds"][0][1] == pytest.approx(result.capture_seconds, rel=1e-6)


def test_tensorboard_log_interval_writes_every_nth_row_of_what_was_read(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed")
    cfg = tiny_config(f"logger.tensorboard_dir={tmp_path}", "logger.tensorboard_log_interval=3")
    writers = MetricWriters(cfg, enabled=True, tokens_per_iteration=256, device=torch.device("cpu"))
    rows = [{"iteration": i, "loss": 5.0 - i / 8, "grad_norm": 1.0 + i, "lr": 1e-3 * i, "nonfinite": float(i == 4),
             "state": "eager", "time": 0.0, "step_ms": 10.0} for i in range(1, 8)]
    writers.write_rows(rows[:4])  # two logging steps: what the recorder read at iterations 4 and 7
    writers.write_rows(rows[4:])
    writers.close()
    scalars = _event_scalars(tmp_path)
    _assert_equal_to_jsonl(scalars, rows, every=3)
    assert scalars["nonfinite-iterations"] == [(3, 0.0), (6, 1.0)]  # iteration 4's flag, counted by iteration 6
    assert "step-time-ms" not in scalars and not any(t.startswith("memory/") for t in scalars)  # both off


def test_writers_write_nothing_on_other_ranks(tmp_path):
    cfg = tiny_config(f"logger.tensorboard_dir={tmp_path}/tb", "logger.wandb_project=p")
    writers = MetricWriters(cfg, enabled=False, tokens_per_iteration=1, device=torch.device("cpu"))
    writers.write_rows([{"iteration": 1, "loss": 1.0}])
    writers.close()
    assert not writers.enabled and not (tmp_path / "tb").exists()


# --------------------------------------------------------------------------
# W&B (offline)


@pytest.mark.slow
def test_wandb_offline_writes_its_run_directory_with_the_losses(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb package is not installed")
    monkeypatch.setenv("WANDB_MODE", "unset")  # so that monkeypatch restores the environment after the run sets it
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_SILENT", "true")
    save = tmp_path / "wandb"
    cfg = tiny_config("train.train_iters=4", "logger.log_interval=1", "logger.wandb_project=graphstep-test",
                      "logger.wandb_exp_name=tiny", f"logger.wandb_save_dir={save}", tmp_path=tmp_path)
    train(cfg)

    assert os.environ["WANDB_MODE"] == "offline"
    runs = glob.glob(str(save / "wandb" / "offline-run-*"))
    assert len(runs) == 1, runs
    (records,) = glob.glob(f"{runs[0]}/*.wandb")
    data = Path(records).read_bytes()
    for row in read_metrics(cfg.logger.metrics_path):  # the history records hold each loss as JSON text
        assert json.dumps(row["loss"]).encode() in data, row


# --------------------------------------------------------------------------
# profiler


@pytest.mark.slow
def test_pytorch_profiler_traces_iterations_3_to_5_and_nothing_else(tmp_path):
    cfg = tiny_config(*FULL, "train.train_iters=7", "profiling.use_pytorch_profiler=true",
                      "profiling.profile_step_start=3", "profiling.profile_step_end=5", tmp_path=tmp_path)
    train(cfg)
    events = _trace_events(tmp_path / "profile")  # beside logger.metrics_path without a tensorboard_dir
    assert _profiler_steps(events) == ["ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"]
    names = {e.get("name") for e in events}
    # warm-up 3: iteration 3 is the last eager one, 4 captures, 5 replays
    assert {"train step: warm-up", "train step: capture", "train step: replay", "optimizer", "data"} <= names


def test_profiler_traces_land_in_the_tensorboard_dir(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed")
    cfg = tiny_config("train.train_iters=2", "model.cuda_graph_warmup_steps=1", "logger.log_interval=1",
                      f"logger.tensorboard_dir={tmp_path}/tb",
                      "profiling.use_pytorch_profiler=true", "profiling.profile_step_start=2",
                      "profiling.profile_step_end=2", tmp_path=tmp_path)
    train(cfg)
    assert _profiler_steps(_trace_events(tmp_path / "tb")) == ["ProfilerStep#2"]
    assert not (tmp_path / "profile").exists()


def test_no_ranges_unless_profiling_and_no_nvtx_without_cuda():
    assert open_ranges(tiny_config(), rank=0) is None
    nsys = tiny_config("profiling.use_nsys_profiler=true")
    assert (open_ranges(nsys, rank=0) is None) is (not torch.cuda.is_available())
    assert open_ranges(tiny_config("profiling.use_pytorch_profiler=true"), rank=1) is None  # profile_ranks=[0]


# --------------------------------------------------------------------------
# the same on a GPU (CudaGraphBackend, bf16): run by scripts/gpu-check


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_tensorboard_equals_jsonl_and_the_trace_shows_graph_launches(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed")
    tb = tmp_path / "tb"
    # warm-up 3, capture at 4: the window 5..6 holds replays only
    cfg = tiny_config(*GPU, *FULL, "train.train_iters=8", "logger.log_interval=1", f"logger.tensorboard_dir={tb}",
                      "profiling.use_pytorch_profiler=true", "profiling.profile_step_start=5",
                      "profiling.profile_step_end=6", tmp_path=tmp_path)
    train(cfg)
    rows = read_metrics(cfg.logger.metrics_path)
    assert [r["state"] for r in rows] == ["eager"] * 3 + ["captured"] + ["replayed"] * 4
    scalars = _event_scalars(tb)
    _assert_equal_to_jsonl(scalars, rows)
    assert scalars["graphs/captured"] == [(4, 1.0)]
    events = _trace_events(tb)
    assert _profiler_steps(events) == ["ProfilerStep#5", "ProfilerStep#6"]
    launches = [e for e in events if e.get("name") == "cudaGraphLaunch"]
    assert len(launches) >= 2, "one graph launch per replayed iteration"
    assert "train step: replay" in {e.get("name") for e in events}
