"""The two interception layers of the analyzer.

:class:`FunctionAnalyzer` (a ``TorchFunctionMode``) sees the Python-level API
the user called -- ``Tensor.item``, ``bool(t)``, ``print(t)``, ``.cpu()``,
``.to(device)``, ``torch.tensor(..., device=...)`` -- which gives findings
their names, catches device/host transfers that the CPU cannot see at the op
level, and simulates the GPU's devices on a CPU-only machine (devices.py).

:class:`DispatchAnalyzer` (a ``TorchDispatchMode``) sees every aten op,
autograd's backward and optimizer internals included: host syncs and
data-dependent shapes (``host_sync_reason`` of the replay backend, the same
rules a capture enforces), unregistered generators, cross-device copies on a
real GPU; it also tracks which storages the step reads, creates and writes
(session.py uses that for stale inputs and to restore what the step changed).

A finding found at the API level suppresses the op-level findings of the same
call, so ``loss.item()`` is one finding, not two. Neither layer stops the
step: each problem is recorded and the op runs (on the CPU, or eagerly on the
GPU), so one run reports every problem.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name

from ..cuda_graph.ops import host_sync_reason, returns_alias
from ..cuda_graph.torch_compat import OpOverload, TorchDispatchMode
from .devices import FACTORIES, tensors

aten = torch.ops.aten
_LIFTS = (aten.lift_fresh, aten.lift, aten.lift_fresh_copy)

_READS = {
    "item": "Tensor.item() copies the value to the host",
    "__bool__": "bool(tensor) / `if tensor:` reads the value on the host",
    "__int__": "int(tensor) reads the value on the host",
    "__float__": "float(tensor) reads the value on the host",
    "__index__": "using a tensor as a Python index reads it on the host",
    "__complex__": "complex(tensor) reads the value on the host",
    "tolist": "Tensor.tolist() copies the tensor to the host",
    "numpy": "Tensor.numpy() needs the tensor in host memory",
    "__array__": "numpy.asarray(tensor) copies the tensor to the host",
    "__repr__": "printing a tensor copies its values to the host",
    "__str__": "printing a tensor copies its values to the host",
    "__format__": "formatting a tensor (f-string, print, logging) copies its values to the host",
    "cpu": "Tensor.cpu() copies the tensor to host memory",
}
# Ops whose Python-value result is metadata, not device data.
_NOT_SYNCS = frozenset({
    "is_pinned", "is_set_to", "_has_compatible_shallow_copy_type", "_fused_sdp_choice", "_use_cudnn_ctc_loss",
    "_use_cudnn_rnn_flatten_weight", "is_vulkan_available", "_is_zerotensor", "_debug_has_internal_overlap",
    "is_coalesced", "_nnz", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "size", "stride",
    "numel", "is_same_size", "_has_same_storage_numel", "output_nr", "_version", "is_conj", "is_neg",
})


_NAMES: dict[Any, str] = {}


def api_name(func: Any) -> str:
    """``torch.Tensor.item``, ``torch.tensor``, ``torch.nn.functional.linear`` ..."""
    try:
        return _NAMES[func]
    except (KeyError, TypeError):
        pass
    try:
        name = resolve_name(func) or str(func)
    except Exception:
        name = getattr(func, "__qualname__", str(func))
    try:
        _NAMES[func] = name
    except TypeError:
        pass
    return name


def _short_name(func: Any) -> str:
    if isinstance(func, OpOverload):
        return func.overloadpacket.__name__
    return getattr(func, "__name__", "")


class FunctionAnalyzer(TorchFunctionMode):
    """Python-level API calls: names, transfers, device simulation."""

    def __init__(self, session: Any) -> None:
        super().__init__()
        self.s = session

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        s = self.s
        if not s.active:
            return func(*args, **kwargs)
        name = _short_name(func)
        self_t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        problem, move, args, kwargs = classify_call(s.devices, name, args, kwargs, self_t)
        api = api_name(func)
        reported = problem is not None and s.recording and not s.suppress
        if reported:
            s.found(problem[0], api, detail=problem[1])
            s.suppress += 1
        outer = s.api, s.api_frame
        if s.api is None:  # the outermost call: names the op-level findings inside it
            s.api, s.api_frame = api, sys._getframe(1)
        try:
            out = self._run(func, name, args, kwargs, self_t, move)
        finally:
            s.api, s.api_frame = outer
            if reported:
                s.suppress -= 1
        if s.devices.simulated:
            _mark(s.devices, name, args, kwargs, out, self_t, move)
        return out

    def _run(self, func, name, args, kwargs, self_t, move):
        dev = self.s.devices
        if not dev.simulated:
            return func(*args, **kwargs)
        pinned = kwargs.pop("pin_memory", False) if name in FACTORIES else False
        if "device" in kwargs:
            kwargs["device"] = dev.remap(kwargs["device"])
        if name in ("cuda", "pin_memory") and self_t is not None:  # no CUDA here: a copy stands for the move
            return self_t.clone() if (move or name == "pin_memory") else self_t
        out = func(*args, **kwargs)
        if move is not None and out is self_t:
            out = self_t.clone()
        if pinned and isinstance(out, torch.Tensor):
            dev.mark_host(out, pinned=True)
        return out


def classify_call(dev, name: str, args: tuple, kwargs: dict, self_t: torch.Tensor | None):
    """(problem, move, args, kwargs) of an API call: problem = (category, detail) or None; move = the
    simulated transfer ("host", "device" or None); args/kwargs with simulated devices remapped."""
    problem: tuple[str, str] | None = None
    move: str | None = None
    if name in _READS and self_t is not None and not dev.is_host(self_t):
        problem, move = ("host_sync", _READS[name]), ("host" if name == "cpu" else None)
    elif name == "to" and self_t is not None:
        target, args, kwargs = _to_target(dev, args, kwargs)
        if target == "host" and not dev.is_host(self_t):
            problem, move = ("host_sync", "Tensor.to('cpu') copies the tensor to host memory"), "host"
        elif target == "device" and dev.is_host(self_t):
            move = "device"
            if not dev.is_pinned(self_t):
                problem = ("h2d_copy", "Tensor.to(device) of a host tensor in pageable memory")
    elif name == "cuda" and self_t is not None and dev.is_host(self_t):
        move = "device"
        if not dev.is_pinned(self_t):
            problem = ("h2d_copy", "Tensor.cuda() of a host tensor in pageable memory")
    elif name == "copy_" and self_t is not None and len(args) > 1 and isinstance(args[1], torch.Tensor):
        src = args[1]
        if not dev.is_host(self_t) and dev.is_host(src) and not dev.is_pinned(src):
            problem = ("h2d_copy", "device_tensor.copy_(host_tensor) from pageable memory")
        elif dev.is_host(self_t) and not dev.is_host(src):
            problem = ("host_sync", "host_tensor.copy_(device_tensor) copies device data to the host")
    elif name in ("tensor", "as_tensor", "asarray") and _device_arg(kwargs) is not None:
        data = args[0] if args else kwargs.get("data")
        on_device = isinstance(data, torch.Tensor) and not dev.is_host(data)
        if not dev.target_is_host(_device_arg(kwargs)) and not on_device:
            problem = ("h2d_copy", f"torch.{name}(..., device=...) copies host data to the device")
    elif name == "new_tensor" and self_t is not None and not dev.is_host(self_t):
        problem = ("h2d_copy", "Tensor.new_tensor(data) copies host data to the device")
    return problem, move, args, kwargs


def _device_arg(kwargs: dict) -> Any:
    return kwargs.get("device")


def _to_target(dev, args: tuple, kwargs: dict) -> tuple[str | None, tuple, dict]:
    """Where ``Tensor.to(...)`` sends the tensor ("host", "device" or None = same place), remapping cuda."""
    args = list(args)
    target = None
    if len(args) > 1 and isinstance(args[1], torch.Tensor):
        target = "host" if dev.is_host(args[1]) else "device"
    elif len(args) > 1 and isinstance(args[1], (str, torch.device, int)):
        target = "host" if dev.target_is_host(args[1]) else "device"
        args[1] = dev.remap(args[1])
    elif kwargs.get("device") is not None:
        target = "host" if dev.target_is_host(kwargs["device"]) else "device"
        kwargs["device"] = dev.remap(kwargs["device"])
    return target, tuple(args), kwargs


def _mark(dev, name: str, args: tuple, kwargs: dict, out: Any, self_t, move: str | None) -> None:
    """Host/device marks of a simulated call's results (see devices.py)."""
    outs = tensors(out)
    if not outs:
        return
    if move == "host" or name == "pin_memory":
        for t in outs:
            dev.mark_host(t, pinned=name == "pin_memory")
        return
    if move == "device":
        for t in outs:
            dev.mark_device(t)
        return
    ins = tensors((args, kwargs))
    if name in FACTORIES and not ins:
        if dev.target_is_host(kwargs.get("device")):
            for t in outs:
                if not dev.is_host(t):
                    dev.mark_host(t)
        return
    if ins and all(dev.is_host(t) for t in ins):
        for t in outs:
            dev.mark_host(t)


def new_outputs(func, out: Any) -> list[torch.Tensor]:
    """Tensors an op allocated (not views or ``out=`` aliases of its inputs)."""
    return [] if returns_alias(func) else tensors(out)


class DispatchAnalyzer(TorchDispatchMode):
    """Every aten op: syncs, data-dependent shapes, generators, copies; read/write tracking."""

    def __init__(self, session: Any) -> None:
        super().__init__()
        self.s = session

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        s = self.s
        if not s.active:
            return func(*args, **kwargs)
        if s.restore:  # every argument: some ops write what their schema calls read-only (BatchNorm's stats)
            s.before_write(tensors((args, kwargs)))
        if s.recording and not s.suppress:
            problem = classify_op(s, func, args, kwargs)
            if problem is not None:
                packet = func.overloadpacket.__name__
                op = f"{s.api} (aten.{packet})" if s.api else f"aten.{packet}"
                s.found(problem[0], op, detail=problem[1])
        out = func(*args, **kwargs)
        if func.overloadpacket in _LIFTS:  # its input is fresh from Python data (torch.tensor, from_numpy)
            s.note_op([], tensors(args) + tensors(out))
        else:
            s.note_op(tensors((args, kwargs)), new_outputs(func, out))
        return out


def classify_op(s: Any, func, args: tuple, kwargs: dict) -> tuple[str, str] | None:
    """(category, detail) when ``func`` breaks capture, else None."""
    dev = s.devices
    gen = kwargs.get("generator")
    if isinstance(gen, torch.Generator) and id(gen) not in s.generators:
        return "rng", "draws from a torch.Generator that is not registered with the graph"
    packet = func.overloadpacket
    if packet.__name__ in _NOT_SYNCS:
        return None
    ins = tensors((args, kwargs))
    problem = host_sync_reason(func, args, kwargs)
    if problem is not None:
        if not ins or all(dev.is_host(t) for t in ins):
            return None  # reads host memory: no device involved
        if packet is aten.bincount:
            with_min = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            return "dynamic_shape", ("bincount reads max(input) on the host to size its result"
                                     + (" (even with minlength)" if with_min else " (no minlength)"))
        return problem[0], problem[1]
    if not dev.simulated:
        return _cross_device_copy(dev, packet, args, kwargs)
    return None


def _cross_device_copy(dev, packet, args: tuple, kwargs: dict) -> tuple[str, str] | None:
    if packet is aten._to_copy and kwargs.get("device") is not None:
        src, target = args[0], torch.device(kwargs["device"])
        if src.device.type != "cpu" and target.type == "cpu":
            return "host_sync", "a device-to-host copy"
        if src.device.type == "cpu" and target.type != "cpu" and not dev.is_pinned(src):
            return "h2d_copy", "a copy from pageable host memory to the device"
    if packet is aten.copy_ and len(args) > 1:
        dst, src = args[0], args[1]
        if dst.device.type != "cpu" and src.device.type == "cpu" and not dev.is_pinned(src):
            return "h2d_copy", "a copy from pageable host memory to the device"
        if dst.device.type == "cpu" and src.device.type != "cpu":
            return "host_sync", "a device-to-host copy"
    return None
