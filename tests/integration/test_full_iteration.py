"""Full-iteration graphs on the CPU replay backend: bit-equality with eager, warm-up, errors, teardown."""

from __future__ import annotations

import gc
import os
import signal
import weakref

import pytest
import torch

from helpers.runs import FULL_ITERATION_IDS, FULL_ITERATION_SETTINGS, assert_same_run, eager, poison_iteration, tiny_config
from graphstep.cuda_graph.registry import get_backend
from graphstep.cuda_graph.errors import CaptureError, ContractError
from graphstep.cuda_graph.full_iteration import GraphedStep
from graphstep.training import loop
from graphstep.training.loop import train
from graphstep.training.metrics import read_metrics

# One long run per implementation (the full-iteration graph, and with the optimizer graph): equality that holds
# over many steps with dropout on. The legacy spelling normalises to the same graph: 12 steps.
ITERS, SHORT = 100, 12


@pytest.fixture(scope="module")
def eager_runs():
    runs: dict[int, object] = {}

    def run(iters: int):
        if iters not in runs:
            runs[iters] = train(eager(tiny_config(f"train.train_iters={iters}")), keep_model=True)
        return runs[iters]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("overrides", FULL_ITERATION_SETTINGS, ids=FULL_ITERATION_IDS)
def test_full_iteration_equals_eager_bit_for_bit(eager_runs, overrides):
    iters = SHORT if "model.cuda_graph_scope=[full_iteration]" in overrides else ITERS
    graphed = train(tiny_config(f"train.train_iters={iters}", *overrides), keep_model=True)
    assert [r["state"] for r in graphed.rows][3:5] == ["captured", "replayed"]
    assert len(graphed.rows) == iters
    assert_same_run(eager_runs(iters), graphed)
    assert graphed.rows[-1]["loss"] < graphed.rows[0]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("warmup", [0, 1, 3, 5])
def test_capture_happens_exactly_at_warmup(tmp_path, warmup):
    cfg = tiny_config("model.cuda_graph_impl=full_iteration", f"model.cuda_graph_warmup_steps={warmup}",
                      "train.train_iters=8", "logger.log_interval=3", tmp_path=tmp_path)
    train(cfg)
    states = {r["iteration"]: r["state"] for r in read_metrics(tmp_path / "metrics.jsonl")}
    assert len(states) == 8
    expected = {i: "eager" if i <= warmup else ("captured" if i == warmup + 1 else "replayed") for i in range(1, 9)}
    assert states == expected


def test_metrics_file_holds_exact_float32_losses(tmp_path):
    cfg = tiny_config("model.cuda_graph_impl=full_iteration", "train.train_iters=6", tmp_path=tmp_path)
    result = train(cfg)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == list(range(1, 7))
    for row, kept in zip(rows, result.rows):
        assert row["loss"] == kept["loss"]
        assert float(torch.tensor(row["loss"], dtype=torch.float32)) == row["loss"]  # a float32 value, exactly


@pytest.mark.slow
def test_eval_graph_equals_eager():
    overrides = ["train.train_iters=12", "train.eval_iters=2", "train.eval_interval=4"]
    base = train(eager(tiny_config(*overrides)))
    graphed = train(tiny_config("model.cuda_graph_impl=full_iteration", "model.cuda_graph_warmup_steps=1", *overrides))
    assert len(base.eval_losses) == 3
    assert graphed.eval_losses == base.eval_losses


def _step_with_item(x: torch.Tensor) -> torch.Tensor:
    y = (x * 2).sum()
    if y.item() > 0:  # the line the error must name
        y = y + 1
    return y


def test_host_sync_in_step_raises_capture_error_with_file_and_line():
    step = GraphedStep(_step_with_item, get_backend("cpu"), warmup_steps=1, name="bad")
    x = torch.ones(4)
    step(x)  # eager warm-up is fine
    with pytest.raises(CaptureError) as info:
        step(x)
    line = _step_with_item.__code__.co_firstlineno + 2
    assert info.value.where.filename == __file__ and info.value.where.lineno == line
    assert f"{__file__}:{line}" in str(info.value)
    assert "_local_scalar_dense" in str(info.value)


def test_batch_not_copied_into_static_buffer_breaks_equality():
    """The check has teeth: a step that reads a batch behind the graph's back replays stale data."""
    stash: list[torch.Tensor] = []
    w = torch.nn.Parameter(torch.ones(3))

    def honest(x: torch.Tensor) -> torch.Tensor:
        return (w * x).sum()

    def sneaky(x: torch.Tensor) -> torch.Tensor:  # ignores its argument, reads the newest batch directly
        return (w * stash[-1]).sum()

    good = GraphedStep(honest, get_backend("cpu"), warmup_steps=1)
    bad = GraphedStep(sneaky, get_backend("cpu"), warmup_steps=1)
    for i in range(4):
        x = torch.full((3,), float(i))
        stash.append(x)
        expected = (w * x).sum()
        assert torch.equal(good(x), expected)
        if i < 2:
            assert torch.equal(bad(x), expected)
        else:
            assert not torch.equal(bad(x), expected)  # the replay still reads batch 1


def test_replay_with_another_shape_is_a_contract_error():
    step = GraphedStep(lambda x: x * 2, get_backend("cpu"), warmup_steps=0, name="train")
    step(torch.ones(2, 8))
    with pytest.raises(ContractError, match=r"\(2, 8\).*\(2, 16\)"):
        step(torch.ones(2, 16))


def test_close_frees_every_graph_and_the_tape():
    backend = get_backend("cpu")
    w = torch.nn.Parameter(torch.randn(8))
    step = GraphedStep(lambda x: (w * x).sum(), backend, warmup_steps=0)
    step(torch.ones(8))
    graph = weakref.ref(step.graph)
    held = weakref.ref(step.graph.keep[0])
    assert backend.live_graphs()
    step.close()
    step.close()  # twice is harmless
    backend.close()
    gc.collect()
    assert graph() is None and held() is None
    assert backend.live_graphs() == []


@pytest.mark.slow
def test_teardown_on_exception_and_signal(monkeypatch):
    calls = {"n": 0}
    real = loop.MetricsRecorder.record

    def failing(self, it, *a, **k):
        calls["n"] += 1
        if it == 6:
            raise RuntimeError("boom")
        return real(self, it, *a, **k)

    monkeypatch.setattr(loop.MetricsRecorder, "record", failing)
    with pytest.raises(RuntimeError, match="boom"):
        train(tiny_config("model.cuda_graph_impl=full_iteration", "train.train_iters=10"))
    assert get_backend("cpu").live_graphs() == []
    monkeypatch.setattr(loop.MetricsRecorder, "record", real)

    def signalling(self, it, *a, **k):
        if it == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, it, *a, **k)

    monkeypatch.setattr(loop.MetricsRecorder, "record", signalling)
    result = train(tiny_config("model.cuda_graph_impl=full_iteration", "train.train_iters=10"))
    assert result.stopped_by_signal and result.iterations == 5
    assert [r["iteration"] for r in result.rows] == [1, 2, 3, 4, 5]
    assert get_backend("cpu").live_graphs() == []


@pytest.mark.slow
def test_nonfinite_flag_inside_graph_and_skip(monkeypatch):
    """A NaN in the loss at iteration 6 is flagged from inside the graph; with skip the update is skipped."""
    poison_iteration(monkeypatch, 6)  # every micro-batch of iteration 6
    common = ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true", "train.train_iters=9"]
    flagged = train(tiny_config(*common), keep_model=True)
    # without skipping, iteration 6 writes NaN into the weights and every later loss is NaN too
    assert flagged.nonfinite_iterations == [6, 7, 8, 9]
    assert [r["iteration"] for r in flagged.rows if r["nonfinite"]] == [6, 7, 8, 9]
    assert all(isinstance(r["loss"], float) for r in flagged.rows[:5])

    skipped = train(tiny_config(*common, "train.skip_step_on_nan=true"), keep_model=True)
    assert skipped.nonfinite_iterations == [6]
    assert skipped.rows[5]["loss"] == "nan"
    later = [r["loss"] for r in skipped.rows[6:]]
    assert all(isinstance(v, float) for v in later)  # training went on with finite weights
    assert all(torch.isfinite(p).all() for p in skipped.model.parameters())
