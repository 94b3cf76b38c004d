"""The CPU replay backend: CUDA-graph semantics without a GPU.

Capture records every aten op of the region with a ``TorchDispatchMode``:
forward, autograd's backward, optimizer updates and collectives all pass
through it. Replay re-runs the recorded ops on the *same tensor objects*,
below autograd and with the grad mode each op was recorded under (a kernel
may choose its algorithm by grad mode, e.g. oneDNN's LSTM: re-running under
``no_grad`` would change the last bits):

* pure views and allocations are skipped (their tensors still alias the same
  storage, as addresses in a CUDA graph do), and so are profiler ranges;
* mutating ops (``add_``, ``copy_``, ``_foreach_mul_``, ``allreduce_`` ...)
  run again in place; an op that writes an argument *and* returns a new
  tensor (``rrelu_with_noise``) runs again and its new result is copied out;
* every other op runs again and its result is copied into the tensor
  recorded at capture, so later ops read fresh values from the old address.
  Re-running also repeats writes an op makes without declaring them in its
  schema (``native_batch_norm``'s running statistics).

So the static-address contract of CUDA graphs holds exactly: a batch not
copied into the static input is not seen by replay, an output read after the
next replay has been overwritten, an RNG stream advances per replay.

Graphs made with ``shared_pool=True`` (the default) share one pool, as on the
CUDA backend, where a capture may be handed memory that an earlier capture
used as scratch: what a later-captured graph allocated (``empty`` and its
kind) and still holds, the earlier graph's replay overwrites. The backend
models that: each replay fills such memory of the graphs captured after it
in its pool with 0xFF bytes (NaN in every float format). A buffer the host
writes once and reads across replays (instead of before each) then fails its
comparison with eager on the CPU as it can on a GPU. Results of the later
graph's own ops are written again when it replays; storages allocated by a
recorded resize (FSDP2's) are not modelled.

Capture must have no observable effect, as on a GPU where nothing executes
while capturing: before an op first touches memory that existed before the
capture, the backend saves that storage (every argument of every re-run op,
since some ops write arguments their schema calls read-only), and restores it
(and every registered generator) when the capture ends. Until then the
capture holds one copy of the pre-existing memory the region touches. The
graph is then replayed to do the step.

A tensor subclass with its own dispatch (DTensor, a functional collective's
AsyncCollectiveTensor) is not recorded as such: the recorder hands its op to
the subclass, and records the plain-tensor ops the subclass runs underneath
(a fake tensor, used by DTensor to propagate shardings, runs unrecorded).
Collectives re-run at replay and are waited before anything reads them: a
c10d collective's ``Work``, a functional collective's ``wait_tensor``.

Host-side state that CUDA tracks natively -- the RNG tracker swapping the
default generator's state, ``torch.get_rng_state``/``set_rng_state`` as
``torch.utils.checkpoint`` uses them -- is recorded as host callbacks
(:func:`record_host_op`; *The host* below) and re-run in order.

What is refused (:class:`CaptureError` naming the op and the user's line):

* a host sync, as the same step would fail on a GPU: ``aten._local_scalar_dense``
  (``.item()``, ``bool(t)``), ``.tolist()``, ``print(t)``/``str``/``repr``/
  ``format`` of a tensor, ops with data-dependent output shapes (``nonzero``,
  boolean-mask indexing);
* reseeding (``torch.manual_seed``) and ops drawing from a generator that is
  not registered with the graph;
* what the backend cannot replay exactly: an op that changes a tensor's
  shape, strides or storage in place (``t_``, ``unsqueeze_``, ``as_strided_``,
  ``resize_`` to a new size, ``set_``). Replay refills each recorded tensor
  object, and those objects keep the layout they have at the *end* of the
  capture: an op recorded before the layout change would be replayed through
  the wrong layout. The rule: an op is replayed only when re-running it on
  the recorded tensor objects computes what eager computed -- its writes are
  in place on arguments (declared or re-run whole), its results are tensors
  refilled in place, its randomness comes from registered generators, and
  no tensor changes layout in place (a change the capture would also leave
  behind, once, where eager makes it every step).

The host: what the replay backend must see of the host while it records.
Some Python-level calls never reach the dispatcher, so a ``TorchDispatchMode``
cannot see them; this module wraps them for the duration of a replay-backend
capture (on the recording thread only; other threads call the originals):

* reads of device data on the host -- ``Tensor.tolist``/``numpy``/``__array__``
  and printing (``print(t)``, ``str``, ``repr``, ``format``, f-strings, which
  ``torch._tensor_str`` runs with the dispatch modes disabled) -- raise
  :class:`CaptureError` naming the call and the user's line, as the same step
  breaks a CUDA capture (and a captured print would run once, not per replay);
* reseeding (``torch.manual_seed``, ``torch.seed``, their ``torch.cuda``
  forms) is refused the same way: CUDA refuses to reseed while capturing;
* generator state copies -- ``torch.get_rng_state``/``set_rng_state`` and
  their ``torch.cuda`` forms, used by ``torch.utils.checkpoint`` with
  ``preserve_rng_state=True`` and by ``torch.random.fork_rng`` -- are recorded
  as host callbacks: a state read refills the *same* tensor on every replay
  (a static address, as ``graphsafe_get_state`` gives on a GPU) and a state
  write re-applies whatever that tensor holds then;
* storage resizes (``UntypedStorage.resize_``, as FSDP2 allocates and frees
  its unsharded parameters around each use) are recorded as host callbacks:
  replay reallocates and frees at the same points, and the recorded ops
  refill the tensors that view the storage; memory a resize allocates is
  the capture's own, never backed up or restored; a storage the capture
  allocated itself is given back its size at the start of every replay;
* a collective's ``Work.wait()`` is recorded as a wait on the re-run
  collective at that point, and what a backend does inside it runs
  unrecorded (gloo copies a reduce-scatter's result out on every wait: it
  belongs to the collective, which replay re-runs and waits itself);
* ``torch.cuda.is_current_stream_capturing()`` answers True.

Host callbacks (:func:`record_host_op`) run in recording order between the
recorded ops; a callback that calls another wrapped function is recorded once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterable, Iterator

import torch

from .backend import CaptureReport, Graph, GraphBackend, default_generators
from .backup import StateBackup, storage_key
from .errors import CaptureError, GraphUsageError, user_frame
from .monkeypatch import Patches
from .ops import (
    fresh_returns, generator_args, host_sync_reason, is_collective, is_functional_collective, returned_tensors_of,
    schema_kind, tensor_arguments,
)
from .torch_compat import (FakeTensor, TorchDispatchMode, below_autograd_outside_autocast, generator_key, op_schema,
                           tree_leaves, wait_tensor)

__all__ = ["ReplayBackend", "host_sync_reason", "record_host_op"]

POOL_GARBAGE = 0xFF  # the byte a shared pool's reuse is modelled with (_Tape._overwrite_later_allocations)

aten = torch.ops.aten

def _active_recorder() -> "_Recorder | None":
    return active_recorder()


# --------------------------------------------------------------------------
# the tape


class _Tape(Graph):
    """A recorded region: replayable entries, grouped in runs recorded under the same grad mode."""

    def __init__(self, backend: "ReplayBackend", name: str, pool: list["_Tape"] | None = None) -> None:
        self.backend = backend
        self.name = name
        self.report: CaptureReport | None = None
        self.runs: list[tuple[bool, list[Callable[[], None]]]] = []
        self.keep: list[Any] = []  # tensors the tape holds alive (its "pool")
        self.num_ops = 0
        self._captured = False
        self._first: list[Callable[[], None]] | None = None  # entries run before everything recorded
        self.pool = pool  # the captured tapes of its shared pool, in capture order (None: a pool of its own)
        self.allocated: list[torch.Tensor] = []  # byte views of the memory its capture allocated (empty & co.)

    @property
    def captured(self) -> bool:
        return self._captured

    def add(self, entry: Callable[[], None]) -> None:
        grad = torch.is_grad_enabled()
        if not self.runs or self.runs[-1][0] != grad:
            self.runs.append((grad, []))
        self.runs[-1][1].append(entry)

    def add_first(self, entry: Callable[[], None]) -> None:
        """An entry every replay runs before all the others (a host callback, grad mode irrelevant)."""
        if self._first is None:
            self._first = []
            self.runs.insert(0, (torch.is_grad_enabled(), self._first))
        self._first.append(entry)

    def replay(self) -> None:
        if not self._captured:
            raise GraphUsageError(f"graph {self.name!r} has not been captured (or was reset)")
        # Below autograd (nothing is recorded for backward, in-place writes to leaves are legal), outside
        # autocast (the casts were recorded), and in each op's recorded grad mode: the kernels take the
        # paths they took when recorded.
        if self.pool is not None:  # a captured tape with a pool is in it (reset takes it out)
            self._overwrite_later_allocations()
        with below_autograd_outside_autocast():
            for grad, run in self.runs:
                with torch.set_grad_enabled(grad):
                    for entry in run:
                        entry()

    def _overwrite_later_allocations(self) -> None:
        """What a shared CUDA pool may do at this replay: write this graph's scratch over memory that a graph
        captured after it allocated (``torch.empty`` and its kind) and still holds, since the allocator may
        have handed it that memory when this graph's capture freed it. Those bytes become 0xFF (NaN in every
        float format), so code that reads such a buffer before writing it again -- a gradient buffer filled once
        by the host instead of before every backward replay -- fails its comparison with eager here too, as it
        can on a GPU. Memory the later graph's own ops write (their results, a recorded fill) is written again
        when it replays; storages a capture allocates by resizing (FSDP2's) are left alone."""
        for later in self.pool[self.pool.index(self) + 1:]:
            for buffer in later.allocated:
                if buffer.untyped_storage().nbytes() == buffer.numel():  # a storage resized since: not this memory
                    buffer.fill_(POOL_GARBAGE)

    def reset(self) -> None:
        self.runs = []
        self.keep = []
        self.allocated = []
        self._first = None
        self._captured = False
        if self.pool is not None and self in self.pool:
            self.pool.remove(self)


def _refill_entry(func, args, kwargs, out, positions: tuple[int, ...]) -> Callable[[], None]:
    """Re-run ``func`` (its in-place writes happen again) and copy its new results into the recorded ones."""
    returned = returned_tensors_of(func, positions)
    recorded = returned(out)
    wait = wait_tensor if is_functional_collective(func) else None

    def run() -> None:
        fresh = returned(func(*args, **kwargs))
        if wait is not None:  # the collective's result is pending until waited
            fresh = [wait(t) for t in fresh]
        for dst, src in zip(recorded, fresh):
            if dst is not src:
                dst.copy_(src)

    return run


def _works(result: Any) -> list[Any]:
    """The c10d ``Work`` objects an op returned, as the Python objects its caller holds."""
    return [torch.distributed.Work.unbox(item) if isinstance(item, torch.ScriptObject) else item
            for item in tree_leaves(result) if not isinstance(item, torch.Tensor) and hasattr(item, "wait")]


def _mutating_entry(func, args, kwargs) -> Callable[[], None]:
    if not is_functional_collective(func):
        return lambda: func(*args, **kwargs)

    def run() -> None:  # an in-place functional collective: done when waited
        for t in tree_leaves(func(*args, **kwargs)):
            if isinstance(t, torch.Tensor):
                wait_tensor(t)

    return run


class _Communication:
    """A c10d op (a collective, a point-to-point send or receive): re-run, and waited where the capture waited.

    At capture the op returns a ``Work``; when the captured code waits on it
    (``Work.wait()``, as ``dist.all_reduce`` does at once and a pipeline
    schedule does after posting a batch of sends and receives), the tape gets
    a wait of the replayed op's ``Work`` at that point (:meth:`wait`). So the
    ranks replay the same posting and waiting order as the capture, which is
    what keeps point-to-point exchanges free of deadlock. A ``Work`` the
    capture never waited on is waited at once after the op is re-run.
    """

    def __init__(self, func, args: tuple, kwargs: dict) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        self.deferred = False  # True once the capture waited on this op's Work
        self.pending: list[Any] = []

    def __call__(self) -> None:
        works = _works(self.func(*self.args, **self.kwargs))
        if self.deferred:
            self.pending = works
        else:
            for work in works:
                work.wait()

    def wait(self) -> None:
        works, self.pending = self.pending, []
        for work in works:
            work.wait()


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().data_ptr()


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: _Tape, generators: set[int], device: torch.device) -> None:
        super().__init__()
        self.tape = tape
        self.generators = generators
        self.device = device
        self.created: set[int] = set()  # addresses of the storages the captured work allocated
        # the storages (ids; the tape keeps each alive) whose size at the start of a replay is taken care of: by
        # identity, not address -- a storage the capture frees gives its address to the next allocation
        self.sized: set[int] = set()
        self.backup = StateBackup()  # memory that existed before the capture, restored when it ends
        self.issued: dict[int, _Communication] = {}  # id of a c10d op's Work -> the tape entry that re-runs it
        self.allocations: list[torch.Tensor] = []  # what empty & co. returned during the capture
        self.resized: set[int] = set()  # addresses of the storages a recorded resize allocated

    def _note_created(self, out: Any) -> None:
        for t in (out,) if isinstance(out, torch.Tensor) else tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.created.add(storage_key(t))

    def restore(self) -> None:
        self.backup.restore()

    def allocated_memory(self) -> list[torch.Tensor]:
        """A byte view of each storage the capture allocated with empty & co. and did not resize (one per storage)."""
        views: dict[int, torch.Tensor] = {}
        for t in self.allocations:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in views and key not in self.resized and storage.nbytes():
                views[key] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
                    storage, 0, (storage.nbytes(),), (1,))
        return list(views.values())

    def _fail(self, func, category: str, reason: str) -> None:
        optimizer = _optimizer_in_stack()
        if optimizer is not None and category != "unreplayable":
            category = "optimizer"
            reason += (f"; {optimizer}.step() is not capturable as constructed: create it with capturable=True "
                       "on CUDA (fused=True on the CPU)")
        raise CaptureError(
            f"{func} cannot be captured: {reason}", op=str(func.overloadpacket.__name__), where=user_frame(),
            category=category,
        )

    def _check(self, func, args: tuple, kwargs: dict) -> None:
        problem = host_sync_reason(func, args, kwargs)
        if problem is not None:
            self._fail(func, *problem)
        for gen in _generators(func, args, kwargs):
            if generator_key(gen) not in self.generators:
                self._fail(func, "rng",
                           "it uses a generator that is not registered with the graph (use the RNG tracker)")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if in_collective_wait():  # a collective's own completion (gloo copies out in wait()): replay re-waits
            return func(*args, **kwargs)
        if any(t is not torch.Tensor and t is not torch.nn.Parameter for t in types):  # a __torch_dispatch__ subclass
            return self._subclass_op(func, types, args, kwargs)
        self._check(func, args, kwargs)
        kind = schema_kind(func)
        if kind in ("mutating", "mutating_fresh", "functional"):
            # Every argument, not only the (a!) ones: some ops write what their schema calls read-only.
            self.backup.save_storages(tensor_arguments(args, kwargs), skip=self.created)
        if kind == "inplace_view":
            return self._inplace_view(func, args, kwargs)
        out = func(*args, **kwargs)
        tape = self.tape
        tape.num_ops += 1
        if kind == "view" and _copied(out, args, kwargs):
            kind = "functional"  # a may-alias op that made a new tensor: it must run again at replay
        if kind in ("view", "alloc", "host_only"):
            if kind == "alloc":
                self._note_created(out)
                self.allocations += [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            tape.keep.append(out)
        elif is_collective(func):
            self._communication(func, args, kwargs, out)
        elif kind == "mutating":
            tape.add(_mutating_entry(func, args, kwargs))
        else:
            positions = fresh_returns(func) if kind == "mutating_fresh" else tuple(range(len(op_schema(func).returns)))
            self._note_created(returned_tensors_of(func, positions)(out))
            tape.keep.append(out)
            tape.add(_refill_entry(func, args, kwargs, out, positions))
        return out

    def _communication(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        entry = _Communication(func, args, kwargs)
        self.tape.add(entry)
        for work in _works(out):
            self.tape.keep.append(work)  # the caller's Work stays this object while the tape lives
            self.issued[id(work)] = entry

    def note_wait(self, work: Any) -> None:
        """The captured code waits on ``work``: replay waits on the re-run op's Work here too."""
        entry = self.issued.get(id(work))
        if entry is not None:
            entry.deferred = True
            self.tape.add(entry.wait)

    def _subclass_op(self, func, types, args: tuple, kwargs: dict) -> Any:
        """An op on a tensor subclass: record what it runs on plain tensors, not the op itself.

        A wrapper subclass (DTensor, a functional collective's AsyncCollectiveTensor)
        unwraps to plain tensors and calls ops on them: returning NotImplemented
        hands the op to the subclass, whose inner ops come back here, plain.
        Replay then refills the local tensors the wrappers hold. A fake tensor
        (DTensor's sharding propagation) computes metadata only: it runs, unrecorded.
        """
        if any(issubclass(t, FakeTensor) for t in types):
            return func(*args, **kwargs)
        return NotImplemented

    def note_storage(self, storage: torch.UntypedStorage) -> None:
        """A storage (re)allocated by the captured work itself: never backed up or restored."""
        self.created.add(storage.data_ptr())
        self.resized.add(storage.data_ptr())
        self._sized(storage)  # allocated by a recorded resize: replay repeats that resize

    def _sized(self, storage: torch.UntypedStorage) -> None:
        if id(storage) not in self.sized:  # FSDP2 resizes the same storages again and again: each is kept once
            self.sized.add(id(storage))
            self.tape.keep.append(storage)  # alive while the tape is: its id names no other storage

    def note_resize(self, storage: torch.UntypedStorage, resize: Callable[[torch.UntypedStorage, int], Any]) -> None:
        """Before a resize of ``storage``: if the capture allocated it, every replay starts with it at its size now.

        A CUDA graph's pool keeps the memory of what its capture allocated, so its replays write where the
        capture did even if the capture freed it (FSDP2's first all-gather in a capture allocates its
        output with ``empty`` and frees it with ``resize_(0)``). Replay reruns the recorded resizes, so a
        storage the capture allocated and then freed must be allocated again before the first op that writes it.
        """
        key = storage.data_ptr()
        if key == 0 or key not in self.created or id(storage) in self.sized:
            return
        self._sized(storage)
        size = storage.nbytes()
        self.tape.add_first(lambda: resize(storage, size) if storage.nbytes() != size else None)

    def _inplace_view(self, func, args: tuple, kwargs: dict) -> Any:
        target = args[0] if args else next(iter(kwargs.values()))
        before = _layout(target)
        out = func(*args, **kwargs)
        self.tape.num_ops += 1
        self.tape.keep.append(out)
        if _layout(target) != before:
            self._fail(func, "unreplayable",
                       "it changes a tensor's shape, strides or storage in place; the replay backend refills "
                       "each recorded tensor through the layout it was recorded with, so it cannot replay this "
                       "exactly (and CUDA graphs would not repeat the change per step either). Use the "
                       "out-of-place form, e.g. `x = x.t()` instead of `x.t_()`")
        return out


def _copied(out: Any, args: tuple, kwargs: dict) -> bool:
    """Whether an op whose schema says its result may alias an argument (``to.dtype``, ``contiguous``,
    ``reshape``: ``Tensor(a) -> Tensor(a)``) returned a new tensor instead. These composite ops reach the
    recorder whole when a tensor subclass calls them underneath (torchao's float8 tensors do), and they alias
    only when there is nothing to convert: ``x.to(torch.float32)`` of a float8 ``x`` is a new tensor, which
    replay must compute again rather than skip as a view."""
    if not isinstance(out, torch.Tensor) or out.numel() == 0:
        return False
    key = storage_key(out)
    return key != 0 and all(storage_key(t) != key for t in tensor_arguments(args, kwargs))


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


def _generators(func, args: tuple, kwargs: dict) -> Iterator[torch.Generator]:
    """The explicit generators an op draws from (the default generator is always registered)."""
    for i, name, kwarg_only in generator_args(func):
        gen = args[i] if i < len(args) and not kwarg_only else kwargs.get(name)
        if isinstance(gen, torch.Generator):
            yield gen


class ReplayBackend(GraphBackend):
    """Record-and-replay of aten ops: CUDA-graph semantics on any device."""

    name = "replay"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pool: list[_Tape] = []  # the shared pool's captured tapes, in capture order

    def new_graph(self, name: str, *, shared_pool: bool = True) -> Graph:
        return self._track(_Tape(self, name, self.pool if shared_pool else None))

    @contextlib.contextmanager
    def capture(self, graph: Graph, generators: Iterable[torch.Generator] = ()) -> Iterator[None]:
        assert isinstance(graph, _Tape)
        self.raise_warmup_problem(graph.name)
        if _active_recorder() is not None:
            raise CaptureError(f"cannot capture graph {graph.name!r} while another capture is recording")
        gens = list(generators) + default_generators(self.device)
        states = [(g, g.get_state()) for g in gens]
        recorder = _Recorder(graph, {generator_key(g) for g in gens}, self.device)
        t0 = time.perf_counter()
        set_recorder(recorder)
        try:
            with recorder, host_guards():
                yield
        except BaseException:
            graph.reset()
            raise
        finally:
            set_recorder(None)
            recorder.restore()
            for g, state in states:
                g.set_state(state)
        held = _held_bytes(graph.keep)
        graph.report = CaptureReport(graph.name, time.perf_counter() - t0, 0, held, 0, held)
        self.reports.append(graph.report)
        graph._captured = True
        graph.allocated = recorder.allocated_memory()
        if graph.pool is not None:
            graph.pool.append(graph)  # capture order: a later capture may reuse what this one freed

    def memory(self) -> tuple[int, int]:
        held = sum(_held_bytes(g.keep) for g in self.live_graphs() if isinstance(g, _Tape))
        return held, held


def _held_bytes(objs: list[Any]) -> int:
    seen: dict[int, int] = {}
    for t in tree_leaves(objs):
        key = storage_key(t) if isinstance(t, torch.Tensor) else 0
        if key:
            seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


# --------------------------------------------------------------------------
# the host: the recorder of this thread, host callbacks


_local = threading.local()


def active_recorder() -> Any:
    """The replay-backend recorder capturing on this thread, or None."""
    return getattr(_local, "recorder", None)


def set_recorder(recorder: Any) -> None:
    _local.recorder = recorder


def _recording() -> bool:
    return active_recorder() is not None and not getattr(_local, "in_host_op", False)


def record_host_op(fn: Callable[[], None]) -> None:
    """Run ``fn`` now and, while a replay-backend capture records on this thread, on every replay.

    For host-side state that a CUDA graph tracks natively (the RNG tracker's
    generator swaps); on the CUDA backend this is just ``fn()``.
    """
    outer = getattr(_local, "in_host_op", False)
    _local.in_host_op = True
    try:
        fn()
    finally:
        _local.in_host_op = outer
    rec = active_recorder()
    if rec is not None and not outer:
        rec.tape.add(fn)


# --------------------------------------------------------------------------
# the wrappers

_DIRECT_READS = {
    "tolist": "Tensor.tolist() copies device data to the host (a sync)",
    "numpy": "Tensor.numpy() copies device data to the host (a sync)",
    "__array__": "numpy.asarray(tensor) copies device data to the host (a sync)",
    "__repr__": "printing a tensor (print, str, repr) copies its values to the host (a sync), and a "
                "captured print would run once, not on every replay; print a clone after the step returns",
    "__format__": "formatting a tensor (f-string, format, logging) copies its values to the host (a sync); "
                  "format a clone after the step returns",
}
_SEEDING = ("manual_seed", "seed")
_CUDA_SEEDING = ("manual_seed", "manual_seed_all", "seed", "seed_all")


def _refuse_read(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def read(self, *args: Any, **kwargs: Any) -> Any:
        if not _recording():
            return original(self, *args, **kwargs)
        raise CaptureError(f"Tensor.{name}() cannot be captured: {_DIRECT_READS[name]}",
                           op=name, where=user_frame(), category="host_sync")

    return read


def _refuse_seed(qualname: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def seed(*args: Any, **kwargs: Any) -> Any:
        if not _recording():
            return original(*args, **kwargs)
        raise CaptureError(
            f"{qualname}() cannot be captured: it reseeds a generator on the host, which a CUDA graph refuses "
            "(and a replay would not repeat); seed once before the step, or draw from a separate stream "
            "with graphstep's RNG tracker (tracker.fork(name))",
            op=qualname, where=user_frame(), category="rng",
        )

    return seed


def _recorded_get_state(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_state(*args: Any, **kwargs: Any) -> Any:
        if not _recording():
            return original(*args, **kwargs)
        held: list[Any] = []

        def read() -> None:  # on replay: the same tensor(s), refilled with the generator's state now
            fresh = original(*args, **kwargs)
            if not held:
                held.append(fresh)
            elif isinstance(fresh, torch.Tensor):
                held[0].copy_(fresh)
            else:
                for dst, src in zip(held[0], fresh):
                    dst.copy_(src)

        record_host_op(read)
        return held[0]

    return get_state


def _recorded_set_state(original: Callable[..., Any]) -> Callable[..., Any]:
    def set_state(*args: Any, **kwargs: Any) -> Any:
        if not _recording():
            return original(*args, **kwargs)
        record_host_op(lambda: original(*args, **kwargs))  # the state tensor's value at replay time

    return set_state


def _recorded_resize(original: Callable[..., Any]) -> Callable[..., Any]:
    def resize_(self: torch.UntypedStorage, size: int) -> Any:
        if not _recording():
            return original(self, size)
        active_recorder().note_resize(self, original)
        record_host_op(lambda: original(self, size))
        active_recorder().note_storage(self)
        return self

    return resize_


def in_collective_wait() -> bool:
    """True inside a collective's ``Work.wait()`` on this thread (its ops are the collective's, not the step's)."""
    return getattr(_local, "in_wait", False)


def _recorded_wait(original: Callable[..., Any]) -> Callable[..., Any]:
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = in_collective_wait()
        if _recording() and not outer:
            active_recorder().note_wait(self)
        _local.in_wait = True
        try:
            return original(self, *args, **kwargs)
        finally:
            _local.in_wait = outer

    return wait


def _wrappers() -> list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
    out: list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]] = []
    for name in _DIRECT_READS:
        out.append((torch.Tensor, name, lambda old, n=name: _refuse_read(n, old)))
    for owner, prefix in ((torch, "torch"), (torch.random, "torch.random")):
        for name in _SEEDING:
            out.append((owner, name, lambda old, q=f"torch.{name}": _refuse_seed(q, old)))
        out.append((owner, "get_rng_state", _recorded_get_state))
        out.append((owner, "set_rng_state", _recorded_set_state))
    out.append((torch.UntypedStorage, "resize_", _recorded_resize))
    if torch.distributed.is_available():
        out.append((torch.distributed.Work, "wait", _recorded_wait))
    if torch.cuda.is_available():
        for name in _CUDA_SEEDING:
            out.append((torch.cuda, name, lambda old, q=f"torch.cuda.{name}": _refuse_seed(q, old)))
        for name in ("get_rng_state", "get_rng_state_all"):
            out.append((torch.cuda, name, _recorded_get_state))
        for name in ("set_rng_state", "set_rng_state_all"):
            out.append((torch.cuda, name, _recorded_set_state))
    return out


@contextlib.contextmanager
def host_guards() -> Iterator[None]:
    """Wrap, while a capture records, what bypasses the dispatcher (see the module docstring)."""
    with Patches() as patches:
        for owner, name, wrap in _wrappers():
            patches.wrap(owner, name, wrap)
        # Code that asks "is the stream capturing?" (torch.optim's capture check,
        # Hugging Face's sync-free mask path) must get the answer a CUDA capture gives.
        patches.wrap(torch.cuda, "is_current_stream_capturing",
                     lambda was_capturing: lambda: active_recorder() is not None or was_capturing())
        yield
