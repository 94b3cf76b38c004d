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
generators), outside autograd, and forgets it; a second call does nothing.
"""

from __future__ import annotations

from typing import Any, Container, Iterable

import torch


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
        """Copy each tensor's whole storage, unless already saved or its address is in ``skip``."""
        for t in tensors:
            if not isinstance(t, torch.Tensor):
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

    def restore(self) -> None:
        """Write every saved copy back and forget them."""
        with torch.no_grad():
            for storage, saved in self._storages.values():
                if storage.nbytes() != saved.nbytes():  # freed or regrown since saved (FSDP2's resharding)
                    storage.resize_(saved.nbytes())
                storage.copy_(saved)
            for t, saved in self._tensors:
                t.copy_(saved)
        for gen, state in reversed(self._generators):  # a generator saved twice gets its first state
            gen.set_state(state)
        self.clear()

    def clear(self) -> None:
        """Forget the copies without writing them back."""
        self._storages.clear()
        self._tensors.clear()
        self._tensor_ids.clear()
        self._generators.clear()
