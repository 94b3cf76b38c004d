"""The CPU replay backend: CUDA-graph semantics without a GPU.

Capture records every aten op of the region with a ``TorchDispatchMode``:
forward, autograd's backward, optimizer updates and collectives all pass
through it. Replay re-runs the recorded ops on the *same tensor objects*
under ``torch.no_grad()``:

* pure views and allocations are skipped (their tensors still alias the same
  storage, as addresses in a CUDA graph do);
* mutating ops (``add_``, ``copy_``, ``_foreach_mul_``, ``allreduce_`` ...)
  run again in place;
* every other op runs again and its result is copied into the tensor
  recorded at capture, so later ops read fresh values from the old address.

So the static-address contract of CUDA graphs holds exactly: a batch not
copied into the static input is not seen by replay, an output read after the
next replay has been overwritten, an RNG stream advances per replay.

Capture must have no observable effect, as on a GPU where nothing executes
while capturing: before the first write to memory that existed before the
capture, the backend saves that storage, and restores it (and every registered
generator) when the capture ends. The graph is then replayed to do the step.

Host-side state that CUDA tracks natively -- the RNG tracker swapping the
default generator's state -- is recorded as host callbacks
(:func:`record_host_op`) and re-run in order.

A host sync inside the region (``aten._local_scalar_dense`` from ``.item()``,
``bool(t)``, ``.tolist()``; ops with data-dependent output shapes such as
``nonzero`` or boolean-mask indexing) raises :class:`CaptureError` naming the
op and the user's source line, as the same step would fail on a GPU.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .backend import CaptureReport, Graph, GraphBackend, default_generators
from .errors import CaptureError, user_frame

aten = torch.ops.aten

_ALLOC_OPS = {
    aten.empty,
    aten.empty_strided,
    aten.new_empty,
    aten.new_empty_strided,
    aten.empty_like,
    aten.empty_permuted,
}
# Ops whose scalar result is metadata, not device data.
_METADATA_OPS = {
    aten.sym_size,
    aten.sym_stride,
    aten.sym_numel,
    aten.sym_storage_offset,
    aten.size,
    aten.stride,
    aten.dim,
    aten.numel,
    aten.is_same_size,
    aten.is_coalesced,
    aten._nnz,
}
_SCALAR_RETURNS = {"bool", "int", "float", "Scalar", "SymInt", "SymFloat", "SymBool", "complex"}

_local = threading.local()


def _active_recorder() -> "_Recorder | None":
    return getattr(_local, "recorder", None)


def record_host_op(fn: Callable[[], None]) -> None:
    """Run ``fn`` now and, while a replay-backend capture records on this thread, on every replay.

    For host-side state that a CUDA graph tracks natively (the RNG tracker's
    generator swaps); on the CUDA backend this is just ``fn()``.
    """
    fn()
    rec = _active_recorder()
    if rec is not None:
        rec.tape.entries.append(fn)


# --------------------------------------------------------------------------
# op classification


def _schema_kind(func: torch._ops.OpOverload) -> str:
    """'view', 'alloc', 'inplace_view', 'mutating' or 'functional'."""
    packet = func.overloadpacket
    if packet in _ALLOC_OPS:
        return "alloc"
    if _is_collective(func):
        return "mutating"
    if torch.Tag.inplace_view in func.tags:
        return "inplace_view"
    schema = func._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "mutating"
    returns = schema.returns
    if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        return "view"
    return "functional"


def _has_bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def host_sync_reason(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[str, str] | None:
    """(category, reason) when ``func`` would read device data on the host during capture."""
    packet = func.overloadpacket
    if packet in _METADATA_OPS:
        return None
    if packet is aten._local_scalar_dense or torch.Tag.data_dependent_output in func.tags:
        return "host_sync", "reads a device value on the host (a sync; not allowed while capturing)"
    if any(str(r.type) in _SCALAR_RETURNS for r in func._schema.returns):
        return "host_sync", "returns a Python value computed from device data (a sync)"
    if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
        if _has_bool_index(args[1] if len(args) > 1 else kwargs.get("indices")):
            return "dynamic_shape", "boolean-mask indexing has a data-dependent shape (it calls nonzero)"
        return None
    if packet is aten.repeat_interleave:
        if kwargs.get("output_size") is None:
            return "dynamic_shape", "repeat_interleave without output_size has a data-dependent shape"
        return None
    if torch.Tag.dynamic_output_shape in func.tags:
        return "dynamic_shape", "its output shape depends on the data (the host must read it)"
    return None


# --------------------------------------------------------------------------
# the tape


class _Tape(Graph):
    """A recorded region: a list of replayable entries."""

    def __init__(self, backend: "ReplayBackend", name: str) -> None:
        self.backend = backend
        self.name = name
        self.report: CaptureReport | None = None
        self.entries: list[Callable[[], None]] = []
        self.keep: list[Any] = []  # tensors the tape holds alive (its "pool")
        self.num_ops = 0
        self._captured = False

    @property
    def captured(self) -> bool:
        return self._captured

    def replay(self) -> None:
        if not self._captured:
            raise RuntimeError(f"graph {self.name!r} has not been captured (or was reset)")
        with torch.no_grad():
            for entry in self.entries:
                entry()

    def reset(self) -> None:
        self.entries = []
        self.keep = []
        self._captured = False


def _functional_entry(func, args, kwargs, out) -> Callable[[], None]:
    recorded = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]

    def run() -> None:
        fresh = [t for t in tree_leaves(func(*args, **kwargs)) if isinstance(t, torch.Tensor)]
        for dst, src in zip(recorded, fresh):
            if dst is not src:
                dst.copy_(src)

    return run


def _mutating_entry(func, args, kwargs) -> Callable[[], None]:
    def run() -> None:
        result = func(*args, **kwargs)
        for item in tree_leaves(result):
            wait = getattr(item, "wait", None)  # c10d Work of a recorded collective
            if wait is not None and not isinstance(item, torch.Tensor):
                wait()

    return run


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: _Tape, generators: set[int], device: torch.device) -> None:
        super().__init__()
        self.tape = tape
        self.generators = generators
        self.device = device
        self.created: set[int] = set()
        self.backups: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    # memory that existed before the capture is restored when it ends
    def _backup(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.created or key in self.backups:
            return
        self.backups[key] = (storage, storage.clone())

    def _note_created(self, out: Any) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.created.add(t.untyped_storage().data_ptr())

    def restore(self) -> None:
        for storage, saved in self.backups.values():
            storage.copy_(saved)
        self.backups.clear()

    def _fail(self, func, category: str, reason: str) -> None:
        optimizer = _optimizer_in_stack()
        if optimizer is not None:
            category = "optimizer"
            reason += (f"; {optimizer}.step() is not capturable as constructed: create it with capturable=True "
                       "on CUDA (fused=True on the CPU)")
        raise CaptureError(
            f"{func} cannot be captured: {reason}", op=str(func.overloadpacket.__name__), where=user_frame(),
            category=category,
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        problem = host_sync_reason(func, args, kwargs)
        if problem is not None:
            self._fail(func, *problem)
        gen = kwargs.get("generator")
        if gen is not None and _gen_key(gen) not in self.generators:
            self._fail(func, "rng", "it uses a generator that is not registered with the graph (use the RNG tracker)")
        kind = _schema_kind(func)
        if kind == "mutating":
            for t in _written_tensors(func, args, kwargs):
                self._backup(t)
        out = func(*args, **kwargs)
        tape = self.tape
        tape.num_ops += 1
        if kind in ("view", "inplace_view"):
            tape.keep.append(out)
        elif kind == "alloc":
            self._note_created(out)
            tape.keep.append(out)
        elif kind == "mutating":
            tape.entries.append(_mutating_entry(func, args, kwargs))
        else:
            self._note_created(out)
            tape.keep.append(out)
            tape.entries.append(_functional_entry(func, args, kwargs, out))
        return out


def _optimizer_in_stack() -> str | None:
    """The torch.optim optimizer whose step() is running, if the failing op comes from one."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        if "/torch/optim/" in frame.f_code.co_filename.replace("\\", "/") and frame.f_code.co_name == "step":
            owner = frame.f_locals.get("self")
            return type(owner).__name__ if owner is not None else "the optimizer"
        frame = frame.f_back
    return None


def _is_collective(func: torch._ops.OpOverload) -> bool:
    # c10d's in-place collectives (allreduce_, broadcast_, allgather_, reduce_scatter_, ...) write
    # into their first argument but their schemas carry no (a!) annotation, and they return a Work
    # that must be waited: treat them as mutating ops on that argument.
    return func.namespace == "c10d" and func._schema.name.endswith("_")


def _written_tensors(func, args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors an op writes to, by its schema's ``(a!)`` annotations (a collective: its first argument)."""
    if _is_collective(func):
        first = args[0] if args else kwargs.get(func._schema.arguments[0].name)
        yield from (t for t in tree_leaves(first) if isinstance(t, torch.Tensor))
        return
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor):
                yield t


def _gen_key(gen: torch.Generator) -> int:
    # The dispatcher hands ops a new Python wrapper of the same C++ generator: compare the C++ object.
    return gen._cdata


class ReplayBackend(GraphBackend):
    """Record-and-replay of aten ops: CUDA-graph semantics on any device."""

    name = "replay"

    def new_graph(self, name: str, *, shared_pool: bool = True) -> Graph:
        return self._track(_Tape(self, name))

    @contextlib.contextmanager
    def capture(self, graph: Graph, generators: Iterable[torch.Generator] = ()) -> Iterator[None]:
        assert isinstance(graph, _Tape)
        if _active_recorder() is not None:
            raise CaptureError(f"cannot capture graph {graph.name!r} while another capture is recording")
        gens = list(generators) + default_generators(self.device)
        states = [(g, g.get_state()) for g in gens]
        recorder = _Recorder(graph, {_gen_key(g) for g in gens}, self.device)
        t0 = time.perf_counter()
        _local.recorder = recorder
        try:
            with recorder, _refuse_direct_host_reads():
                yield
        except BaseException:
            graph.reset()
            raise
        finally:
            _local.recorder = None
            recorder.restore()
            for g, state in states:
                g.set_state(state)
        held = _held_bytes(graph.keep)
        graph.report = CaptureReport(graph.name, time.perf_counter() - t0, 0, held, 0, held)
        self.reports.append(graph.report)
        graph._captured = True

    def memory(self) -> tuple[int, int]:
        held = sum(_held_bytes(g.keep) for g in self.live_graphs() if isinstance(g, _Tape))
        return held, held


_DIRECT_READS = ("tolist", "numpy", "__array__")


@contextlib.contextmanager
def _refuse_direct_host_reads() -> Iterator[None]:
    """While recording, behave as a CUDA capture does for what bypasses the dispatcher.

    ``Tensor.tolist``/``numpy`` read memory without an aten op: refused, as CUDA
    would; ``torch.cuda.is_current_stream_capturing()`` answers True.
    """
    saved = {name: getattr(torch.Tensor, name) for name in _DIRECT_READS}

    def refuse(name: str):
        def read(self, *args, **kwargs):
            if _active_recorder() is None:
                return saved[name](self, *args, **kwargs)
            raise CaptureError(
                f"Tensor.{name}() cannot be captured: it copies device data to the host (a sync)",
                op=name, where=user_frame(), category="host_sync",
            )

        return read

    for name in _DIRECT_READS:
        setattr(torch.Tensor, name, refuse(name))
    # Code that asks "is the stream capturing?" (torch.optim's capture check,
    # Hugging Face's sync-free mask path) must get the answer a CUDA capture gives.
    was_capturing = torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: _active_recorder() is not None or was_capturing()
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        torch.cuda.is_current_stream_capturing = was_capturing


def _held_bytes(objs: list[Any]) -> int:
    seen: dict[int, int] = {}
    for t in tree_leaves(objs):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())
