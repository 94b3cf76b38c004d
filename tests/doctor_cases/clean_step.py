"""A capture-ready step (no finding): fixed shapes, device-side decisions, a capturable optimizer."""

import torch

from ._common import sgd, tiny


def make():
    model, x = tiny()
    opt = sgd(model)
    loss_sum = torch.zeros(())

    def step(x):
        out = model(x)
        keep = (out[:, 0] > 0).float()  # a mask used by multiplication, not selection
        loss = (out.square().mean(-1) * keep).sum() / keep.sum().clamp(min=1.0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=False)
        loss_sum.add_(loss.detach())  # a device-side running sum, read outside the step
        return torch.where(torch.isfinite(loss), loss, torch.zeros_like(loss)).detach()

    return step, (x,)
