"""What an aten op is, read from its schema and tags: one classification for the replay backend and the doctor.

* :func:`schema_kind` -- how the replay backend re-runs an op: a view, an
  allocation, an in-place metadata change, a mutating op (with or without a
  new result), a functional op, or host-only annotation;
* :func:`host_sync_reason` -- whether an op reads device data on the host (a
  sync) or has a data-dependent shape: what breaks a CUDA capture, named
  the same way by the replay backend's errors and the doctor's findings;
* :func:`returns_alias`, :func:`fresh_returns`, :func:`is_collective`,
  :func:`generator_args`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .torch_compat import FUNCTIONAL_COLLECTIVES, OpOverload, op_schema, tree_leaves

aten = torch.ops.aten

ALLOC_OPS = {
    aten.empty,
    aten.empty_strided,
    aten.new_empty,
    aten.new_empty_strided,
    aten.empty_like,
    aten.empty_permuted,
}
# Ops whose scalar result is metadata, not device data.
METADATA_OPS = {
    aten.sym_size,
    aten.sym_stride,
    aten.sym_numel,
    aten.sym_storage_offset,
    aten.size,
    aten.stride,
    aten.dim,
    aten.numel,
    aten.is_same_size,
    aten.is_coalesced,
    aten._nnz,
}
SCALAR_RETURNS = {"bool", "int", "float", "Scalar", "SymInt", "SymFloat", "SymBool", "complex"}
# Namespaces whose ops only annotate the host timeline: a graph replays no profiler range.
HOST_ONLY_NAMESPACES = {"profiler"}
# Functional collectives that hand back the tensor they are given.
FUNCOL_IDENTITIES = {"wait_tensor", "_wrap_tensor_autograd"}


@functools.lru_cache(maxsize=None)
def schema_kind(func: OpOverload) -> str:
    """'view', 'alloc', 'inplace_view', 'mutating', 'mutating_fresh' (writes an argument and returns
    a new tensor), 'functional' or 'host_only'."""
    packet = func.overloadpacket
    if packet in ALLOC_OPS:
        return "alloc"
    if func.namespace in HOST_ONLY_NAMESPACES:
        return "host_only"
    if is_collective(func):
        return "mutating"
    if func.namespace == FUNCTIONAL_COLLECTIVES and op_schema(func).name.split("::")[-1] in FUNCOL_IDENTITIES:
        # wait_tensor/_wrap_tensor_autograd hand back the tensor they are given: replay waits on the
        # collective it re-runs instead (see is_functional_collective).
        return "view"
    if torch.Tag.inplace_view in func.tags:
        return "inplace_view"
    schema = op_schema(func)
    returns = schema.returns
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "mutating_fresh" if fresh_returns(func) else "mutating"
    if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        return "view"
    return "functional"


@functools.lru_cache(maxsize=None)
def fresh_returns(func: OpOverload) -> tuple[int, ...]:
    """Positions of the schema's returns that are new tensors (not aliases of an argument)."""
    return tuple(i for i, r in enumerate(op_schema(func).returns)
                 if r.alias_info is None and ("Tensor" in str(r.type)))


def returned_tensors(func: OpOverload, out: Any, positions: tuple[int, ...]) -> list[torch.Tensor]:
    values = out if len(op_schema(func).returns) > 1 else (out,)
    return [t for i in positions for t in tree_leaves(values[i]) if isinstance(t, torch.Tensor)]


def tensor_arguments(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments. A schema's argument is a tensor, an optional tensor or a list
    of (optional) tensors, so one level of lists is walked; anything deeper goes through ``tree_leaves``."""
    found = []
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, torch.Tensor):
            found.append(arg)
        elif isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, torch.Tensor):
                    found.append(item)
                elif isinstance(item, (list, tuple, dict)):
                    found.extend(t for t in tree_leaves(item) if isinstance(t, torch.Tensor))
        elif isinstance(arg, dict):
            found.extend(t for t in tree_leaves(arg) if isinstance(t, torch.Tensor))
    return found


def returned_tensors_of(func: OpOverload, positions: tuple[int, ...]) -> Callable[[Any], list[torch.Tensor]]:
    """``returned_tensors(func, out, positions)`` as a function of ``out``, made once per recorded op: where every
    return at ``positions`` is a plain ``Tensor`` (most ops), without walking the result as a tree on each replay."""
    plain, several = _plain_tensor_returns(func, positions)
    if not plain:
        return lambda out: returned_tensors(func, out, positions)
    if several:
        return lambda out: [out[i] for i in positions]
    return (lambda out: [out]) if positions else (lambda out: [])


@functools.lru_cache(maxsize=None)
def _plain_tensor_returns(func: OpOverload, positions: tuple[int, ...]) -> tuple[bool, bool]:
    """(every return at ``positions`` is a plain ``Tensor``, the op returns several values): read off the schema
    once per op, not once per recorded call."""
    returns = op_schema(func).returns
    return all(str(returns[i].type) == "Tensor" for i in positions), len(returns) > 1


def _has_bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _is_masked_fill(args: tuple, kwargs: dict) -> bool:
    """``t[mask] = scalar``: one boolean mask on ``t``'s device and a one-element CPU value, which
    ``index_put_`` turns into ``masked_fill_`` (no nonzero, no sync; ATen's can_dispatch_to_masked_fill)."""
    self, indices = args[0], args[1] if len(args) > 1 else kwargs.get("indices")
    values = args[2] if len(args) > 2 else kwargs.get("values")
    masks = [i for i in indices or () if i is not None]
    return (isinstance(values, torch.Tensor) and values.numel() == 1 and values.device.type == "cpu"
            and len(masks) == 1 and masks[0].device == self.device and not kwargs.get("accumulate", False)
            and not (len(args) > 3 and args[3]))


_INDEX_OPS = (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_)
_DEPENDS_ON_ARGS = "depends on the arguments"


def host_sync_reason(func: OpOverload, args: tuple, kwargs: dict) -> tuple[str, str] | None:
    """(category, reason) when ``func`` would read device data on the host during capture."""
    reason = _sync_reason_of(func)
    if reason != _DEPENDS_ON_ARGS:
        return reason
    packet = func.overloadpacket
    if packet is aten.repeat_interleave:
        if kwargs.get("output_size") is None:
            return "dynamic_shape", "repeat_interleave without output_size has a data-dependent shape"
        return None
    indices = args[1] if len(args) > 1 else kwargs.get("indices")
    if _has_bool_index(indices) and not (packet is not aten.index and _is_masked_fill(args, kwargs)):
        return "dynamic_shape", "boolean-mask indexing has a data-dependent shape (it calls nonzero)"
    return None


@functools.lru_cache(maxsize=None)
def _sync_reason_of(func: OpOverload) -> tuple[str, str] | str | None:
    """What ``host_sync_reason`` can tell from the op alone (its schema and tags), read once per op; for
    indexing and ``repeat_interleave``, whose answer depends on their arguments, ``_DEPENDS_ON_ARGS``."""
    packet = func.overloadpacket
    if packet in METADATA_OPS:
        return None
    if packet is aten._local_scalar_dense or torch.Tag.data_dependent_output in func.tags:
        return "host_sync", "reads a device value on the host (a sync; not allowed while capturing)"
    if any(str(r.type) in SCALAR_RETURNS for r in op_schema(func).returns):
        return "host_sync", "returns a Python value computed from device data (a sync)"
    if packet in _INDEX_OPS or packet is aten.repeat_interleave:
        return _DEPENDS_ON_ARGS
    if torch.Tag.dynamic_output_shape in func.tags:
        return "dynamic_shape", "its output shape depends on the data (the host must read it)"
    return None


def is_functional_collective(func: OpOverload) -> bool:
    """A functional collective (``_c10d_functional``, what DTensor redistributes with): its result
    is pending until ``wait_tensor``, so a replay waits on it before reading it."""
    return func.namespace == FUNCTIONAL_COLLECTIVES and op_schema(func).name.split("::")[-1] not in FUNCOL_IDENTITIES


def is_collective(func: OpOverload) -> bool:
    # c10d's ops -- in-place collectives (allreduce_, broadcast_, allgather_, reduce_scatter_, ...),
    # point-to-point send and recv_, barrier -- return a Work that must be waited; the in-place ones
    # write into their first argument although their schemas carry no (a!) annotation: treat them
    # all as mutating ops on their arguments.
    return func.namespace == "c10d" and any("Work" in str(r.type) for r in op_schema(func).returns)


@functools.lru_cache(maxsize=None)
def generator_args(func: OpOverload) -> tuple[tuple[int, str, bool], ...]:
    return tuple((i, a.name, a.kwarg_only) for i, a in enumerate(op_schema(func).arguments)
                 if "Generator" in str(a.type))




@functools.lru_cache(maxsize=None)
def returns_alias(func: OpOverload) -> bool:
    """Whether any of the op's results aliases an argument (a view or an ``out=``/in-place result)."""
    return any(r.alias_info is not None for r in op_schema(func).returns)
