from ._common import sgd, tiny


def make():
    model, x = tiny()
    opt = sgd(model)

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        if loss > 10.0:  # doctor: host_sync
            for p in model.parameters():
                p.grad.zero_()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    return step, (x,)
