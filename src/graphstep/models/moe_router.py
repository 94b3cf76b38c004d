"""The MoE router: scores, top-k selection and the load-balancing losses.

This follows Megatron Core's ``router.py`` / ``moe_utils.py`` so that a
Megatron user finds the same numbers:

* logits are computed in fp32 (``moe_router_dtype=fp32``);
* ``softmax``: top-k of the logits, then a softmax over the k chosen logits
  (Megatron's default, ``moe_router_pre_softmax=False``; equal, up to
  rounding, to Hugging Face Qwen3-MoE's softmax + top-k + renormalisation,
  ``norm_topk_prob=true``). With ``moe_router_pre_softmax`` the softmax over
  all experts comes first and the k chosen probabilities are the weights, not
  renormalised (Hugging Face ``norm_topk_prob=false``);
* ``sigmoid``: sigmoid scores, top-k, and the k weights normalised to sum
  to one when k > 1. With ``moe_router_enable_expert_bias`` the *selection*
  uses ``score + expert_bias`` while the weights use the unbiased scores
  (aux-loss-free balancing, DeepSeek-V3);
* the load-balancing loss is Switch/GShard's, as
  ``switch_load_balancing_loss_func``:
  ``E / (k * N^2) * sum_e (sum_n p[n, e]) * f_e`` with ``p`` the full score
  distribution and ``f_e`` the number of tokens routed to expert ``e``;
* the z-loss is ``mean(logsumexp(logits)^2)``.

Both losses enter the gradient through :class:`AuxLossAutoScaler`, which
returns its input unchanged and, in backward, adds ``d(coeff * loss)`` scaled
by a device tensor (1 / micro-batches, set once with
:meth:`TopKRouter.set_aux_loss_scale`). Nothing here reads a device value on
the host, so the router can be captured.

Logging and the bias update need per-layer state that survives graph replays:
every statistic accumulates *in place* into a persistent buffer of the router
(``aux_loss_sum``, ``z_loss_sum``, ``tokens_per_expert``,
``bias_tokens_per_expert``); those buffers and ``expert_bias`` stay fp32/int64
even when the model is cast to bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cuda_graph.torch_compat import AfterApply, module_buffers
from .transformer import is_recomputing


def fp32_or_wider(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or as is when already fp64 (so fp64 gradient checks stay exact)."""
    return t if t.dtype == torch.float64 else t.float()


# Buffers that must keep their dtype when the model is cast (``model.to(bf16)``
# casts every floating buffer): sums over many steps and the bias need fp32.
_FP32_BUFFERS = ("expert_bias", "aux_loss_sum", "z_loss_sum", "aux_loss_scale")


class AuxLossAutoScaler(torch.autograd.Function):
    """Attach ``aux_loss`` to ``output``: identity forward, ``+ scale * d(aux_loss)`` backward.

    Megatron's ``MoEAuxLossAutoScaler`` with the backward scale passed in as a
    device tensor instead of a class global, so a captured backward reads the
    current value on every replay.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss, scale)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        aux_loss, scale = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss) * scale.to(aux_loss.dtype), None


def topk_routing(
    logits: torch.Tensor, topk: int, score_function: str, expert_bias: torch.Tensor | None = None,
    pre_softmax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [N, k] fp32, expert indices [N, k] int64) as Megatron's ``topk_routing_with_score_function``."""
    if score_function == "softmax" and pre_softmax:
        return torch.topk(torch.softmax(fp32_or_wider(logits), dim=-1), topk, dim=-1)
    if score_function == "softmax":
        top_logits, idx = torch.topk(logits, topk, dim=-1)
        return torch.softmax(fp32_or_wider(top_logits), dim=-1), idx
    scores = torch.sigmoid(fp32_or_wider(logits))
    if expert_bias is not None:
        # Select with the bias, weight without it: the bias only steers load.
        _, idx = torch.topk(scores + expert_bias, topk, dim=-1)
        top = scores.gather(1, idx)
    else:
        top, idx = torch.topk(scores, topk, dim=-1)
    if topk > 1:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top, idx


def aux_loss_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """The full score distribution the load-balancing loss uses (``compute_routing_scores_for_aux_loss``)."""
    if score_function == "softmax":
        return torch.softmax(fp32_or_wider(logits), dim=-1)
    scores = torch.sigmoid(fp32_or_wider(logits))
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def count_tokens(idx: torch.Tensor, num_experts: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Tokens routed to each expert, [E], on the device (no bincount: its size depends on data)."""
    routing_map = torch.zeros(idx.shape[0], num_experts, device=idx.device, dtype=dtype)
    return routing_map.scatter_(1, idx, 1.0).sum(dim=0)


def load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, topk: int) -> torch.Tensor:
    """Switch/GShard loss without its coefficient (Megatron's ``switch_load_balancing_loss_func``)."""
    num_tokens, num_experts = scores.shape
    weight = num_experts / (topk * num_tokens * num_tokens)
    return torch.sum(scores.sum(dim=0) * tokens_per_expert) * weight


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss without its coefficient (ST-MoE): mean squared log-partition."""
    return torch.logsumexp(fp32_or_wider(logits), dim=-1).square().mean()


class TopKRouter(AfterApply):
    """Linear gate + top-k routing + aux losses, with persistent statistics buffers."""

    def __init__(self, hidden: int, moe) -> None:
        super().__init__()
        self.moe = moe
        E = moe.num_experts
        self.weight = nn.Parameter(torch.empty(E, hidden))
        nn.init.normal_(self.weight, 0.0, 0.02)
        if moe.enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E))
            self.register_buffer("bias_tokens_per_expert", torch.zeros(E, dtype=torch.int64))
        else:
            self.expert_bias = None
        self.register_buffer("aux_loss_sum", torch.zeros(()))
        self.register_buffer("z_loss_sum", torch.zeros(()))
        self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.int64))
        # Backward scale of the aux losses (1 / micro-batches); non-persistent:
        # the trainer sets it for each run.
        self.register_buffer("aux_loss_scale", torch.ones(()), persistent=False)

    def after_apply(self) -> None:
        buffers = module_buffers(self)
        for name in _FP32_BUFFERS:
            buf = buffers.get(name)
            if buf is not None and buf.dtype != torch.float32:
                buffers[name] = buf.float()

    def set_aux_loss_scale(self, scale: float) -> None:
        """Set the backward scale of the aux losses (eager, once; not per step)."""
        with torch.no_grad():
            self.aux_loss_scale.fill_(scale)

    def _attach(self, tensor: torch.Tensor, loss: torch.Tensor, coeff: float) -> torch.Tensor:
        if coeff == 0.0 or not (self.training and torch.is_grad_enabled()):
            return tensor
        return AuxLossAutoScaler.apply(tensor, loss * coeff, self.aux_loss_scale)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (probs [N, k] fp32, expert indices [N, k] int64)."""
        moe = self.moe
        logits = F.linear(fp32_or_wider(x), fp32_or_wider(self.weight))
        # the statistics count each forward once: not again in a full recompute's second forward
        track = self.training and torch.is_grad_enabled() and not is_recomputing()
        if moe.z_loss_coeff is not None:
            zl = z_loss(logits)
            logits = self._attach(logits, zl, moe.z_loss_coeff)
            if track:
                self.z_loss_sum.add_(zl.detach().float())
        probs, idx = topk_routing(logits, moe.topk, moe.score_function, self.expert_bias,
                                  pre_softmax=getattr(moe, "pre_softmax", False))
        if moe.load_balancing_type == "aux_loss":
            probs = self._aux_loss(logits, probs, idx, track)
        if track:
            counts = count_tokens(idx, moe.num_experts).long()
            self.tokens_per_expert.add_(counts)
            if self.expert_bias is not None:
                self.bias_tokens_per_expert.add_(counts)
        return probs, idx

    def _aux_loss(self, logits: torch.Tensor, probs: torch.Tensor, idx: torch.Tensor, track: bool) -> torch.Tensor:
        moe = self.moe
        scores = aux_loss_scores(logits, moe.score_function)
        if self.expert_bias is not None:
            # The loss measures the router's own preference, without the bias.
            _, idx = torch.topk(scores, moe.topk, dim=-1)
        aux = load_balancing_loss(scores, count_tokens(idx, moe.num_experts, scores.dtype), moe.topk)
        if track:
            self.aux_loss_sum.add_(aux.detach())
        return self._attach(probs, aux, moe.aux_loss_coeff)

    @torch.no_grad()
    def update_expert_bias(self, group=None) -> None:
        """Megatron's ``_update_router_expert_bias``: bias += rate * sign(mean - count); counts reset.

        Eager, after the optimizer step. With data parallelism the counts are
        summed over ``group`` first, so every rank applies the same update.
        """
        if self.expert_bias is None:
            return
        counts = self.bias_tokens_per_expert.float()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts, group=group)
        offset = counts.mean() - counts
        self.expert_bias.add_(torch.sign(offset) * self.moe.bias_update_rate)
        self.bias_tokens_per_expert.zero_()
