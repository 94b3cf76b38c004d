"""One graph backend per process and device.

:func:`get_backend` hands out the process's backend for a device -- a
:class:`~.backend.CudaGraphBackend` on a GPU, a :class:`~.replay.ReplayBackend`
elsewhere or when asked (a dry run) -- making it on first use, so every graph
of the process shares that backend's pool and capture stream. The first
replay backend of a device says once in the log that it checks capture and
gives no speed-up. :func:`close_all_backends` resets every graph of every
backend (before ``destroy_process_group``, at exit).
"""

from __future__ import annotations

import logging

import torch

from .backend import CudaGraphBackend, GraphBackend
from .devices import normalize_device
from .replay import ReplayBackend

log = logging.getLogger("graphstep")

_BACKENDS: dict[tuple[str, str], GraphBackend] = {}
_ANNOUNCED: set[str] = set()
KINDS = ("auto", "cuda", "replay")


def get_backend(device: torch.device | str | int, kind: str = "auto") -> GraphBackend:
    """The process's backend for ``device``: CUDA graphs on a GPU, replay elsewhere.

    ``kind`` is ``auto``, ``cuda`` or ``replay`` (a dry run on any device).
    """
    device = normalize_device(device)
    if kind not in KINDS:
        raise ValueError(f"graph backend must be auto, cuda or replay, got {kind!r}")
    if kind == "auto":
        kind = "cuda" if device.type == "cuda" else "replay"
    if kind == "cuda" and device.type != "cuda":
        raise ValueError(f"the cuda graph backend needs a CUDA device, the model is on {device}")
    key = (kind, str(device))
    backend = _BACKENDS.get(key)
    if backend is None:
        backend = CudaGraphBackend(device) if kind == "cuda" else ReplayBackend(device)
        _BACKENDS[key] = backend
        if kind == "replay":
            _announce_replay(device)
    return backend


def _announce_replay(device: torch.device) -> None:
    """Once per device: the replay backend checks capture, it does not speed anything up."""
    if str(device) in _ANNOUNCED:
        return
    _ANNOUNCED.add(str(device))
    if device.type == "cuda":
        log.info("graph backend: CPU replay backend on %s (dry run) -- checks capture, gives no speed-up", device)
    else:
        log.info("no CUDA device: capturing with the CPU replay backend -- checks capture, gives no speed-up")


def close_all_backends() -> None:
    """Reset every graph of every backend of this process (harmless to repeat)."""
    for backend in list(_BACKENDS.values()):
        backend.close()
    _BACKENDS.clear()
