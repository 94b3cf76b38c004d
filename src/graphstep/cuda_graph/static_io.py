"""Static input buffers and the contract a replay must keep.

A graph reads its inputs from fixed addresses. :class:`StaticInputs` owns one
buffer per tensor of the first call's arguments (positional and keyword, any
nesting of lists, tuples and dicts) and, on every later call, checks the new arguments against that
contract -- same structure, same shapes, dtypes and devices, same non-tensor
values -- then copies the new tensors in. A difference raises
:class:`ContractError` naming the argument (``[0]['tokens']`` for a positional
argument, ``mask`` or ``batch['tokens']`` for a keyword one) and both values.

The input contract of graphstep's graphs:

* static: parameters, buffers, optimizer state -- updated in place, never replaced;
* copied in: the arguments given to a graphed call (batches), through this class;
* graph-owned: everything the graph returns -- overwritten by the next replay.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from .errors import ContractError


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    return repr(x)


class StaticInputs:
    """Fixed-address copies of a call's tensor arguments, with the call's contract."""

    def __init__(self, example: Any, device: torch.device | None = None, name: str = "graph",
                 call: bool = False) -> None:
        """``call=True``: ``example`` is a call's ``(args, kwargs)``, and messages name arguments as a call does."""
        self.name = name
        self.device = device
        self.call = call
        leaves, self.spec = tree_flatten_with_path(example)
        self.paths = [_call_path(path) if call else keystr(path) for path, _ in leaves]
        self.leaves: list[Any] = []
        for _, value in leaves:
            if isinstance(value, torch.Tensor):
                target = device if device is not None else value.device
                # detach(): the buffer must be a leaf of its own, not a copy that autograd links
                # back to the example (a node made outside the capture, on another stream).
                self.leaves.append(torch.empty_like(value, device=target).copy_(value.detach()))
            else:
                self.leaves.append(value)
        self.tree = tree_unflatten(self.leaves, self.spec)

    def check(self, value: Any) -> list[Any]:
        """The new call's leaves, after checking them against the contract."""
        leaves, spec = tree_flatten(value)  # the replay path: key paths only for messages (self.paths)
        if spec != self.spec:
            captured = _call_shape(tree_unflatten(self.leaves, self.spec)) if self.call else str(self.spec)
            now = _call_shape(value) if self.call else str(spec)
            raise ContractError(
                f"{self.name}: the call's arguments have another structure than the captured call's "
                f"(pass the same arguments, by the same names, every call).\n  captured: {captured}\n  now:      {now}"
            )
        out = []
        for path, new, old in zip(self.paths, leaves, self.leaves):
            if isinstance(old, torch.Tensor):
                if not isinstance(new, torch.Tensor):
                    raise ContractError(f"{self.name}: argument {path} was a tensor at capture, now {_describe(new)}")
                if new.shape != old.shape or new.dtype != old.dtype:
                    raise ContractError(
                        f"{self.name}: argument {path} differs from the captured call: "
                        f"captured {_describe(old)}, now {_describe(new)}. A graph replays the captured shapes: "
                        "pad inputs to a fixed shape (or drop the last partial batch), or capture one graph "
                        "per shape."
                    )
                if self.device is None and new.device != old.device:
                    raise ContractError(
                        f"{self.name}: argument {path} is on {new.device}, the captured call had it on {old.device}"
                    )
            elif not _same_value(new, old):
                raise ContractError(
                    f"{self.name}: non-tensor argument {path} differs from the captured call: "
                    f"captured {old!r}, now {new!r} (non-tensor values are baked into the graph)"
                )
            out.append(new)
        return out

    def copy_in(self, value: Any) -> None:
        """Check ``value`` and copy its tensors into the static buffers."""
        for dst, src in zip(self.leaves, self.check(value)):
            if isinstance(dst, torch.Tensor) and not _same_memory(dst, src):
                dst.copy_(src, non_blocking=True)


def _call_shape(call: Any) -> str:
    """``(args, kwargs)`` as a signature-like line: ``(tensor, [tensor, tensor], mask=tensor)``."""
    args, kwargs = call

    def shape(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return "tensor"
        if isinstance(x, (list, tuple)):
            inner = ", ".join(shape(v) for v in x)
            return f"[{inner}]" if isinstance(x, list) else f"({inner})"
        if isinstance(x, dict):
            return "{" + ", ".join(f"{k!r}: {shape(v)}" for k, v in x.items()) + "}"
        return type(x).__name__

    return "(" + ", ".join([shape(a) for a in args] + [f"{k}={shape(v)}" for k, v in kwargs.items()]) + ")"


def _call_path(path: tuple) -> str:
    """``(args, kwargs)`` key paths as a call spells them: ``[1]['x']`` for args, ``mask['x']`` for kwargs."""
    head, rest = path[0], path[1:]
    if getattr(head, "idx", None) == 1 and rest:  # kwargs: the keyword's name, then the rest of the path
        return f"{rest[0].key}{keystr(rest[1:])}"
    return keystr(rest)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b`` is ``a`` or a view of exactly the same memory (a graph output fed back in: no copy)."""
    return a is b or (
        a.data_ptr() == b.data_ptr() and a.device == b.device and a.stride() == b.stride() and a.shape == b.shape
    )


def _same_value(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # an object without a usable __eq__ must be the same object
        return a is b
