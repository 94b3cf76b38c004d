import torch

from ._common import tiny


def make():
    model, x = tiny()

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # doctor: autocast_cache
            out = model(x)
        loss = out.float().square().mean()
        loss.backward()
        return loss.detach()

    return step, (x,)
