"""The Mamba mixer under context parallel (models/mamba.py, parallel/context_parallel.py): each rank holds chunks
``r`` and ``2 cp - 1 - r`` of every sequence, the conv input and dt are exchanged for the whole sequences of
``1 / cp`` of the heads, and the output comes back to the rank's tokens.

One launch of 4 gloo ranks checks, in float64, that the rank's outputs are the one-process mixer's outputs at its
positions and that the parameter gradients summed over the context-parallel ranks are the one-process gradients
(the input gradients at its positions too): ``cp=4`` over the 4 ranks and ``cp=2`` over each half, with more
groups of B and C than context-parallel ranks, as many, and fewer (a group's B and C then go to every rank
holding one of its heads, and their gradients come back summed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.launch import torchrun_reports

pytestmark = pytest.mark.ranks4

CASES = [(cp, groups) for cp in (4, 2) for groups in (1, 2, 4, 8)]


def worker(out: str, device: str) -> None:
    import torch.distributed as dist

    from graphstep.data.context_parallel import context_parallel_positions
    from graphstep.models.mamba import MambaMixer, MambaShape
    from graphstep.parallel.context_parallel import ContextParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    report = {}
    try:
        for cp, groups in CASES:
            group, cp_rank = (dist.group.WORLD, rank) if cp == 4 else (halves[rank // 2], rank % 2)
            torch.manual_seed(groups)
            shape = MambaShape(hidden=32, d_inner=64, heads=8, head_dim=8, state=4, groups=groups, chunk=5, eps=1e-5)
            one, split = MambaMixer(shape).double(), MambaMixer(shape).double()
            split.load_state_dict(one.state_dict())
            x = torch.randn(2, 8 * cp, 32, dtype=torch.float64, requires_grad=True)
            weights = torch.randn(2, 8 * cp, 32, dtype=torch.float64)
            expected = one(x)
            (expected * weights).sum().backward()
            held = context_parallel_positions(8 * cp, cp_rank, cp)
            mine = x.detach()[:, held].clone().requires_grad_()
            split.context = ContextParallel(group, cp_rank, cp)
            got = split(mine)
            (got * weights[:, held]).sum().backward()
            grads = {}
            for (name, p), q in zip(split.named_parameters(), one.parameters()):
                summed = p.grad.clone()
                dist.all_reduce(summed, group=group)
                grads[name] = (summed - q.grad).abs().max().item()
            report[f"cp{cp}_groups{groups}"] = {
                "output": (got - expected.detach()[:, held]).abs().max().item(),
                "input_grad": (mine.grad - x.grad[:, held]).abs().max().item(),
                "grads": grads, "scale": max(q.grad.abs().max().item() for q in one.parameters())}
    finally:
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


def test_mamba_mixer_over_context_parallel_ranks_computes_the_whole_sequence(tmp_path):
    reports = torchrun_reports(__file__, "worker", tmp_path, 4, "cpu", timeout=300)
    for rank, report in enumerate(reports):
        assert sorted(report) == sorted(f"cp{cp}_groups{g}" for cp, g in CASES), rank
        for case, r in report.items():
            assert r["output"] < 1e-12 and r["input_grad"] < 1e-12, (rank, case, r)
            assert r["scale"] > 1e-3 and len(r["grads"]) == 8, (rank, case, r)  # every parameter, not all zero
            assert max(r["grads"].values()) < 1e-12 * max(r["scale"], 1.0), (rank, case, r["grads"])
