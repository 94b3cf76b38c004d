"""On a GPU: a capture CUDA refuses is ended cleanly, diagnosed by the doctor, and replaced by eager steps.

Run by scripts/gpu-check (``pytest -m cuda``); skipped without CUDA.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from graphstep.cuda_graph.registry import get_backend
from graphstep.cuda_graph.errors import CaptureError
from graphstep.cuda_graph.full_iteration import GraphedStep
from graphstep.doctor import capture_error_hook, check

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BREAKER = "if loss.item() > 1e6:"


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.Dropout(0.1), nn.ReLU(), nn.Linear(512, 1)).to(device)


def _step(model: nn.Module, opt: torch.optim.Optimizer):
    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        if loss.item() > 1e6:  # a host sync: CUDA refuses it while the stream is capturing
            raise FloatingPointError("diverged")
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    return step


def _run(step, xs: list[torch.Tensor], probe: int | None = None) -> tuple[list[torch.Tensor], tuple[int, ...]]:
    """Losses of ``step`` over ``xs`` from a fixed CUDA seed; memory around call ``probe``, each side
    after emptying the allocator's cache: (allocated before, reserved before, allocated after, reserved after)."""
    torch.cuda.manual_seed(1)
    losses, mem = [], (0, 0, 0, 0)

    def settled() -> tuple[int, int]:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # a failed capture's pool, once handed back, is released here
        return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    for i, x in enumerate(xs):
        if i == probe:
            before = settled()
        out = step(x)
        if i == probe:
            mem = (*before, *settled())
        losses.append(out.clone())
    return losses, mem


def test_failed_capture_is_freed_diagnosed_and_continues_eagerly():
    dev = torch.device("cuda", torch.cuda.current_device())
    model, ref = _model(dev), _model(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    xs = [torch.randn(4096, 256, device=dev) for _ in range(6)]  # 8 MiB activations: a pool worth freeing
    # cuBLAS keeps a workspace per (thread, stream) for the life of the process: create the default
    # stream's ones (forward and autograd's thread) before measuring, as any earlier step would have.
    _model(dev)(xs[0]).sum().backward()
    graphed = GraphedStep(_step(model, opt), get_backend(dev, "cuda"), warmup_steps=2, name="broken",
                          on_failure="eager", on_capture_error=capture_error_hook)

    got, (alloc0, reserved0, alloc1, reserved1) = _run(graphed, xs, probe=2)  # call 2 tries the capture
    want, _ = _run(_step(ref, ref_opt), xs)

    print(f"\nmemory around the failed capture (after empty_cache): allocated {alloc0} -> {alloc1} B, "
          f"reserved {reserved0} -> {reserved1} B")
    assert graphed.failed is not None and not graphed.captured and graphed.state == "eager"
    findings = graphed.failed.findings
    print("doctor:", [(f.category, f.op, f.location) for f in findings])
    assert [(f.category, f.where.line.strip()) for f in findings] == [
        ("host_sync", BREAKER + "  # a host sync: CUDA refuses it while the stream is capturing")]
    # the step's returned loss (one 512-byte block) is all that may stay; the region holds 8 MiB activations
    assert alloc1 - alloc0 <= 512, "the failed capture (or its diagnosis) left memory allocated"
    # the failed capture's pool went back to the allocator (one small 2 MiB segment of slack for the loss)
    assert reserved1 <= reserved0 + 2 * 2**20, "the failed capture's pool was not handed back"
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.cuda.current_stream(dev) == torch.cuda.default_stream(dev)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i}: graphed-then-eager {a.item()} != eager {b.item()}"
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_raise_mode_reports_the_line_and_leaves_cuda_usable():
    dev = torch.device("cuda", torch.cuda.current_device())
    model = _model(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    graphed = GraphedStep(_step(model, opt), get_backend(dev, "cuda"), warmup_steps=1, name="broken",
                          on_capture_error=capture_error_hook)
    x = torch.randn(64, 256, device=dev)
    graphed(x)
    with pytest.raises(CaptureError) as info:
        graphed(x)
    assert [f.category for f in info.value.findings] == ["host_sync"]
    assert "graphstep doctor" in "".join(getattr(info.value, "__notes__", []))
    assert not torch.cuda.is_current_stream_capturing()
    # the generators are out of capture mode: eager random ops work (torch raised "Offset increment
    # outside graph capture" here on versions that left them in it)
    torch.nn.functional.dropout(torch.ones(1024, device=dev), 0.5).sum().item()
    torch.rand(8, device=dev).sum().item()


def test_check_on_gpu_tensors():
    dev = torch.device("cuda", torch.cuda.current_device())
    model = _model(dev)

    def step(x):
        out = model(x)
        keep = out[out > 0]  # dynamic_shape
        w = torch.tensor([2.0], device=dev)  # h2d_copy
        loss = out.square().mean() * w + keep.sum() * 0
        loss.backward()
        return loss.detach().cpu()  # host_sync

    report = check(step, torch.randn(64, 256, device=dev))
    print(report.format())
    assert {f.category for f in report.findings} == {"dynamic_shape", "h2d_copy", "host_sync"}
    assert not any("tensors are on the CPU" in n for n in report.notes)
