import torch

from ._common import tiny


def make():
    model, x = tiny()

    def step(x):
        out = model(x)
        expert = out.argmax(-1)
        load = torch.bincount(expert)  # doctor: dynamic_shape
        loss = out.square().mean()
        loss.backward()
        return loss.detach(), load

    return step, (x,)
