"""A run's view of the process's graph backend: the graphs it made, and only those.

The process holds one backend per device (cuda_graph/backend.py's
``get_backend``): its pool, its capture stream, and every graph anyone made
through it -- a user's ``graphstep.graph_step``, an earlier ``train()`` in the
same process, another bench row. A run must count and free only its own.

:class:`RunBackend` wraps that backend and is what a run's graphs are made
through. It is a :class:`GraphBackend` itself, so the mechanism
(``GraphedStep``, ``LayerGraphs``) cannot tell the difference:

* ``new_graph`` and ``capture`` go to the process backend (same pool, same
  stream); the view remembers the graphs it made and appends the report of
  each capture that succeeded to its own ``reports`` -- this run's captures;
* ``close()`` resets only those graphs (the process backend's other graphs
  keep replaying); ``warmup``, ``memory`` and the rest are the process
  backend's.

"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch

from .backend import Graph, GraphBackend


class RunBackend(GraphBackend):
    """The process backend, seen by one run: graphs and capture reports of this run only."""

    def __init__(self, inner: GraphBackend) -> None:
        super().__init__(inner.device)
        self.inner = inner
        self.name = inner.name
        self.needs_stream_warmup = inner.needs_stream_warmup
        self.captures_fused_optimizers = inner.captures_fused_optimizers

    def new_graph(self, name: str, *, shared_pool: bool = True) -> Graph:
        return self._track(self.inner.new_graph(name, shared_pool=shared_pool))

    @contextlib.contextmanager
    def capture(self, graph: Graph, generators: Iterable[torch.Generator] = ()) -> Iterator[None]:
        with self.inner.capture(graph, generators):
            yield
        if graph.report is not None:  # only a capture that succeeded gets here
            self.reports.append(graph.report)

    def warmup(self) -> contextlib.AbstractContextManager:
        return self.inner.warmup()

    def memory(self) -> tuple[int, int]:
        return self.inner.memory()

    def synchronize(self) -> None:
        self.inner.synchronize()

    def close(self) -> None:
        """Reset this run's graphs (harmless twice); the process backend and its other graphs stay."""
        super().close()
        if self.device.type == "cuda":  # hand the freed graph memory back, as the process backend's close does
            self.inner.synchronize()
            torch.cuda.empty_cache()

    def __getattr__(self, name: str) -> Any:  # anything else a backend offers (a pool, a stream, a session)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
