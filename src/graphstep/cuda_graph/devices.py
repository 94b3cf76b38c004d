"""Devices and sizes, said once for the whole package.

:func:`normalize_device` is how graphstep reads a device argument: a
``torch.device``, a string or a CUDA ordinal; ``"cuda"`` without an index
means the current CUDA device (``torch.cuda.current_device()``), so two
spellings of one GPU key the same backend, stream and generator.
:func:`default_device` is where work goes when nobody says: the current CUDA
device, else the CPU.
"""

from __future__ import annotations

import torch

GiB = 1024**3


def normalize_device(device: torch.device | str | int) -> torch.device:
    """``device`` as a ``torch.device`` with an index on CUDA (an int is a CUDA ordinal)."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def default_device() -> torch.device:
    """The current CUDA device when there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
