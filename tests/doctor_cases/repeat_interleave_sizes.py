import torch

from ._common import tiny


def make():
    model, x = tiny()
    counts = torch.tensor([1, 2, 0, 1, 1, 1])

    def step(x, counts):
        out = model(x)
        expanded = torch.repeat_interleave(out, counts, dim=0)  # doctor: dynamic_shape
        loss = expanded.square().mean()
        loss.backward()
        return loss.detach()

    return step, (x, counts)
