"""A torchrun worker for the documented teardown: a graphed step that all-reduces, then close(), close_all()
and destroy_process_group(); writes the rank's losses, and what of graphstep could still hold a c10d object
after close_all(), to ``<argv[1]>/rank<r>.json`` (see tests/distributed/test_teardown.py), or prints it without an
argument."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import graphstep


def c10d_holders() -> list[str]:
    """graphstep objects that could still hold a c10d ``Work`` or process group: backends in the registry, tapes
    with recorded entries or kept objects, a recorder, a tape entry of a c10d op."""
    from graphstep.cuda_graph import registry, replay

    held = [f"backend {kind} on {device}" for kind, device in registry._BACKENDS]
    for obj in gc.get_objects():
        if isinstance(obj, replay._Tape) and (obj.runs or obj.keep):
            held.append(f"tape {obj.name!r}: {sum(len(run) for _, run in obj.runs)} entries, {len(obj.keep)} kept")
        elif isinstance(obj, (replay._Communication, replay._Recorder)):
            held.append(type(obj).__name__)
    return held


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
    held = c10d_holders()
    rank = dist.get_rank()
    dist.destroy_process_group()
    report = {"losses": losses, "state": graphed.state, "held": held}
    if len(sys.argv) > 1:
        (Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(report))
    else:  # a launch by hand
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
