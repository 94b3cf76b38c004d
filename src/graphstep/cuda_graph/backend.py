"""Graph backends: one capture mechanism, two implementations.

Every capture in graphstep goes through a :class:`GraphBackend`::

    backend = get_backend(device)            # registry.py: one per process and device
    graph = backend.new_graph("train")
    with backend.warmup():                   # eager warm-up on the capture stream
        step(*static_inputs)
    with backend.capture(graph, generators=tracker.generators()):
        outputs = step(*static_inputs)       # recorded, not (observably) executed
    graph.replay()                           # runs the step; outputs are overwritten

:class:`CudaGraphBackend` wraps ``torch.cuda.CUDAGraph``: one graph pool and
one capture stream per process, ``thread_local`` capture mode, Python GC frozen
during capture, every RNG-tracker generator registered with the graph where the
running PyTorch needs it.

:class:`ReplayBackend` gives the same semantics on the CPU (see replay.py): it
records every aten op of the region and replays them on the same tensors, so a
forgotten copy into a static input, a stale output or an RNG stream that does
not advance shows up on the CPU exactly as on a GPU.

.. warning::
    Inside a capture, nothing may read device data on the host (``.item()``,
    ``.tolist()``, ``bool(t)``, ``nonzero``, boolean-mask indexing): both
    backends raise :class:`CaptureError` naming the op and the user's line.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
import warnings
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from .devices import normalize_device
from . import torch_compat
from .errors import ACCUMULATE_GRAD_WARNING, CaptureError, GraphUsageError, accumulate_grad_stream

log = logging.getLogger("graphstep")


@dataclass
class CaptureReport:
    """Time and memory of one capture (bytes; the replay backend counts what the tape keeps alive)."""

    name: str
    seconds: float
    allocated_before: int
    allocated_after: int
    reserved_before: int
    reserved_after: int

    @property
    def allocated_delta(self) -> int:
        return self.allocated_after - self.allocated_before

    @property
    def reserved_delta(self) -> int:
        return self.reserved_after - self.reserved_before


class Graph(ABC):
    """A captured region that can be replayed."""

    name: str
    report: CaptureReport | None

    @abstractmethod
    def replay(self) -> None: ...

    @abstractmethod
    def reset(self) -> None:
        """Free what the capture holds; the graph can not be replayed again."""

    @property
    @abstractmethod
    def captured(self) -> bool: ...


class GraphBackend(ABC):
    """Creates, captures and frees graphs on one device."""

    name: str
    device: torch.device
    # Whether work must run once on the capture stream before it is captured
    # (lazy per-stream and per-thread initialisation, e.g. cuBLAS in autograd's
    # device thread, is illegal during a capture).
    needs_stream_warmup: bool = False
    # Whether a torch optimizer built with fused=True (and capturable=False) can be captured: on the CPU
    # its step counter stays a tensor, but on CUDA torch refuses to capture any optimizer that is not capturable.
    captures_fused_optimizers: bool = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._graphs: list[weakref.ref[Graph]] = []
        self.reports: list[CaptureReport] = []
        self.warmup_warning: str | None = None  # what the warm-up said about the coming capture (raised by it)

    @abstractmethod
    def new_graph(self, name: str, *, shared_pool: bool = True) -> Graph: ...

    @abstractmethod
    def capture(self, graph: Graph, generators: Iterable[torch.Generator] = ()) -> contextlib.AbstractContextManager:
        """Context manager: the work inside is captured into ``graph``."""

    def warmup(self) -> contextlib.AbstractContextManager:
        """Context manager for eager warm-up work (on the capture stream for CUDA)."""
        return self._watch_warmup()

    @contextlib.contextmanager
    def _watch_warmup(self) -> Iterator[None]:
        """Keep what the warm-up tells about the coming capture (PyTorch's AccumulateGrad stream warning)."""
        with _watch_warnings(ACCUMULATE_GRAD_WARNING) as seen:
            yield
        if seen and self.warmup_warning is None:
            self.warmup_warning = seen[0]

    def raise_warmup_problem(self, graph_name: str) -> None:
        """Every backend's ``capture`` starts here: what the warm-up showed cannot be captured is raised
        (once) with its cause, instead of a capture that fails on the GPU without one."""
        warning, self.warmup_warning = self.warmup_warning, None
        if warning is not None:
            raise accumulate_grad_stream(graph_name, f"the warm-up on the capture stream warned: {warning}")

    @abstractmethod
    def memory(self) -> tuple[int, int]:
        """(allocated, reserved) bytes on the device now."""

    def synchronize(self) -> None:
        return None

    def live_graphs(self) -> list[Graph]:
        return [g for r in self._graphs if (g := r()) is not None and g.captured]

    def _track(self, graph: Graph) -> Graph:
        self._graphs.append(weakref.ref(graph))
        return graph

    def close(self) -> None:
        """Reset every graph made by this backend and free the pool."""
        for ref in self._graphs:
            g = ref()
            if g is not None:
                g.reset()
        self._graphs.clear()


@contextlib.contextmanager
def _watch_warnings(text: str) -> Iterator[list[str]]:
    """Collect the warnings that contain ``text``; every other warning is shown as usual."""
    seen: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # a once-only warning must reach us even if it was shown before
        yield seen
    for w in caught:
        if text in str(w.message):
            seen.append(str(w.message).splitlines()[0])
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """Collecting garbage during capture can free tensors whose memory the capture
    uses and costs time per object: freeze what exists, keep the collector off.

    No ``gc.collect()`` first: a full collection costs ~0.1 s in a process that
    has imported torch, once per graph -- it was 95% of the capture time of
    per-layer graphs (3.3 of 3.45 s for 32 graphs on an H200) -- and capture
    needs none (PyTorch's own ``torch.cuda.graph`` dropped it by default too).
    """
    was_enabled = gc.isenabled()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()


def default_generators(device: torch.device) -> list[torch.Generator]:
    """The generators random ops use when given none: the CPU's, and the device's on CUDA."""
    gens = [torch.default_generator]
    if device.type == "cuda":
        gens.append(torch.cuda.default_generators[device.index or 0])
    return gens


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One capture stream per device for the life of the process.

    cuBLAS keeps a workspace (tens of MiB, allocated from the caching allocator)
    per handle and stream, for good: a new stream for every backend (a bench
    row, a test, a re-capture after close) would add workspaces that are
    never freed.
    """
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


@contextlib.contextmanager
def capture_stream(device: torch.device | str | int | None = None) -> Iterator[None]:
    """Run the block on graphstep's capture stream of ``device`` (a no-op without a CUDA device).

    Construct DDP, FSDP or anything that keeps AccumulateGrad nodes inside
    ``with graphstep.capture_stream():``: autograd accumulates a parameter's
    gradient on the stream its AccumulateGrad node was made on, and a node made
    on the default stream cannot join a graph captured on the capture stream.
    The stream waits for the current one on entry, and the current one for it on exit.
    """
    if device is None:
        if not torch.cuda.is_available():
            yield
            return
        device = "cuda"
    device = normalize_device(device)
    if device.type != "cuda":
        yield
        return
    stream = _capture_stream(device)
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        yield
    current.wait_stream(stream)


class CudaGraphBackend(GraphBackend):
    """``torch.cuda.CUDAGraph`` with one pool and one capture stream per process."""

    name = "cuda"
    needs_stream_warmup = True
    captures_fused_optimizers = False

    def __init__(self, device: torch.device, capture_error_mode: str = "thread_local") -> None:
        super().__init__(device)
        self.capture_error_mode = capture_error_mode
        with torch.cuda.device(device):
            self.stream = _capture_stream(device)
            self.pool = torch.cuda.graph_pool_handle()

    def new_graph(self, name: str, *, shared_pool: bool = True) -> Graph:
        return self._track(_CudaGraph(self, name, self.pool if shared_pool else None))

    @contextlib.contextmanager
    def warmup(self) -> Iterator[None]:
        with self._watch_warmup(), capture_stream(self.device):
            yield

    @contextlib.contextmanager
    def capture(self, graph: Graph, generators: Iterable[torch.Generator] = ()) -> Iterator[None]:
        assert isinstance(graph, _CudaGraph)
        self.raise_warmup_problem(graph.name)  # a capture that would fail on the GPU: say why without trying
        generators = list(generators)
        _register_generators(graph.cuda_graph, generators)
        torch.cuda.synchronize(self.device)
        alloc0, res0 = self.memory()
        t0 = time.perf_counter()
        # An explicit pool id even for a private pool, so a broken capture can hand it back.
        pool = graph.pool if graph.pool is not None else torch.cuda.graph_pool_handle()
        ctx = torch.cuda.graph(graph.cuda_graph, pool=pool, stream=self.stream,
                               capture_error_mode=self.capture_error_mode)
        outer = torch.cuda.current_stream(self.device)
        with _gc_frozen():
            try:
                ctx.__enter__()
                yield
                ctx.__exit__(None, None, None)
            except BaseException as exc:  # KeyboardInterrupt too: never leave the stream capturing
                self._end_broken_capture(graph, ctx, pool, outer, generators)
                if not isinstance(exc, Exception):
                    raise
                raise CaptureError.from_cuda(exc, graph.name) from exc
        torch.cuda.synchronize(self.device)
        alloc1, res1 = self.memory()
        graph.report = CaptureReport(graph.name, time.perf_counter() - t0, alloc0, alloc1, res0, res1)
        self.reports.append(graph.report)
        graph._captured = True

    def _release(self, graph: "_CudaGraph") -> None:
        """A graph was reset: once no captured graph uses the shared pool, start a new one.

        The caching allocator frees a pool when its last graph goes; capturing
        into that pool's id afterwards trips an internal assert, so the next
        capture must get a fresh pool handle.
        """
        if graph.pool is not None and graph.pool == self.pool:
            if not any(g.pool == self.pool for g in self.live_graphs()):
                self.pool = torch.cuda.graph_pool_handle()

    def _end_broken_capture(self, graph: "_CudaGraph", ctx: torch.cuda.graph, pool, outer: torch.cuda.Stream,
                            generators: list[torch.Generator]) -> None:
        """Leave no trace of a failed capture: capture ended, pool handed back, stream and RNG as before.

        ``torch.cuda.graph.__exit__`` does not clean up after an error: when the error invalidated the
        capture, ``capture_end`` raises before telling the allocator (which keeps routing to the pool
        through a filter that points at the graph), before restoring the stream, and before taking the
        registered generators out of capture mode. Each step here is best effort, except the allocator calls
        (torch_compat.py): a torch without them would leak the pool, so that is a TorchCompatError, raised
        after the rest of the clean-up.
        """
        cg = graph.cuda_graph
        try:
            with warnings.catch_warnings():  # "The CUDA Graph is empty": the error came before any kernel
                warnings.simplefilter("ignore")
                cg.capture_end()  # a capture the error did not invalidate ends normally; reset() frees it
        except Exception:
            ended = False
        else:
            ended = True
        try:
            # the allocator may still route to the pool: stop it and drop the capture's reference
            if not ended and torch_compat.end_allocate_to_pool(self.device, pool):
                torch_compat.release_pool(self.device, pool)
        finally:  # a TorchCompatError (this torch lacks those calls) comes out after the rest of the clean-up
            self._restore_after_broken_capture(graph, ctx, outer, generators)

    def _restore_after_broken_capture(self, graph: "_CudaGraph", ctx: torch.cuda.graph, outer: torch.cuda.Stream,
                                      generators: list[torch.Generator]) -> None:
        try:
            ctx.stream_ctx.__exit__(None, None, None)
        except Exception:
            pass
        if torch.cuda.current_stream(self.device) != outer:
            torch.cuda.set_stream(outer)
        try:
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # a stale error of the failed capture surfaces here once
            log.debug("after the failed capture of %r: %s", graph.name, exc)
        graph.reset()
        self._end_generator_capture(generators)
        torch.cuda.empty_cache()
        with torch.cuda.stream(self.stream):
            if torch.cuda.is_current_stream_capturing():
                log.error("the capture stream is still capturing after the failed capture of %r", graph.name)

    def _end_generator_capture(self, generators: list[torch.Generator]) -> None:
        # Some PyTorch versions leave generators registered with a failed capture in capture mode (the next
        # eager random op raises "Offset increment outside graph capture"); an empty capture ends it.
        flush = torch.cuda.CUDAGraph()
        try:
            _register_generators(flush, generators)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with torch.cuda.graph(flush, stream=self.stream, capture_error_mode=self.capture_error_mode):
                    pass
        except Exception as exc:
            log.warning("could not take the RNG generators out of capture mode (%s): random ops may fail", exc)
        finally:
            flush.reset()

    def memory(self) -> tuple[int, int]:
        return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        super().close()
        # A new pool handle drops our reference to the old pool's id; the
        # caching allocator frees its blocks once no graph uses them.
        with torch.cuda.device(self.device):
            self.pool = torch.cuda.graph_pool_handle()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


class _CudaGraph(Graph):
    def __init__(self, backend: CudaGraphBackend, name: str, pool) -> None:
        self.backend = backend
        self.name = name
        self.pool = pool
        self.cuda_graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()
        self.report = None
        self._captured = False

    @property
    def captured(self) -> bool:
        return self._captured

    def replay(self) -> None:
        if not self._captured or self.cuda_graph is None:
            raise GraphUsageError(f"graph {self.name!r} has not been captured (or was reset): capture it again "
                                  "(reset() on the graphed step starts a new warm-up)")
        self.cuda_graph.replay()

    def reset(self) -> None:
        if self.cuda_graph is not None:
            self.cuda_graph.reset()
            self.cuda_graph = None
        self._captured = False
        self.backend._release(self)


def _register_generators(graph: torch.cuda.CUDAGraph, generators: Iterable[torch.Generator]) -> None:
    """Register graph-safe generators where this PyTorch needs it.

    ``CUDAGraph.register_generator_state`` exists from about 2.4; from about
    2.14 every generator is tracked automatically and the method is a
    deprecated no-op. Registering the default generator is always implicit.
    """
    register = getattr(graph, "register_generator_state", None)
    if register is None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        for gen in generators:
            if gen.device.type == "cuda":
                register(gen)
