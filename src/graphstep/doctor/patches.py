"""Python-level APIs the doctor watches by wrapping them for the duration of a run.

* ``torch.cuda.synchronize`` (a host sync) and ``torch.cuda.get_rng_state`` /
  ``set_rng_state`` (RNG copies the graph cannot replay) are recorded; on a
  machine without CUDA they are emulated (a no-op, the CPU generator) so the
  step runs on, and ``torch.cuda.is_current_stream_capturing()`` answers
  True inside the analysed call, as it would during a capture;
* torch.optim's global step hooks see every ``optimizer.step()``: one that
  is not capturable is one finding, and the host syncs inside it are not
  reported again;
* ``GradScaler.step`` and ``autocast.__enter__`` are wrapped to recognise a
  dynamic loss scaler and an autocast cache.

Everything is put back exactly when the run ends, also on errors (cuda_graph/monkeypatch.py, the
mechanism the replay backend patches with too).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

import torch
import torch.optim.optimizer as optim_mod

from ..cuda_graph.monkeypatch import Patches
from ..cuda_graph.torch_compat import autocast_settings, grad_scaler_device
from .frames import is_internal, user_frame


def _amp_unavailable() -> bool:
    try:
        return bool(torch.cuda.amp.common.amp_definitely_not_available())
    except Exception:
        return not torch.cuda.is_available()


@contextlib.contextmanager
def patched(s: Any) -> Iterator[None]:
    patches = Patches()

    def put(owner: Any, name: str, new: Callable[..., Any]) -> None:
        patches.wrap(owner, name, new, keep_metadata=True)

    sim = s.devices.simulated
    put(torch.cuda, "synchronize", lambda old: _recorded(
        s, old, "host_sync", "torch.cuda.synchronize", "waits on the host for all device work", sim,
        why="the host waits for the device: not allowed while a stream is capturing (the work is only being "
            "recorded), and a replay runs without the host waiting anyway"))
    for name, stand_in in (("get_rng_state", lambda *a, **k: _CPU_RNG[0]()),
                           ("set_rng_state", lambda state, *a, **k: _CPU_RNG[1](state)),
                           ("get_rng_state_all", lambda *a, **k: [_CPU_RNG[0]()]),
                           ("set_rng_state_all", lambda states, *a, **k: _CPU_RNG[1](states[0]))):
        put(torch.cuda, name, lambda old, n=name, f=stand_in: _recorded(
            s, old, "rng", f"torch.cuda.{n}", "copies the CUDA generator's state on the host", sim, f))
    if sim:
        for name in ("get_rng_state", "set_rng_state"):  # the CPU generator stands for the device's here
            put(torch, name, lambda old, n=name: _recorded(s, old, "rng", f"torch.{n}",
                                                            "copies the generator's state on the host", False))
        put(torch.cuda, "is_current_stream_capturing", lambda old: _capturing(s, old))
        for name in ("range_push", "range_pop", "mark"):
            put(torch.cuda.nvtx, name, lambda old: lambda *a, **k: None)
    from torch.amp import autocast_mode, grad_scaler

    put(grad_scaler.GradScaler, "step", lambda old: _scaler_step(s, old))
    put(autocast_mode.autocast, "__enter__", lambda old: _autocast_enter(s, old))
    hooks = [optim_mod.register_optimizer_step_pre_hook(lambda opt, a, k: _optimizer_pre(s, opt)),
             optim_mod.register_optimizer_step_post_hook(lambda opt, a, k: _optimizer_post(s, opt))]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        patches.restore()


# the CPU generator's state functions, unpatched, for the stand-ins above
_CPU_RNG = (torch.get_rng_state, torch.set_rng_state)


def _recorded(s: Any, old: Callable[..., Any], category: str, op: str, detail: str, sim: bool,
              stand_in: Callable[..., Any] | None = None, why: str = "") -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        if s.active and s.recording and not s.suppress:
            s.found(category, op, detail=detail, where=user_frame(), why=why)
        if sim and not torch.cuda.is_available():
            return stand_in(*args, **kwargs) if stand_in is not None else None
        return old(*args, **kwargs)

    return call


def _capturing(s: Any, old: Callable[..., Any]) -> Callable[..., Any]:
    # User code asking "am I being captured?" gets yes inside the analysed call, so it takes its capture
    # path; PyTorch's own checks (optimizer health checks ...) get the real answer.
    def capturing() -> bool:
        caller = sys._getframe(1).f_code.co_filename
        if s.active and s.recording and not is_internal(caller):
            return True
        return bool(old()) if torch.cuda.is_available() else False

    return capturing


def _capturable(opt: torch.optim.Optimizer) -> bool:
    for group in opt.param_groups:
        if "capturable" in group and not group["capturable"] and not group.get("fused"):
            return False
    return True


def _optimizer_pre(s: Any, opt: torch.optim.Optimizer) -> None:
    if not (s.active and s.recording) or _capturable(opt):
        return
    # one finding for the optimizer; the .item() calls inside its step are the same problem
    if not s.suppress:
        s.found("optimizer", f"{type(opt).__name__}.step",
                detail=f"{type(opt).__name__}(capturable=False, fused=False)", where=user_frame())
    s.suppress += 1
    s.in_optimizer.append(id(opt))


def _optimizer_post(s: Any, opt: torch.optim.Optimizer) -> None:
    if s.in_optimizer and s.in_optimizer[-1] == id(opt):
        s.in_optimizer.pop()
        s.suppress -= 1


def _scaler_step(s: Any, old: Callable[..., Any]) -> Callable[..., Any]:
    def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if not (s.active and s.recording):
            return old(scaler, optimizer, *args, **kwargs)
        cuda_here = grad_scaler_device(scaler) == "cuda" and _amp_unavailable()
        if (scaler.is_enabled() or cuda_here) and not s.suppress:
            where = "disabled on this machine (no GPU), on a GPU: " if cuda_here and not scaler.is_enabled() else ""
            s.found("grad_scaler", "GradScaler.step",
                    detail=f"{where}reads found_inf on the host (.item()) before stepping", where=user_frame())
        s.suppress += 1
        try:
            return old(scaler, optimizer, *args, **kwargs)
        finally:
            s.suppress -= 1

    return step


def _autocast_enter(s: Any, old: Callable[..., Any]) -> Callable[..., Any]:
    def enter(ac: Any) -> Any:
        if s.active and s.recording and not s.suppress and autocast_settings(ac)[1]:
            wanted = autocast_settings(ac)[0] or (getattr(ac, "device", "") == "cuda" and _amp_unavailable())
            if wanted:
                s.found("autocast_cache", "torch.autocast",
                        detail=f"torch.autocast({getattr(ac, 'device', '?')!r}) with cache_enabled=True",
                        where=user_frame())
        return old(ac)

    return enter
