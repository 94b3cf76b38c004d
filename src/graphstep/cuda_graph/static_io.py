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

Tensor subclasses that wrap other tensors (``DTensor``, float8 tensors: any
subclass with ``__tensor_flatten__``) have no memory of their own -- their
``data_ptr()`` is 0 -- so they are compared, copied and cloned through the
plain tensors they hold (:func:`local_tensors`): the static buffer of a
DTensor argument is a DTensor of the same mesh and placements whose local
tensor receives each call's local tensor. A DTensor argument whose mesh or
placements differ from the captured one's (or a plain tensor where a DTensor
was captured) is a :class:`ContractError`: the graph was captured for that
layout, its collectives included. :func:`clone_keeping_layout` copies one
keeping its placements (DTensor's own ``clone()`` of a ``Partial`` tensor
returns a ``Replicate`` one, with an all-reduce).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .errors import ContractError
from .torch_compat import async_collective_tensor_types, keystr, tree_flatten, tree_flatten_with_path, tree_unflatten


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        kind = type(x).__name__ if is_wrapper(x) else "tensor"
        return f"{kind}(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    return repr(x)


# ---- tensor subclasses that wrap other tensors (DTensor) ----------------------


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # the replay path's common case, decided by one type look-up


def _lazy_tensor_types() -> tuple[type, ...]:
    """Subclasses that are plain tensors whose data is still arriving: the result of a functional collective
    (``AsyncCollectiveTensor``, what tensor parallel's ``use_local_output`` hands a module) waits for its
    collective in its own dispatch, so it is read and copied as a plain tensor -- its inner tensor, copied
    directly, would be read before the collective has filled it. Verified on torch 2.11 and 2.13."""
    return async_collective_tensor_types()


_LAZY = _lazy_tensor_types()


def is_wrapper(t: Any) -> bool:
    """Whether ``t`` is a tensor subclass holding its data in inner tensors (DTensor): its ``data_ptr()`` is 0."""
    return (type(t) not in _PLAIN and isinstance(t, torch.Tensor) and not isinstance(t, _LAZY)
            and hasattr(t, "__tensor_flatten__") and hasattr(type(t), "__tensor_unflatten__"))


def local_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data: ``[t]``, or a wrapper's inner tensors (a DTensor's local tensor)."""
    if not is_wrapper(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    out: list[torch.Tensor] = []
    for name in names:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):  # DTensor also names its (non-tensor) mesh
            out += local_tensors(inner)
    return out


def addresses(t: torch.Tensor) -> tuple[int, ...]:
    """Where ``t``'s data is: the address of each of its local tensors (a DTensor's: its local tensor's)."""
    if type(t) in _PLAIN:  # checked for every watched tensor before every replay
        return (t.data_ptr(),)
    return tuple(x.data_ptr() for x in local_tensors(t))


def _rebuild(t: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``t`` with ``make(local)`` in place of each local tensor: same subclass, mesh and placements."""
    if not is_wrapper(t):
        return make(t)
    names, ctx = t.__tensor_flatten__()
    inner = {}
    for name in names:
        value = getattr(t, name)
        inner[name] = _rebuild(value, make) if isinstance(value, torch.Tensor) else value
    return type(t).__tensor_unflatten__(inner, ctx, t.size(), t.stride())


def clone_keeping_layout(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t``; a DTensor keeps its placements (its own ``clone()`` turns Partial into Replicate)."""
    if not is_wrapper(t):
        return t.detach().clone()
    with torch.no_grad():
        return _rebuild(t.detach(), torch.clone)


def empty_keeping_layout(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor like ``t``; a DTensor: one of the same mesh and placements."""
    if not is_wrapper(t):
        return torch.empty_like(t)
    with torch.no_grad():
        return _rebuild(t.detach(), torch.empty_like)


def layout(t: torch.Tensor) -> Any:
    """What a wrapper's contract checks besides its global shape and dtype (None for a plain tensor): its
    subclass, a DTensor's mesh and placements, and its local tensors' shapes and dtypes."""
    if not is_wrapper(t):
        return None
    return (type(t), getattr(t, "device_mesh", None), tuple(getattr(t, "placements", ())),
            tuple((tuple(x.shape), x.dtype) for x in local_tensors(t)))


def describe_layout(t: Any) -> str:
    if not isinstance(t, torch.Tensor) or not is_wrapper(t):
        return _describe(t)
    placements = getattr(t, "placements", None)
    where = f" placements={tuple(placements)} on {t.device_mesh}" if placements is not None else ""
    local = ", ".join(str(tuple(x.shape)) for x in local_tensors(t))
    return f"{type(t).__name__}(shape={tuple(t.shape)},{where}, local shape {local})"


def same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b`` is ``a``, or holds exactly ``a``'s memory (through the local tensors of a wrapper)."""
    if a is b:
        return True
    if not is_wrapper(a):
        return _same_memory(a, b)
    return all(_same_memory(x, y) for x, y in zip(local_tensors(a), local_tensors(b)))


def copy_data(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` unless it is already there; a wrapper through its local tensors (of one layout)."""
    if not is_wrapper(dst):
        if not _same_memory(dst, src):
            dst.copy_(src, non_blocking=True)
        return
    for x, y in zip(local_tensors(dst), local_tensors(src)):
        if not _same_memory(x, y):
            x.copy_(y, non_blocking=True)


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
        for path, value in zip(self.paths, (v for _, v in leaves)):
            if isinstance(value, torch.Tensor) and is_wrapper(value):
                if device is not None and value.device != device:
                    raise ContractError(f"{self.name}: argument {path} is a {type(value).__name__} on "
                                        f"{value.device}; the graph's inputs live on {device}: pass it there")
                # its own local tensors, with the argument's mesh and placements
                self.leaves.append(clone_keeping_layout(value))
            elif isinstance(value, torch.Tensor):
                target = device if device is not None else value.device
                # detach(): the buffer must be a leaf of its own, not a copy that autograd links
                # back to the example (a node made outside the capture, on another stream).
                self.leaves.append(torch.empty_like(value, device=target).copy_(value.detach()))
            else:
                self.leaves.append(value)
        self.flat_key = _flat_call_key(example, [v for _, v in leaves])
        self.refresh()

    def refresh(self) -> None:
        """After ``leaves`` changed (a buffer replaced by another graph's output): the tree and the layouts."""
        self.tree = tree_unflatten(self.leaves, self.spec)
        # per leaf: a wrapper's layout (checked on every call), None for plain tensors and other values
        self.layouts = [layout(t) if isinstance(t, torch.Tensor) else None for t in self.leaves]

    def call_leaves(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """The leaves of a call ``(args, kwargs)``, its structure checked against the captured call's.

        The replay path of a graphed module: a call whose arguments are all leaves, as the captured one's
        were, is its arguments in order, with no pytree walk and no spec comparison."""
        if self.flat_key is not None and _flat_key(args, kwargs) == self.flat_key:
            return [*args, *kwargs.values()]
        leaves, spec = tree_flatten((args, kwargs))
        self._check_structure((args, kwargs), spec)
        return leaves

    def _check_structure(self, value: Any, spec: Any) -> None:
        if spec != self.spec:
            captured = _call_shape(tree_unflatten(self.leaves, self.spec)) if self.call else str(self.spec)
            now = _call_shape(value) if self.call else str(spec)
            raise ContractError(
                f"{self.name}: the call's arguments have another structure than the captured call's "
                f"(pass the same arguments, by the same names, every call).\n  captured: {captured}\n  now:      {now}"
            )

    def check_leaves(self, leaves: list[Any]) -> list[Any]:
        """``leaves`` (of a call of the captured structure), after checking them against the contract."""
        out = []
        for path, new, old, captured in zip(self.paths, leaves, self.leaves, self.layouts):
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
                if (captured is not None or type(new) is not torch.Tensor) and layout(new) != captured:
                    raise ContractError(
                        f"{self.name}: argument {path} has another layout than at capture: captured "
                        f"{describe_layout(old)}, now {describe_layout(new)}. The graph was captured for that "
                        "layout (its collectives too): pass the same (e.g. x.redistribute(mesh, placements)), "
                        "or capture again."
                    )
                if self.device is None and new.device != old.device:
                    raise ContractError(
                        f"{self.name}: argument {path} is on {new.device}, the captured call had it on {old.device}"
                    )
            elif not same_value(new, old):
                raise ContractError(
                    f"{self.name}: non-tensor argument {path} differs from the captured call: "
                    f"captured {old!r}, now {new!r} (non-tensor values are baked into the graph)"
                )
            out.append(new)
        return out

    def copy_in(self, value: Any) -> None:
        """Check ``value`` and copy its tensors into the static buffers."""
        leaves, spec = tree_flatten(value)
        self._check_structure(value, spec)
        self.copy_in_leaves(leaves)

    def copy_in_leaves(self, leaves: list[Any]) -> None:
        """Check the leaves of a call of the captured structure and copy its tensors into the static buffers."""
        for dst, src, wrapped in zip(self.leaves, self.check_leaves(leaves), self.layouts):
            if wrapped is not None:
                copy_data(dst, src)  # through the local tensors: a DTensor's data_ptr() is 0
            elif isinstance(dst, torch.Tensor) and not _same_memory(dst, src):
                dst.copy_(src, non_blocking=True)


_SCALAR_LEAVES = (type(None), bool, int, float, str)


def _flat_key(args: Any, kwargs: Any) -> tuple[int, tuple[str, ...]] | None:
    """(positional count, keyword names) of a call whose arguments are all leaves; None for any other call."""
    if type(args) is not tuple or type(kwargs) is not dict:
        return None
    for v in args:
        if not (isinstance(v, torch.Tensor) or type(v) in _SCALAR_LEAVES):
            return None
    for v in kwargs.values():
        if not (isinstance(v, torch.Tensor) or type(v) in _SCALAR_LEAVES):
            return None
    return len(args), tuple(kwargs)


def _flat_call_key(example: Any, leaves: list[Any]) -> tuple[int, tuple[str, ...]] | None:
    """The flat key of an example call ``(args, kwargs)`` whose pytree leaves are its arguments, in order."""
    if type(example) is not tuple or len(example) != 2:
        return None
    key = _flat_key(*example)
    flat = [*example[0], *example[1].values()] if key is not None else []
    if key is None or len(flat) != len(leaves) or any(a is not b for a, b in zip(flat, leaves)):
        return None
    return key


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


def same_value(a: Any, b: Any) -> bool:
    """Whether a non-tensor argument equals the captured one (same type, equal; else the very object)."""
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # an object without a usable __eq__ must be the same object
        return a is b
