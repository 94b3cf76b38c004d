"""Errors of the capture machinery: what happened, where, and what to change.

Every error raised while a region is captured or replayed names the user's
line (``where``), found by frames.py: the innermost frame that is not inside
PyTorch, the Python standard library or graphstep's own machinery. Known
causes of a failed CUDA capture (out of memory, AccumulateGrad nodes made on
another stream) get their own message and fix.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from .devices import GiB
from .frames import SourceLine, user_frame  # noqa: F401  (replay.py imports them from here)


class GraphstepError(Exception):
    """Base of every error graphstep raises on purpose (catch this to catch them all).

    ``exit_code`` is the status the ``graphstep`` command ends with when this error stops it (cli.py reads
    it): 1, a failure of the run itself (capture, replay, the library used out of order), is raised with its
    traceback like any other exception; 2, input the user can fix (graphstep.errors.ConfigError and the
    others there), is printed as one line without a traceback. graphstep/errors.py lists the whole tree.
    """

    exit_code: int = 1


class CaptureError(GraphstepError, RuntimeError):
    """A region cannot be captured (or a graph cannot be replayed) as asked.

    ``op`` is the aten operator (or CUDA error) that broke the capture, ``where``
    the user's source line that led to it, when known, and ``category`` what
    kind of problem it is: ``host_sync``, ``dynamic_shape``, ``rng``,
    ``optimizer``, ``lazy_state`` (persistent state created inside the
    capture), ``oom`` (out of device memory), ``accumulate_grad_stream``
    (retained AccumulateGrad nodes made on another stream) or ``cuda`` (any
    other CUDA failure; the doctor re-runs the region to name the line).
    ``findings`` is what an ``on_capture_error`` hook found (the doctor's findings; empty without one).
    """

    def __init__(self, message: str, *, op: str | None = None, where: SourceLine | None = None, category: str = ""):
        self.op = op
        self.where = where
        self.category = category
        self.findings: list[Any] = []
        text = message
        if where is not None:
            text += f"\n  at {where}"
        super().__init__(text)

    @classmethod
    def from_cuda(cls, exc: BaseException, graph_name: str) -> "CaptureError":
        """The error a failed CUDA capture raises: known causes get their own message and fix."""
        if isinstance(exc, CaptureError):
            return exc
        if is_out_of_memory(exc):
            return out_of_memory(exc, graph_name)
        if is_stream_capture_implicit(str(exc)):
            return accumulate_grad_stream(graph_name, f"the capture failed with: {first_line(exc)}")
        refused = _TORCH_OPTIMIZER_REFUSAL.search(str(exc))
        if refused:  # torch's own capture check, should an optimizer step reach it
            return uncapturable_optimizer(refused.group(1), fused=False, fused_suffices=False)
        return cls(
            f"capture of graph {graph_name!r} failed: {exc}. Run `graphstep doctor` (or "
            "graphstep.doctor.check) on this step to find the line that breaks capture.",
            op=type(exc).__name__,
            category="cuda",
        )


class ContractError(GraphstepError, ValueError):
    """A replay call differs from the captured one (shape, dtype, device, structure or value)."""


class GraphUsageError(GraphstepError, RuntimeError):
    """A graphed object was used out of order (forward twice before backward, replay before capture...)."""


# --------------------------------------------------------------------------
# a torch optimizer that cannot be captured (both backends, before its step runs)

OPTIMIZER_FIX = "create it with capturable=True on CUDA (fused=True on the CPU)"

# torch.optim's _accelerator_graph_capture_health_check
_TORCH_OPTIMIZER_REFUSAL = re.compile(r"graph capture of step\(\) for an instance of (\w+) but param_groups' "
                                      r"capturable is False")


def uncapturable_optimizer(name: str, *, fused: bool, fused_suffices: bool,
                           where: SourceLine | None = None) -> CaptureError:
    """A torch.optim optimizer whose ``step()`` keeps and reads its step counter on the host.

    The same error on every backend (GraphedStep raises it from an optimizer step pre-hook, before the
    step does anything); ``fused_suffices`` is False on CUDA, where torch refuses a fused optimizer's
    capture too unless it is capturable.
    """
    if fused and not fused_suffices:
        built = f"{name}(capturable=False, fused=True): on CUDA torch captures only capturable optimizers"
    else:
        built = f"{name}(capturable=False, fused=False) keeps its step counter on the host and reads it there"
    return CaptureError(f"{name}.step() cannot be captured: {built}; {OPTIMIZER_FIX}",
                        op=f"{name}.step", where=where, category="optimizer")


# --------------------------------------------------------------------------
# known causes of a failed CUDA capture

# cudaErrorStreamCaptureImplicit: work on the legacy default stream while another stream captures.
_IMPLICIT_CAPTURE_TEXTS = ("cudaErrorStreamCaptureImplicit",
                           "operation would make the legacy stream depend on a capturing blocking stream")
# PyTorch's autograd warning when a retained AccumulateGrad node lives on another stream.
ACCUMULATE_GRAD_WARNING = "The AccumulateGrad node's stream does not match the stream of the node that produced"


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def is_stream_capture_implicit(text: str) -> bool:
    return any(t in text for t in _IMPLICIT_CAPTURE_TEXTS)


def accumulate_grad_stream(graph_name: str, evidence: str) -> CaptureError:
    """Parameters whose AccumulateGrad nodes were made (and kept, e.g. by DDP) on another stream."""
    return CaptureError(
        f"graph {graph_name!r} cannot be captured: {evidence}. Some parameters have AccumulateGrad nodes that "
        "were created on another stream and are kept alive (torch DDP or FSDP, or a gradient hook on "
        "p.expand_as(p).grad_fn.next_functions[0][0]), so their gradients would be accumulated outside the "
        "capture stream. Build the wrapper on graphstep's capture stream: "
        "`with graphstep.capture_stream(): model = DDP(model)`.",
        op="AccumulateGrad", category="accumulate_grad_stream",
    )


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return "out of memory" in text and ("CUDA" in text or "cudaErrorMemoryAllocation" in text)


def out_of_memory(exc: BaseException, graph_name: str) -> CaptureError:
    """What was asked for and what is free, and that nothing was graphed (never re-run to diagnose)."""
    asked = re.search(r"Tried to allocate ([0-9.]+ ?[KMGTP]?i?B)", str(exc))
    parts = [f"asked for {asked.group(1)}"] if asked else []
    free = _free_device_memory()
    if free:
        parts.append(free)
    detail = f" ({'; '.join(parts)})" if parts else ""
    return CaptureError(
        f"capture of graph {graph_name!r} ran out of device memory{detail}: nothing was graphed and the step did "
        "not run. Make the step allocate less (a smaller micro-batch or sequence length) or free device memory "
        "before the capture; a graph keeps what it allocates for as long as it lives.",
        op="OutOfMemoryError", category="oom",
    )


def _free_device_memory() -> str:
    if not torch.cuda.is_available():
        return ""
    try:
        free, total = torch.cuda.mem_get_info()
    except Exception:
        return ""
    return f"{free / GiB:.2f} GiB free of {total / GiB:.2f} GiB"
