import torch

from ._common import sgd, tiny


def make():
    model, x = tiny()
    opt = sgd(model)
    scaler = torch.amp.GradScaler("cpu")

    def step(x):
        loss = model(x).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)  # doctor: grad_scaler
        scaler.update()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    return step, (x,)
