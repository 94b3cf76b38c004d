"""Pipeline parallel on ``torch.distributed.pipelining``: stages and their schedules.

``model.pipeline_model_parallel_size`` stages split the decoder layers over
the ``pp`` dimension of the device mesh (parallel/dims.py): the first
stage holds the embedding, the last the final norm, the output layer and the
loss, and the layers are spread as Megatron Bridge spreads them
(:func:`stage_layers`: ``num_layers_in_first/last_pipeline_stage``, the rest
evenly; or ``pipeline_model_parallel_layout``,
``account_for_embedding/loss_in_pipeline_split``: :func:`model_chunks`,
validation/stage_split.py). Every rank builds the whole model from the same
seed and keeps its stage (:func:`split_stage`; with virtual stages the union
of its chunks, run as parallel/interleaved.py says), so a pipelined run
starts from the weights a one-stage run has; layer names stay those of the whole model (``layers.5``
on the stage that holds layer 5), so checkpoints name parameters the same
at every layout.

The schedule is torch's own -- ``Schedule1F1B`` (Megatron's non-interleaved
schedule) or ``ScheduleGPipe`` (``model.pipeline_schedule``) -- over one
:class:`~torch.distributed.pipelining.PipelineStage` per rank (:class:`Pipeline`).
training/step.py's ``PipelineTrainStep`` is the training step the full-iteration graph
captures: the schedule's forwards, backwards, sends and receives of every
micro-batch, then the data-parallel gradient all-reduce and the loss, which
the last stage computes and the others receive (an all-reduce over the
stage group), so every rank logs the same loss and non-finite flag. A CUDA
graph captures NCCL's point-to-point calls; the CPU replay backend re-runs
them in the order the capture posted and waited on them
(cuda_graph/replay.py).

The first step is eager (rule R29): it is when the stages exchange the
shapes of what they send, on the host. Evaluation runs a forward-only GPipe
pass over a stage of its own (its own receive buffers, for its own number
of micro-batches).

Tied embeddings (``share_embeddings_and_output_weights``, two stages: rule
R28 refuses more): the first stage embeds the tokens with the embedding's
weight, the last computes the logits with it. Each holds a copy, named
``embedding.weight`` on both (so checkpoints name it the same at every
layout; the last stage's :class:`TiedOutputEmbedding` only lends the weight
to the logits), equal at the start (every rank builds the model from one
seed) and kept equal as Megatron keeps them: after the backward, the two
copies' gradients are summed over the two stages
(:class:`TiedEmbeddingReducer`, an all-reduce over the stage group, inside
the full-iteration graph), so both take the gradient one process computes
and the same optimizer step. The gradient norm counts the first stage's copy
only (:func:`is_tied_copy`).

That first step's set-up leaves no trace (:func:`_setup_leaves_no_trace`):
torch 2.13 infers the shapes by running the stage's forward and backward
once, with dropout, and shields only torch's default generators from it, not
the RNG tracker's streams that dropout draws from. A resumed run sets its
stages up again, so without this its dropout masks would be shifted from the
uninterrupted run's from the resume on. A stage after the first runs that
forward on uninitialised inputs (``torch.empty`` of the received shapes), so
what the forward accumulates in the model's buffers -- an MoE router's
load-balancing statistics and token counts for the expert-bias update --
would be garbage: the set-up restores every buffer of the stage too.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import ModelConfig
from ..cuda_graph.rng import get_rng_tracker
from ..engines_compat import dtensor_local, forward_only_step, view_base, wrap_stage_setup
from ..models.transformer import token_loss
from ..validation.stage_split import Chunk, even_chunks, split_chunks

SCHEDULES = ("1f1b", "gpipe")
Batch = dict[str, torch.Tensor]  # a micro-batch: tokens, labels, loss mask (training/step.py)


def stage_layers(num_layers: int, stages: int, first: int | None = None, last: int | None = None) -> list[range]:
    """The decoder layers of each stage: ``first``/``last`` on the end stages (None: an even share), the rest evenly.

    A layout rule R28 refuses first has already refused; this raises for direct calls with a split that does not work.
    """
    return [c.layers for c in even_chunks(num_layers, stages, 1, first, last)]


def model_chunks(m: ModelConfig, stages: int) -> list[Chunk]:
    """The model chunks (virtual stages, in data-flow order) of ``m`` over ``stages`` pipeline ranks, as its split
    fields say (validation/stage_split.py); chunk ``c`` runs on rank ``c % stages``."""
    return split_chunks(m.num_layers, stages, vpp=m.virtual_pipeline_model_parallel_size,
                        first=m.num_layers_in_first_pipeline_stage, last=m.num_layers_in_last_pipeline_stage,
                        layout=m.pipeline_model_parallel_layout,
                        account_for_embedding=m.account_for_embedding_in_pipeline_split is True,
                        account_for_loss=m.account_for_loss_in_pipeline_split is True)


class TiedOutputEmbedding(nn.Module):
    """The last stage's copy of a tied embedding: GPTModel computes the logits with its ``weight``; its forward
    passes the hidden state the stage received on unchanged (the first stage embedded the tokens)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight
        weight.tied_copy = True  # counted once in the gradient norm: on the first stage (is_tied_copy)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h


def is_tied_copy(p: torch.Tensor) -> bool:
    """Whether ``p`` is the last stage's copy of a tied embedding (its gradient is the first stage's too)."""
    return getattr(p, "tied_copy", False)


def keep_stage(model: nn.Module, layers: Iterable[int], *, first: bool, last: bool) -> nn.Module:
    """Keep in ``model`` (a GPTModel) what one stage holds; layer names keep their whole-model index. With tied
    embeddings the last stage keeps the embedding's weight for its logits (:class:`TiedOutputEmbedding`)."""
    kept = nn.ModuleDict({str(i): model.layers[i] for i in layers})
    model.layers = kept
    tied = model.output_layer is None  # the logits use the embedding's weight
    if not first:
        model.embedding = TiedOutputEmbedding(model.embedding.weight) if last and tied else None
    if not last:
        model.final_layernorm = None
        model.output_layer = None
    return model


def split_stage(model: nn.Module, m: ModelConfig, stages: int, stage: int) -> nn.Module:
    """Keep in ``model`` (the whole GPTModel) what pipeline rank ``stage`` of ``stages`` holds, as ``m`` splits the
    layers: its one stage, or with virtual stages the union of its chunks (parallel/interleaved.py)."""
    mine = [c for c in model_chunks(m, stages) if c.index % stages == stage]
    layers = [i for c in mine for i in c.layers]
    return keep_stage(model, layers, first=any(c.embedding for c in mine), last=any(c.loss for c in mine))


class _StageModule(nn.Module):
    """What ``PipelineStage`` runs: the stage's part of the model, input to output (GPTModel.stage_forward).

    It calls the model itself (``model(x)``: without labels, GPTModel returns what ``stage_forward`` returns),
    not ``stage_forward``, so the hooks on the model's own call run: FSDP2's root module gathers its
    parameters (the embedding, the final norm, the output layer) there and initialises itself on the first call.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class _StageLoss:
    """The schedule's ``loss_fn`` on the last stage: the token loss of each micro-batch, in order.

    The schedule hands it the logits and the labels of micro-batch ``i`` --
    a slice of the step's label tensor, in micro-batch order --; the loss
    mask comes from the step's batches. It adds the loss to the step's device
    total and, when training, returns ``loss / n`` for the backward: what
    TrainStep backpropagates. A call with labels that are not a slice of the
    step's (torch's shape inference on a schedule's first step runs the loss
    on a copy) is computed and not counted.

    With context parallel (``context``: the stage model's ContextParallel) the
    loss is the one a stage-less model returns, :meth:`ContextParallel.loss`:
    ``cp x`` the rank's summed token losses over the mask tokens of the whole
    sequences, counted with a device all-reduce over the stage's
    context-parallel group (every context-parallel rank of the last stage
    calls it for the same micro-batches, in the same order). The uncounted
    shape-inference call stays a plain token loss: no collective there.
    """

    def __init__(self, context: Any = None) -> None:
        self.context = context
        self.masks: list[torch.Tensor | None] = []
        self.target: torch.Tensor | None = None
        self.total: torch.Tensor | None = None
        self.scale = 1
        self.index = 0

    def start(self, batches: list[Batch], target: torch.Tensor | None, total: torch.Tensor, scale: int) -> None:
        self.masks = [mb.get("loss_mask") for mb in batches]
        self.target, self.total, self.scale, self.index = target, total, scale, 0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.target is None or view_base(labels) is not self.target:
            return token_loss(logits, labels)
        mask = self.masks[self.index]
        if self.context is not None:
            loss = self.context.loss(logits, labels, mask)
        else:
            loss = token_loss(logits, labels, mask)
        self.index += 1
        self.total.add_(loss.detach())
        return loss / self.scale if self.scale != 1 else loss


class Pipeline:
    """One rank's stage of the pipeline and its schedules (training and evaluation)."""

    def __init__(self, model: nn.Module, *, stage_index: int, stages: int, group: Any, device: torch.device,
                 schedule: str, num_micro_batches: int) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        assert schedule in SCHEDULES, f"model.pipeline_schedule={schedule!r}: rule R28 allows {', '.join(SCHEDULES)}"
        self.model, self.device, self.group = model, device, group
        self.stage_index, self.stages = stage_index, stages
        self.is_first, self.is_last = stage_index == 0, stage_index == stages - 1
        self.module = _StageModule(model)
        self.loss = _StageLoss(getattr(model, "context", None))
        stage = PipelineStage(self.module, stage_index, stages, device, group=group)
        kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        # scale_grads=False: the loss function divides by the micro-batch count, as TrainStep does
        self.train_schedule = _setup_leaves_no_trace(
            kind(stage, num_micro_batches, loss_fn=self.loss, scale_grads=False), model)
        self._eval: dict[int, Any] = {}
        # no merged last-stage outputs where torch can skip them (a copy of every micro-batch's logits)
        self._step_kwargs = {"return_outputs": False} if "return_outputs" in inspect.signature(kind.step).parameters \
            else {}

    def chunk_models(self) -> list[nn.Module]:
        """The parts of the rank's model that its schedule runs as stages: here the one stage, the whole model."""
        return [self.model]

    def eval_schedule(self, n: int) -> Any:
        """A forward-only schedule for ``n`` micro-batches, over a stage of its own (its own receive buffers)."""
        if n not in self._eval:
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

            stage = PipelineStage(self.module, self.stage_index, self.stages, self.device, group=self.group)
            self._eval[n] = _setup_leaves_no_trace(ScheduleGPipe(stage, n, loss_fn=self.loss, scale_grads=False),
                                                  self.model)
        return self._eval[n]

    def run(self, schedule: Any, batches: list[Batch], total: torch.Tensor, *, train: bool) -> None:
        """Run ``schedule`` over ``batches``; the last stage adds each micro-batch's loss to ``total``."""
        args = (torch.cat([mb["tokens"] for mb in batches]),) if self.is_first else ()
        target = torch.cat([mb["labels"] for mb in batches]) if self.is_last else None
        self.loss.start(batches, target, total, len(batches) if train else 1)
        if train:
            schedule.step(*args, target=target, **self._step_kwargs)
        else:
            _forward_only(schedule, args, target, self._step_kwargs)
        if self.is_last and self.loss.index != len(batches):  # never a silently uncounted loss
            raise RuntimeError(f"the pipeline's last stage counted {self.loss.index} of {len(batches)} micro-batch "
                               "losses: this torch's schedule hands the loss function labels that are not slices of "
                               "the step's label tensor (parallel/pipeline.py, _StageLoss)")

    def share_(self, t: torch.Tensor) -> None:
        """The last stage's ``t`` on every stage, in place (others hold zeros): a device all-reduce."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)


class TiedEmbeddingReducer:
    """The training step's gradient reduction with tied embeddings over two stages: ``then`` (the data-parallel
    reduction, or None), then the tied copies' gradients summed over the stage group, as Megatron does."""

    def __init__(self, grad: torch.Tensor, group: Any, then: Callable[[], None] | None = None) -> None:
        self.grad, self.group, self.then = grad, group, then

    def arm(self, accumulations: int = 1) -> None:
        """Arm ``then`` where it overlaps its reduction with the backward (parallel/data_parallel.py)."""
        arm = getattr(self.then, "arm", None)
        if arm is not None:
            arm(accumulations=accumulations)

    def __call__(self) -> None:
        if self.then is not None:
            self.then()
        dist.all_reduce(self.grad, op=dist.ReduceOp.SUM, group=self.group)

    def describe(self) -> str:
        inner = getattr(self.then, "describe", None)
        return (f"{inner()}; " if inner is not None else "") + "tied embedding gradients summed over the two stages"


def tied_embedding_grad(model: nn.Module, *, tied: bool, first: bool, last: bool) -> torch.Tensor | None:
    """The gradient buffer (``main_grad``) of the stage's copy of the tied embedding; None on a middle stage, without
    tied embeddings, on one stage, or when the embedding is frozen (its copies stay equal without gradients)."""
    if not tied or first == last:
        return None
    grad = getattr(model.embedding.weight, "main_grad", None)
    return dtensor_local(grad) if isinstance(grad, DTensor) else grad  # tensor parallel: this rank's rows


def _setup_leaves_no_trace(schedule: Any, model: nn.Module) -> Any:
    """``schedule`` with its stage set-up leaving every RNG stream where it was and every buffer of ``model``
    as it was (see the module docstring).

    A single-stage schedule calls ``_initialize_stage`` at the start of every step, and it sets the stage up
    on the first (torch 2.13 infers the shapes there with a real forward and backward of the first
    micro-batch, forking only torch's default generators). The wrapper keeps the tracker's streams and the
    default generators around it in eager steps, and puts the buffers back after it when it set the stage up;
    a captured step comes after the eager first one (R29).
    """
    calls = [0]  # a schedule sets its stage up on its first step (each schedule runs one mode: train or eval)

    def wrap(init: Callable[..., Any]) -> Callable[..., Any]:
        def initialize(*args: Any, **kwargs: Any) -> Any:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():  # set up already (R29)
                return init(*args, **kwargs)
            calls[0] += 1
            buffers = list(model.buffers()) if calls[0] == 1 else []
            saved = [b.detach().clone() for b in buffers]
            with get_rng_tracker().preserved():
                out = init(*args, **kwargs)
            with torch.no_grad():
                for b, before in zip(buffers, saved):
                    b.copy_(before)
            return out

        return initialize

    wrap_stage_setup(schedule, wrap)
    return schedule


def _forward_only(schedule: Any, args: tuple, target: torch.Tensor | None, kwargs: dict) -> None:
    """Forwards only, the loss on the last stage: ``schedule.eval`` where torch has it."""
    forward_only_step(schedule, *args, target=target, **kwargs)
