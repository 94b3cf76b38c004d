from ._common import tiny

history = []


def make():
    model, x = tiny()

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        history.append(loss.detach())  # doctor: python_state
        return loss.detach()

    return step, (x,)
