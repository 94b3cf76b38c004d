import torch

from ._common import tiny


def make():
    model, x = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()  # doctor: optimizer
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    return step, (x,)
