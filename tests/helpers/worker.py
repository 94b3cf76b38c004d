"""The tests' one subprocess worker: ``python -m helpers.worker FILE::FUNCTION [ARG ...]`` loads the test file
``FILE`` as a module and calls ``FUNCTION(*ARGS)`` (strings). torchrun launches it once per rank
(helpers.launch.torchrun_reports); the function writes what the test reads back."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

from helpers import aten_cpu_matmuls


def load(target: str) -> Callable[..., Any]:
    """``FUNCTION`` of the test file ``FILE`` (``target`` = ``FILE::FUNCTION``), the file loaded as a module."""
    path, function = target.rsplit("::", 1)
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"helpers.worker: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return getattr(module, function)


def main(argv: list[str]) -> None:
    if not argv or "::" not in argv[0]:
        raise SystemExit("usage: python -m helpers.worker FILE::FUNCTION [ARG ...]")
    aten_cpu_matmuls()  # as in the test process (tests/conftest.py)
    load(argv[0])(*argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
