import torch

from ._common import tiny

DEVICE = "cuda"  # the step is written for the GPU; the doctor runs it on the CPU


def make():
    model, x = tiny()

    def step(x):
        out = model(x)
        weights = torch.tensor([1.0, 2.0, 1.0, 0.5], device=DEVICE)  # doctor: h2d_copy
        loss = (out.square() * weights).mean()
        loss.backward()
        return loss.detach()

    return step, (x,)
