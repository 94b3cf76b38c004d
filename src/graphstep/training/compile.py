"""How long torch.compile took: :class:`CompileTimeReport` wraps the training step and logs, once, how long
Dynamo and Inductor spent compiling during the first step (forward and the lazily compiled backward), from
Dynamo's compile start/end callbacks. What is compiled, and where, is parallel/compile.py's.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ..engines_compat import dynamo_callbacks

log = logging.getLogger("graphstep")


class CompileTimer:
    """Seconds Dynamo spends compiling while inside ``with``: its compile start/end callbacks, outermost pairs."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.compiles = 0
        self._depth = 0
        self._t0 = 0.0

    def _start(self, _args: Any) -> None:
        if self._depth == 0:
            self._t0 = time.perf_counter()
        self._depth += 1

    def _end(self, _args: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._t0
            self.compiles += 1

    def __enter__(self) -> "CompileTimer":
        callback_handler = dynamo_callbacks()
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        return self

    def __exit__(self, *exc: Any) -> None:
        callback_handler = dynamo_callbacks()
        callback_handler.remove_start_callback(self._start)
        callback_handler.remove_end_callback(self._end)


class CompileTimeReport:
    """The training step, whose first call logs "compiled in X s"; every attribute is the step's."""

    def __init__(self, step: Callable[..., Any], what: str) -> None:
        self.__dict__.update(step=step, what=what, reported=False, compile_seconds=None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.reported:
            return self.step(*args, **kwargs)
        with CompileTimer() as timer:
            out = self.step(*args, **kwargs)
        self.__dict__.update(reported=True, compile_seconds=timer.seconds)
        log.info("%s: compiled in %.1f s (%d compilations in the first training step)",
                 self.what, timer.seconds, timer.compiles)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["step"], name)
