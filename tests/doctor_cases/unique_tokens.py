import torch

from ._common import tiny


def make():
    model, x = tiny()
    tokens = torch.tensor([3, 1, 3, 2, 1, 0])

    def step(x, tokens):
        out = model(x)
        vocab = torch.unique(tokens)  # doctor: dynamic_shape
        loss = out.square().mean() + out[:, : vocab.numel()].sum() * 0.01
        loss.backward()
        return loss.detach()

    return step, (x, tokens)
