"""Per-layer graphs over FSDP2 modules: the gathered parameters stay where the graphs read them.

FSDP2 (``fully_shard``) all-gathers a module's parameters into storage it
allocates before the module runs and frees after its backward (ZeRO-2) or
its forward (ZeRO-3); the next all-gather allocates it again, wherever the
allocator finds room. A per-layer graph reads the parameters at the
addresses it was captured with, so a replay after such a move would read
freed memory (ModuleGraph refuses it: it checks the parameters' addresses
before every replay).

For every FSDP2 module that manages the parameters of a graphed module,
:func:`keep_gathered` keeps that storage allocated: FSDP2 still all-gathers
the updated shards into it before every forward, still reduce-scatters the
gradients and still switches the module between its sharded and unsharded
parameters, but the gathered copy never moves. The memory cost is the
graphed modules' gathered parameters, resident for the whole run: what
ZeRO-2 holds anyway at the end of every forward, and the whole parameter
saving of ZeRO-3 (the trainer refuses that combination, rule R27).

A graphed module must be an FSDP2 module or lie inside one: an FSDP2 module
inside a graphed module would never run its hooks on replay (no all-gather
of the updated shards), so :func:`fsdp_owners` refuses it.

:func:`gathered` unshards those modules for the capture, which runs outside
the modules' forward hooks, and reshards them after; :func:`release_gathered`
(``LayerGraphs.close()``) hands the storage back to FSDP2.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable, Iterator, Sequence

from torch import nn

from . import torch_compat as tc
from .errors import GraphUsageError

log = logging.getLogger("graphstep")

KEPT_FLAG = "graphstep_keeps_gathered"


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return None
    return FSDPModule


def _groups(module: nn.Module) -> list[Any]:
    """FSDP2's parameter groups of ``module`` (none when it manages no parameter); a torch whose FSDP2 keeps
    them differently is a TorchCompatError (torch_compat.py)."""
    return tc.fsdp_param_groups(tc.fsdp_state(module))


def _fsdp_params(module: nn.Module) -> list[Any]:
    """FSDP2's per-parameter state of ``module`` (empty when it manages no parameter)."""
    return [fp for group in _groups(module) for fp in group.fsdp_params]


def _is_unsharded(module: nn.Module) -> bool:
    return all(group.is_unsharded for group in _groups(module))


def fsdp_owners(model: nn.Module, modules: Sequence[nn.Module]) -> list[nn.Module]:
    """The FSDP2 modules of ``model`` that manage a parameter of one of ``modules``, in model order."""
    fsdp_type = _fsdp_module_type()
    if fsdp_type is None:
        return []
    units = [m for m in model.modules() if isinstance(m, fsdp_type)]
    if not units:
        return []
    wanted = {id(p) for m in modules for p in m.parameters()}
    inside = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    owners = []
    for unit in units:
        params = _fsdp_params(unit)
        if any(id(fp.sharded_param) in wanted or id(tc.unsharded_param(fp)) in wanted for fp in params):
            if id(unit) in inside:
                # A replay replaces the whole forward of the graphed module, so the hooks of an FSDP2
                # module inside it would never gather its updated shards again: stale weights.
                raise GraphUsageError(
                    f"per-layer graphs over FSDP2: a graphed module contains the FSDP2 module "
                    f"{type(unit).__name__}, whose all-gathers would not run on replay. Apply fully_shard to "
                    "the graphed module itself or to a module around it, or graph the modules inside it."
                )
            owners.append(unit)
    return owners


def keep_gathered(owners: Sequence[nn.Module]) -> None:
    """Keep the gathered parameter storage of each FSDP2 module in ``owners`` allocated (see the module docstring)."""
    for unit in owners:
        if getattr(unit, KEPT_FLAG, False):
            continue
        for fp in _fsdp_params(unit):
            tc.keep_unsharded_storage(fp)
        setattr(unit, KEPT_FLAG, True)
    if owners:
        log.info("per-layer graphs over FSDP2: the gathered parameters of %d FSDP2 modules stay allocated "
                 "(the graphs read them where they were captured)", len(owners))


def release_gathered(owners: Sequence[nn.Module]) -> None:
    """Undo :func:`keep_gathered`: the gathered storage of a module that is sharded now is freed, and FSDP2
    frees it again whenever it reshards."""
    for unit in owners:
        if not getattr(unit, KEPT_FLAG, False):
            continue
        for fp in _fsdp_params(unit):
            tc.stop_keeping_unsharded_storage(fp)
        setattr(unit, KEPT_FLAG, False)


@contextlib.contextmanager
def gathered(owners: Sequence[nn.Module]) -> Iterator[None]:
    """Unshard ``owners`` (their modules hold the gathered parameters) for a capture, then reshard those that
    were sharded before (a capture inside a module's forward leaves that module as its forward needs it)."""
    sharded = [unit for unit in owners if not _is_unsharded(unit)]
    for unit in sharded:
        unit.unshard()
    try:
        yield
    finally:
        for unit in sharded:
            unit.reshard()


def prepare_fsdp(model: nn.Module, modules: Sequence[nn.Module]) -> list[nn.Module]:
    """The FSDP2 modules managing ``modules``' parameters, their gathered storage kept (for LayerGraphs)."""
    owners = fsdp_owners(model, modules)
    keep_gathered(owners)
    return owners


# --------------------------------------------------------------------------
# a failed capture: FSDP2's state put back as it was before


_NOT_A_CONTAINER = object()


def _copy_attrs(obj: Any) -> dict[str, tuple[Any, Any]]:
    """``obj``'s attributes, each with a copy of its contents when it is a list, dict or set."""
    saved = {}
    for name, value in vars(obj).items():
        if isinstance(value, (list, dict, set)):
            saved[name] = (value, list(value) if isinstance(value, list) else value.copy())
        else:
            saved[name] = (value, _NOT_A_CONTAINER)
    return saved


def _put_attrs(obj: Any, saved: dict[str, tuple[Any, Any]]) -> None:
    """Every attribute as saved (containers refilled in place: other objects may hold them); new ones removed."""
    attrs = vars(obj)
    for name in [n for n in attrs if n not in saved]:
        del attrs[name]
    for name, (value, contents) in saved.items():
        if isinstance(value, list):
            value[:] = contents
        elif contents is not _NOT_A_CONTAINER:
            value.clear()
            value.update(contents)
        attrs[name] = value


class FsdpSnapshot:
    """FSDP2's host-side state of some modules, taken before a capture and put back when it fails.

    A failed capture leaves FSDP2's Python state machine where the capture stopped: parameter groups
    unsharded (on a GPU their all-gathers never ran: the gathered parameters hold garbage), training
    states mid-forward or mid-backward, pending all-gather and reduce-scatter states, the final backward
    callback marked as queued, an unsharded parameter's gradient. :meth:`restore` reshards every group that
    was sharded before, then puts back the attributes of every FSDP2 state of the modules, their shared
    contexts and parameter groups (whatever their names), and the unsharded parameters' gradients. No
    collective runs and nothing the capture recorded is waited on. The FSDP2 internals this reads are
    reached through torch_compat.py; on a torch where they changed, taking the snapshot is a
    TorchCompatError naming them (before, a warning and no restore).
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.objects: list[tuple[Any, dict[str, tuple[Any, Any]]]] = []
        self.groups: list[tuple[Any, Any]] = []  # (group, its _sharded_state before)
        self.params: list[tuple[Any, dict[str, Any], Any]] = []  # (FSDPParam, accumulated grad, unsharded grad)
        fsdp_type = _fsdp_module_type()
        if fsdp_type is None:
            return
        units = {id(u): u for m in modules for u in m.modules() if isinstance(u, fsdp_type)}
        self._take(units.values())

    def _take(self, units: Iterable[nn.Module]) -> None:
        seen: set[int] = set()
        for unit in units:
            state = tc.fsdp_state(unit)
            groups = tc.fsdp_param_groups(state)
            for obj in (state, *tc.fsdp_shared_contexts(state), *groups):
                if obj is not None and id(obj) not in seen:
                    seen.add(id(obj))
                    self.objects.append((obj, _copy_attrs(obj)))
            for group in groups:
                self.groups.append((group, tc.group_sharded_state(group)))
                for fp in group.fsdp_params:
                    unsharded = tc.unsharded_param(fp)
                    accumulated = tc.accumulated_grad(fp)
                    self.params.append((fp, accumulated, None if unsharded is None else unsharded.grad))

    def restore(self) -> None:
        for group, before in self.groups:
            if tc.group_sharded_state(group) != before and before.name == "SHARDED":
                tc.group_to_sharded(group)  # the module's sharded parameters registered again, the gathered freed
        now = {id(group): tc.group_sharded_state(group) for group, _ in self.groups}
        for obj, saved in self.objects:
            _put_attrs(obj, saved)
            if id(obj) in now:  # what its parameters are now (a group unsharded before may be sharded now)
                tc.set_group_sharded_state(obj, now[id(obj)])
        for fp, accumulated, grad in self.params:
            vars(fp).update(accumulated)
            unsharded = tc.unsharded_param(fp)
            if unsharded is not None and unsharded.grad is not grad:
                unsharded.grad = grad
