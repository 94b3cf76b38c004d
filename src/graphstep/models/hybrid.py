"""Building MoE and hybrid (Mamba) models as plain :class:`GPTModel` instances.

The layer list comes from the configuration:

* ``model.hybrid_override_pattern`` (Nemotron-H style), one character per
  layer: ``M`` Mamba, ``*`` attention, ``-`` dense MLP, ``E`` MoE. Each
  character is one :class:`DecoderLayer` holding one block named ``mamba``,
  ``attn``, ``mlp`` or ``moe``, so each layer exposes exactly its scope.
* otherwise, with ``model.num_moe_experts`` (Qwen3-MoE style): every layer is
  ``attn`` + ``moe`` where Megatron's ``moe_layer_freq`` makes it an MoE
  layer (``i % freq == 0``), else ``attn`` + ``mlp``.

The model is a :class:`GPTModel` with ``layers=``, so the trainer and the graph
engine treat it like the dense one. GPTModel's generic initialisation zeros
1-D parameters; Mamba's A, D and dt get their own init afterwards.
"""

from __future__ import annotations

from torch import nn

from .mamba import MambaBlock, MambaMixer, MambaShape
from .moe import MoEBlock, MoEShape
from .transformer import AttentionBlock, DecoderLayer, GPTModel, MLPBlock, ModelShape

PATTERN_BLOCKS = {"M": "mamba", "*": "attn", "-": "mlp", "E": "moe"}


def layer_kinds(m) -> list[list[str]]:
    """The block names of every layer, in order (e.g. ``[["mamba"], ["attn"], ["moe"]]``)."""
    pattern = m.hybrid_override_pattern
    if pattern:
        bad = sorted({c for c in pattern if c not in PATTERN_BLOCKS})
        if bad:
            raise ValueError(
                f"model.hybrid_override_pattern={pattern!r} has unknown symbols {bad}; "
                "use M (Mamba), * (attention), - (MLP), E (MoE)"
            )
        if len(pattern) != m.num_layers:
            raise ValueError(
                f"model.hybrid_override_pattern has {len(pattern)} layers but model.num_layers={m.num_layers}"
            )
        return [[PATTERN_BLOCKS[c]] for c in pattern]
    if not m.num_moe_experts:
        return [["attn", "mlp"] for _ in range(m.num_layers)]
    if m.moe_layer_freq < 1:
        raise ValueError(f"model.moe_layer_freq must be >= 1, got {m.moe_layer_freq}")
    return [["attn", "moe" if i % m.moe_layer_freq == 0 else "mlp"] for i in range(m.num_layers)]


def _block(kind: str, s: ModelShape, m) -> nn.Module:
    if kind == "attn":
        return AttentionBlock(s)
    if kind == "mlp":
        return MLPBlock(s)
    if kind == "moe":
        return MoEBlock(s, MoEShape.from_config(m))
    return MambaBlock(s, MambaShape.from_config(m))


def build_layers(m, s: ModelShape) -> list[DecoderLayer]:
    """One DecoderLayer per entry of :func:`layer_kinds`."""
    return [DecoderLayer({kind: _block(kind, s, m) for kind in kinds}) for kinds in layer_kinds(m)]


def build_layered_model(m) -> GPTModel:
    """The GPTModel of an MoE or hybrid configuration (fp32, on the current default device)."""
    s = ModelShape.from_config(m)
    model = GPTModel(s, layers=build_layers(m, s))
    for module in model.modules():
        if isinstance(module, MambaMixer):
            module.reset_special_parameters()
    return model


def is_layered(m) -> bool:
    """Whether the configuration needs :func:`build_layered_model` (MoE or hybrid)."""
    return bool(m.hybrid_override_pattern) or bool(m.num_moe_experts)
