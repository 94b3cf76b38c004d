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
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.moe import moe_routers, moe_stats, reset_moe_stats, set_aux_loss_scale, update_expert_bias

KEYS = ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance")


class MoEHooks:
    def __init__(self, model: nn.Module, num_micro_batches: int, group=None, token_shares: int = 1) -> None:
        self.model = model
        self.routers = moe_routers(model)  # found once: a walk over every module per step costs host time
        self.layers = len(self.routers)
        self.num_micro_batches = num_micro_batches
        self.group = group
        if self.layers:
            set_aux_loss_scale(self.routers, 1.0 / (num_micro_batches * token_shares))

    @property
    def enabled(self) -> bool:
        return self.layers > 0

    def before_step(self) -> None:
        reset_moe_stats(self.routers)

    def after_optimizer_step(self) -> None:
        update_expert_bias(self.routers, self.group)

    def metrics(self) -> dict[str, torch.Tensor]:
        stats = moe_stats(self.routers)
        per = float(self.layers * self.num_micro_batches)
        counts = stats["tokens_per_expert"].float()
        return {
            "moe_aux_loss": stats["aux_loss"] / per,
            "moe_z_loss": stats["z_loss"] / per,
            "moe_load_imbalance": (counts.max(dim=-1).values / counts.mean(dim=-1).clamp(min=1.0)).max(),
        }
