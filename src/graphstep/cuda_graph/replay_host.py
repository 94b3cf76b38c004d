"""What the replay backend must see of the host while it records.

Some Python-level calls never reach the dispatcher, so a ``TorchDispatchMode``
cannot see them; this module wraps them for the duration of a replay-backend
capture (on the recording thread only; other threads call the originals):

* reads of device data on the host -- ``Tensor.tolist``/``numpy``/``__array__``
  and printing (``print(t)``, ``str``, ``repr``, ``format``, f-strings, which
  ``torch._tensor_str`` runs with the dispatch modes disabled) -- raise
  :class:`CaptureError` naming the call and the user's line, as the same step
  breaks a CUDA capture (and a captured print would run once, not per replay);
* reseeding (``torch.manual_seed``, ``torch.seed``, their ``torch.cuda``
  forms) is refused the same way: CUDA refuses to reseed while capturing;
* generator state copies -- ``torch.get_rng_state``/``set_rng_state`` and
  their ``torch.cuda`` forms, used by ``torch.utils.checkpoint`` with
  ``preserve_rng_state=True`` and by ``torch.random.fork_rng`` -- are recorded
  as host callbacks: a state read refills the *same* tensor on every replay
  (a static address, as ``graphsafe_get_state`` gives on a GPU) and a state
  write re-applies whatever that tensor holds then;
* storage resizes (``UntypedStorage.resize_``, as FSDP2 allocates and frees
  its unsharded parameters around each use) are recorded as host callbacks:
  replay reallocates and frees at the same points, and the recorded ops
  refill the tensors that view the storage; memory a resize allocates is
  the capture's own, never backed up or restored; a storage the capture
  allocated itself is given back its size at the start of every replay;
* a collective's ``Work.wait()`` is recorded as a wait on the re-run
  collective at that point, and what a backend does inside it runs
  unrecorded (gloo copies a reduce-scatter's result out on every wait: it
  belongs to the collective, which replay re-runs and waits itself);
* ``torch.cuda.is_current_stream_capturing()`` answers True.

Host callbacks (:func:`record_host_op`) run in recording order between the
recorded ops; a callback that calls another wrapped function is recorded once.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch

from .errors import CaptureError, user_frame
from .monkeypatch import Patches

_local = threading.local()


def active_recorder() -> Any:
    """The replay-backend recorder capturing on this thread, or None."""
    return getattr(_local, "recorder", None)


def set_recorder(recorder: Any) -> None:
    _local.recorder = recorder


def _recording() -> bool:
    return active_recorder() is not None and not getattr(_local, "in_host_op", False)


def record_host_op(fn: Callable[[], None]) -> None:
    """Run ``fn`` now and, while a replay-backend capture records on this thread, on every replay.

    For host-side state that a CUDA graph tracks natively (the RNG tracker's
    generator swaps); on the CUDA backend this is just ``fn()``.
    """
    outer = getattr(_local, "in_host_op", False)
    _local.in_host_op = True
    try:
        fn()
    finally:
        _local.in_host_op = outer
    rec = active_recorder()
    if rec is not None and not outer:
        rec.tape.add(fn)


# --------------------------------------------------------------------------
# the wrappers

_DIRECT_READS = {
    "tolist": "Tensor.tolist() copies device data to the host (a sync)",
    "numpy": "Tensor.numpy() copies device data to the host (a sync)",
    "__array__": "numpy.asarray(tensor) copies device data to the host (a sync)",
    "__repr__": "printing a tensor (print, str, repr) copies its values to the host (a sync), and a "
                "captured print would run once, not on every replay; print a clone after the step returns",
    "__format__": "formatting a tensor (f-string, format, logging) copies its values to the host (a sync); "
                  "format a clone after the step returns",
}
_SEEDING = ("manual_seed", "seed")
_CUDA_SEEDING = ("manual_seed", "manual_seed_all", "seed", "seed_all")


def _refuse_read(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def read(self, *args: Any, **kwargs: Any) -> Any:
        if not _recording():
            return original(self, *args, **kwargs)
        raise CaptureError(f"Tensor.{name}() cannot be captured: {_DIRECT_READS[name]}",
                           op=name, where=user_frame(), category="host_sync")

    return read


def _refuse_seed(qualname: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def seed(*args: Any, **kwargs: Any) -> Any:
        if not _recording():
            return original(*args, **kwargs)
        raise CaptureError(
            f"{qualname}() cannot be captured: it reseeds a generator on the host, which a CUDA graph refuses "
            "(and a replay would not repeat); seed once before the step, or draw from a separate stream "
            "with graphstep's RNG tracker (tracker.fork(name))",
            op=qualname, where=user_frame(), category="rng",
        )

    return seed


def _recorded_get_state(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_state(*args: Any, **kwargs: Any) -> Any:
        if not _recording():
            return original(*args, **kwargs)
        held: list[Any] = []

        def read() -> None:  # on replay: the same tensor(s), refilled with the generator's state now
            fresh = original(*args, **kwargs)
            if not held:
                held.append(fresh)
            elif isinstance(fresh, torch.Tensor):
                held[0].copy_(fresh)
            else:
                for dst, src in zip(held[0], fresh):
                    dst.copy_(src)

        record_host_op(read)
        return held[0]

    return get_state


def _recorded_set_state(original: Callable[..., Any]) -> Callable[..., Any]:
    def set_state(*args: Any, **kwargs: Any) -> Any:
        if not _recording():
            return original(*args, **kwargs)
        record_host_op(lambda: original(*args, **kwargs))  # the state tensor's value at replay time

    return set_state


def _recorded_resize(original: Callable[..., Any]) -> Callable[..., Any]:
    def resize_(self: torch.UntypedStorage, size: int) -> Any:
        if not _recording():
            return original(self, size)
        active_recorder().note_resize(self, original)
        record_host_op(lambda: original(self, size))
        active_recorder().note_storage(self)
        return self

    return resize_


def in_collective_wait() -> bool:
    """True inside a collective's ``Work.wait()`` on this thread (its ops are the collective's, not the step's)."""
    return getattr(_local, "in_wait", False)


def _recorded_wait(original: Callable[..., Any]) -> Callable[..., Any]:
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = in_collective_wait()
        if _recording() and not outer:
            active_recorder().note_wait(self)
        _local.in_wait = True
        try:
            return original(self, *args, **kwargs)
        finally:
            _local.in_wait = outer

    return wait


def _wrappers() -> list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
    out: list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]] = []
    for name in _DIRECT_READS:
        out.append((torch.Tensor, name, lambda old, n=name: _refuse_read(n, old)))
    for owner, prefix in ((torch, "torch"), (torch.random, "torch.random")):
        for name in _SEEDING:
            out.append((owner, name, lambda old, q=f"torch.{name}": _refuse_seed(q, old)))
        out.append((owner, "get_rng_state", _recorded_get_state))
        out.append((owner, "set_rng_state", _recorded_set_state))
    out.append((torch.UntypedStorage, "resize_", _recorded_resize))
    if torch.distributed.is_available():
        out.append((torch.distributed.Work, "wait", _recorded_wait))
    if torch.cuda.is_available():
        for name in _CUDA_SEEDING:
            out.append((torch.cuda, name, lambda old, q=f"torch.cuda.{name}": _refuse_seed(q, old)))
        for name in ("get_rng_state", "get_rng_state_all"):
            out.append((torch.cuda, name, _recorded_get_state))
        for name in ("set_rng_state", "set_rng_state_all"):
            out.append((torch.cuda, name, _recorded_set_state))
    return out


@contextlib.contextmanager
def host_guards() -> Iterator[None]:
    """Wrap, while a capture records, what bypasses the dispatcher (see the module docstring)."""
    with Patches() as patches:
        for owner, name, wrap in _wrappers():
            patches.wrap(owner, name, wrap)
        # Code that asks "is the stream capturing?" (torch.optim's capture check,
        # Hugging Face's sync-free mask path) must get the answer a CUDA capture gives.
        patches.wrap(torch.cuda, "is_current_stream_capturing",
                     lambda was_capturing: lambda: active_recorder() is not None or was_capturing())
        yield
