"""``train.manual_gc``: Megatron Bridge's manual garbage-collection policy.

With ``manual_gc=true`` Python's automatic collector is disabled for the run
(after one full collection at the start) and collects only where the loop
says: every ``manual_gc_interval`` iterations (0 = never again), and with
``manual_gc_eval`` a full collection before each evaluation and a young
generation one after it. Every call site is between steps, outside every
graph: an automatic collection can otherwise run at any allocation -- inside
a capture, or in a timed step on one rank while the others wait for it.
The collector's state before the run is restored at the end.
"""

from __future__ import annotations

import gc
from typing import Any


class ManualGC:
    """The policy of ``cfg.train``: a context manager around the loop plus its three call sites."""

    def __init__(self, train: Any) -> None:
        self.enabled = train.manual_gc is True
        self.interval = train.manual_gc_interval
        self.around_eval = self.enabled and bool(train.manual_gc_eval)
        self._was_enabled = True

    def __enter__(self) -> "ManualGC":
        if self.enabled:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled and self._was_enabled:
            gc.enable()

    def after_iteration(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    def before_eval(self) -> None:
        if self.around_eval:
            gc.collect()

    def after_eval(self) -> None:
        if self.around_eval:
            gc.collect(generation=0)
