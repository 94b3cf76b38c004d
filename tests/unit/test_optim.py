"""graphstep's AdamW against torch.optim.AdamW; schedule; clipping; skip on non-finite; no host sync."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from graphstep.cuda_graph.registry import get_backend
from graphstep.cuda_graph.full_iteration import GraphedStep
from graphstep.training.optim import AdamW, GradBuffers, LRSchedule


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.LayerNorm(9), nn.Linear(9, 4))


def _torch_groups(m: nn.Module, wd: float) -> list[dict]:
    return [
        {"params": [p for p in m.parameters() if p.dim() > 1], "weight_decay": wd},
        {"params": [p for p in m.parameters() if p.dim() == 1], "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_adamw_equals_torch_adamw(fused, clip):
    sched = LRSchedule(1e-2, 1e-3, warmup_iters=3, decay_iters=10)
    ref, ours = _model(), _model()
    ref_opt = torch.optim.AdamW(_torch_groups(ref, 0.1), lr=1.0, betas=(0.9, 0.95), eps=1e-8)
    grads = GradBuffers(ours)
    opt = AdamW(ours, grads, sched, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip_grad=clip, fused=fused)
    gen = torch.Generator().manual_seed(1)
    for k in range(1, 12):
        x = torch.randn(5, 6, generator=gen)
        ref_opt.zero_grad()
        ref(x).pow(2).sum().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        for group in ref_opt.param_groups:
            group["lr"] = sched.at(k)
        ref_opt.step()
        grads.zero()
        ours(x).pow(2).sum().backward()
        out = opt.step()
        assert math.isclose(float(out["lr"]), sched.at(k), rel_tol=1e-6)
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_schedule_shape():
    s = LRSchedule(1.0, 0.1, warmup_iters=10, decay_iters=110)
    assert s.at(5) == pytest.approx(0.5)
    assert s.at(10) == pytest.approx(1.0)
    assert s.at(60) == pytest.approx(0.55, rel=1e-5)  # half-way down the cosine
    assert s.at(110) == pytest.approx(0.1)
    assert s.at(500) == pytest.approx(0.1)
    assert LRSchedule(1.0, 0.0, 0, 10, "linear").at(5) == pytest.approx(0.5)
    assert LRSchedule(1.0, 0.0, 2, 10, "constant").at(7) == pytest.approx(1.0)


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_the_lr_comes_from_the_schedule_table_past_its_end_too(style, monkeypatch):
    """The optimizer reads its LR from a table of the schedule (one index, not the formula's dozen kernels): every
    update's LR is the formula's, after the decay too (the table's last entry), and without a table (a schedule
    longer than ``LR_TABLE_MAX``) the formula runs and gives the same LRs."""
    from graphstep.training import optim

    sched = LRSchedule(1e-2, 1e-3, warmup_iters=3, decay_iters=7, style=style)
    lrs = {}
    for table in (True, False):
        if not table:
            monkeypatch.setattr(optim, "LR_TABLE_MAX", 4)
        m = _model()
        grads = GradBuffers(m)
        opt = AdamW(m, grads, sched, fused=False)
        assert (opt.lr_table is not None) == table
        lrs[table] = [float(opt.step()["lr"]) for _ in range(12)]  # updates 1 to 12: the schedule ends at 7
    assert lrs[True] == pytest.approx([sched.at(k) for k in range(1, 13)], rel=1e-6)
    assert lrs[True] == pytest.approx(lrs[False], rel=1e-6)
    assert lrs[True][-1] == pytest.approx(1e-2 if style == "constant" else 1e-3, rel=1e-6)
    assert len(set(lrs[True][7:])) == 1  # past the end: the last entry


def test_skip_on_nonfinite_leaves_everything_unchanged():
    m = _model()
    grads = GradBuffers(m)
    opt = AdamW(m, grads, LRSchedule(1e-2, 1e-3, 0, 10), weight_decay=0.1, skip_on_nonfinite=True, fused=False)
    m(torch.randn(3, 6)).sum().backward()
    opt.step()
    before = [t.clone() for t in opt.master + opt.exp_avg + opt.exp_avg_sq] + [opt.step_t.clone()]
    grads.zero()
    m(torch.randn(3, 6)).sum().backward()
    grads.flat[0] = float("nan")
    out = opt.step()
    assert float(out["found_nonfinite"]) == 1.0
    after = [t for t in opt.master + opt.exp_avg + opt.exp_avg_sq] + [opt.step_t]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_optimizer_step_has_no_host_sync():
    """The whole update (norm, clip, schedule, skip) records on the replay backend: no .item() anywhere."""
    m = _model()
    grads = GradBuffers(m)
    opt = AdamW(m, grads, LRSchedule(1e-2, 1e-3, 2, 10), clip_grad=1.0, skip_on_nonfinite=True, fused=False)
    m(torch.randn(3, 6)).sum().backward()
    step = GraphedStep(lambda: opt.step(), get_backend("cpu"), warmup_steps=1)
    step()
    step()
    assert step.state == "captured"


def test_bf16_params_keep_fp32_master_and_grads():
    m = _model().to(torch.bfloat16)
    grads = GradBuffers(m)
    opt = AdamW(m, grads, LRSchedule(1e-2, 1e-3, 0, 10), fused=False)
    assert grads.flat.dtype == torch.float32 and all(t.dtype == torch.float32 for t in opt.master)
    m(torch.randn(3, 6, dtype=torch.bfloat16)).float().sum().backward()
    assert all(p.grad is None for p in m.parameters())  # accumulated into main_grad, then dropped
    opt.step()
    for p, master in zip(m.parameters(), opt.master):
        assert torch.equal(p, master.to(torch.bfloat16))


def test_nonfinite_flag_is_isfinites_negation():
    """The two-kernel flag (x - x != 0) is 1.0 exactly where isfinite is false, the largest floats included."""
    from graphstep.training.optim import nonfinite

    big = torch.finfo(torch.float32).max
    x = torch.tensor([0.0, -0.0, 1.5, -big, big, float("inf"), float("-inf"), float("nan")])
    flag = nonfinite(x)
    assert flag.dtype == torch.float32
    assert torch.equal(flag, (~torch.isfinite(x)).float())
    out = torch.empty(())
    assert nonfinite(torch.tensor(float("nan")), out=out) is out and float(out) == 1.0


def test_overwritten_buffers_hold_the_zeroed_buffers_sums():
    """GradBuffers.overwrite_first: the step's first gradient copied in, the next added, and a parameter no
    gradient reached zeroed at the end -- the zeroed buffers' values over steps whose unused parameter changes
    (its stale gradient from the step before would survive an overwrite without the end-of-step zeroing)."""
    ref, ours = _model(), _model()
    zeroed, overwritten = GradBuffers(ref), GradBuffers(ours)
    overwritten.overwrite_first()
    gen = torch.Generator().manual_seed(2)
    for step in range(4):
        skip = step % 3  # the layer no gradient reaches this step (2: every layer is used)
        for buffers, m in ((zeroed, ref), (overwritten, ours)):
            buffers.start_step()
            for _ in range(2):  # two micro-batches
                x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
                h = m[0](x) if skip != 0 else x.repeat(1, 2)[:, :9]
                h = m[1](h)
                out = m[2](h) if skip != 1 else h[:, :4]
                out.pow(2).sum().backward()
            buffers.end_accumulation()
        assert overwritten.flat.abs().sum() > 0 and zeroed.flat.abs().sum() > 0
        assert torch.equal(overwritten.flat, zeroed.flat), f"step {step}"
        overwritten.flat.add_(torch.randn(overwritten.flat.shape, generator=gen))  # stale values for the next step
        zeroed.flat.add_(1.0)


def test_overwrite_first_refuses_dtensor_parameters(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    m = nn.Linear(3, 2)
    m.weight = nn.Parameter(distribute_tensor(m.weight.detach(), mesh))
    with pytest.raises(ValueError, match="DTensor parameters"):
        GradBuffers(m).overwrite_first()
