"""The one small protocol through which models expose graph scopes.

The per-layer engine never special-cases a model class. A model that supports
per-layer graphs has ``graph_layers()``, the decoder layers in execution
order; each layer has ``graph_scopes()``, a mapping from scope name to the
submodule (or submodules, in call order) that the scope captures::

    class DecoderLayer(nn.Module):
        def graph_scopes(self):
            return {"attn": self.self_attention, "mlp": self.mlp}

A layer may also name the runs of submodules its forward calls one after
the other with nothing in between -- no tensor work, no change of state --
each taking only what the ones before it returned::

        def graph_runs(self):
            return [[self.self_attention, self.mlp]]

Graphed together, such a run is captured and replayed as one graph
(cuda_graph/chains.py); without ``graph_runs()`` every module keeps its own.
A model whose forward calls its layers one after the other, each on the
one before's output with nothing in between, may say so too: its own
``graph_runs()`` pairs a layer's last module with the next layer's first,
and runs then go on from layer to layer::

        def graph_runs(self):  # on the model
            return [[a.mlp, b.self_attention] for a, b in zip(self.layers, self.layers[1:])]

``modules=[]`` (whole layer) captures the layer itself. A layer simply omits
scopes it does not have (an attention layer has no ``mamba``).

A scoped submodule must be a pure tensor function of its inputs, parameters
and buffers: tensor (or tuple-of-tensor) arguments and results, no host
syncs, static shapes. Non-tensor arguments are allowed but are part of the
captured contract: a replay with another value raises an error.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence, runtime_checkable

from torch import nn

SCOPES: tuple[str, ...] = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")


@runtime_checkable
class GraphScopedLayer(Protocol):
    def graph_scopes(self) -> Mapping[str, nn.Module | Sequence[nn.Module]]: ...


@runtime_checkable
class GraphScopedModel(Protocol):
    def graph_layers(self) -> Sequence[nn.Module]: ...


def scope_modules(layer: nn.Module, scope: str) -> list[nn.Module]:
    """The submodules of ``layer`` that ``scope`` captures (empty when it has none)."""
    if not isinstance(layer, GraphScopedLayer):
        raise TypeError(f"{type(layer).__name__} does not expose graph scopes (no graph_scopes() method)")
    found = layer.graph_scopes().get(scope)
    if found is None:
        return []
    if isinstance(found, nn.Module):
        return [found]
    return list(found)
