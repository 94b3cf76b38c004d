"""Whole-step graphs: warm up, capture once, replay.

:class:`GraphedStep` is the mechanism (and graphstep's public full-step
wrapper): calls ``0 .. warmup_steps-1`` run the function eagerly on the static
input buffers (on the capture stream); call ``warmup_steps`` captures it and
replays it at once; later calls copy their arguments into the static buffers
and replay. What the function returns is graph-owned: the same tensors every
replay, overwritten by the next one -- clone what you keep.

:class:`CaptureOptions` is how a step warms up, captures and fails -- one
frozen set of options that several graphs can share, each call site changing
only what differs (``GraphedStep(fn, backend, options, name="eval",
input_device=device)``). The trainer's full-iteration graph is a
``GraphedStep`` over forward and backward of the step's list of micro-batches
(training/graphs.py reads them from the data iterator); training and
evaluation use separate instances, each with its own buffers and graph.

Hooks (set by the caller; the mechanism decides nothing about them):

* ``before_capture`` -- callables run right before a capture (e.g. a barrier
  among data-parallel ranks, so no rank starts a captured all-reduce alone);
  ``will_capture`` says whether the next call captures;
* ``on_capture_error(error, failed)`` -- called when a capture fails, with the
  :class:`CaptureError` and a :class:`FailedCapture` (the name, the function,
  its static arguments, the generators, the device) so the hook can re-run the
  region to say why (``graphstep.graph_step`` plugs the doctor in here). What
  the hook raises is logged, never raised instead of the capture error.

.. warning::
    The step must not read device values on the host, allocate inputs anew
    or replace parameters: it is recorded once and replayed on the same
    addresses. ``graphstep doctor`` finds what breaks this before a GPU run.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Sequence, Union

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .backend import Graph, GraphBackend, default_generators
from .backup import StepSnapshot
from .decisions import DecisionLog
from .errors import CaptureError, uncapturable_optimizer, user_frame
from .graph_state import GraphState
from .persistent import PersistentState
from .static_io import StaticInputs
from .torch_compat import tree_map

log = logging.getLogger("graphstep")

# the states as module constants, for call sites that import them from here (training/graphs.py)
EAGER, CAPTURED, REPLAYED = GraphState.EAGER, GraphState.CAPTURED, GraphState.REPLAYED


@dataclass(frozen=True)
class FailedCapture:
    """What an ``on_capture_error`` hook gets besides the error: enough to re-run the region."""

    name: str
    fn: Callable[..., Any]
    call: Any  # (args, kwargs): the static input buffers the capture ran on
    generators: Callable[[], Iterable[torch.Generator]]
    device: torch.device

    def copy_call(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` with every tensor cloned: re-running on them leaves the static buffers as they are."""
        args, kwargs = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.call)
        return tuple(args), dict(kwargs)


CaptureErrorHook = Callable[[CaptureError, FailedCapture], None]
Hooks = Union[Callable[[], Any], Sequence[Callable[[], Any]], None]

GeneratorSource = Union[Callable[[], Iterable[torch.Generator]], Iterable[torch.Generator], torch.Generator, None]


def generator_source(generators: GeneratorSource) -> Callable[[], Iterable[torch.Generator]]:
    """``generators=`` as a callable: a callable (asked at capture time), an iterable of generators, or one."""
    if generators is None:
        return lambda: ()
    if isinstance(generators, torch.Generator):
        return lambda: (generators,)
    if callable(generators):
        return generators
    try:
        gens = list(generators)
    except TypeError:
        raise TypeError(f"generators= takes a callable or an iterable of torch.Generator, got "
                        f"{type(generators).__name__}") from None
    bad = [g for g in gens if not isinstance(g, torch.Generator)]
    if bad:
        raise TypeError(f"generators= must hold torch.Generator objects, got {type(bad[0]).__name__}")
    return lambda: gens


@dataclass(frozen=True)
class CaptureOptions:
    """How a :class:`GraphedStep` warms up, captures and fails (the arguments of its docstring but ``fn``,
    ``backend`` and ``name``). Frozen: graphs share one and ``GraphedStep(..., field=value)`` changes a field
    for one graph (``dataclasses.replace``)."""

    warmup_steps: int = 3
    generators: GeneratorSource = None
    shared_pool: bool = True
    on_failure: str = "raise"
    input_device: torch.device | str | None = None
    modules: Sequence[nn.Module] = ()
    optimizers: Iterable[torch.optim.Optimizer] = ()
    before_capture: Hooks = None
    on_capture_error: CaptureErrorHook | None = None

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.on_failure not in ("raise", "eager"):
            raise ValueError(f"on_failure must be 'raise' or 'eager', got {self.on_failure!r}")


class GraphedStep:
    """A function captured as one graph after ``warmup_steps`` eager calls.

    Args:
        fn: the step; takes the (static) arguments, returns tensors or a pytree of them.
        backend: where graphs are captured (see :func:`get_backend`).
        options: a :class:`CaptureOptions` (default: its defaults); each of its fields below may also be given
            by keyword, which overrides ``options`` for this graph.
        name: for logs and errors.
        warmup_steps: eager calls before the capture (counted from creation or ``reset()``).
        generators: the RNG generators the graph must register: a callable (called at capture time),
            an iterable of generators or one generator.
        shared_pool: capture into the backend's process-wide pool.
        on_failure: ``"raise"`` or ``"eager"`` -- after a failed capture, keep running eagerly. Either way a
            failed capture leaves the program as if it had not been tried: optimizer state and settings,
            gradients, generators and FSDP2's state are put back (backup.py's :class:`StepSnapshot`).
        input_device: where the static input buffers live (default: where the first call's tensors are);
            later calls may pass tensors from another device (e.g. pinned CPU batches), copied in.
        modules, optimizers: persistent state the capture must not create (see persistent.py); the
            optimizers the step function refers to are found by themselves.
        before_capture: a callable, or a list of them, called (without arguments) right before each capture.
        on_capture_error: called as ``hook(error, failed)`` when a capture fails (see :class:`FailedCapture`);
            None (the default) diagnoses nothing.

    ``state`` (a :class:`GraphState`) is ``EAGER`` until the capture, then ``CAPTURED`` (the call that captured)
    and ``REPLAYED``; ``EAGER`` again after ``reset()`` or a failed capture with ``on_failure="eager"``.

    .. warning::
        Outputs are graph-owned: the next call overwrites them.
    .. warning::
        Arguments must keep their structure, shapes and dtypes, and non-tensor
        arguments their values; a different call raises ``ContractError``.
    """

    def __init__(self, fn: Callable[..., Any], backend: GraphBackend, options: CaptureOptions | None = None, *,
                 name: str = "step", **changes: Any) -> None:
        options = options if options is not None else CaptureOptions()
        options = replace(options, **changes) if changes else options
        self.fn = fn
        self.backend = backend
        self.name = name
        self.options = options
        self.warmup_steps = options.warmup_steps
        self.generators = generator_source(options.generators)
        self.shared_pool = options.shared_pool
        self.on_failure = options.on_failure
        self.input_device = torch.device(options.input_device) if options.input_device is not None else None
        self.graph: Graph | None = None
        self.static: StaticInputs | None = None
        self.outputs: Any = None
        self.calls = 0
        self.state = GraphState.EAGER
        self.failed: BaseException | None = None
        self.persistent = PersistentState(fn, options.modules, options.optimizers)
        self.decisions = DecisionLog()  # host decisions of the eager calls, reused by the capture
        self.before_capture: list[Callable[[], Any]] = _hook_list(options.before_capture)
        self.on_capture_error = options.on_capture_error

    @property
    def captured(self) -> bool:
        return self.graph is not None and self.graph.captured

    @property
    def will_capture(self) -> bool:
        """True when the next call captures: the warm-up is over, nothing is captured and no capture failed."""
        return self.failed is None and not self.captured and self.calls >= self.warmup_steps

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.static is None:
            self.static = StaticInputs((args, kwargs), device=self.input_device, name=self.name, call=True)
        else:
            self.static.copy_in((args, kwargs))
        if self.captured:  # the replay path first: one check per call
            self.graph.replay()
            self.state = GraphState.REPLAYED
        elif self.will_capture:
            for hook in self.before_capture:
                hook()
            self.outputs = self._capture()
            self.state = GraphState.CAPTURED if self.captured else GraphState.EAGER
        else:
            self.outputs = self._eager()
            self.state = GraphState.EAGER
        self.calls += 1
        return self.outputs

    def _run(self) -> Any:
        args, kwargs = self.static.tree
        return self.fn(*args, **kwargs)

    def _eager(self) -> Any:
        with self.backend.warmup(), self.decisions.recording():
            return self._run()

    def _capture(self) -> Any:
        self.graph = self.backend.new_graph(self.name, shared_pool=self.shared_pool)
        generators = list(self.generators())
        before = self._snapshot(generators)
        try:
            self.persistent.snapshot()
            with self.backend.capture(self.graph, generators), self.decisions.replaying(), \
                    _capturable_optimizers_only(self.backend):
                outputs = self._run()
            self._check_persistent_state()
        except BaseException as exc:
            if self.graph is not None:
                self.graph.reset()
            self.graph = None
            before.restore()  # the program goes on as if the capture had never been tried
            if not isinstance(exc, CaptureError):
                raise
            self._report_failure(exc)
            before.restore()  # the hook may have re-run the step (the doctor puts tensors and RNG back, not the rest)
            if self.on_failure != "eager":
                raise
            _drop_frames(exc)  # what the failed capture allocated dies with the traceback's frames
            self.failed = exc
            log.warning("capture of %r failed; continuing eagerly (cuda_graph_on_failure=eager): %s", self.name, exc)
            return self._eager()
        if self.decisions.unfrozen:
            log.warning("graph %r: %s could not be frozen at capture (it depends on the data, or changed between "
                        "warm-up calls); the graph takes the library's general path, which may differ from eager by "
                        "rounding", self.name,
                        ", ".join(self.decisions.unfrozen))
        # Capture executes nothing observable: run the step now.
        self.graph.replay()
        return outputs

    def _snapshot(self, generators: list[torch.Generator]) -> StepSnapshot:
        """What a failed capture must leave as it was (see backup.py's StepSnapshot)."""
        return StepSnapshot(optimizers=self.persistent.all_optimizers(), modules=self.persistent.all_modules(),
                            generators=[*generators, *default_generators(self.backend.device)],
                            device=self.backend.device)

    def _report_failure(self, exc: CaptureError) -> None:
        """Hand the failure to ``on_capture_error``; what the hook raises is logged, never raised instead."""
        if self.on_capture_error is None:
            return
        failed = FailedCapture(self.name, self.fn, self.static.tree, self.generators, self.backend.device)
        try:
            self.on_capture_error(exc, failed)
        except Exception as err:
            log.warning("the on_capture_error hook failed on the capture error of %r: %s", self.name, err)

    def _check_persistent_state(self) -> None:
        created = self.persistent.created()
        if not created:
            return
        shown = ", ".join(created[:4]) + (f" and {len(created) - 4} more" if len(created) > 4 else "")
        raise CaptureError(
            f"the capture of {self.name!r} created persistent state ({shown}); the graph would create it again on "
            f"every replay (optimizer moments and momentum reset each step): warm up at least one step so the "
            f"optimizer creates its state (warmup_steps=1 or more, now {self.warmup_steps}), or create the state "
            "before the capture.", op="lazy_state", category="lazy_state",
        )

    def reset(self) -> None:
        """Drop the graph and the static buffers; the next call starts a new warm-up."""
        if self.graph is not None:
            self.graph.reset()
        self.graph = None
        self.static = None
        self.outputs = None
        self.calls = 0
        self.state = GraphState.EAGER

    close = reset


@contextlib.contextmanager
def _capturable_optimizers_only(backend: GraphBackend) -> Iterator[None]:
    """While capturing, a torch optimizer whose step keeps its step counter on the host raises before it runs.

    The same :class:`CaptureError` (category ``optimizer``) on every backend, from torch's public optimizer
    step pre-hook: on CUDA torch would refuse the step itself with a message naming no fix, and a
    non-capturable optimizer that torch does not check would read its step on the host and freeze it.
    """
    def check(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        groups = [g for g in opt.param_groups if "capturable" in g]
        fused_ok = backend.captures_fused_optimizers
        if all(g["capturable"] or (fused_ok and g.get("fused")) for g in groups):
            return None
        raise uncapturable_optimizer(type(opt).__name__, fused=any(g.get("fused") for g in groups),
                                     fused_suffices=fused_ok, where=user_frame())

    handle = register_optimizer_step_pre_hook(check)
    try:
        yield
    finally:
        handle.remove()


def _hook_list(hooks: Hooks) -> list[Callable[[], Any]]:
    """``before_capture=`` as a list: None, one callable or a sequence of callables."""
    if hooks is None:
        return []
    if callable(hooks):
        return [hooks]
    out = list(hooks)
    bad = [h for h in out if not callable(h)]
    if bad:
        raise TypeError(f"before_capture= takes a callable or a list of callables, got a {type(bad[0]).__name__}")
    return out


def _drop_frames(exc: BaseException | None) -> None:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__

