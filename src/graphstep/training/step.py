"""What one training iteration computes: forward and backward over micro-batches.

This is the function the full-iteration graph wraps, and exactly what runs
eagerly with ``cuda_graph_impl=none`` -- the same ops in the same order, so
graphed and eager losses are bit-identical. It never reads a device value on
the host: the loss and its finiteness flag stay device tensors. The flag
(``nonfinite``, 1.0 when the step's loss is NaN/Inf) is computed only with
``train.check_for_nan_on_device``; without it the step returns the loss alone.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..parallel.pipeline import Pipeline
from .optim import GradBuffers, nonfinite

Batch = dict[str, torch.Tensor]


def packed_rows(mb: Batch) -> dict[str, torch.Tensor]:
    """The document offsets of a micro-batch of packed rows (data/packing.py), for the model's forward."""
    return {"cu_seqlens": mb["cu_seqlens"]} if "cu_seqlens" in mb else {}


class TrainStep:
    """Forward/backward of all micro-batches, gradient accumulation and reduction.

    Args:
        model: returns the mean token loss of a micro-batch.
        grads: the persistent fp32 gradient buffers (zeroed at the start of the step, or overwritten by its
            first gradients: GradBuffers.overwrite_first).
        reduce_grads: the data-parallel hook, called after the last backward
            (inside the full-iteration graph when there is one); one with an
            ``arm()`` (parallel/data_parallel.py) is armed before the last backward,
            during which it starts reducing.
        reduce_loss: averages the step's loss over data-parallel ranks in place
            (a device all-reduce, inside the graph too), so the logged loss and
            the non-finite flag are the same on every rank.
        before_step: model state reset at the start of every step (e.g. MoE statistics).
        after_backward: model state updated at the end of every step, after the gradient reduction
            (FP8 delayed scaling's amax histories and scales, converters/fp8_delayed.py); device ops only.
        retain_graph: ``model.cuda_graph_retain_backward_graph``.
        check_nonfinite: ``train.check_for_nan_on_device``: also return ``nonfinite``, a device
            flag of the loss (graph-safe: no host read).
    """

    def __init__(
        self,
        model: nn.Module,
        grads: GradBuffers,
        *,
        reduce_grads: Callable[[], None] | None = None,
        reduce_loss: Callable[[torch.Tensor], None] | None = None,
        before_step: Callable[[], None] | None = None,
        after_backward: Callable[[], None] | None = None,
        retain_graph: bool = False,
        check_nonfinite: bool = True,
    ) -> None:
        self.model = model
        self.grads = grads
        self.reduce_grads = reduce_grads
        self.reduce_loss = reduce_loss
        self.before_step = before_step
        self.after_backward = after_backward
        self.retain_graph = retain_graph
        self.check_nonfinite = check_nonfinite

    def forward_backward(self, batches: list[Batch]) -> dict[str, torch.Tensor]:
        n = len(batches)
        self.grads.start_step()
        if self.before_step is not None:
            self.before_step()
        total = torch.zeros((), dtype=torch.float32, device=self.grads.flat.device)
        self._accumulate(batches, total)
        self.grads.end_accumulation()
        if self.reduce_grads is not None:
            self.reduce_grads()
        if self.after_backward is not None:
            self.after_backward()
        mean = self._mean(total, n)
        if self.reduce_loss is not None:
            self.reduce_loss(mean)
        if not self.check_nonfinite:
            return {"loss": mean}
        return {"loss": mean, "nonfinite": nonfinite(mean)}

    __call__ = forward_backward

    def _accumulate(self, batches: list[Batch], total: torch.Tensor) -> None:
        """Forward and backward of every micro-batch; each loss is added to ``total``."""
        n = len(batches)
        arm = getattr(self.reduce_grads, "arm", None)  # an overlapped reduction starts in the last backward
        for i, mb in enumerate(batches):
            loss = self.model(mb["tokens"], mb["labels"], mb.get("loss_mask"), **packed_rows(mb))
            if arm is not None and i == n - 1:
                arm()
            # x / 1 is x exactly, and so is the gradient it passes back: one micro-batch skips the two kernels
            (loss if n == 1 else loss / n).backward(retain_graph=self.retain_graph)
            total.add_(loss.detach())

    def _mean(self, total: torch.Tensor, n: int) -> torch.Tensor:
        return total if n == 1 else total / n  # the step's own tensor either way


class EvalStep:
    """Mean loss over evaluation micro-batches, without gradients.

    ``release``: called after the last forward, to free what a forward keeps
    for a backward that never comes -- FSDP2's unsharded parameters
    (parallel/fsdp.py), so every step, graphed or not, ends with the
    parameters sharded, as a training step does.
    """

    def __init__(self, model: nn.Module, device: torch.device, reduce_loss: Callable[[torch.Tensor], Any] | None = None,
                 release: Callable[[], None] | None = None):
        self.model = model
        self.device = device
        self.reduce_loss = reduce_loss
        self.release = release

    @torch.no_grad()
    def __call__(self, batches: list[Batch]) -> dict[str, torch.Tensor]:
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        self._accumulate(batches, total)
        if self.release is not None:
            self.release()
        mean = self._mean(total, len(batches))
        if self.reduce_loss is not None:
            self.reduce_loss(mean)
        return {"loss": mean}

    def _accumulate(self, batches: list[Batch], total: torch.Tensor) -> None:
        for mb in batches:
            total.add_(self.model(mb["tokens"], mb["labels"], mb.get("loss_mask"), **packed_rows(mb)))

    def _mean(self, total: torch.Tensor, n: int) -> torch.Tensor:
        return total / n


# --------------------------------------------------------------------------
# over a pipeline stage (parallel/pipeline.py)


class PipelineTrainStep(TrainStep):
    """TrainStep over a pipeline: the schedule runs every forward and backward, and the loss is the
    last stage's, shared with every stage. Takes TrainStep's keyword arguments but ``retain_graph`` (R29)."""

    def __init__(self, pipeline: Pipeline, grads: GradBuffers, **kwargs: Any) -> None:
        super().__init__(pipeline.model, grads, **kwargs)
        self.pipeline = pipeline

    def _accumulate(self, batches: list[Batch], total: torch.Tensor) -> None:
        arm = getattr(self.reduce_grads, "arm", None)  # an overlapped reduction starts in the stage's last backward
        if arm is not None:
            arm(accumulations=len(batches))
        self.pipeline.run(self.pipeline.train_schedule, batches, total, train=True)

    def _mean(self, total: torch.Tensor, n: int) -> torch.Tensor:
        mean = total / n
        self.pipeline.share_(mean)
        return mean


class PipelineEvalStep(EvalStep):
    """EvalStep over a pipeline: forwards only, the mean loss on every stage."""

    def __init__(self, pipeline: Pipeline, device: torch.device,
                 reduce_loss: Callable[[torch.Tensor], Any] | None = None,
                 release: Callable[[], None] | None = None) -> None:
        super().__init__(pipeline.model, device, reduce_loss=reduce_loss, release=release)
        self.pipeline = pipeline

    def _accumulate(self, batches: list[Batch], total: torch.Tensor) -> None:
        self.pipeline.run(self.pipeline.eval_schedule(len(batches)), batches, total, train=False)

    def _mean(self, total: torch.Tensor, n: int) -> torch.Tensor:
        mean = total / n
        self.pipeline.share_(mean)
        return mean
