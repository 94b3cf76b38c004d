"""Interleaved pipelines: several model chunks (virtual stages) per pipeline rank, and their p2p communicators.

With ``model.virtual_pipeline_model_parallel_size`` = v > 1 (or a
``pipeline_model_parallel_layout`` of pp x v stages) the model is cut into
pp x v chunks in data-flow order (validation/stage_split.py says which layers
each holds); rank r holds chunks r, r + pp, r + 2 pp, ... (Megatron's
assignment, and torch's: ``generate_stage_to_rank_mapping``). Every rank
builds the whole model from one seed and keeps the union of its chunks
(parallel/pipeline.py ``split_stage``), so the rank's model is one module
with every parameter it trains, named as in the whole model; each chunk
runs through :func:`chunk_view`, a view of that module holding only the
chunk's layers (and the embedding on chunk 0, the final norm and output
layer on the last chunk), sharing its parameters.

The schedule is torch's ``ScheduleInterleaved1F1B`` (``pipeline_schedule``
1f1b or interleaved_1f1b) or ``ScheduleInterleavedZeroBubble``
(interleaved_zero_bubble), over one :class:`DirectedStage` per chunk. Zero
bubble splits each backward into the input gradient and, later, the weight
gradient, which torch writes into ``param.grad`` itself instead of through
autograd's accumulation (the hook that moves it into graphstep's gradient
buffer does not fire): :meth:`InterleavedPipeline.run` moves what is left in
``param.grad`` into ``main_grad`` after the schedule, inside the captured step.

Per-layer graphs (cuda_graph/layers.py) graph the layers of the rank's model,
which its chunk views share; :meth:`InterleavedPipeline.chunk_models` names
the chunks, so that each counts the micro-batches it runs on its own (its
layers' *chain*). Not under zero bubble (rule R28): a layer's backward graph
computes the input and the weight gradients in one replay.

Communicators. With several chunks per rank, a pair of neighbouring ranks
exchanges activations and gradients in both directions, for several chunks,
in an order that differs between the two ranks' programs. On one
communicator NCCL matches the operations between a pair in the order each
side posts them, and a CUDA graph fixes that order: a receive posted behind
an unrelated send can wait for a transfer the peer posts only later, which
deadlocks or misorders the replay (pytorch #196665/#196666; torchtitan
#4591 builds such groups too). :func:`directed_p2p_groups` builds one process
group per directed pair of neighbouring pipeline ranks (r -> r+1 and
r+1 -> r, the last rank's to the first for the chunk boundary that wraps
around), from the ``pp`` dimension of the run's mesh (parallel/dims.py), and
:class:`DirectedStage` posts every send and receive of the schedule on the
group of its direction. The first (eager) step opens them (rule R29), so a
capture never initialises a communicator. The shape exchange of that first
step stays on the stage group.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..engines_compat import module_view
from ..validation.stage_split import Chunk
from .dims import WorldMesh, shared_groups
from .pipeline import Pipeline, _StageLoss, _StageModule, _setup_leaves_no_trace

Edge = tuple[int, int]  # (sending global rank, receiving global rank)


def chunk_view(model: nn.Module, chunk: Chunk) -> nn.Module:
    """A view of the rank's GPTModel that runs ``chunk`` only: the same parameters and submodules (a shallow copy
    with its own submodule table), holding the chunk's layers, the embedding only on chunk 0 and the final norm and
    output layer only on the last chunk. Its ``stage_forward`` is GPTModel's, over what the view holds.

    One view per chunk and model: a second call returns the first call's view (FSDP2 shards each chunk's view as
    a root of its own before the pipeline is built: parallel/parallelize.py). The view is made after context
    parallel is applied (parallelize's step 2) and copies the model's attributes, ``context`` among them; its
    attention modules are the model's own, which hold ``context`` too."""
    views = model.__dict__.setdefault("_chunk_views", {})
    if chunk.index in views:
        return views[chunk.index]
    view = module_view(model)  # setting a submodule below leaves the rank's model as it is
    view.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in chunk.layers})
    if not chunk.embedding:
        view.embedding = None
    if not chunk.loss:
        view.final_layernorm = None
        view.output_layer = None
    views[chunk.index] = view
    return view


class _ChunkModule(_StageModule):
    """What one chunk's ``PipelineStage`` runs; it follows the rank's model into training or evaluation mode
    (the view is not a child of the rank's model, so ``model.eval()`` does not reach it). It calls the view, as
    :class:`_StageModule` calls the model: under FSDP2 each chunk's view is a root of its own, whose hooks gather
    the chunk's embedding or final norm and output layer."""

    def __init__(self, view: nn.Module, model: nn.Module) -> None:
        super().__init__(view)
        self.__dict__["owner"] = model  # not a submodule: the view already holds the chunk's parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.model.training = self.owner.training
        return self.model(x)


def pipeline_edges(mesh: WorldMesh) -> list[Edge]:
    """Every directed pair of neighbouring pipeline ranks of the mesh, in one order on every rank: for each
    pipeline (a column of the ``pp`` dimension), r -> r+1 and r+1 -> r for each stage r, wrapping around."""
    pp = mesh.dims.pp
    pipelines = mesh.dims.rank_grid().reshape(pp, -1).T.tolist()  # each row: one pipeline's ranks, stage order
    edges: list[Edge] = []
    for ranks in pipelines:
        for i in range(pp):
            a, b = ranks[i], ranks[(i + 1) % pp]
            for edge in ((a, b), (b, a)):
                if a != b and edge not in edges:
                    edges.append(edge)
    return edges


def directed_p2p_groups(mesh: WorldMesh) -> dict[Edge, Any]:
    """One process group per directed pair of neighbouring pipeline ranks: every rank creates every group (a
    collective call, in :func:`pipeline_edges`' order) and keeps those it sends or receives on."""
    def make() -> dict[Edge, Any]:
        me, groups = dist.get_rank(), {}
        for src, dst in pipeline_edges(mesh):
            group = dist.new_group(ranks=[src, dst])
            if me in (src, dst):
                groups[(src, dst)] = group
        return groups

    return shared_groups(("p2p", mesh.root), make)  # once per mesh and process (parallel/dims.py)


def edge_of(op: Any, me: int) -> Edge:
    """The direction of ``op`` (torch's ``P2POp``, ``peer`` a global rank) posted by rank ``me``: a send to
    ``peer`` is (me, peer), a receive from it (peer, me)."""
    return (me, op.peer) if op.op is dist.isend else (op.peer, me)


def directed(ops: list[Any], groups: dict[Edge, Any]) -> list[Any]:
    """``ops`` posted on the group of their direction (:func:`edge_of`), tensors, peers and tags unchanged."""
    me = dist.get_rank()
    return [dist.P2POp(op.op, op.tensor, op.peer, groups[edge_of(op, me)], op.tag) for op in ops]


@functools.cache
def _directed_stage_class() -> type:
    """:class:`DirectedStage`, defined on first use (torch's pipelining is imported only by pipelined runs)."""
    from torch.distributed.pipelining import PipelineStage

    class DirectedStage(PipelineStage):
        """A ``PipelineStage`` whose schedule-time sends and receives go on the directed groups (module docstring).

        The four ``get_*_ops`` methods are the ones torch's schedules call for every micro-batch's transfers."""

        def __init__(self, *args: Any, p2p_groups: dict[Edge, Any], **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.p2p_groups = p2p_groups

        def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[Any]:
            return directed(super().get_fwd_recv_ops(fwd_chunk_id), self.p2p_groups)

        def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[Any]:
            return directed(super().get_bwd_recv_ops(bwd_chunk_id), self.p2p_groups)

        def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[Any]:
            return directed(super().get_fwd_send_ops(fwd_chunk_id), self.p2p_groups)

        def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[Any]:
            return directed(super().get_bwd_send_ops(bwd_chunk_id), self.p2p_groups)

    return DirectedStage


class InterleavedPipeline(Pipeline):
    """One rank's chunks of an interleaved pipeline and their schedules (training and evaluation); the same
    interface as :class:`Pipeline` (training/step.py runs either)."""

    def __init__(self, model: nn.Module, *, chunks: list[Chunk], num_chunks: int, group: Any,
                 p2p_groups: dict[Edge, Any], device: torch.device, schedule: str, num_micro_batches: int) -> None:
        from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble

        self.model, self.device, self.group, self.p2p_groups = model, device, group, p2p_groups
        self.chunks, self.num_chunks = chunks, num_chunks
        self.stage_index, self.stages = chunks[0].index, num_chunks
        self.is_first, self.is_last = chunks[0].index == 0, chunks[-1].index == num_chunks - 1
        self.modules = [_ChunkModule(chunk_view(model, c), model) for c in chunks]
        self.loss = _StageLoss(getattr(model, "context", None))
        kind = ScheduleInterleavedZeroBubble if schedule == "interleaved_zero_bubble" else ScheduleInterleaved1F1B
        # scale_grads=False: the loss function divides by the micro-batch count, as TrainStep does
        self.train_schedule = _setup_leaves_no_trace(kind(self._stages(), num_micro_batches, loss_fn=self.loss,
                                                          scale_grads=False), model)
        self._eval: dict[int, Any] = {}
        self._step_kwargs = {"return_outputs": False}  # the multi-stage schedules' step takes it (torch 2.13)

    def describe(self) -> str:
        """e.g. ``interleaved pipeline: chunks 0, 2 of 4 (layers 0, 2), ScheduleInterleaved1F1B, ...``."""
        layers = ", ".join(str(i) for c in self.chunks for i in c.layers) or "none"
        return (f"interleaved pipeline: chunks {', '.join(str(c.index) for c in self.chunks)} of {self.num_chunks} "
                f"(layers {layers}), {type(self.train_schedule).__name__}, sends and receives on a process group "
                f"per direction ({len(self.p2p_groups)} here)")

    def chunk_models(self) -> list[nn.Module]:
        """The chunks' views, in the order of ``chunks``: each runs the step's micro-batches on its own count."""
        return [module.model for module in self.modules]

    def _stages(self) -> list[Any]:
        stage = _directed_stage_class()
        return [stage(module, c.index, self.num_chunks, self.device, group=self.group, p2p_groups=self.p2p_groups)
                for module, c in zip(self.modules, self.chunks)]

    def eval_schedule(self, n: int) -> Any:
        """A forward-only schedule for ``n`` micro-batches over stages of its own: torch's looped BFS (every
        micro-batch through one chunk, then the next), which takes any number of micro-batches."""
        if n not in self._eval:
            from torch.distributed.pipelining import ScheduleLoopedBFS

            self._eval[n] = _setup_leaves_no_trace(ScheduleLoopedBFS(self._stages(), n, loss_fn=self.loss,
                                                                     scale_grads=False), self.model)
        return self._eval[n]

    def run(self, schedule: Any, batches: list[dict[str, torch.Tensor]], total: torch.Tensor, *, train: bool) -> None:
        super().run(schedule, batches, total, train=train)
        if train:
            self._gradients_to_buffers()

    def _gradients_to_buffers(self) -> None:
        """Weight gradients zero bubble wrote into ``param.grad`` directly, added into ``main_grad`` (device work,
        captured with the step); ``param.grad`` is None again, as after autograd's accumulation hook."""
        for p in self.model.parameters():
            if p.grad is not None and hasattr(p, "main_grad"):
                p.main_grad.add_(p.grad)
                p.grad = None
