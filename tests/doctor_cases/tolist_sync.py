from ._common import tiny


def make():
    model, x = tiny()

    def step(x):
        logits = model(x)
        counts = logits.argmax(-1).tolist()  # doctor: host_sync
        loss = logits.square().mean() * len(counts)
        loss.backward()
        return loss.detach()

    return step, (x,)
