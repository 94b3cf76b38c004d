"""Host or device: which tensors a step would have on the GPU, and which on the host.

On a GPU (``simulated=False``) the answer is the tensor's device. The doctor
also runs a GPU step on a CPU-only machine (``simulated=True``); then every
tensor is on the CPU and the doctor keeps the distinction itself:

* device tensors: everything that exists before the analysed calls (arguments,
  parameters, buffers), what factories make with a ``device=`` argument
  (``device="cuda"`` is rewritten to the CPU), and results of ops on device
  tensors;
* host tensors: what the step makes with a factory and no device
  (``torch.tensor([..])``, ``torch.zeros(3)``) or with ``device="cpu"``,
  ``.cpu()`` / ``.to("cpu")`` results, and results of ops on host tensors only.

A ``torch.device`` object is taken as the step's device (``x.to(device)``
where ``device = torch.device("cpu")`` on this machine means "the GPU" in the
real run); only the *string* ``"cpu"`` and ``.cpu()`` mean the host.
Simulated moves (``host.to(device)``, ``dev.cpu()``) return a copy, as the
real ones do, so the two kinds never share a tensor object.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

FACTORIES = frozenset({
    "tensor", "as_tensor", "asarray", "from_numpy", "lift_fresh", "frombuffer", "scalar_tensor",
    "zeros", "ones", "empty", "full", "arange", "range", "linspace", "logspace", "eye", "empty_strided",
    "rand", "randn", "randint", "randperm", "normal", "tril_indices", "triu_indices", "complex", "polar",
})


class DeviceModel:
    """Host/device classification of tensors (see module docstring)."""

    def __init__(self, simulated: bool) -> None:
        self.simulated = simulated
        self._host: dict[int, weakref.ref] = {}
        self._pinned: dict[int, weakref.ref] = {}

    # ---- queries ------------------------------------------------------------
    def is_host(self, t: torch.Tensor) -> bool:
        if not self.simulated:
            return t.device.type == "cpu"
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def is_pinned(self, t: torch.Tensor) -> bool:
        if self.simulated:
            ref = self._pinned.get(id(t))
            return ref is not None and ref() is t
        try:
            return t.is_pinned()
        except RuntimeError:
            return False

    def target_is_host(self, device: Any) -> bool:
        """Does a ``device=`` argument name the host? (see module docstring for the simulated rule)."""
        if device is None:
            return True
        if self.simulated:
            return isinstance(device, str) and torch.device(device).type == "cpu"
        if isinstance(device, int):
            return False
        return torch.device(device).type == "cpu"

    # ---- marks --------------------------------------------------------------
    def mark_host(self, t: Any, pinned: bool = False) -> None:
        if self.simulated and isinstance(t, torch.Tensor):
            self._host[id(t)] = weakref.ref(t)
            if pinned:
                self._pinned[id(t)] = weakref.ref(t)

    def mark_device(self, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            self._host.pop(id(t), None)
            self._pinned.pop(id(t), None)

    # ---- simulated device arguments ----------------------------------------
    def remap(self, device: Any) -> Any:
        """``cuda`` (or any accelerator) -> the CPU, when simulating."""
        if not self.simulated or device is None:
            return device
        if isinstance(device, int):
            return torch.device("cpu")
        dev = torch.device(device)
        return device if dev.type == "cpu" else torch.device("cpu")


def tensors(tree: Any) -> list[torch.Tensor]:
    from ..cuda_graph.torch_compat import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def step_device_is_real(*trees: Any) -> bool:
    """True when any tensor of the step (arguments, parameters) is on an accelerator."""
    for tree in trees:
        for t in tensors(tree):
            if t.device.type not in ("cpu", "meta"):
                return True
    return False
