"""Captures that go wrong: ``warmup_steps=0`` over FSDP2 (its lazy initialisation inside the capture)
equals eager (the ``cuda`` twins run through scripts/gpu-check).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphstep

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def _batches(device: str, n: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, 8, generator=g).to(device) for _ in range(n)]


# --------------------------------------------------------------------------
# FSDP2 models whose first block can break at a line


class _HostRead(torch.autograd.Function):
    """Identity that reads a device value on the host in its forward or backward (``where``):
    harmless eagerly, a failed capture on both backends."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, where: str) -> torch.Tensor:
        ctx.where = where
        if where == "forward":
            float(x.sum())
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if ctx.where == "backward":
            float(g.sum())
        return g.clone(), None


class _Block(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.up, self.drop, self.down = nn.Linear(8, 16), nn.Dropout(0.1), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(_HostRead.apply(torch.relu(self.up(x)), self.where)))


def _fsdp_model(device: str, where: str = "nowhere") -> nn.Module:
    """Two ZeRO-3 blocks under a root ``fully_shard`` on a one-rank mesh; the first block breaks at ``where``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(_Block(where), _Block("nowhere")).to(device)
    mesh = init_device_mesh(device, (1,))
    for block in model:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _shards(model: nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


# --------------------------------------------------------------------------
# warmup_steps=0 over FSDP2: its lazy initialisation and first all-gather run inside the capture


@pytest.mark.parametrize("device", DEVICES)
def test_graph_step_without_warmup_over_fsdp2_with_sgd_equals_eager(one_rank_group, device):
    runs = []
    for graphed in (False, True):
        model = _fsdp_model(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: nothing to create lazily

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss.detach()

        run = graphstep.graph_step(step, warmup_steps=0, device=device) if graphed else step
        torch.manual_seed(1)
        runs.append(([run(x).clone() for x in _batches(device)], _shards(model), run))
    (eager, eager_shards, _), (graphed, graphed_shards, run) = runs
    assert run.state == "replayed"
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed)), (eager, graphed)
    assert all(torch.equal(a, b) for a, b in zip(eager_shards, graphed_shards))


def test_storage_allocated_and_freed_inside_the_capture_is_allocated_again_on_replay():
    """A CUDA graph's pool keeps what its capture allocated; the replay backend gives such a storage its
    size back at the start of every replay (it crashed writing into the freed storage)."""
    held: list[torch.Tensor] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        if held:  # allocated again before each use, freed after (FSDP2's unsharded parameters)
            held[0].untyped_storage().resize_(4 * 4)
        else:  # the first use allocates it (FSDP2's first all-gather): inside the capture
            held.append(torch.empty(4))
        buf = held[0]
        buf.copy_(x * 2)
        y = buf.sum() + 1
        buf.untyped_storage().resize_(0)
        return y

    graphed = graphstep.graph_step(step, warmup_steps=0, backend="replay")
    outs = [graphed(torch.full((4,), float(i))).clone() for i in range(4)]
    assert [o.item() for o in outs] == [8 * i + 1 for i in range(4)]
