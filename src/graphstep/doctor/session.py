"""One analysis run: the modes, the patches, the phases, the findings.

A step is analysed the way a graph runs it: a warm-up call (eager, watched
but not judged: what the step changes here is what changes every step) and
the call a graph would capture (judged: every op, API call, state change and
stale input). :func:`check` does exactly that for any step function;
:func:`diagnose` runs one judged call (after a real capture failed);
recipe.py drives the trainer and judges only the regions its graphs capture.

Phases of a :class:`Session` (context managers):

* ``warmup()`` -- records the storages the call reads or creates and the
  Python state it changes;
* ``tracked()`` -- the iteration that contains captured regions: records the
  storages it creates before and between them;
* ``region(name)`` -- a captured region: findings are recorded.

With ``restore=True`` the session saves every pre-existing storage before
its first write and the RNG states (cuda_graph/backup.py), and puts them back at the end: the
analysed calls leave the tensors as they found them (not Python objects).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch

from ..cuda_graph.backup import StateBackup, storage_key
from .devices import DeviceModel, step_device_is_real
from .findings import Finding, Report
from .frames import code_line, traceback_user_frame, user_frame
from .modes import DispatchAnalyzer, FunctionAnalyzer
from .patches import patched
from .state import LineTracer, changes, show, snapshot, step_roots, tensor_name


def default_generators() -> list[torch.Generator]:
    """The generators every graph draws from safely: the defaults and the RNG tracker's streams."""
    from ..cuda_graph.rng import get_rng_tracker

    gens = [torch.default_generator]
    if torch.cuda.is_available():
        gens += list(torch.cuda.default_generators)
    return gens + get_rng_tracker().generators()


class Session:
    """Modes, patches and findings of one doctor run (see module docstring)."""

    def __init__(self, report: Report, *, simulated: bool, generators: Iterable[torch.Generator] = (),
                 restore: bool = False, roots: dict[str, Any] | None = None, fn: Any = None) -> None:
        self.report = report
        self.devices = DeviceModel(simulated)
        self.gens = default_generators() + list(generators)
        self.generators = {id(g) for g in self.gens}
        self.restore = restore
        self.roots = roots or {}
        self.fn = fn
        self.active = self.recording = False
        self.tracking: str | None = None
        self.suppress = 0
        self.api: str | None = None
        self.api_frame: Any = None
        self.in_optimizer: list[int] = []
        self.backup = StateBackup()  # with restore: pre-existing storages before their first write, RNG states
        self.created_all: set[int] = set()
        self.seen: set[int] = set()
        self.created_now: set[int] = set()
        self.new_reads: dict[int, tuple[str | None, Any, weakref.ref, tuple[int, ...]]] = {}
        self.baseline = False  # a warm-up ran: stale inputs can be judged
        self.watch: dict[str, Callable[[], Any]] = {}
        self._stack: contextlib.ExitStack | None = None

    # ---- lifetime -----------------------------------------------------------
    def __enter__(self) -> "Session":
        if self.restore:
            self.backup.save_generators(self.gens)
        stack = contextlib.ExitStack()
        stack.enter_context(patched(self))
        stack.enter_context(FunctionAnalyzer(self))
        stack.enter_context(DispatchAnalyzer(self))
        self._stack = stack
        self.active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.active = self.recording = False
        assert self._stack is not None
        self._stack.close()
        self.backup.restore()  # empty without restore

    # ---- what the modes call ------------------------------------------------
    def found(self, category: str, op: str, *, detail: str = "", where: Any = None, why: str = "") -> None:
        if where is None:
            where = user_frame(sys._getframe(1))
        if where is None and self.api_frame is not None:  # autograd's device thread: the call that started it
            where = user_frame(self.api_frame)
        self.report.add(Finding(category, op, where, why=why, detail=detail))

    def before_write(self, written: list[torch.Tensor]) -> None:
        self.backup.save_storages(written, skip=self.created_all)

    def note_op(self, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        if self.restore:
            self.created_all.update(storage_key(t) for t in outs)
        if self.tracking is None:
            return
        if self.tracking == "warmup":
            self.seen.update(storage_key(t) for t in ins)
            self.seen.update(storage_key(t) for t in outs)
            return
        self.created_now.update(storage_key(t) for t in outs)
        if not (self.recording and self.baseline):
            return
        for t in ins:
            p = storage_key(t)
            if p and p not in self.seen and p not in self.created_now and p not in self.new_reads:
                self.new_reads[p] = (self.api, user_frame(), weakref.ref(t), tuple(t.shape))

    def error(self, exc: BaseException) -> None:
        where = traceback_user_frame(exc.__traceback__) or code_line(self.fn)
        self.report.add(Finding("error", type(exc).__name__, where, detail=str(exc).splitlines()[0][:300]
                                if str(exc) else type(exc).__name__))

    # ---- phases -------------------------------------------------------------
    def _snapshot(self) -> tuple[dict[str, Any], dict[str, Callable[[], Any]]]:
        return snapshot(self.roots, self.fn)

    @contextlib.contextmanager
    def warmup(self) -> Iterator[None]:
        before, _ = self._snapshot()
        prev, self.tracking = self.tracking, "warmup"
        try:
            yield
        finally:
            self.tracking = prev
        after, getters = self._snapshot()
        self.watch |= {p: getters[p] for p in changes(before, after)}
        self.baseline = True

    @contextlib.contextmanager
    def tracked(self) -> Iterator[None]:
        prev, self.tracking = self.tracking, "tracked"
        self.created_now.clear()
        try:
            yield
        finally:
            self.tracking = prev

    @contextlib.contextmanager
    def region(self, name: str = "step") -> Iterator[None]:
        """A captured region: everything inside is judged."""
        if torch.is_autocast_enabled() and torch.is_autocast_cache_enabled():
            self.found("autocast_cache", "torch.autocast", detail=f"autocast with its cache is active around {name!r}",
                       where=user_frame())
        before, _ = self._snapshot()
        outer_tracking = self.tracking
        if outer_tracking != "tracked":
            self.tracking = "tracked"
            self.created_now.clear()
        tracer = LineTracer(dict(self.watch))
        self.recording = True
        try:
            with tracer:
                yield
        finally:
            self.recording = False
            self.tracking = outer_tracking
            self.suppress, self.api, self.api_frame = 0, None, None
            self.in_optimizer.clear()
        after, _ = self._snapshot()
        for path, (old, new) in sorted(changes(before, after).items()):
            self.found("python_state", path, detail=f"{path}: {show(old)} -> {show(new)} inside {name!r}",
                       where=tracer.where.get(path) or code_line(self.fn))
        self._stale_inputs()

    def _stale_inputs(self) -> None:
        for api, where, ref, shape in self.new_reads.values():
            t = ref()
            name = tensor_name(self.roots, self.fn, t) if t is not None else None
            what = f"tensor {name}" if name else "a tensor"
            self.found("new_input", api or "read", where=where,
                       detail=f"reads {what} of shape {list(shape)} made outside the step, not the one the "
                              "previous call read")
        self.new_reads.clear()


# --------------------------------------------------------------------------
# the public entry points


def _describe(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    where = code_line(fn)
    return f"{name} ({where.filename}:{where.lineno})" if where is not None else name


def _module_params(roots: dict[str, Any]) -> list[torch.Tensor]:
    out = []
    for v in roots.values():
        if isinstance(v, torch.nn.Module):
            out += list(v.parameters())[:1]
    return out


def analyze(step_fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, *,
            generators: Iterable[torch.Generator] = (), calls: int = 2, restore: bool = True,
            name: str | None = None, simulated: bool | None = None) -> Report:
    """Run ``step_fn(*args, **kwargs)`` as a graph would (warm-up call, then the captured call) and report.

    ``calls=1`` skips the warm-up (then stale inputs are not judged). ``generators``: extra generators
    the graph registers. With ``restore`` the tensors and RNG states the calls changed are put back.
    ``simulated``: run a GPU step on the CPU (``device="cuda"`` moved to the host); by default only
    when no tensor of the step is on an accelerator.
    """
    kwargs = dict(kwargs or {})
    roots = step_roots(step_fn, args, kwargs)
    if simulated is None:
        simulated = not step_device_is_real(args, kwargs, _module_params(roots))
    report = Report(name or _describe(step_fn))
    if simulated:
        report.notes.append("tensors are on the CPU: the step is analysed as it would run on a GPU")
    with Session(report, simulated=simulated, generators=generators, restore=restore, roots=roots,
                 fn=step_fn) as s:
        try:
            if calls >= 2:
                with s.warmup():
                    step_fn(*args, **kwargs)
            with s.region(getattr(step_fn, "__name__", "step")):
                step_fn(*args, **kwargs)
        except Exception as exc:  # the step itself failed: report it, with the user's line
            s.error(exc)
    return report


def check(step_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Report:
    """Capture readiness of ``step_fn(*args, **kwargs)``: every finding, with the user's file:line.

    The step runs twice (a warm-up call, then the call a graph would capture); the tensors it changes
    are restored afterwards. Works on a GPU or, simulating the GPU, on the CPU.
    """
    return analyze(step_fn, args, kwargs)


def diagnose(fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, *,
             generators: Iterable[torch.Generator] = (), device: torch.device | str | None = None) -> list[Finding]:
    """Re-run a region whose capture failed under the analyzer: what broke it, and where.

    One call, eager, on the device the tensors are on; tensors and RNG states are restored after.
    ``device`` is the failed graph's device: on a real accelerator the region is never simulated,
    i.e. its device work (``torch.zeros(n, device="cuda")``) is never moved to the host.
    """
    real = device is not None and torch.device(device).type not in ("cpu", "meta")
    return analyze(fn, args, kwargs, generators=generators, calls=1, restore=True,
                   simulated=False if real else None).findings
