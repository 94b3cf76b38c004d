"""What a user would try instead of graphstep, on the same model and data.

* ``manual_graph``: a hand-written whole-step ``torch.cuda.graph`` -- forward,
  backward and torch's fused capturable AdamW on the model's own parameters
  and ``.grad`` -- the plain-PyTorch best case;
* ``make_graphed_callables``: ``torch.cuda.make_graphed_callables`` on the
  same layer submodules as graphstep's ``[attn,mlp]`` scopes, with graphstep's
  eager optimizer;
* ``compile[reduce-overhead]``: ``torch.compile(model, mode="reduce-overhead")``
  (Inductor kernels replayed through CUDA graph trees) with graphstep's eager
  optimizer, used as a careful user must for training with gradient
  accumulation (see :func:`compiled`).

graphstep's own full-iteration graph around a compiled model is the row
``compile+full_iteration`` (bench/run.py).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from ..cuda_graph.scopes import scope_modules
from ..engines_compat import reset_dynamo
from ..training.step import packed_rows
from .harness import Workload, make_workload


def _static_batch(w: Workload) -> list[dict[str, torch.Tensor]]:
    return [{k: v.to(w.device) for k, v in b.items()} for b in w.batches[: w.num_micro_batches]]


def manual_graph(cfg, device: torch.device) -> tuple[Any, Iterator[Any], Any, Any]:
    """Whole step in one ``torch.cuda.graph``, written as the PyTorch docs show it."""
    w = make_workload(cfg, device)
    w.grads.remove_hooks()  # plain PyTorch: gradients in .grad, in the model dtype
    params = list(w.model.parameters())
    opt = torch.optim.AdamW(params, lr=torch.tensor(cfg.optimizer.lr, device=device), fused=True, capturable=True,
                            betas=(cfg.optimizer.adam_beta1, cfg.optimizer.adam_beta2),
                            weight_decay=cfg.optimizer.weight_decay)
    static = _static_batch(w)
    n = len(static)

    def body() -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        total = torch.zeros((), device=device)
        for mb in static:
            loss = w.model(mb["tokens"], mb["labels"], mb["loss_mask"], **packed_rows(mb))
            (loss / n).backward()
            total += loss.detach()
        opt.step()
        return total

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    import time

    t0 = time.perf_counter()
    with torch.cuda.graph(graph):
        body()
    capture_s = time.perf_counter() - t0

    def step(it: Iterator[Any]) -> None:
        for dst in static:
            src = next(it)
            for k in dst:
                dst[k].copy_(src[k], non_blocking=True)
        graph.replay()

    class Owner:
        def close(self) -> None:
            graph.reset()

    return step, w.data(), lambda: capture_s, Owner()


class MarkStepPerCall:
    """Calls ``torch.compiler.cudagraph_mark_step_begin()`` before every forward of ``model``.

    CUDA graph trees reuse their output memory at the next replay of a graph.
    With gradient accumulation the same forward/backward graphs replay once per
    micro-batch within one optimizer step, so a mark per *iteration* is not
    enough: without a mark before each micro-batch, graph trees see a forward
    while the previous micro-batch's outputs may still be read and raise
    "accessing tensor output of CUDAGraphs that has been overwritten by a
    subsequent run". Everything a micro-batch produces must also be consumed
    before the next forward: graphstep's step adds the loss into a running total
    at once and its gradient hooks move each ``.grad`` into the fp32 buffers
    and drop it, so nothing graph-owned outlives its micro-batch.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return self.model(*args, **kwargs)


def compiled(cfg, device: torch.device, mode: str = "reduce-overhead") -> tuple[Any, Any, Any, Any]:
    """``torch.compile(model, mode=mode)`` with the trainer's step and eager optimizer (compile time = capture)."""
    import time

    from ..training.step import TrainStep

    w = make_workload(cfg, device)
    model = torch.compile(w.model, mode=mode)
    train_step = TrainStep(MarkStepPerCall(model) if mode == "reduce-overhead" else model, w.grads)
    first: list[float] = []

    def step(it: Iterator[Any]) -> Any:
        t0 = time.perf_counter()
        batches = [{k: v.to(device, non_blocking=True) for k, v in next(it).items()} for _ in range(w.num_micro_batches)]
        out = train_step(batches)
        result = w.optimizer.step(None)
        if not first:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first.append(time.perf_counter() - t0)
        return out, result

    class Owner:
        def close(self) -> None:
            reset_dynamo()  # drops the compiled graphs and their CUDA graph trees

    return step, w.data(), lambda: first[0] if first else None, Owner()


def make_graphed(cfg, device: torch.device, scopes: tuple[str, ...] = ("attn", "mlp")) -> tuple[Any, Any, Any, Any]:
    """``torch.cuda.make_graphed_callables`` on each layer's scoped blocks."""
    import time

    w = make_workload(cfg, device)
    modules = [m for layer in w.model.graph_layers() for s in scopes for m in scope_modules(layer, s)]
    mb, seq, d = cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.hidden_size
    dtype = next(w.model.parameters()).dtype
    samples = tuple((torch.randn(mb, seq, d, device=device, dtype=dtype, requires_grad=True),) for _ in modules)
    t0 = time.perf_counter()
    torch.cuda.make_graphed_callables(tuple(modules), samples)
    capture_s = time.perf_counter() - t0

    def step(it: Iterator[Any]) -> Any:
        batches = [{k: v.to(device, non_blocking=True) for k, v in next(it).items()} for _ in range(w.num_micro_batches)]
        w.train_step(batches)
        return w.optimizer.step(None)

    return step, w.data(), lambda: capture_s, None
