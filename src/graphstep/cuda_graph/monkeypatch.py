"""Replacing attributes of other libraries' objects for a while, and putting them back exactly.

The replay backend (replay.py) wraps host-side torch functions while a
capture records, and the doctor (doctor/patches.py) wraps others while it
analyses a step. Both go through :class:`Patches`:

* :meth:`Patches.wrap` replaces ``owner.name`` by ``make(old)``, and does
  nothing when ``owner`` has no such attribute (a function this build of
  torch lacks, e.g. ``torch.cuda.*`` seeding without CUDA);
* :meth:`Patches.restore` (or leaving the ``with`` block, also on errors)
  puts every attribute back in reverse order, exactly: the owner's own value
  (the raw class-dict entry, so a staticmethod stays one) where it had one,
  and no own attribute where the value was inherited (``torch.Tensor.tolist``
  lives on ``torch._C.TensorBase``: the patch on ``torch.Tensor`` is deleted,
  not replaced by a copy).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

_ABSENT = object()


class Patches:
    """Attributes replaced on their owners, each put back exactly by :meth:`restore` (see the module docstring)."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any]] = []  # (owner, name, its own value before or _ABSENT)

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Any], *, keep_metadata: bool = False) -> bool:
        """Replace ``owner.name`` by ``make(old)``; False (nothing replaced) when ``owner`` has no ``name``.

        ``keep_metadata``: the replacement takes the original's name, docstring and ``__wrapped__``
        (``functools.wraps``), so code that inspects it sees the original.
        """
        old = getattr(owner, name, None)
        if old is None:
            return False
        new = make(old)
        self.set(owner, name, functools.wraps(old)(new) if keep_metadata else new)
        return True

    def set(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name`` to ``value`` until :meth:`restore`."""
        self.saved.append((owner, name, vars(owner).get(name, _ABSENT)))
        setattr(owner, name, value)

    def restore(self) -> None:
        """Put every replaced attribute back, last replaced first."""
        while self.saved:
            owner, name, own = self.saved.pop()
            if own is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, own)

    def __enter__(self) -> "Patches":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()
