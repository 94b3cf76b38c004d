"""The trainer's side of MoE layers: what happens around each step, and what is logged.

* once: the aux-loss backward scale (1 / micro-batches, a device buffer the
  captured backward reads; and 1 / tensor-parallel ranks under tensor parallel,
  where each rank's loss is that of its share of the tokens and the router's
  gradient is summed over the ranks: parallel/tensor_parallel.py);
* at the start of every step, inside the full-iteration graph when there is
  one: the router statistics are zeroed in place;
* after the optimizer step, eagerly: the aux-loss-free expert-bias update from
  the accumulated token counts (outside any graph, so warm-up and capture
  never move the bias);
* per iteration, as device scalars for the metrics: the load-balancing and
  z-losses (per layer and micro-batch, without coefficients, as Megatron logs
  them) and the load imbalance (max / mean tokens per expert).

Over pipeline stages each stage holds some of the MoE layers (or none: a
hybrid model's stage may hold Mamba and MLP layers only), so the metrics of
the whole model are summed over the stages -- Megatron reduces its aux-loss
tracker over the pipeline group the same way --: one device all-reduce over
the stage group per iteration (and one MAX for the imbalance), outside every
graph, which every stage runs, MoE layers or not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..models.moe import moe_routers, moe_stats, reset_moe_stats, set_aux_loss_scale, update_expert_bias

KEYS = ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance")


class MoEHooks:
    """``group``: the ranks whose token counts the expert-bias update sums (None: the default group).
    ``token_shares``: the ranks a MoE block's tokens are split over (tensor parallel). ``stages``: a pipeline's
    stage group (None without stages), over which the metrics are summed; ``moe_model``: whether the whole model
    has MoE layers (a stage may hold none)."""

    def __init__(self, model: nn.Module, num_micro_batches: int, group=None, token_shares: int = 1, *, stages=None,
                 moe_model: bool = False) -> None:
        self.model = model
        self.routers = moe_routers(model)  # found once: a walk over every module per step costs host time
        self.layers = len(self.routers)
        self.num_micro_batches = num_micro_batches
        self.group = group
        self.stages = stages
        self.moe_model = self.layers > 0 or (stages is not None and moe_model)
        if self.layers:
            set_aux_loss_scale(self.routers, 1.0 / (num_micro_batches * token_shares))

    @property
    def enabled(self) -> bool:
        """Whether this rank holds MoE layers (its step resets their statistics, its optimizer step moves biases)."""
        return self.layers > 0

    @property
    def logged(self) -> bool:
        """Whether the metrics have the MoE keys: the model has MoE layers, on this stage or another."""
        return self.moe_model

    def before_step(self) -> None:
        reset_moe_stats(self.routers)

    def after_optimizer_step(self) -> None:
        update_expert_bias(self.routers, self.group)

    def metrics(self) -> dict[str, torch.Tensor]:
        if self.stages is not None:
            return self._pipeline_metrics()
        stats = moe_stats(self.routers)
        per = float(self.layers * self.num_micro_batches)
        return {
            "moe_aux_loss": stats["aux_loss"] / per,
            "moe_z_loss": stats["z_loss"] / per,
            "moe_load_imbalance": _imbalance(stats["tokens_per_expert"]),
        }

    def _pipeline_metrics(self) -> dict[str, torch.Tensor]:
        """The metrics of every stage's MoE layers: sums and layer counts added over the stages, the largest
        imbalance taken (device all-reduces, no host read)."""
        device = self.routers[0].aux_loss_sum.device if self.routers else _device_of(self.model)
        if self.routers:
            stats = moe_stats(self.routers)
            sums = torch.stack([stats["aux_loss"], stats["z_loss"], torch.tensor(float(self.layers), device=device)])
            imbalance = _imbalance(stats["tokens_per_expert"]).reshape(1)
        else:
            sums, imbalance = torch.zeros(3, device=device), torch.zeros(1, device=device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.stages)
        dist.all_reduce(imbalance, op=dist.ReduceOp.MAX, group=self.stages)
        per = sums[2] * self.num_micro_batches
        return {"moe_aux_loss": sums[0] / per, "moe_z_loss": sums[1] / per, "moe_load_imbalance": imbalance[0]}


def _imbalance(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """max / mean tokens per expert, the largest over the layers ([layers, experts] counts)."""
    counts = tokens_per_expert.float()
    return (counts.max(dim=-1).values / counts.mean(dim=-1).clamp(min=1.0)).max()


def _device_of(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")
