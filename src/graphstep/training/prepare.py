"""Turn a config's graph settings into the callables the training loop runs.

Policy lives here; cuda_graph/ only provides mechanisms. ``prepare`` applies
the features in a fixed order (see its comment), and returns a
:class:`Runner` whose three calls the loop makes every iteration:
``train_step`` (forward/backward of all micro-batches), ``optimizer_step``,
and ``evaluate``. With ``cuda_graph_impl=none`` these are exactly the eager
functions of step.py.

Shape buckets (``data.seq_length_buckets``): every micro-batch of a step is
padded to the same bucket (data/buckets.py), and the full-iteration graph
becomes :class:`GraphPerBucket`, a dispatcher keyed by the step's width that
runs a separate graph per bucket -- its own static buffers and warm-up count,
captured into the shared pool the first time the bucket is past its warm-up.
Evaluation batches are padded to the largest bucket: one evaluation graph.
Per-layer graphs with buckets are refused (one set of layer graphs per bucket
is not implemented).

Ownership: ``prepare`` is handed the backend to capture with (the process's
backend for the device, or the doctor's); every graph of the run is made
through a :class:`RunBackend` view of it (training/run_backend.py), so the
runner's ``close()`` frees this run's graphs and nothing else, and its
``backend.reports`` are this run's captures.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..cuda_graph.backend import GraphBackend
from ..cuda_graph.errors import GraphUsageError
from ..cuda_graph.full_iteration import EAGER, FullIterationGraph, GraphedStep
from ..cuda_graph.rng import get_rng_tracker
from ..config import ConfigError
from ..cuda_graph.settings import CudaGraphSettings, GraphImpl
from .optim import AdamW
from .run_backend import RunBackend
from .step import EvalStep, TrainStep

log = logging.getLogger("graphstep")


@dataclass
class Runner:
    """What the loop calls; owns every graph it made (``close()`` frees them, and only them).

    ``backend`` is the run's view of the process backend (None without graphs):
    ``backend.reports`` holds this run's capture reports.
    """

    train_step: Callable[[Iterator[Any]], dict[str, torch.Tensor]]
    optimizer_step: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    evaluate: Callable[[Iterator[Any], int], torch.Tensor]
    backend: RunBackend | None
    graphs: list[Any] = field(default_factory=list)
    describe: str = "eager"

    def state(self) -> str:
        """eager / captured / replayed for the last training step (the first graph's state)."""
        for g in self.graphs:
            st = getattr(g, "state", None)
            if st is not None:
                return st
        return EAGER

    @property
    def reports(self) -> list[Any]:
        """The capture reports of this run's graphs, in capture order."""
        return list(self.backend.reports) if self.backend is not None else []

    def close(self) -> None:
        """Free every graph this run made (never another's); harmless to call twice."""
        for g in self.graphs:
            g.close()
        self.graphs.clear()
        if self.backend is not None:
            self.backend.close()


def prepare(
    model: nn.Module,
    train_step: TrainStep,
    eval_step: EvalStep,
    optimizer: AdamW,
    settings: CudaGraphSettings,
    *,
    backend: GraphBackend | None,
    device: torch.device,
    num_micro_batches: int,
    skip_on_nonfinite: bool,
    capture_barrier: Callable[[], None] | None = None,
    buckets: list[int] | None = None,
    on_capture_error: Callable[..., None] | None = None,
) -> Runner:
    """Build the runner. The order is fixed:

    1. per-layer graphs wrap the selected submodules first, so every step
       function built afterwards calls the wrapped modules;
    2. the full-iteration graph wraps forward/backward of all micro-batches
       (a separate graph for evaluation); it never combines with step 1 (R4);
    3. the optimizer graph comes last: it reads the training step's outputs
       (the non-finite flag) and captures into the same pool after it.

    With data parallelism, ``train_step`` already holds the gradient and loss
    all-reduces (TrainStep's hooks), so the full-iteration graph captures
    them; ``capture_barrier`` (GraphedStep's ``before_capture`` hook) makes the
    ranks meet before each capture of a graph with collectives (Megatron does
    the same). A capture that fails without a cause (a CUDA error) is
    diagnosed by ``graphstep doctor`` (the ``on_capture_error`` hook). Per-layer graphs hold no
    collective: the reduction runs eagerly after the backward graphs.

    With ``buckets`` (the sorted ``data.seq_length_buckets``), step 2 makes one
    full-iteration graph per bucket (:class:`GraphPerBucket`).

    ``backend`` captures every graph (required when ``settings.enabled``); the
    runner sees it through a :class:`RunBackend` of its own.
    """
    if buckets and settings.per_layer:
        raise ConfigError(
            f"data.seq_length_buckets={buckets} with per-layer graphs (model.cuda_graph_modules) is not implemented: "
            "each bucket would need its own set of layer graphs. Use model.cuda_graph_impl=full_iteration (one graph "
            "per bucket), model.cuda_graph_impl=none, or drop data.seq_length_buckets"
        )
    if settings.enabled and backend is None:
        raise GraphUsageError(f"prepare(): model.cuda_graph_impl={settings.impl.value} captures graphs but no backend "
                              "was given: pass backend=graphstep.get_backend(device) (or build the run with build_run)")
    run_backend = RunBackend(backend) if settings.enabled else None
    generators = get_rng_tracker().generators
    graphs: list[Any] = []
    describe = "eager"

    if settings.per_layer:  # 1
        from ..cuda_graph.layers import apply_layer_graphs

        layer_graphs = apply_layer_graphs(model, settings, run_backend, generators=generators)
        graphs.append(layer_graphs)
        describe = layer_graphs.describe()

    fwd_bwd: Callable[[Iterator[Any]], dict[str, torch.Tensor]]
    evaluate_batches: Callable[[list[Any]], dict[str, torch.Tensor]]
    if settings.full_iteration:  # 2
        # graphs holding collectives: the ranks meet before each capture (Megatron does the same)
        common = dict(
            warmup_steps=settings.warmup_steps, generators=generators, shared_pool=settings.use_single_mempool,
            on_failure=settings.on_failure, input_device=device, on_capture_error=on_capture_error,
            before_capture=capture_barrier,
        )

        def train_graph_named(name: str) -> Any:
            return FullIterationGraph(train_step, run_backend, num_micro_batches=num_micro_batches, name=name, **common)

        eval_graph = GraphedStep(eval_step, run_backend, name="eval", **common)
        if buckets:
            train_graph = GraphPerBucket(lambda width: train_graph_named(f"train[{width}]"), num_micro_batches)
            describe = f"full iteration, a graph per bucket of {buckets} ({run_backend.name} backend)"
        else:
            train_graph = train_graph_named("train")
            describe = f"full iteration ({run_backend.name} backend)"
        graphs += [train_graph, eval_graph]
        fwd_bwd, evaluate_batches = train_graph, eval_graph
    else:

        def fwd_bwd(it: Iterator[Any]) -> dict[str, torch.Tensor]:
            return train_step([_to_device(next(it), device) for _ in range(num_micro_batches)])

        if settings.per_layer:
            fwd_bwd = _capture_after_warmup(fwd_bwd, layer_graphs, settings.warmup_steps)
            graphs.insert(0, fwd_bwd)

        def evaluate_batches(batches: list[Any]) -> dict[str, torch.Tensor]:
            return eval_step([_to_device(b, device) for b in batches])

    def opt_fn(train_out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return optimizer.step(train_out.get("nonfinite") if skip_on_nonfinite else None)

    optimizer_step: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = opt_fn
    if settings.optimizer_graph and settings.enabled:  # 3
        opt_graph = GraphedStep(
            opt_fn, run_backend, warmup_steps=settings.warmup_steps, name="optimizer", generators=generators,
            shared_pool=settings.use_single_mempool, on_failure=settings.on_failure,
            on_capture_error=on_capture_error,
        )
        graphs.append(opt_graph)
        optimizer_step = opt_graph
        describe += " + optimizer graph"

    def evaluate(it: Iterator[Any], iters: int) -> torch.Tensor:
        model.eval()
        try:
            return evaluate_batches([next(it) for _ in range(iters)])["loss"]
        finally:
            model.train()

    if settings.impl is GraphImpl.TRANSFORMER_ENGINE:
        log.info("cuda_graph_impl=transformer_engine: per-layer capture with Transformer Engine's semantics, "
                 "performed by graphstep's own engine (Transformer Engine is not used)")
    return Runner(fwd_bwd, optimizer_step, evaluate, run_backend, graphs, describe)


class _capture_after_warmup:
    """Per-layer graphs: eager iterations record call order and samples, then one capture.

    The engine needs one eager micro-batch to learn the call order and the
    input shapes, so ``cuda_graph_warmup_steps=0`` still runs one eager
    iteration (said in the log).
    """

    def __init__(self, step: Callable[[Iterator[Any]], dict[str, torch.Tensor]], layer_graphs: Any, warmup: int):
        if warmup == 0:
            log.info("per-layer graphs: one eager iteration records the call order before capture "
                     "(cuda_graph_warmup_steps=0 is treated as 1)")
        self.step, self.layer_graphs, self.warmup = step, layer_graphs, max(1, warmup)
        self.calls = 0
        self.state: str | None = None

    def __call__(self, it: Iterator[Any]) -> dict[str, torch.Tensor]:
        if self.calls == self.warmup and not self.layer_graphs.captured:
            self.layer_graphs.capture()  # with the micro-batches in flight of the last warm-up step
            self.state = "captured"
        elif self.layer_graphs.captured:
            self.state = "replayed"
        else:
            self.state = EAGER
        self.layer_graphs.start_step()
        self.calls += 1
        return self.step(it)

    def close(self) -> None:
        self.layer_graphs.close()


class GraphPerBucket:
    """A full-iteration graph per sequence-length bucket: this dispatcher picks, the graph captures or replays.

    Every micro-batch of a step has the bucket's width (the loader pads the whole
    step to one bucket), so the width keys the graph. A bucket's graph is made
    on its first step and warms up and captures on its own count.
    """

    def __init__(self, make_graph: Callable[[int], Any], num_micro_batches: int) -> None:
        self.make_graph, self.num_micro_batches = make_graph, num_micro_batches
        self.graphs: dict[int, Any] = {}
        self.state: str | None = None

    def __call__(self, data_iterator: Iterator[Any]) -> dict[str, torch.Tensor]:
        batches = [next(data_iterator) for _ in range(self.num_micro_batches)]
        widths = sorted({b["tokens"].shape[-1] for b in batches})
        if len(widths) != 1:
            raise ValueError(f"the micro-batches of one step have widths {widths}; with data.seq_length_buckets "
                             "every micro-batch of a step must be padded to the same bucket")
        graph = self.graphs.get(widths[0])
        if graph is None:
            graph = self.graphs[widths[0]] = self.make_graph(widths[0])
        out = graph(iter(batches))
        self.state = graph.state
        return out

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.close()
        self.graphs.clear()


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
