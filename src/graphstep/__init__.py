"""graphstep: capture LLM training steps into CUDA graphs and replay them.

The library API (docs/library.md)::

    import graphstep

    step = graphstep.graph_step(train_step, warmup_steps=3, modules=[model])
    for batch in loader:
        loss = step(batch["x"], batch["y"])      # graph-owned: clone what you keep

    graphs = graphstep.graph_layers(hf_model, ["attn", "mlp"])   # per-layer graphs
    with graphstep.capture_stream():                             # DDP/FSDP keep AccumulateGrad nodes:
        model = DDP(model)                                       # build them on the capture stream
    ...
    graphstep.close_all()

The trainer (``graphstep train``) is built on the same mechanisms.
"""

from .api import HF_SCOPE_MAPS, close_all, graph_layers, graph_step, parse_scope_map, scope_map_for
from .cuda_graph.backend import capture_stream
from .errors import (
    BucketError, CaptureError, CheckpointError, ConfigError, ContractError, CorpusNotFoundError, GraphstepError,
    GraphUsageError, HFCheckpointError, HFExportError, IndexedDatasetError, InputError, MissingExtraError,
    PreprocessError, RunSetupError, ScriptError, SFTDataError, TorchCompatError,
)
from .cuda_graph.full_iteration import CaptureOptions, GraphedStep
from .cuda_graph.graph_state import GraphState
from .cuda_graph.registry import get_backend
from .cuda_graph.layers import LayerGraphs
from .cuda_graph.rng import RNGTracker, get_rng_tracker, initialize_rng_tracker

__version__ = "0.1.0"

__all__ = [
    "BucketError",
    "CaptureError",
    "CaptureOptions",
    "CheckpointError",
    "ConfigError",
    "ContractError",
    "CorpusNotFoundError",
    "GraphState",
    "GraphUsageError",
    "GraphedStep",
    "GraphstepError",
    "HFCheckpointError",
    "HFExportError",
    "HF_SCOPE_MAPS",
    "IndexedDatasetError",
    "InputError",
    "LayerGraphs",
    "MissingExtraError",
    "PreprocessError",
    "RNGTracker",
    "RunSetupError",
    "SFTDataError",
    "ScriptError",
    "TorchCompatError",
    "capture_stream",
    "close_all",
    "get_backend",
    "get_rng_tracker",
    "graph_layers",
    "graph_step",
    "initialize_rng_tracker",
    "parse_scope_map",
    "scope_map_for",
]
