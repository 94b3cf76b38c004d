"""The pieces of a run's graphs that are policy: what an iteration reads, when layer graphs capture, which bucket.

``build_run`` (training/build.py) makes a run's graphs in a fixed order and
hands them to a :class:`Runner`, whose three calls the loop makes every
iteration: ``train_step`` (forward/backward of all micro-batches),
``optimizer_step`` and ``evaluate``. With ``cuda_graph_impl=none`` these are
exactly the eager functions of step.py. cuda_graph/ provides the mechanisms
(``GraphedStep``, ``LayerGraphs``); this module decides how the loop drives
them:

* :func:`over_micro_batches` -- an iteration reads the step's micro-batches
  from the data iterator and hands their list to the step (to the
  full-iteration graph, a ``GraphedStep`` whose static inputs are that list);
* :class:`CaptureLayersAfterWarmup` -- per-layer graphs capture at the start
  of the first iteration after ``cuda_graph_warmup_steps`` eager ones;
* :class:`GraphPerBucket` -- with shape buckets (``data.seq_length_buckets``)
  every micro-batch of a step is padded to the same bucket (data/buckets.py),
  and this dispatcher, keyed by the step's width, runs a separate
  full-iteration graph per bucket -- its own static buffers and warm-up count,
  captured into the shared pool the first time the bucket is past its
  warm-up. Evaluation batches are padded to the largest bucket: one
  evaluation graph. Per-layer graphs with buckets are refused (rule R21: one
  set of layer graphs per bucket is not implemented).

Ownership: every graph of a run is made through a :class:`RunBackend` view
of the backend it was handed (cuda_graph/run_backend.py), so the runner's
``close()`` frees this run's graphs and nothing else, and its
``backend.reports`` are this run's captures.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..cuda_graph.full_iteration import EAGER
from ..cuda_graph.layers import LayerGraphs
from ..cuda_graph.run_backend import RunBackend

log = logging.getLogger("graphstep")

Batch = dict[str, torch.Tensor]
Outputs = dict[str, torch.Tensor]


@dataclass
class Runner:
    """What the loop calls; owns every graph it made (``close()`` frees them, and only them).

    ``backend`` is the run's view of the process backend (None without graphs):
    ``backend.reports`` holds this run's capture reports.
    """

    train_step: Callable[[Iterator[Any]], Outputs]
    optimizer_step: Callable[[Outputs], Outputs]
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


def over_micro_batches(step: Callable[[list[Any]], Outputs], num_micro_batches: int,
                       ) -> Callable[[Iterator[Any]], Outputs]:
    """One iteration of ``step``: read the step's ``num_micro_batches`` micro-batches, call ``step`` on their list."""

    def iteration(data: Iterator[Any]) -> Outputs:
        return step([next(data) for _ in range(num_micro_batches)])

    return iteration


def on_device(step: Callable[[list[Batch]], Outputs], device: torch.device) -> Callable[[list[Batch]], Outputs]:
    """``step`` called eagerly on the batches moved to ``device`` (a graph copies them into its static buffers)."""

    def moved(batches: list[Batch]) -> Outputs:
        return step([{k: v.to(device, non_blocking=True) for k, v in b.items()} for b in batches])

    return moved


def evaluating(model: nn.Module, evaluate_batches: Callable[[list[Any]], Outputs],
               ) -> Callable[[Iterator[Any], int], torch.Tensor]:
    """The runner's ``evaluate(data, iters)``: ``iters`` batches in eval mode, the mean loss (graph-owned)."""

    def evaluate(it: Iterator[Any], iters: int) -> torch.Tensor:
        model.eval()
        try:
            return evaluate_batches([next(it) for _ in range(iters)])["loss"]
        finally:
            model.train()

    return evaluate


class CaptureLayersAfterWarmup:
    """Per-layer graphs: eager iterations record call order and samples, then one capture.

    Wraps the training iteration: it marks each step for the engine
    (``LayerGraphs.start_step``) and, at the start of iteration
    ``cuda_graph_warmup_steps``, captures every layer graph with the
    micro-batches in flight of the last warm-up iteration. When to capture is
    the trainer's decision, counted in iterations; the engine (cuda_graph/layers.py)
    only records and captures. It needs one eager micro-batch to learn the call
    order and the input shapes, so ``cuda_graph_warmup_steps=0`` still runs one
    eager iteration (said in the log).
    """

    def __init__(self, step: Callable[[Iterator[Any]], Outputs], layer_graphs: LayerGraphs, warmup: int):
        if warmup == 0:
            log.info("per-layer graphs: one eager iteration records the call order before capture "
                     "(cuda_graph_warmup_steps=0 is treated as 1)")
        self.step, self.layer_graphs, self.warmup = step, layer_graphs, max(1, warmup)
        self.calls = 0
        self.state: str | None = None

    def __call__(self, it: Iterator[Any]) -> Outputs:
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

    def __call__(self, data_iterator: Iterator[Any]) -> Outputs:
        batches = [next(data_iterator) for _ in range(self.num_micro_batches)]
        widths = sorted({b["tokens"].shape[-1] for b in batches})
        if len(widths) != 1:
            raise ValueError(f"the micro-batches of one step have widths {widths}; with data.seq_length_buckets "
                             "every micro-batch of a step must be padded to the same bucket")
        graph = self.graphs.get(widths[0])
        if graph is None:
            graph = self.graphs[widths[0]] = self.make_graph(widths[0])
        out = graph(batches)
        self.state = graph.state
        return out

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.close()
        self.graphs.clear()
