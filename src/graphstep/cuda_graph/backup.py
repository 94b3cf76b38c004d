"""Put tensors and RNG streams back as they were: one helper for every "leave no trace" guard.

A capture (or a doctor's re-run of a step) may execute work that must not
count: the CPU replay backend runs the region while recording it, a per-layer
warm-up on the capture stream runs each module once, the doctor runs the step
to watch it. :class:`StateBackup` saves what that work could change and
``restore()`` writes it back:

* ``save_storages(tensors)`` -- the whole storage behind each tensor, once per
  storage, before its first write. For writes whose extent is unknown (an op
  that writes an argument its schema calls read-only, BatchNorm's running
  stats); storages listed in ``skip`` (made by the guarded work itself) are
  left alone.
* ``save_tensors(tensors)`` -- only the elements each tensor views. For
  declared state (module buffers, ``main_grad`` views of one flat gradient
  buffer): the copy is the size of the view, not of the flat buffer.
* ``save_generators(generators)`` -- each generator's state.

``restore()`` copies everything back (storages, then tensors, then
generators), outside autograd, and forgets it; a second call does nothing
(``restore(keep=True)`` keeps the copies for another restore).

:class:`StepSnapshot` is the host-side state of a whole step that a failed
capture may leave changed (GraphedStep takes it before every capture and
restores it when the capture fails): optimizer state and settings, parameter
gradients, generators, FSDP2's state machine.
"""

from __future__ import annotations

from typing import Any, Container, Iterable, Sequence

import torch
from torch import nn

from .fsdp import FsdpSnapshot


def storage_key(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (0 for a tensor without one: meta, sparse, some subclasses)."""
    try:
        return t.untyped_storage().data_ptr()
    except Exception:
        return 0


class StateBackup:
    """Copies taken before a guarded piece of work, written back by ``restore()`` (see module docstring)."""

    def __init__(self) -> None:
        self._storages: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        self._tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._tensor_ids: set[int] = set()
        self._generators: list[tuple[torch.Generator, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self._storages) + len(self._tensors) + len(self._generators)

    def save_storages(self, tensors: Iterable[Any], skip: Container[int] = ()) -> None:
        """Copy each tensor's whole storage, unless already saved or its address is in ``skip``.

        A wrapper subclass (DTensor) has no storage of its own: the storages of the tensors it wraps are
        saved (a dispatch mode that sees DTensor's ops does not see the writes to its local tensor).
        """
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            flatten = getattr(t, "__tensor_flatten__", None)
            if flatten is not None:
                self.save_storages([getattr(t, name) for name in flatten()[0]], skip)
                continue
            key = storage_key(t)
            if key == 0 or key in skip or key in self._storages:
                continue
            storage = t.untyped_storage()
            self._storages[key] = (storage, storage.clone())

    def save_tensors(self, tensors: Iterable[Any]) -> None:
        """Copy the elements each tensor views (each tensor object once; non-tensors are ignored)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and id(t) not in self._tensor_ids:
                self._tensor_ids.add(id(t))
                self._tensors.append((t, t.detach().clone()))

    def save_generators(self, generators: Iterable[torch.Generator]) -> None:
        for gen in generators:
            self._generators.append((gen, gen.get_state()))

    def restore(self, *, keep: bool = False) -> None:
        """Write every saved copy back and forget them (unless ``keep``)."""
        with torch.no_grad():
            for storage, saved in self._storages.values():
                if storage.nbytes() != saved.nbytes():  # freed or regrown since saved (FSDP2's resharding)
                    storage.resize_(saved.nbytes())
                storage.copy_(saved)
            for t, saved in self._tensors:
                t.copy_(saved)
        for gen, state in reversed(self._generators):  # a generator saved twice gets its first state
            gen.set_state(state)
        if not keep:
            self.clear()

    def clear(self) -> None:
        """Forget the copies without writing them back."""
        self._storages.clear()
        self._tensors.clear()
        self._tensor_ids.clear()
        self._generators.clear()


class StepSnapshot:
    """What a failed capture of a step may leave changed on the host, put back by :meth:`restore`.

    A CUDA capture executes no device work, but the step's Python code runs in full until the
    error, and so does its CPU work: FSDP2 moves through its forward and backward states and sets
    gradients, ``zero_grad()`` sets them to None, a CPU step counter is incremented, generators
    advance. The replay backend restores the tensors it recorded writes to and the generators, but
    not that Python state either. Taken right before a capture, restored after a failed one (and again
    after an ``on_capture_error`` hook that re-ran the step):

    * each optimizer's ``param_groups`` (every setting, e.g. a learning rate a scheduler set) and
      ``state`` (the per-parameter dicts as they were, state the capture created removed), and the
      values of its tensors that live on another kind of device than the graph's (a CPU step counter:
      CPU work runs during a CUDA capture);
    * every parameter's ``.grad`` -- the same tensor object, or None -- of those optimizers and of
      ``modules``;
    * the generators' states;
    * FSDP2's state of every ``fully_shard`` module inside ``modules`` (fsdp.py's :class:`FsdpSnapshot`).

    Other host-side effects of the step (a Python counter, a CPU tensor outside the optimizers' state
    on a CUDA capture) are not known here: keep them out of the captured step.
    """

    def __init__(self, *, optimizers: Sequence[torch.optim.Optimizer], modules: Sequence[nn.Module],
                 generators: Iterable[torch.Generator], device: torch.device) -> None:
        self.tensors = StateBackup()
        self.tensors.save_generators(generators)
        self.groups = [(group, dict(group)) for opt in optimizers for group in opt.param_groups]
        self.states = [(opt, {p: (s, dict(s)) for p, s in opt.state.items()}) for opt in optimizers]
        host = [v for opt in optimizers for s in opt.state.values() for v in s.values()]
        host += [v for opt in optimizers for group in opt.param_groups for v in group.values()]
        self.tensors.save_tensors(t for t in host if isinstance(t, torch.Tensor) and t.device.type != device.type)
        self.fsdp = FsdpSnapshot(modules)
        params = {id(p): p for opt in optimizers for group in opt.param_groups for p in group["params"]}
        params.update((id(p), p) for m in modules for p in m.parameters())
        self.grads = [(p, p.grad) for p in params.values()]

    def restore(self) -> None:
        """Put everything back; can be called again."""
        self.fsdp.restore()  # first: resharding registers the sharded parameters whose grads come next
        for p, grad in self.grads:
            if p.grad is not grad:
                p.grad = grad
        for group, saved in self.groups:
            group.clear()
            group.update(saved)
        for opt, saved in self.states:
            for p in [p for p in opt.state if p not in saved]:
                del opt.state[p]
            for p, (state, contents) in saved.items():
                state.clear()
                state.update(contents)
                opt.state[p] = state
        self.tensors.restore(keep=True)
