"""Whole-step graphs: warm up, capture once, replay.

:class:`GraphedStep` is the mechanism (and graphstep's public full-step
wrapper): calls ``0 .. warmup_steps-1`` run the function eagerly on the static
input buffers (on the capture stream); call ``warmup_steps`` captures it and
replays it at once; later calls copy their arguments into the static buffers
and replay. What the function returns is graph-owned: the same tensors every
replay, overwritten by the next one -- clone what you keep.

:class:`FullIterationGraph` is the training-iteration form of spec section 3:
each call reads every micro-batch of the step from the data iterator, copies
them into per-micro-batch static buffers and runs forward and backward of all
of them (with gradient reduction) as one graph. Training and evaluation use
separate instances, each with its own buffers and graph.

.. warning::
    The step must not read device values on the host, allocate inputs anew
    or replace parameters: it is recorded once and replayed on the same
    addresses. ``graphstep doctor`` finds what breaks this before a GPU run.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any, Callable, Iterable, Iterator, Sequence, Union

import torch
from torch import nn

from .backend import Graph, GraphBackend
from .decisions import DecisionLog
from .errors import CaptureError
from .persistent import PersistentState
from .static_io import StaticInputs

log = logging.getLogger("graphstep")

EAGER, CAPTURED, REPLAYED = "eager", "captured", "replayed"

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


class GraphedStep:
    """A function captured as one graph after ``warmup_steps`` eager calls.

    Args:
        fn: the step; takes the (static) arguments, returns tensors or a pytree of them.
        backend: where graphs are captured (see :func:`get_backend`).
        warmup_steps: eager calls before the capture (counted from creation or ``reset()``).
        name: for logs and errors.
        generators: the RNG generators the graph must register: a callable (called at capture time),
            an iterable of generators or one generator.
        shared_pool: capture into the backend's process-wide pool.
        on_failure: ``"raise"`` or ``"eager"`` -- after a failed capture, keep running eagerly.
        input_device: where the static input buffers live (default: where the first call's tensors are);
            later calls may pass tensors from another device (e.g. pinned CPU batches), copied in.
        modules, optimizers: persistent state the capture must not create (see persistent.py); the
            optimizers the step function refers to are found by themselves.

    ``state`` is ``"eager"`` until the capture, then ``"captured"`` (the call that captured) and
    ``"replayed"``; ``"eager"`` again after ``reset()`` or a failed capture with ``on_failure="eager"``.

    .. warning::
        Outputs are graph-owned: the next call overwrites them.
    .. warning::
        Arguments must keep their structure, shapes and dtypes, and non-tensor
        arguments their values; a different call raises ``ContractError``.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        backend: GraphBackend,
        *,
        warmup_steps: int = 3,
        name: str = "step",
        generators: GeneratorSource = None,
        shared_pool: bool = True,
        on_failure: str = "raise",
        input_device: torch.device | str | None = None,
        modules: Sequence[nn.Module] = (),
        optimizers: Iterable[torch.optim.Optimizer] = (),
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if on_failure not in ("raise", "eager"):
            raise ValueError(f"on_failure must be 'raise' or 'eager', got {on_failure!r}")
        self.fn = fn
        self.backend = backend
        self.warmup_steps = warmup_steps
        self.name = name
        self.generators = generator_source(generators)
        self.shared_pool = shared_pool
        self.on_failure = on_failure
        self.input_device = torch.device(input_device) if input_device is not None else None
        self.graph: Graph | None = None
        self.static: StaticInputs | None = None
        self.outputs: Any = None
        self.calls = 0
        self.state: str = EAGER
        self.failed: BaseException | None = None
        self.persistent = PersistentState(fn, modules, optimizers)
        self.decisions = DecisionLog()  # host decisions of the eager calls, reused by the capture

    @property
    def captured(self) -> bool:
        return self.graph is not None and self.graph.captured

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.static is None:
            self.static = StaticInputs((args, kwargs), device=self.input_device, name=self.name, call=True)
        else:
            self.static.copy_in((args, kwargs))
        if self.failed is not None or self.calls < self.warmup_steps:
            self.outputs = self._eager()
            self.state = EAGER
        elif not self.captured:
            self.outputs = self._capture()
            self.state = CAPTURED if self.captured else EAGER
        else:
            self.graph.replay()
            self.state = REPLAYED
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
        try:
            problem = self.backend.take_warmup_problem(self.name)
            if problem is not None:  # the warm-up showed that this capture cannot work
                raise problem
            self.persistent.snapshot()
            with self.backend.capture(self.graph, self.generators()), self.decisions.replaying():
                outputs = self._run()
            self._check_persistent_state()
        except CaptureError as exc:
            if self.graph is not None:
                self.graph.reset()
            self.graph = None
            if exc.category == "cuda":  # CUDA names no op and no line: re-run the region under the doctor
                _diagnose(exc, self.name, self.fn, self.static.tree, self.generators, self.backend.device)
            if self.on_failure != "eager":
                raise
            _drop_frames(exc)  # what the failed capture allocated dies with the traceback's frames
            self.failed = exc
            log.warning("capture of %r failed; continuing eagerly (cuda_graph_on_failure=eager): %s", self.name, exc)
            return self._eager()
        if self.decisions.unfrozen:
            log.warning("graph %r: %s decided differently across the warm-up calls; the graph takes the library's "
                        "general path, which may differ from eager by rounding", self.name,
                        ", ".join(self.decisions.unfrozen))
        # Capture executes nothing observable: run the step now.
        self.graph.replay()
        return outputs

    def _check_persistent_state(self) -> None:
        created = self.persistent.created()
        if not created:
            return
        self.persistent.rollback()
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
        self.state = EAGER

    close = reset


def _diagnose(exc: CaptureError, name: str, fn: Callable[..., Any], call: Any,
              generators: Callable[[], Iterable[torch.Generator]], device: torch.device) -> None:
    """Attach to ``exc`` (``exc.findings``, a note, the log) what broke the capture of ``fn`` and where.

    The doctor re-runs the region once, eagerly, on a copy of the static inputs, on the graph's own
    device (never simulated on the host), and restores every tensor and RNG state it changed: the
    step's results are as if it had not run. Only for failures CUDA names no cause of (category
    ``cuda``): an out-of-memory error, for one, is never re-run.
    """
    from torch.utils._pytree import tree_map

    from ..doctor import diagnose

    try:
        args, kwargs = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, call)
        findings = diagnose(fn, tuple(args), kwargs, generators=list(generators()), device=device)
    except Exception as err:  # the diagnosis must never hide the capture error
        log.warning("graphstep doctor could not diagnose the failed capture of %r: %s", name, err)
        return
    exc.findings = findings
    text = "\n".join(f.format() for f in findings) or "graphstep doctor found nothing in the region."
    if hasattr(exc, "add_note"):
        exc.add_note(f"graphstep doctor, re-running {name!r}:\n{text}")
    log.error("capture of %r failed; graphstep doctor on the region:\n%s", name, text)


def _drop_frames(exc: BaseException | None) -> None:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


class FullIterationGraph:
    """Forward and backward of all micro-batches of an iteration, as one graph.

    ``forward_backward(batches)`` takes the list of micro-batch pytrees and
    returns graph-owned outputs (the averaged loss and any metrics).
    """

    def __init__(
        self,
        forward_backward: Callable[[list[Any]], Any],
        backend: GraphBackend,
        *,
        num_micro_batches: int,
        warmup_steps: int,
        name: str = "train",
        generators: GeneratorSource = None,
        shared_pool: bool = True,
        on_failure: str = "raise",
        input_device: torch.device | str | None = None,
        modules: Sequence[nn.Module] = (),
        optimizers: Iterable[torch.optim.Optimizer] = (),
    ) -> None:
        self.num_micro_batches = num_micro_batches
        self.step = GraphedStep(
            forward_backward, backend, warmup_steps=warmup_steps, name=name, generators=generators,
            shared_pool=shared_pool, on_failure=on_failure, input_device=input_device, modules=modules,
            optimizers=optimizers,
        )

    @property
    def state(self) -> str:
        return self.step.state

    @property
    def captured(self) -> bool:
        return self.step.captured

    def __call__(self, data_iterator: Iterator[Any]) -> Any:
        batches = [next(data_iterator) for _ in range(self.num_micro_batches)]
        return self.step(batches)

    def reset(self) -> None:
        self.step.reset()

    close = reset
