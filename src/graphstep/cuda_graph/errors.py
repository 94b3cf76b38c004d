"""Errors of the capture machinery, and how they find the user's line.

A capture error is only useful if it says *where*: every error raised while a
region is captured or replayed names the first frame of the stack that is not
inside PyTorch, the Python standard library or graphstep's own capture
machinery -- the line the user wrote.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback
from dataclasses import dataclass

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_DIR = os.path.dirname(__file__)
_STDLIB_DIRS = tuple(
    {os.path.realpath(p) for k in ("stdlib", "platstdlib") if (p := sysconfig.get_paths().get(k))}
)


@dataclass(frozen=True)
class SourceLine:
    filename: str
    lineno: int
    function: str
    line: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.function}: {self.line.strip()}"


def _is_internal(filename: str) -> bool:
    if filename.startswith("<"):
        return True
    real = os.path.realpath(filename)
    if real.startswith(_TORCH_DIR) or real.startswith(_THIS_DIR):
        return True
    if "site-packages" in real:
        return False
    return real.startswith(_STDLIB_DIRS)


def user_frame(skip_internal: bool = True) -> SourceLine | None:
    """The innermost frame of the current stack that the user wrote."""
    frames = traceback.extract_stack(sys._getframe(1))
    for fr in reversed(frames):
        if skip_internal and _is_internal(fr.filename):
            continue
        return SourceLine(fr.filename, fr.lineno or 0, fr.name, fr.line or "")
    return None


class CaptureError(RuntimeError):
    """A region cannot be captured (or a graph cannot be replayed) as asked.

    ``op`` is the aten operator (or CUDA error) that broke the capture and
    ``where`` the user's source line that led to it, when known.
    """

    def __init__(self, message: str, *, op: str | None = None, where: SourceLine | None = None, category: str = ""):
        self.op = op
        self.where = where
        self.category = category
        text = message
        if where is not None:
            text += f"\n  at {where}"
        super().__init__(text)

    @classmethod
    def from_cuda(cls, exc: BaseException, graph_name: str) -> "CaptureError":
        if isinstance(exc, CaptureError):
            return exc
        return cls(
            f"capture of graph {graph_name!r} failed: {exc}. Run `graphstep doctor` (or "
            "graphstep.doctor.check) on this step to find the line that breaks capture.",
            op=type(exc).__name__,
            category="cuda",
        )


class ContractError(ValueError):
    """A replay call differs from the captured one (shape, dtype, device, structure or value)."""
