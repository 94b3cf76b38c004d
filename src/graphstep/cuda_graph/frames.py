"""Which frame is the user's: the line an error or a finding points at.

A capture error is only useful if it says *where*. Internal frames are
PyTorch's, the Python standard library's, generated code (``<string>``) and
graphstep's capture machinery (this package); layers built on it add their
own files or folders with :func:`mark_internal` (the library API's wrappers,
the doctor). The innermost frame that is none of these is the line the user
wrote. graphstep's models and trainer count as user code, so an error in a
recipe's step names its line; packages installed in ``site-packages`` too.
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
import sysconfig
import traceback
import types
from dataclasses import dataclass

import torch

_TORCH_DIR = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
_THIS_DIR = os.path.dirname(os.path.realpath(__file__)) + os.sep
_STDLIB_DIRS = tuple(
    {os.path.realpath(p) + os.sep for k in ("stdlib", "platstdlib") if (p := sysconfig.get_paths().get(k))}
)
_MARKED: set[str] = set()  # files, and folders (ending in os.sep), that layers above marked internal


@dataclass(frozen=True)
class SourceLine:
    filename: str
    lineno: int
    function: str
    line: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.function}: {self.line.strip()}"


def mark_internal(path: str) -> None:
    """Never point at ``path`` (a file, or a folder and everything under it) as the user's line."""
    real = os.path.realpath(path)
    _MARKED.add(real + os.sep if os.path.isdir(real) else real)
    is_internal.cache_clear()


@functools.lru_cache(maxsize=4096)
def is_internal(filename: str) -> bool:
    """PyTorch, the standard library, this package, what was marked internal, or generated code."""
    if filename.startswith("<"):
        return True
    real = os.path.realpath(filename)
    if real.startswith((_TORCH_DIR, _THIS_DIR)) or real in _MARKED:
        return True
    if any(m.endswith(os.sep) and real.startswith(m) for m in _MARKED):
        return True
    if "site-packages" in real or "dist-packages" in real:
        return False
    return real.startswith(_STDLIB_DIRS)


def frame_line(frame: types.FrameType, lineno: int | None = None) -> SourceLine:
    """The source line a frame is at (or at ``lineno`` of its code)."""
    code = frame.f_code
    n = lineno if lineno is not None else frame.f_lineno
    return SourceLine(code.co_filename, n, code.co_name, linecache.getline(code.co_filename, n))


def user_frame(start: types.FrameType | None = None) -> SourceLine | None:
    """The innermost frame of the current stack (or of ``start`` and its callers) that the user wrote."""
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
