"""graphstep doctor: capture readiness before the GPU, and a diagnosis when a capture fails.

    from graphstep.doctor import check
    report = check(train_step, model, batch)      # any step function, any nn.Module
    print(report.format())                        # category, op, file:line, why, fix
    report.exit_code                              # 0 ok, 1 breaks capture, 3 corrupts replay

``graphstep doctor --recipe R`` does the same for a recipe's training step
(recipe.py), ``graphstep doctor script.py:function`` for a function in a
script. A failed capture is diagnosed through :func:`capture_error_hook`, the
``on_capture_error`` hook of a ``GraphedStep`` (``graphstep.graph_step`` sets
it; the trainer passes it too): it calls :func:`diagnose` to name the line.
See docs/troubleshooting.md for every category with an example and its fix.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .findings import CATEGORIES, Finding, Report
from .session import analyze, check, diagnose

__all__ = ["CATEGORIES", "Finding", "Report", "analyze", "capture_error_hook", "check", "check_recipe", "diagnose"]

if TYPE_CHECKING:
    from ..cuda_graph.errors import CaptureError
    from ..cuda_graph.full_iteration import FailedCapture

log = logging.getLogger("graphstep")


def capture_error_hook(exc: "CaptureError", failed: "FailedCapture") -> None:
    """Attach to a failed capture's error (``exc.findings``, a note, the log) what broke it and where.

    The ``on_capture_error`` hook of ``GraphedStep`` (``exc``: the CaptureError, ``failed``: its
    FailedCapture). Only for failures CUDA names no cause of (category ``cuda``): an out-of-memory error
    or AccumulateGrad nodes on another stream are never re-run. The region runs once, eagerly, on a copy of
    the static inputs, on the graph's own device (never simulated on the host), and every tensor and RNG
    state it changed is restored: the step's results are as if it had not run.
    """
    if exc.category != "cuda":
        return
    try:
        args, kwargs = failed.copy_call()
        findings = diagnose(failed.fn, args, kwargs, generators=list(failed.generators()), device=failed.device)
    except Exception as err:  # the diagnosis must never hide the capture error
        log.warning("graphstep doctor could not diagnose the failed capture of %r: %s", failed.name, err)
        return
    exc.findings = findings
    text = "\n".join(f.format() for f in findings) or "graphstep doctor found nothing in the region."
    if hasattr(exc, "add_note"):
        exc.add_note(f"graphstep doctor, re-running {failed.name!r}:\n{text}")
    log.error("capture of %r failed; graphstep doctor on the region:\n%s", failed.name, text)


def check_recipe(*args, **kwargs) -> Report:
    """See :func:`graphstep.doctor.recipe.check_recipe` (imported lazily: it needs the trainer)."""
    from .recipe import check_recipe as run

    return run(*args, **kwargs)
