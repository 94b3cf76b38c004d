"""graphstep doctor: the breaker corpus, no false positive on any recipe, the CLI, diagnose().

Each case in tests/doctor_cases/ marks its breaking line with ``# doctor: <category>``;
the doctor must report that category at that line, and nothing of another category.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import pathlib
import re

import pytest
import torch
from torch import nn

from graphstep.config import apply_overrides
from graphstep.cuda_graph.backend import Graph, GraphBackend
from graphstep.cuda_graph.errors import CaptureError
from graphstep.cuda_graph.full_iteration import GraphedStep
from graphstep.doctor import CATEGORIES, Finding, Report, capture_error_hook, check, check_recipe, diagnose
from graphstep.recipes import RECIPES, get_recipe

from helpers.runs import NeverCapturedGraph
from helpers.launch import TESTS

CASES = sorted(p for p in (TESTS / "doctor_cases").glob("*.py") if not p.name.startswith("_"))  # tests/ is on
# sys.path (conftest.py's folder), so the cases import as doctor_cases.NAME


def _markers(path: pathlib.Path) -> list[tuple[str, int]]:
    return [(m.group(1), n) for n, line in enumerate(path.read_text().splitlines(), 1)
            if (m := re.search(r"# doctor: (\w+)", line))]


def _run_case(path: pathlib.Path) -> Report:
    step, args = importlib.import_module(f"doctor_cases.{path.stem}").make()
    return check(step, *args)


def test_the_corpus_covers_every_step_category():
    marked = {cat for p in CASES for cat, _ in _markers(p)}
    assert len([p for p in CASES if _markers(p)]) >= 12
    assert marked == set(CATEGORIES) - {"error", "config"}


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_doctor_names_the_category_and_line(path):
    report = _run_case(path)
    expected = _markers(path)
    got = {(f.category, f.where.lineno) for f in report.findings if f.where and f.where.filename == str(path)}
    for category, line in expected:
        assert (category, line) in got, f"expected {category} at line {line}\n{report.format()}"
    assert {f.category for f in report.findings} == {c for c, _ in expected}, report.format()
    assert report.ok == (not expected)
    if expected:
        assert report.exit_code == (1 if report.capture_would_fail else 3)


def test_check_leaves_tensors_as_it_found_them():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(3, 4)
    rng = torch.get_rng_state()

    def step(x):
        loss = torch.nn.functional.dropout(model(x), 0.5).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    assert check(step, x).ok
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.equal(rng, torch.get_rng_state())


def test_graphsteps_own_adamw_is_capturable():
    from graphstep.training.optim import AdamW, GradBuffers, LRSchedule

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    grads = GradBuffers(model)
    opt = AdamW(model, grads, LRSchedule(1e-3, 1e-4, 2, 10), weight_decay=0.1, clip_grad=1.0,
                skip_on_nonfinite=True)

    def step(x):
        grads.zero()
        loss = model(x).square().mean()
        loss.backward()
        return opt.step((~torch.isfinite(loss)).float())

    report = check(step, torch.randn(5, 8))
    assert report.ok, report.format()


def test_findings_report_every_breaker_of_a_step_not_only_the_first():
    def step(x):
        y = x * 2
        a = y.sum().item()  # 1
        b = y.nonzero()  # 2
        return y.cpu(), a, b  # 3

    report = check(step, torch.randn(4))
    assert [f.category for f in report.findings] == ["host_sync", "dynamic_shape", "host_sync"]
    assert report.to_dict()["findings"][0]["code"] == "a = y.sum().item()  # 1"
    data = json.loads(report.to_json())
    assert data["exit_code"] == 1 and len(data["findings"]) == 3


def test_a_step_that_raises_is_an_error_finding_at_its_line():
    def step(x):
        return x.view(3, 5)  # the doctor reports this line

    report = check(step, torch.randn(4))
    (f,) = report.findings
    assert f.category == "error" and f.where.line.strip().startswith("return x.view(3, 5)")


# --------------------------------------------------------------------------
# recipes: no false positive, and a breaker in a recipe's model is found

SMALL = ["model.seq_length=16", "train.micro_batch_size=1", "logger.progress_bar=false"]


# recipes that carry a multi-rank layout (Megatron Bridge's): the doctor judges one unsharded rank of their model
ONE_RANK = {"llama3_70b": ["model.tensor_model_parallel_size=1", "model.sequence_parallel=false",
                           "model.pipeline_model_parallel_size=1", "model.virtual_pipeline_model_parallel_size=null",
                           "model.context_parallel_size=1"]}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_gives_no_finding(name):
    cfg = apply_overrides(get_recipe(name), [*SMALL, *ONE_RANK.get(name, [])])
    report = check_recipe(cfg, name=name, proxy="always")
    assert report.ok, report.format()
    assert any(n.startswith("judged:") for n in report.notes)


def _item_in_forward(monkeypatch, cls):
    original = cls.forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if out.float().mean() > 1e9:  # breaker
            out = out * 0
        return out

    monkeypatch.setattr(cls, "forward", forward)
    return forward.__code__.co_filename, forward.__code__.co_firstlineno + 2


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["full_iteration", "none"])
def test_a_breaker_inside_a_recipe_step_is_found(monkeypatch, impl):
    from graphstep.models.transformer import MLPBlock

    filename, line = _item_in_forward(monkeypatch, MLPBlock)
    cfg = apply_overrides(get_recipe("llama3_tiny"), SMALL + [f"model.cuda_graph_impl={impl}"])
    report = check_recipe(cfg, name="llama3_tiny", proxy="always")
    assert [(f.category, f.where.filename, f.where.lineno) for f in report.findings] == [
        ("host_sync", filename, line)], report.format()
    assert report.exit_code == 1


def test_a_broken_rule_is_reported_without_running_the_step():
    cfg = apply_overrides(get_recipe("llama3_tiny"), ["rerun_state_machine.check_for_nan_in_loss=true"])
    report = check_recipe(cfg, name="llama3_tiny")
    assert [f.category for f in report.findings] == ["config"] and report.findings[0].op == "R6"
    assert report.exit_code == 2


@pytest.mark.parametrize("layout", [["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads"],
                                    ["ddp.use_distributed_optimizer=true"]])
def test_a_sharded_layout_is_refused_not_judged_as_another_model(layout):
    """The doctor runs one unsharded rank: a FSDP2 run is not judged (exit 2, the fix names the replay dry-run)."""
    cfg = apply_overrides(get_recipe("llama3_tiny"), ["model.cuda_graph_impl=full_iteration",
                                                      "model.use_te_rng_tracker=true", *layout])
    report = check_recipe(cfg, name="llama3_tiny")
    assert [(f.category, f.op) for f in report.findings] == [("config", "layout")]
    assert "replay backend under torchrun" in report.findings[0].fix and report.exit_code == 2


# --------------------------------------------------------------------------
# the command line

SCRIPT = '''
import torch
from torch import nn

model = nn.Linear(4, 2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def train_step_inputs():
    return (torch.randn(8, 4),)


if __name__ == "__main__":
    raise SystemExit("the doctor must not run this")
'''


def test_cli_script_target_json(tmp_path, capsys):
    from graphstep.cli import main

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert main(["doctor", f"{script}:train_step", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    (f,) = data["findings"]
    assert (f["category"], f["line"], f["code"]) == ("optimizer", 12, "opt.step()")
    assert "capturable=True" in f["fix"]


@pytest.mark.slow
def test_cli_recipe(capsys):
    from graphstep.cli import main

    assert main(["doctor", "--recipe", "qwen3_moe_tiny", *SMALL, "train.global_batch_size=2"]) == 0
    out = capsys.readouterr().out
    assert "no finding" in out and "full iteration" in out


# --------------------------------------------------------------------------
# run time: a failed CUDA capture is diagnosed, then on_failure decides


class _FailingCudaBackend(GraphBackend):
    """Stands in for CudaGraphBackend: the capture fails as CUDA would, naming no op and no line,
    and (as on a GPU, where captured work does not run) leaves ``state`` as it was."""

    name = "cuda"

    def __init__(self, device, state):
        super().__init__(device)
        self.state = state

    def new_graph(self, name: str, *, shared_pool: bool = True) -> Graph:
        return self._track(NeverCapturedGraph())

    @contextlib.contextmanager
    def capture(self, graph, generators=()):
        saved = [t.clone() for t in self.state()]
        _CAPTURING[0] = True
        try:
            yield
        except RuntimeError as exc:
            with torch.no_grad():
                for t, s in zip(self.state(), saved):
                    t.copy_(s)
            raise CaptureError.from_cuda(exc, "step") from exc
        finally:
            _CAPTURING[0] = False

    def memory(self):
        return 0, 0


def _sync_step(model, opt):
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        if loss.item() > 1e9:  # stands for the op CUDA refuses
            raise RuntimeError("diverged")
        if _CAPTURING[0]:  # what CUDA does at the .item() above
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    return step


_CAPTURING = [False]


@pytest.mark.parametrize("on_failure", ["eager", "raise"])
def test_failed_cuda_capture_is_diagnosed_then_on_failure_applies(on_failure):
    torch.manual_seed(0)
    model, ref = nn.Linear(4, 4), nn.Linear(4, 4)
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    def state():
        return [t for p in model.parameters() for t in (p, p.grad)]

    graphed = GraphedStep(_sync_step(model, opt), _FailingCudaBackend(torch.device("cpu"), state), warmup_steps=1,
                          on_failure=on_failure, on_capture_error=capture_error_hook)
    eager = _sync_step(ref, ref_opt)
    xs = [torch.randn(3, 4) for _ in range(4)]
    graphed(xs[0]), eager(xs[0])
    if on_failure == "raise":
        with pytest.raises(CaptureError) as info:
            graphed(xs[1])
        findings = info.value.findings
    else:
        graphed(xs[1])
        findings = graphed.failed.findings
    assert [(f.category, f.where.line.strip()[:14]) for f in findings] == [("host_sync", "if loss.item()")]
    if on_failure == "eager":
        eager(xs[1])
        for x in xs[2:]:
            assert torch.equal(graphed(x), eager(x)) and graphed.state == "eager"
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_diagnose_runs_once_and_restores():
    model = nn.Linear(4, 4)
    before = [p.detach().clone() for p in model.parameters()]

    def step(x):
        model.weight.data.add_(1.0)
        return x.nonzero()

    (f,) = diagnose(step, (torch.randn(4),))
    assert f.category == "dynamic_shape"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_finding_defaults_come_from_the_category():
    f = Finding("h2d_copy", "torch.tensor")
    assert f.why == CATEGORIES["h2d_copy"].why and f.severity == "capture" and f.location == "(no user line)"
