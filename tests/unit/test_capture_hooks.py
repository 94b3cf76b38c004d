"""GraphedStep's hooks and the small shared helpers of cuda_graph/.

* ``on_capture_error``: a failed capture is handed to the caller's hook;
  ``graphstep.graph_step`` plugs the doctor in, a bare ``GraphedStep``
  diagnoses nothing and never imports the doctor.
* ``before_capture`` and ``will_capture``: the caller's hooks run once, right
  before the capture.
* ``GraphState``, ``normalize_device``, ``StateBackup``, the one user-frame finder.
"""

from __future__ import annotations

import importlib.util
import contextlib
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import graphstep
import graphstep.doctor.frames as doctor_frames
from graphstep.cuda_graph import frames
from graphstep.cuda_graph.backend import Graph, GraphBackend
from graphstep.cuda_graph.backup import StateBackup
from graphstep.cuda_graph.devices import normalize_device
from graphstep.cuda_graph.errors import CaptureError
from graphstep.cuda_graph.full_iteration import CaptureOptions, FailedCapture, GraphedStep
from graphstep.cuda_graph.graph_state import GraphState
from graphstep.cuda_graph.registry import get_backend

from helpers.runs import NeverCapturedGraph
from helpers.launch import ROOT

SRC = ROOT / "src"
CUDA_REFUSAL = "CUDA error: operation not permitted when stream is capturing"


class _RefusingBackend(GraphBackend):
    """Stands in for a GPU whose capture fails as CUDA does: no op, no line (category ``cuda``)."""

    name = "cuda"

    def new_graph(self, name: str, *, shared_pool: bool = True) -> Graph:
        return self._track(NeverCapturedGraph())

    @contextlib.contextmanager
    def capture(self, graph, generators=()):
        raise CaptureError.from_cuda(RuntimeError(CUDA_REFUSAL), graph.name)
        yield  # a generator function: the capture fails on entry

    def memory(self):
        return 0, 0


def _syncing_step(model: nn.Module):
    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        if loss.item() > 1e9:  # the host sync CUDA refuses
            raise FloatingPointError("diverged")
        return loss.detach()

    return step


# --------------------------------------------------------------------------
# on_capture_error


def test_graph_step_diagnoses_a_failed_cuda_capture_with_the_doctor():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    step = graphstep.graph_step(_syncing_step(model), warmup_steps=1, device="cpu")
    step.backend = _RefusingBackend(torch.device("cpu"))  # the capture fails as on a GPU
    x = torch.randn(3, 4)
    step(x)
    with pytest.raises(CaptureError) as info:
        step(x)
    assert info.value.category == "cuda"
    assert [(f.category, f.where.line.strip()[:14]) for f in info.value.findings] == [("host_sync", "if loss.item()")]
    assert "graphstep doctor, re-running 'step'" in "".join(info.value.__notes__)


def test_a_bare_graphed_step_diagnoses_nothing_and_never_imports_the_doctor():
    code = f"""
import sys, contextlib, torch
from graphstep.cuda_graph.backend import GraphBackend
from graphstep.cuda_graph.errors import CaptureError
from graphstep.cuda_graph.full_iteration import GraphedStep

class Refusing(GraphBackend):
    name = "cuda"
    def new_graph(self, name, *, shared_pool=True):
        return None
    @contextlib.contextmanager
    def capture(self, graph, generators=()):
        raise CaptureError.from_cuda(RuntimeError({CUDA_REFUSAL!r}), "step")
        yield
    def memory(self):
        return 0, 0

step = GraphedStep(lambda x: x * 2, Refusing(torch.device("cpu")), warmup_steps=1, on_failure="eager")
outs = [step(torch.full((2,), float(i))) for i in range(3)]
assert [o.tolist() for o in outs] == [[0.0, 0.0], [2.0, 2.0], [4.0, 4.0]], outs
assert step.failed.category == "cuda" and step.failed.findings == [] and step.state == "eager"
print(sorted(m for m in sys.modules if m.startswith("graphstep.doctor")))
"""
    env = dict(os.environ, PYTHONPATH=str(SRC))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_on_capture_error_gets_the_error_and_a_copy_of_the_call():
    seen: list[tuple[CaptureError, FailedCapture, tuple]] = []

    def hook(exc: CaptureError, failed: FailedCapture) -> None:
        seen.append((exc, failed, failed.copy_call()))

    def fn(x: torch.Tensor, *, scale: float) -> torch.Tensor:
        return x * scale

    gens = [torch.Generator()]
    step = GraphedStep(fn, _RefusingBackend(torch.device("cpu")), warmup_steps=0, name="mine", generators=gens,
                       on_capture_error=hook)
    x = torch.arange(3.0)
    with pytest.raises(CaptureError) as info:
        step(x, scale=2.0)
    ((exc, failed, (args, kwargs)),) = seen
    assert exc is info.value and failed.name == "mine" and failed.fn is fn
    assert failed.device == torch.device("cpu") and list(failed.generators()) == gens
    assert torch.equal(args[0], x) and kwargs == {"scale": 2.0}
    static = failed.call[0][0]
    assert args[0].untyped_storage().data_ptr() != static.untyped_storage().data_ptr()  # a copy to re-run on


def test_the_hook_hears_of_every_failed_capture_not_only_cuda_ones():
    categories = []
    step = GraphedStep(lambda x: x[x > 0].sum(), get_backend("cpu"), warmup_steps=0,
                       on_capture_error=lambda exc, failed: categories.append(exc.category))
    with pytest.raises(CaptureError):
        step(torch.randn(4))
    assert categories == ["dynamic_shape"]


def test_a_failing_hook_never_hides_the_capture_error(caplog):
    def hook(exc, failed):
        raise ValueError("the hook broke")

    step = GraphedStep(lambda x: x + 1, _RefusingBackend(torch.device("cpu")), warmup_steps=0, on_capture_error=hook)
    with caplog.at_level(logging.WARNING, logger="graphstep"), pytest.raises(CaptureError, match="capture of graph"):
        step(torch.ones(2))
    assert "the on_capture_error hook failed" in caplog.text and "the hook broke" in caplog.text


# --------------------------------------------------------------------------
# before_capture and will_capture


def _train_step(model: nn.Module, opt: torch.optim.Optimizer):
    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    return step


def _model_and_opt(device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt


def test_before_capture_runs_once_right_before_the_capture_and_the_step_still_equals_eager():
    model, opt = _model_and_opt()
    ref, ref_opt = _model_and_opt()
    log: list[tuple[str, int, bool]] = []
    step = GraphedStep(_train_step(model, opt), get_backend("cpu"), warmup_steps=2, before_capture=[
        lambda: log.append(("first", step.calls, step.will_capture)),
        lambda: log.append(("second", step.calls, step.will_capture)),
    ])
    eager = _train_step(ref, ref_opt)
    will, states = [], []
    for i in range(5):
        x = torch.randn(4, 8)
        will.append(step.will_capture)
        assert torch.equal(step(x), eager(x)), f"call {i}"
        states.append(step.state)
    assert log == [("first", 2, True), ("second", 2, True)]
    assert will == [False, False, True, False, False]
    assert states == ["eager", "eager", "captured", "replayed", "replayed"]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_will_capture_is_false_after_a_failed_capture_and_the_hook_ran_once():
    calls = []
    step = GraphedStep(lambda x: x * 3, _RefusingBackend(torch.device("cpu")), warmup_steps=1, on_failure="eager",
                       before_capture=lambda: calls.append(step.calls))
    outs = [step(torch.full((2,), float(i))).clone() for i in range(4)]
    assert calls == [1] and not step.will_capture and step.failed is not None
    assert [o.tolist() for o in outs] == [[3.0 * i] * 2 for i in range(4)]


def test_full_iteration_graph_passes_the_hooks_on():
    """The trainer's full-iteration graph: a GraphedStep over the list of micro-batches an iteration reads."""
    from graphstep.training.graphs import over_micro_batches

    calls = []
    graph = GraphedStep(lambda batches: sum(b * 2 for b in batches), get_backend("cpu"), warmup_steps=1,
                        before_capture=lambda: calls.append("meet"))
    iteration = over_micro_batches(graph, 2)
    assert not graph.will_capture
    data = iter([torch.full((2,), float(i)) for i in range(6)])
    outs = [iteration(data).clone() for _ in range(3)]
    assert calls == ["meet"] and [o.tolist() for o in outs] == [[2.0, 2.0], [10.0, 10.0], [18.0, 18.0]]
    assert graph.state is GraphState.REPLAYED


def test_before_capture_takes_callables_only():
    with pytest.raises(TypeError, match="before_capture= takes a callable or a list of callables"):
        GraphedStep(lambda x: x, get_backend("cpu"), before_capture=[print, "barrier"])


def test_capture_options_are_shared_and_a_keyword_changes_them_for_one_graph():
    calls = []
    options = CaptureOptions(warmup_steps=1, before_capture=lambda: calls.append("meet"))
    shared = GraphedStep(lambda x: x + 1, get_backend("cpu"), options, name="shared")
    alone = GraphedStep(lambda x: x + 2, get_backend("cpu"), options, name="alone", warmup_steps=0, before_capture=None)
    assert (shared.warmup_steps, alone.warmup_steps, options.warmup_steps) == (1, 0, 1)  # options stay as they were
    states = []
    for _ in range(2):
        shared(torch.zeros(2)), alone(torch.zeros(2))
        states.append((shared.state, alone.state))
    assert states == [("eager", "captured"), ("captured", "replayed")] and calls == ["meet"]  # shared's capture only
    with pytest.raises(ValueError, match="warmup_steps must be >= 0, got -1"):
        GraphedStep(lambda x: x, get_backend("cpu"), options, warmup_steps=-1)
    with pytest.raises(ValueError, match="on_failure must be 'raise' or 'eager'"):
        CaptureOptions(on_failure="retry")


# --------------------------------------------------------------------------
# GraphState


def test_states_are_graph_state_members_that_read_as_their_strings():
    step = GraphedStep(lambda x: x + 1, get_backend("cpu"), warmup_steps=1)
    states = []
    for i in range(3):
        step(torch.full((2,), float(i)))
        states.append(step.state)
    assert states == [GraphState.EAGER, GraphState.CAPTURED, GraphState.REPLAYED]
    assert all(isinstance(s, GraphState) for s in states)
    assert states == ["eager", "captured", "replayed"]
    assert json.dumps({"state": step.state}) == '{"state": "replayed"}'
    assert f"{step.state}|{step.state!s}" == "replayed|replayed" and graphstep.GraphState is GraphState
    step.reset()
    assert step.state is GraphState.EAGER


def test_layer_graphs_states_are_graph_state_members():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    graphs = graphstep.graph_layers(model, ["0"], warmup_steps=1, backend="replay")
    states = []
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        states.append(graphs.state)
    graphs.close()
    assert states == [GraphState.EAGER, GraphState.REPLAYED, GraphState.REPLAYED]
    assert all(isinstance(s, GraphState) for s in states)


# --------------------------------------------------------------------------
# devices, backups, frames


def test_normalize_device_gives_cuda_an_index(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert normalize_device("cuda") == torch.device("cuda", 3)
    assert normalize_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert normalize_device("cuda:1") == torch.device("cuda", 1) and normalize_device(2) == torch.device("cuda", 2)
    assert normalize_device("cpu") == torch.device("cpu") and normalize_device(torch.device("cpu")).index is None
    assert get_backend("cpu") is get_backend(torch.device("cpu"))


def test_state_backup_restores_views_storages_and_generators():
    flat = torch.zeros(8)
    view, other = flat[:4], flat[4:]
    backup = StateBackup()
    backup.save_tensors([view, view, None])  # the view only: the copy is 4 elements
    gen = torch.Generator().manual_seed(7)
    want = torch.rand(3, generator=gen)
    gen.manual_seed(7)
    backup.save_generators([gen])
    flat.fill_(1.0)
    torch.rand(3, generator=gen)
    backup.restore()
    assert flat.tolist() == [0.0] * 4 + [1.0] * 4  # the view went back, the rest of the buffer did not
    assert torch.equal(torch.rand(3, generator=gen), want)

    whole, made = torch.zeros(4), torch.zeros(2)
    backup.save_storages([whole[1:3], made, 5], skip={made.untyped_storage().data_ptr()})
    whole.fill_(2.0), made.fill_(2.0)
    backup.restore()
    assert whole.tolist() == [0.0] * 4 and made.tolist() == [2.0, 2.0]  # whole storage back; `made` skipped
    whole.fill_(3.0)
    backup.restore()  # nothing left to restore
    assert whole.tolist() == [3.0] * 4 and len(backup) == 0 and other.tolist() == [1.0] * 4


def test_one_user_frame_finder_for_capture_errors_and_the_doctor(tmp_path):
    assert doctor_frames.user_frame is frames.user_frame
    assert doctor_frames.traceback_user_frame is frames.traceback_user_frame
    assert frames.is_internal(doctor_frames.__file__) and frames.is_internal(graphstep.api.__file__)
    helper = tmp_path / "wrapper_helper.py"
    helper.write_text("from graphstep.cuda_graph.frames import user_frame\n\ndef where():\n    return user_frame()\n")
    spec = importlib.util.spec_from_file_location("wrapper_helper", helper)
    wrapper_helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wrapper_helper)
    try:
        assert wrapper_helper.where().filename == str(helper)  # a user file until marked internal
        frames.mark_internal(str(tmp_path))
        here = wrapper_helper.where()
        assert here.filename == __file__ and "here = wrapper_helper.where()" in here.line
    finally:
        frames._MARKED.discard(os.path.realpath(tmp_path) + os.sep)
        frames.is_internal.cache_clear()


# --------------------------------------------------------------------------
# on a GPU (pytest -m cuda)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_step_on_a_gpu_names_the_host_sync_through_the_doctor():
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = nn.Linear(64, 1).to(dev)
    step = graphstep.graph_step(_syncing_step(model), warmup_steps=1, device=dev)
    x = torch.randn(16, 64, device=dev)
    step(x)
    with pytest.raises(CaptureError) as info:
        step(x)
    assert info.value.category == "cuda"
    assert [(f.category, f.where.line.strip()[:14]) for f in info.value.findings] == [("host_sync", "if loss.item()")]
    assert not torch.cuda.is_current_stream_capturing()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_before_capture_on_a_gpu_runs_once_and_the_graph_equals_eager():
    model, opt = _model_and_opt("cuda")
    ref, ref_opt = _model_and_opt("cuda")
    calls = []
    step = GraphedStep(_train_step(model, opt), get_backend("cuda", "cuda"), warmup_steps=2,
                       before_capture=lambda: calls.append(step.calls))
    eager = _train_step(ref, ref_opt)
    states = []
    for i in range(6):
        x = torch.randn(4, 8, device="cuda")
        assert torch.equal(step(x), eager(x)), f"call {i}"
        states.append(step.state)
    assert calls == [2] and states == ["eager", "eager", "captured"] + ["replayed"] * 3
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    step.reset()
