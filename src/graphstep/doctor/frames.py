"""Which frame is the user's: the line a finding points at.

Internal frames are PyTorch, the Python standard library, graphstep's
capture machinery (``cuda_graph/``) and the doctor itself; the innermost
frame that is none of these is the line the user wrote. graphstep's models
and trainer count as user code, so a recipe's findings name their lines.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import traceback
import types

import torch

from ..cuda_graph.errors import SourceLine

_TORCH_DIR = os.path.dirname(os.path.realpath(torch.__file__))
_GRAPH_DIR = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "cuda_graph"))
_DOCTOR_DIR = os.path.dirname(os.path.realpath(__file__))
_STDLIB_DIRS = tuple(
    {os.path.realpath(p) for k in ("stdlib", "platstdlib") if (p := sysconfig.get_paths().get(k))}
)


@functools.lru_cache(maxsize=4096)
def is_internal(filename: str) -> bool:
    """PyTorch, stdlib, graphstep's cuda_graph/ and doctor/, or a generated frame."""
    if filename.startswith("<"):
        return True
    real = os.path.realpath(filename)
    if real.startswith((_TORCH_DIR, _GRAPH_DIR, _DOCTOR_DIR)):
        return True
    if "site-packages" in real or "dist-packages" in real:
        return False
    return real.startswith(_STDLIB_DIRS)


def frame_line(frame: types.FrameType, lineno: int | None = None) -> SourceLine:
    import linecache

    code = frame.f_code
    n = lineno if lineno is not None else frame.f_lineno
    return SourceLine(code.co_filename, n, code.co_name, linecache.getline(code.co_filename, n))


def user_frame(start: types.FrameType | None = None) -> SourceLine | None:
    """The innermost frame of the current stack (or of ``start``'s) that the user wrote."""
    frame = start if start is not None else sys._getframe(1)
    while frame is not None:
        if not is_internal(frame.f_code.co_filename):
            return frame_line(frame)
        frame = frame.f_back
    return None


def traceback_user_frame(tb: types.TracebackType | None) -> SourceLine | None:
    """The innermost user frame of an exception's traceback (where the user's code raised)."""
    found = None
    for fs in traceback.extract_tb(tb):
        if not is_internal(fs.filename):
            found = SourceLine(fs.filename, fs.lineno or 0, fs.name, fs.line or "")
    return found


def code_line(fn: object) -> SourceLine | None:
    """The ``def`` line of a function (for findings that have no better line)."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None) or getattr(getattr(type(fn), "__call__", None), "__code__", None)
    if code is None:
        return None
    import linecache

    return SourceLine(code.co_filename, code.co_firstlineno, code.co_name,
                      linecache.getline(code.co_filename, code.co_firstlineno))
