"""A torchrun worker for the documented teardown: a graphed step that all-reduces, then close(), close_all()
and destroy_process_group(); prints the rank's losses as one JSON line (see test_library_contract.py)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch import nn

import graphstep


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = model(x).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        return loss.detach()

    graphed = graphstep.graph_step(step, warmup_steps=1, device="cpu", modules=[model])
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = [graphed(torch.randn(4, 8, generator=g)).item() for _ in range(4)]
    graphed.close()
    graphstep.close_all()
    dist.destroy_process_group()
    print(json.dumps({"losses": losses, "state": graphed.state}), flush=True)


if __name__ == "__main__":
    main()
