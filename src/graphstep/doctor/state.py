"""Python-side state a step changes: what a graph replay will not update.

A replay re-runs device work only. A counter incremented in the step, a list
appended to, a learning rate set on a param group: eager steps change them,
replays leave them at their captured values.

:func:`snapshot` walks what the step can reach -- its arguments (and their
attributes, submodules, optimizer param groups), the globals its code names
and the cells of its closures, recursively into helper functions defined in
user files -- and records every simple value (numbers, strings, booleans,
None) and the length of every list, dict and set, by path
(``stats.calls``, ``len(history)``, ``optimizer.param_groups[0]['lr']``).
Comparing the snapshots around the analysed call gives the changes.

:class:`LineTracer` finds the line of each change: during the analysed call
it re-reads the watched values (those that changed in the warm-up call) at
every line of user code (``sys.settrace``, user frames only) and names the
line that ran just before a value changed.
"""

from __future__ import annotations

import enum
import inspect
import math
import numbers
import sys
import types
from typing import Any, Callable

import torch
from torch import nn

from ..cuda_graph.torch_compat import MODULE_DICTS, module_buffers, module_parameters
from .frames import SourceLine, is_internal

_MISSING = object()
_LIMIT = 20000
_SKIP_ATTRS = MODULE_DICTS | {"__dict__", "__weakref__"}

Getter = Callable[[], Any]


def _simple(v: Any) -> bool:
    return v is None or isinstance(v, (bool, numbers.Number, str, bytes, enum.Enum, torch.dtype, torch.device))


def same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _opaque(v: Any) -> bool:
    """Values whose insides are not Python state a step keeps (tensors, code, classes, torch objects)."""
    if isinstance(v, (torch.Tensor, torch.Generator, types.ModuleType, type, types.FunctionType,
                      types.BuiltinFunctionType, types.MethodType, property, classmethod, staticmethod)):
        return True
    return callable(v) and not hasattr(v, "__dict__")


def _user_function(v: Any) -> bool:
    return isinstance(v, types.FunctionType) and not is_internal(v.__code__.co_filename)


class _Walker:
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.getters: dict[str, Getter] = {}
        self.seen: set[int] = set()
        self.funcs: set[int] = set()
        self.level = 1  # how many functions deep the walk is (roots count as 1)

    def put(self, path: str, get: Getter) -> None:
        if len(self.values) < _LIMIT:
            self.getters[path] = get
            self.values[path] = _read(get)

    def walk(self, obj: Any, path: str, get: Getter, depth: int) -> None:
        if len(self.values) >= _LIMIT:
            return
        if _simple(obj):
            self.put(path, get)
            return
        if _user_function(obj):
            self.function(obj, self.level + 1)
            return
        if _opaque(obj) or id(obj) in self.seen or depth <= 0:
            return
        self.seen.add(id(obj))
        if isinstance(obj, nn.Module):
            self.module(obj, path)
        elif isinstance(obj, (list, tuple)):
            if isinstance(obj, list):
                self.put(f"len({path})", lambda o=obj: len(o))
            for i, v in enumerate(obj[:16]):
                self.walk(v, f"{path}[{i}]", lambda o=obj, i=i: o[i] if i < len(o) else _MISSING, depth - 1)
        elif isinstance(obj, (set, frozenset)):
            self.put(f"len({path})", lambda o=obj: len(o))
        elif isinstance(obj, dict):
            self.put(f"len({path})", lambda o=obj: len(o))
            for k, v in list(obj.items())[:64]:
                if isinstance(k, (str, int)):
                    self.walk(v, f"{path}[{k!r}]", lambda o=obj, k=k: o.get(k, _MISSING), depth - 1)
        elif hasattr(obj, "__dict__") and isinstance(vars(obj), dict):
            self.attrs(obj, path, depth)

    def attrs(self, obj: Any, path: str, depth: int) -> None:
        for k, v in list(vars(obj).items()):
            if k.startswith("__") or k in _SKIP_ATTRS:
                continue
            self.walk(v, f"{path}.{k}", lambda o=obj, k=k: getattr(o, k, _MISSING), depth - 1)

    def module(self, mod: nn.Module, path: str) -> None:
        for name, m in mod.named_modules():
            here = f"{path}.{name}" if name else path
            self.seen.add(id(m))
            self.put(f"len({here}._parameters)", lambda m=m: len(module_parameters(m)))
            self.put(f"len({here}._buffers)", lambda m=m: len(module_buffers(m)))
            self.attrs(m, here, 3)

    def function(self, fn: types.FunctionType, level: int = 0) -> None:
        """The globals ``fn`` names and its closure cells (helpers it references: up to 2 levels down)."""
        if id(fn) in self.funcs or level > 2:
            return
        self.funcs.add(id(fn))
        outer, self.level = self.level, level
        prefix = "" if level == 0 else f"{fn.__module__}."
        g = fn.__globals__
        for name in sorted(_code_names(fn.__code__)):
            if name in g:
                self.walk(g[name], prefix + name, lambda g=g, n=name: g.get(n, _MISSING), 4)
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            if _cell_ok(cell):
                self.walk(cell.cell_contents, prefix + name, lambda c=cell: c.cell_contents, 4)
        self.level = outer


def _read(get: Getter) -> Any:
    try:
        return get()
    except Exception:
        return _MISSING


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def step_roots(fn: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """Name -> object for what the step receives: ``self`` of a method, the callable object, its arguments."""
    roots: dict[str, Any] = {}
    if inspect.ismethod(fn):
        roots["self"] = fn.__self__
    elif not isinstance(fn, types.FunctionType) and hasattr(fn, "__dict__"):
        roots[type(fn).__name__] = fn
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {f"arg{i}": a for i, a in enumerate(args)} | dict(kwargs)
    for name, value in bound.items():
        roots[name] = value
    return roots


def _functions_of(fn: Any) -> list[types.FunctionType]:
    """The Python functions whose globals and closures the step uses."""
    out = []
    for f in (getattr(fn, "__func__", None), fn, getattr(type(fn), "__call__", None), getattr(fn, "forward", None)):
        f = getattr(f, "__func__", f)
        if isinstance(f, types.FunctionType) and f not in out:
            out.append(f)
    return out


def snapshot(roots: dict[str, Any], fn: Any = None) -> tuple[dict[str, Any], dict[str, Getter]]:
    """Simple values and container lengths reachable from ``roots`` and ``fn``'s globals and closures."""
    w = _Walker()
    for name, value in roots.items():
        w.walk(value, name, lambda v=value: v, 4)
    for f in _functions_of(fn) if fn is not None else ():
        w.function(f, 0)
    return w.values, w.getters


def changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Paths whose value differs (paths present on one side only are ignored: new objects, not changes)."""
    return {p: (before[p], after[p]) for p in before.keys() & after.keys() if not same(before[p], after[p])}


def show(v: Any) -> str:
    return "(missing)" if v is _MISSING else repr(v)


class LineTracer:
    """Names the user line after which each watched value changed (see module docstring)."""

    def __init__(self, watch: dict[str, Getter]) -> None:
        self.watch = watch
        self.last = {p: _read(g) for p, g in watch.items()}
        self.where: dict[str, SourceLine] = {}
        self.loc: tuple[types.CodeType, int] | None = None
        self._old: Any = None

    def __enter__(self) -> "LineTracer":
        if self.watch:
            self._old = sys.gettrace()
            sys.settrace(self._global)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.watch:
            sys.settrace(self._old)

    def _global(self, frame: types.FrameType, event: str, arg: Any):
        if event == "call" and not is_internal(frame.f_code.co_filename):
            return self._local
        return None

    def _local(self, frame: types.FrameType, event: str, arg: Any):
        self._check()
        if event == "line":
            self.loc = (frame.f_code, frame.f_lineno)
        elif event == "return":
            back = frame.f_back
            inside = back is not None and not is_internal(back.f_code.co_filename)
            self.loc = (back.f_code, back.f_lineno) if inside else self.loc
        return self._local

    def _check(self) -> None:
        for p, get in self.watch.items():
            v = _read(get)
            if not same(v, self.last[p]):
                if p not in self.where and self.loc is not None:
                    import linecache

                    code, n = self.loc
                    self.where[p] = SourceLine(code.co_filename, n, code.co_name, linecache.getline(code.co_filename, n))
                self.last[p] = v


def tensor_name(roots: dict[str, Any], fn: Any, target: torch.Tensor) -> str | None:
    """A name for ``target`` (or a tensor sharing its storage) among the roots and the step's globals."""
    try:
        ptr = target.untyped_storage().data_ptr()
    except Exception:
        return None
    candidates = dict(roots)
    for f in _functions_of(fn) if fn is not None else ():
        g = f.__globals__
        candidates |= {n: g[n] for n in _code_names(f.__code__) if n in g}
        candidates |= {n: c.cell_contents for n, c in zip(f.__code__.co_freevars, f.__closure__ or ())
                       if _cell_ok(c)}
    seen: set[int] = set()

    def find(obj: Any, path: str, depth: int) -> str | None:
        if isinstance(obj, torch.Tensor):
            try:
                return path if obj.untyped_storage().data_ptr() == ptr else None
            except Exception:
                return None
        if depth <= 0 or id(obj) in seen or _simple(obj) or _opaque(obj):
            return None
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(obj[:64])]
        elif isinstance(obj, dict):
            items = [(f"{path}[{k!r}]", v) for k, v in list(obj.items())[:64]]
        elif hasattr(obj, "__dict__") and not isinstance(obj, nn.Module):
            items = [(f"{path}.{k}", v) for k, v in vars(obj).items()]
        else:
            return None
        for p, v in items:
            hit = find(v, p, depth - 1)
            if hit:
                return hit
        return None

    for name, value in candidates.items():
        hit = find(value, name, 3)
        if hit:
            return hit
    return None


def _cell_ok(cell: Any) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False
