"""Persistent state must exist before a capture: the check behind ``warmup_steps >= 1``.

A graph replays what it captured. If optimizer state (SGD's momentum buffer,
AdamW's ``exp_avg`` and step) or a parameter or buffer is *created* inside the
capture, its creation is part of the graph and runs again on every replay:
momentum is reset to the current gradient, Adam's moments to zero, a lazy
parameter is re-initialised -- losses silently drift from eager's.

:class:`PersistentState` snapshots, before the capture, every tensor of

* the optimizers' state (``opt.state[p][key]``) -- optimizers passed in, and
  every ``torch.optim.Optimizer`` the step function refers to (closure cells,
  globals it names, a bound method's object and that object's attributes,
  ``functools.partial`` arguments, one level into lists, tuples and dicts);
* the parameters and buffers of the modules passed in;

and, after the capture, names every one that is new or was replaced.
The failed capture's state is then put back by GraphedStep (backup.py's
:class:`StepSnapshot`), so an eager fallback creates it again as eager code would.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from .static_io import local_tensors

# (tensor id, storage addresses): a tensor replaced, or its storage replaced, counts as new
_Key = tuple[int, tuple[int, ...]]


def _storage_key(t: torch.Tensor) -> _Key:
    """A DTensor's storage is its local tensor's (its own has no data pointer)."""
    try:
        return id(t), tuple(local.untyped_storage().data_ptr() for local in local_tensors(t))
    except Exception:
        return id(t), ()


def _expand(value: Any) -> Iterator[Any]:
    yield value
    if isinstance(value, (list, tuple)):
        yield from value
    elif isinstance(value, dict):
        yield from value.values()


def referenced_objects(fn: Callable[..., Any]) -> Iterator[Any]:
    """Objects ``fn`` refers to directly: closure cells, named globals, bound self (and its attributes)."""
    if isinstance(fn, functools.partial):
        yield from fn.args
        yield from fn.keywords.values()
        fn = fn.func
    owner = getattr(fn, "__self__", None)
    if owner is not None and not inspect.ismodule(owner):
        yield owner
        yield from getattr(owner, "__dict__", {}).values()
    func = getattr(fn, "__func__", fn)
    for cell in getattr(func, "__closure__", None) or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue
    code = getattr(func, "__code__", None)
    namespace = getattr(func, "__globals__", {})
    for name in getattr(code, "co_names", ()):
        if name in namespace:
            yield namespace[name]


def _find(fn: Callable[..., Any], kind: type) -> list[Any]:
    found: dict[int, Any] = {}
    for obj in referenced_objects(fn):
        for value in _expand(obj):
            if isinstance(value, kind):
                found.setdefault(id(value), value)
    return list(found.values())


def find_optimizers(fn: Callable[..., Any]) -> list[torch.optim.Optimizer]:
    return _find(fn, torch.optim.Optimizer)


def find_modules(fn: Callable[..., Any]) -> list[nn.Module]:
    return _find(fn, nn.Module)


class PersistentState:
    """Optimizer state and module tensors that a capture must not create (see module docstring)."""

    def __init__(self, fn: Callable[..., Any], modules: Sequence[nn.Module] = (),
                 optimizers: Iterable[torch.optim.Optimizer] = ()) -> None:
        self.fn = fn
        self.modules = list(modules)
        self.optimizers = list(optimizers)
        self._optimizers: list[torch.optim.Optimizer] = []
        self._before: dict[str, _Key] = {}

    def all_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers passed in, then those the step function refers to."""
        seen = {id(o) for o in self.optimizers}
        return self.optimizers + [o for o in find_optimizers(self.fn) if id(o) not in seen]

    def all_modules(self) -> list[nn.Module]:
        """The modules passed in, then those the step function refers to."""
        seen = {id(m) for m in self.modules}
        return self.modules + [m for m in find_modules(self.fn) if id(m) not in seen]

    def _tensors(self, optimizers: list[torch.optim.Optimizer]) -> Iterator[tuple[str, torch.Tensor]]:
        for opt in optimizers:
            names = {id(p): f"param {j}" for j, p in enumerate(p for g in opt.param_groups for p in g["params"])}
            for p, state in opt.state.items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        yield f"{type(opt).__name__}.state[{names.get(id(p), '?')}][{key!r}]", value
        for i, m in enumerate(self.modules):
            prefix = f"modules[{i}]." if len(self.modules) > 1 else ""
            for name, t in [*m.named_parameters(), *m.named_buffers()]:
                yield f"{prefix}{name}", t

    def snapshot(self) -> None:
        """Before the capture."""
        self._optimizers = self.all_optimizers()
        self._before = {name: _storage_key(t) for name, t in self._tensors(self._optimizers)}

    def created(self) -> list[str]:
        """After the capture: the persistent tensors the capture allocated or replaced."""
        return [name for name, t in self._tensors(self._optimizers) if self._before.get(name) != _storage_key(t)]
