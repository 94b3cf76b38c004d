"""Which frame is the user's: the line a finding points at.

One implementation serves the capture errors and the doctor:
cuda_graph/frames.py (PyTorch, the standard library and graphstep's capture
machinery are internal). This module marks the doctor's own folder internal
too, and adds :func:`code_line`, the ``def`` line of a step (for findings that
have no better line). graphstep's models and trainer count as user code, so a
recipe's findings name their lines.
"""

from __future__ import annotations

import linecache
import os

from ..cuda_graph.frames import (  # noqa: F401  (the doctor's modules import them from here)
    SourceLine,
    frame_line,
    is_internal,
    mark_internal,
    traceback_user_frame,
    user_frame,
)

mark_internal(os.path.dirname(os.path.realpath(__file__)))


def code_line(fn: object) -> SourceLine | None:
    """The ``def`` line of a function (for findings that have no better line)."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None) or getattr(getattr(type(fn), "__call__", None), "__code__", None)
    if code is None:
        return None
    return SourceLine(code.co_filename, code.co_firstlineno, code.co_name,
                      linecache.getline(code.co_filename, code.co_firstlineno))
