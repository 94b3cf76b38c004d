"""Host decisions frozen at capture: a graph does what the eager calls did.

Some libraries branch on device data in eager mode (a host sync) and, while a
stream is capturing, take a general sync-free path instead. The graph then
computes something other than the eager step -- the same function, but other
kernels, so other rounding (and, with dropout, other random numbers).
Hugging Face ``transformers`` is the common case: eagerly it checks on the
host whether the sequences are packed and, when they are not, uses SDPA's
``is_causal`` kernel; under capture it cannot look, so it builds an explicit
mask for the packed case.

A :class:`DecisionLog` belongs to one graphed region. Integrations wrap a
library's decision function and call :func:`decide` in it:

* eager warm-up calls run inside ``log.recording()``: the eager decision is
  taken (host sync and all, as eager does) and appended to the log;
* the capture runs inside ``log.replaying()``: the decisions of the last
  warm-up call are returned in order, so the captured graph takes eager's path;
* when two warm-up calls decided differently, or the capture asks for more
  decisions than were recorded, the decision is data-dependent: the library's
  general path runs and the log says so (``log.unfrozen``), once, at capture;
  so does a branch point the integration knows to read device data
  (:func:`data_dependent`).

Freezing is the graphs' usual contract (like shapes): a decision that eager
would take differently on later data is not revisited by the replay.
Integrations register a patch per library module (:func:`register`); it is
applied the first time a log is used while that module is imported.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable, Iterator

_local = threading.local()
_PATCHES: dict[str, Callable[[], None]] = {}
_APPLIED: set[str] = set()

FOLLOW = object()  # what decide() returns when the library's own (general) path must run


def register(module: str, install: Callable[[], None]) -> None:
    """Install ``install()`` once, the first time a log is used after ``module`` was imported."""
    _PATCHES[module] = install


def _install_patches() -> None:
    for module, install in _PATCHES.items():
        if module not in _APPLIED and module in sys.modules:
            _APPLIED.add(module)
            install()


class DecisionLog:
    """The host decisions of one graphed region (see module docstring)."""

    def __init__(self) -> None:
        self.values: list[tuple[str, Any]] = []
        self.stable = True
        self.recorded_calls = 0
        self.unfrozen: list[str] = []
        self._mode: str | None = None
        self._pos = 0

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        _install_patches()
        previous, self.values = self.values, []
        with self._active("record"):
            yield
        if self.recorded_calls and previous != self.values:
            self.stable = False
        self.recorded_calls += 1

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        _install_patches()
        self._pos = 0
        self.unfrozen = []
        with self._active("replay"):
            yield

    @contextlib.contextmanager
    def _active(self, mode: str) -> Iterator[None]:
        outer = getattr(_local, "log", None)
        _local.log, self._mode = self, mode
        try:
            yield
        finally:
            _local.log, self._mode = outer, None

    def _decide(self, key: str, eager: Callable[[], Any]) -> Any:
        if self._mode == "record":
            value = eager()
            self.values.append((key, value))
            return value
        pos, self._pos = self._pos, self._pos + 1
        if self.stable and pos < len(self.values) and self.values[pos][0] == key:
            return self.values[pos][1]
        if key not in self.unfrozen:
            self.unfrozen.append(key)
        return FOLLOW


def data_dependent(key: str) -> None:
    """A branch point whose answer reads device data: never frozen; at capture, noted in ``log.unfrozen``."""
    log = getattr(_local, "log", None)
    if log is not None and log._mode == "replay" and key not in log.unfrozen:
        log.unfrozen.append(key)


def decide(key: str, eager: Callable[[], Any]) -> Any:
    """At a data-dependent branch point: the value to use, or ``FOLLOW`` for the library's own path.

    ``eager()`` computes the decision as eager code would (it may sync the host:
    it runs only on eager calls). Outside any log, ``FOLLOW``.
    """
    log = getattr(_local, "log", None)
    if log is None:
        return FOLLOW
    return log._decide(key, eager)
