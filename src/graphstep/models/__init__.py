"""Reference models whose layers expose graph scopes (see cuda_graph/scopes.py)."""

from __future__ import annotations

import torch
from torch import nn

from .hybrid import build_layered_model, is_layered
from .transformer import GPTModel, ModelShape


def resolve_dtype(params_dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is bf16 on a GPU and fp32 on the CPU."""
    if params_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
    if params_dtype not in table:
        raise ValueError(f"model.params_dtype must be auto, bf16 or fp32, got {params_dtype!r}")
    return table[params_dtype]


def build_model(model_cfg, device: torch.device | str = "cpu", *, dtype: torch.dtype | None = None) -> nn.Module:
    """The model a ``ModelConfig`` describes, on ``device`` in its parameter dtype (or ``dtype``).

    Weights are initialised in fp32 on the CPU from torch's current seed (so
    every device starts from the same numbers), then moved and cast.
    """
    device = torch.device(device)
    if is_layered(model_cfg):  # MoE (Qwen3-MoE style) or hybrid (Nemotron-H pattern)
        model = build_layered_model(model_cfg)
    else:
        model = GPTModel(ModelShape.from_config(model_cfg))
    return model.to(device=device, dtype=dtype or resolve_dtype(model_cfg.params_dtype, device))
