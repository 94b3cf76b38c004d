"""Mixed-precision AdamW that never syncs the host.

Megatron's recipe: parameters in the model dtype (bf16 on a GPU), fp32 master
weights in the optimizer, and fp32 gradient buffers at fixed addresses:

* :class:`GradBuffers` -- one flat fp32 buffer; each parameter's ``main_grad``
  is a view into it. A post-accumulate-grad hook adds ``param.grad`` into
  ``main_grad`` and drops ``param.grad``, so gradient accumulation over
  micro-batches happens in fp32 at addresses a graph can capture. The flat
  buffer is what data-parallel reduction all-reduces. Where nothing else
  writes the buffer (:meth:`GradBuffers.overwrite_first`), a step's first
  gradient of a parameter is copied in instead of added to zeros: no zeroing
  pass and no read of the zeros.
* :class:`AdamW` -- the step counter and the learning rate are device tensors;
  the LR is read on the device from a table of the schedule indexed by the step
  counter (three kernels instead of the formula's thirteen), the global
  gradient norm and clipping stay on the device, and a non-finite norm can
  skip the update in place. Nothing reads a device value on the host, so the
  whole step can be captured (``optimizer.optimizer_cuda_graph``). On CUDA the
  update is torch's fused AdamW kernel; elsewhere a foreach implementation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..cuda_graph.graphed_module import MAIN_GRAD_HOOK_FLAG
from ..cuda_graph.torch_compat import (foreach_add_, foreach_addcmul_, foreach_copy_, foreach_div, foreach_div_,
                                      foreach_lerp_, foreach_mul_, foreach_norm, foreach_sqrt, foreach_zero_,
                                      fused_adamw_)
from ..parallel.dims import counted_here, local_tensor
from ..parallel.expert_parallel import is_expert_parameter
from ..parallel.tensor_parallel import partial_over_tp


class GradBuffers:
    """Persistent fp32 gradient buffers (``param.main_grad``) in one flat tensor.

    With tensor parallelism or FSDP2 (parallel/) a parameter is a
    DTensor: the buffer holds this rank's part of each gradient, ``main_grad``
    is a DTensor over that part (so accumulating a sharded or partial gradient
    into it is DTensor's business, e.g. the all-reduce of a sequence-parallel
    norm's gradient), and ``grads`` are the plain local views the optimizer
    updates with. ``mesh`` (None: one replica of every gradient per rank)
    makes :meth:`norm` the norm over the whole mesh, each element counted once.
    """

    def __init__(self, model: nn.Module, mesh: DeviceMesh | None = None) -> None:
        # the dense gradients first, then those that are each tensor-parallel rank's share (MoE blocks, qk norms:
        # summed over the tensor-parallel ranks too), expert-parallel experts last (reduced over other ranks):
        # parallel/data_parallel.py
        partial = partial_over_tp(model)

        def reduction_order(p: torch.Tensor) -> int:
            return 2 if is_expert_parameter(p) else 1 if id(p) in partial else 0

        self.params = sorted((p for p in model.parameters() if p.requires_grad), key=reduction_order)
        self.dense_numel = sum(local_tensor(p).numel() for p in self.params if not is_expert_parameter(p))
        shares = [local_tensor(p).numel() for p in self.params if id(p) in partial and not is_expert_parameter(p)]
        self.tp_partials = slice(self.dense_numel - sum(shares), self.dense_numel)  # in the flat buffer
        self.locals = [local_tensor(p) for p in self.params]
        device = self.locals[0].device
        total = sum(t.numel() for t in self.locals)
        self.flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.grads: list[torch.Tensor] = []
        offset = 0
        self._hooks = []
        for p, local in zip(self.params, self.locals):
            view = self.flat[offset : offset + local.numel()].view_as(local)
            offset += local.numel()
            p.main_grad = view if p is local else DTensor.from_local(
                view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
            self.grads.append(view)
            self._hooks.append(p.register_post_accumulate_grad_hook(_accumulate_main_grad))
        self.mesh = mesh
        self.counted = [g for p, g in zip(self.params, self.grads) if counted_here(p, mesh)]
        self._first: _FirstWrites | None = None  # overwrite_first's hook and this step's untouched buffers

    def zero(self) -> None:
        self.flat.zero_()

    def overwrite_first(self) -> None:
        """From now on a step's first gradient of each parameter is copied into ``main_grad`` (later ones are
        added), and :meth:`end_accumulation` zeroes only the buffers no gradient reached: the same sums as zeroing
        first (``0 + g`` is ``g``; a ``-0.0`` stays ``-0.0``, which compares and computes as ``0.0``), with
        one pass over the buffer fewer, and one read fewer, per step.

        Only for a trainer whose step does nothing else with the buffers before :meth:`end_accumulation`: no
        per-layer graph adding into ``main_grad`` itself (the hooks stop offering that), no reduction started
        during the backward, no pipeline schedule, plain (not DTensor) parameters."""
        if any(p is not local for p, local in zip(self.params, self.locals)):
            raise ValueError("GradBuffers.overwrite_first: DTensor parameters (tensor parallel, FSDP2) keep the "
                             "zeroed buffers")
        for h in self._hooks:
            h.remove()
        self._first = _FirstWrites()
        self._by_id = {id(p): g for p, g in zip(self.params, self.grads)}  # copied into the hook every step
        self._hooks = [p.register_post_accumulate_grad_hook(self._first) for p in self.params]

    def start_step(self) -> None:
        """Before a step's first backward: zero the buffers, or (:meth:`overwrite_first`) mark them all
        unwritten."""
        if self._first is None:
            self.zero()
        else:
            self._first.unwritten = dict(self._by_id)

    def end_accumulation(self) -> None:
        """After a step's last backward, before anything reads the buffers: zero those no gradient reached."""
        if self._first is not None and self._first.unwritten:
            foreach_zero_(list(self._first.unwritten.values()))
            self._first.unwritten = {}

    def norm(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The L2 norm of the whole gradient: this rank's buffer, or summed over the mesh (no host read); written
        into ``out`` (a float32 scalar) when given.

        Per gradient tensor first, then the norm of those norms on one rank (one kernel), their squares summed
        and all-reduced over a mesh: torch's CPU ``vector_norm`` of the whole fp32 buffer at once came out 6e-5
        below the float64 norm on a tiny MoE model (239k elements), where the per-tensor norms kept 2e-7."""
        counted = self.grads if self.mesh is None else self.counted
        norms = torch.stack(foreach_norm(counted, 2.0)) if counted else None
        if norms is not None and self.mesh is None:  # the norm of the per-tensor norms: one kernel after the stack
            return torch.linalg.vector_norm(norms, out=out)
        if norms is not None:
            square = norms.square().sum()
        else:
            square = torch.zeros((), dtype=torch.float32, device=self.flat.device)
        if self.mesh is not None:
            dist.all_reduce(square, op=dist.ReduceOp.SUM)  # every rank of the mesh: the default group
        return torch.sqrt(square, out=out)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


class _FirstWrites:
    """GradBuffers.overwrite_first's hook: a parameter's first gradient of the step copied into ``main_grad``,
    later ones added. It holds the step's untouched buffers by parameter id and never a parameter: autograd keeps
    a tensor's hooks where the garbage collector does not look, so a hook reaching its own parameter would keep
    the model and its buffers alive after the run. Not marked MAIN_GRAD_HOOK_FLAG: a per-layer graph adding into
    ``main_grad`` itself would skip the copy."""

    def __init__(self) -> None:
        self.unwritten: dict[int, torch.Tensor] = {}

    def __call__(self, p: torch.Tensor) -> None:
        if self.unwritten.pop(id(p), None) is None:
            _accumulate_main_grad(p)
            return
        p.main_grad.copy_(p.grad)
        p.grad = None


def _accumulate_main_grad(p: torch.Tensor) -> None:
    # fp32 accumulation into the fixed buffer; dropping .grad keeps no second
    # copy alive and lets the next micro-batch start from None again.
    p.main_grad.add_(p.grad)
    p.grad = None


# Per-layer graphs may add the gradient into main_grad inside the backward graph instead
# of returning it to autograd: this hook does nothing else, so skipping it is unobservable.
setattr(_accumulate_main_grad, MAIN_GRAD_HOOK_FLAG, True)


LR_TABLE_MAX = 1 << 24  # entries (64 MiB of float32; exact update numbers in float32 up to 2**24)


@dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up then cosine/linear/constant decay, evaluated on the device."""

    max_lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    style: str = "cosine"

    def __call__(self, step: torch.Tensor) -> torch.Tensor:
        """LR of update number ``step`` (1-based, a float32 device tensor)."""
        warm = self.max_lr * step / max(1, self.warmup_iters)
        span = max(1, self.decay_iters - self.warmup_iters)
        ratio = ((step - self.warmup_iters) / span).clamp(0.0, 1.0)
        if self.style == "cosine":
            decayed = self.min_lr + 0.5 * (self.max_lr - self.min_lr) * (torch.cos(math.pi * ratio) + 1.0)
        elif self.style == "linear":
            decayed = self.min_lr + (self.max_lr - self.min_lr) * (1.0 - ratio)
        else:
            assert self.style == "constant", f"scheduler.lr_decay_style={self.style!r}: rule V allows no other value"
            decayed = torch.full_like(step, self.max_lr)
        return torch.where(step <= self.warmup_iters, warm, decayed)

    def at(self, step: int) -> float:
        """The same schedule on the host (for docs and tests)."""
        return float(self(torch.tensor(float(step))))

    def table(self, device: torch.device | str) -> torch.Tensor | None:
        """The LR of every update number from 0 to the last one where the schedule still changes, as a float32
        tensor on ``device`` (each entry computed by :meth:`__call__`); later updates take the last entry. None when
        that would be over ``LR_TABLE_MAX`` entries: the optimizer then computes the schedule every step."""
        n = max(self.warmup_iters, self.decay_iters) + 2
        if n > LR_TABLE_MAX:
            return None
        return self(torch.arange(n, dtype=torch.float32, device=device))


def _no_decay(name: str, p: torch.Tensor) -> bool:
    # Megatron's default: no weight decay for biases and 1-D (norm) weights.
    return name.endswith(".bias") or p.dim() == 1


class AdamW:
    """AdamW over fp32 master weights; ``step()`` returns device tensors only.

    ``step()`` returns ``{"grad_norm", "lr", "found_nonfinite"}`` (device
    tensors owned by the optimizer when it is captured in a graph);
    ``found_nonfinite`` only with ``check_nonfinite`` (``train.check_for_nan_on_device``),
    which skipping a non-finite update needs.
    """

    def __init__(
        self,
        model: nn.Module,
        grads: GradBuffers,
        schedule: LRSchedule,
        *,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        clip_grad: float = 0.0,
        skip_on_nonfinite: bool = False,
        check_nonfinite: bool = True,
        fused: bool | None = None,
    ) -> None:
        self.grads = grads
        self.schedule = schedule
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.clip_grad, self.check_nonfinite = clip_grad, check_nonfinite
        self.skip_on_nonfinite = skip_on_nonfinite and check_nonfinite
        names = {id(p): n for n, p in model.named_parameters()}
        device = grads.flat.device
        self.fused = (device.type == "cuda") if fused is None else fused
        self.model_params = grads.locals  # this rank's part of each parameter (itself when not sharded)
        self.master = [p.detach() if p.dtype == torch.float32 else p.detach().float() for p in self.model_params]
        self.needs_copy_back = [m is not p for m, p in zip(self.master, self.model_params)]
        self.exp_avg = [torch.zeros_like(m) for m in self.master]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.master]
        self.step_t = torch.zeros((), dtype=torch.float32, device=device)
        self.lr_t = torch.zeros((), dtype=torch.float32, device=device)
        self.lr_table = schedule.table(device)
        self.grad_norm = torch.zeros((), dtype=torch.float32, device=device)
        self.found = torch.zeros((), dtype=torch.float32, device=device)
        decay = [not _no_decay(names.get(id(p), ""), p) for p in grads.params]
        self.groups = [
            [i for i, d in enumerate(decay) if d],
            [i for i, d in enumerate(decay) if not d],
        ]

    # ------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "step": self.step_t.clone(),
            "master": [m.clone() for m in self.master],
            "exp_avg": [t.clone() for t in self.exp_avg],
            "exp_avg_sq": [t.clone() for t in self.exp_avg_sq],
        }

    def load_state_dict(self, state: dict) -> None:
        """Copy in place: addresses a captured graph uses stay valid."""
        self.step_t.copy_(state["step"])
        for dst_list, key in ((self.master, "master"), (self.exp_avg, "exp_avg"), (self.exp_avg_sq, "exp_avg_sq")):
            if len(state[key]) != len(dst_list):
                raise ValueError(f"optimizer state {key!r} has {len(state[key])} tensors, expected {len(dst_list)}")
            for dst, src in zip(dst_list, state[key]):
                dst.copy_(src)
        self._copy_back()

    # ------------------------------------------------------------------
    def step(self, extra_nonfinite: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Clip, schedule and update; no host sync anywhere."""
        grads = self.grads.grads
        norm = self.grads.norm(out=self.grad_norm)
        if self.check_nonfinite:
            if extra_nonfinite is None:
                nonfinite(norm, out=self.found)
            else:
                torch.logical_or(nonfinite(norm), extra_nonfinite != 0, out=self.found)
        # clipping: the gradients divided by max(norm / clip, 1) -- inside the fused update (its grad_scale), or over
        # the flat buffer; three kernels, and the fused update makes no pass over the gradients of its own for it
        scale = torch.add(norm, 1e-6).div_(self.clip_grad).clamp_(min=1.0) if self.clip_grad > 0 else None
        if scale is not None and not self.fused:
            self.grads.flat.div_(scale)
        if self.skip_on_nonfinite:
            self.step_t.add_(1.0 - self.found)
        else:
            self.step_t.add_(1.0)
        self._set_lr()
        skip = self.found if self.skip_on_nonfinite else None
        for group, wd in zip(self.groups, (self.weight_decay, 0.0)):
            if group:
                self._update([self.master[i] for i in group], [grads[i] for i in group],
                             [self.exp_avg[i] for i in group], [self.exp_avg_sq[i] for i in group], wd, skip, scale)
        self._copy_back()
        if not self.check_nonfinite:
            return {"grad_norm": self.grad_norm, "lr": self.lr_t}
        return {"grad_norm": self.grad_norm, "lr": self.lr_t, "found_nonfinite": self.found}

    def _set_lr(self) -> None:
        """``lr_t`` = the schedule at ``step_t``: the table's entry (three kernels), or the formula without a table."""
        if self.lr_table is None:
            self.lr_t.copy_(self.schedule(self.step_t))
            return
        index = self.step_t.long().clamp_(max=len(self.lr_table) - 1)
        torch.index_select(self.lr_table, 0, index.view(1), out=self.lr_t.view(1))

    def _copy_back(self) -> None:
        pairs = [(p, m) for p, m, c in zip(self.model_params, self.master, self.needs_copy_back) if c]
        if pairs:
            with torch.no_grad():
                foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    def _update(self, params, grads, m, v, wd: float, skip: torch.Tensor | None,
                grad_scale: torch.Tensor | None) -> None:
        beta1, beta2 = self.betas
        if self.fused:
            fused_adamw_(
                params, grads, m, v, [], [self.step_t] * len(params),
                lr=self.lr_t, beta1=beta1, beta2=beta2, weight_decay=wd, eps=self.eps,
                amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=skip,
            )
            return
        if skip is not None:
            keep = [t.clone() for t in params + m + v]
        _foreach_adamw(params, grads, m, v, self.step_t, self.lr_t, beta1, beta2, wd, self.eps)
        if skip is not None:
            with torch.no_grad():
                for cur, old in zip(params + m + v, keep):
                    cur.copy_(torch.where(skip != 0, old, cur))


def nonfinite(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """1.0 where ``x`` is infinite or NaN, else 0.0 (float32, into ``out`` when given), in two kernels
    (``isfinite`` and its negation take five): ``x - x`` is 0 for every finite ``x`` and NaN for the others."""
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    return torch.ne(x - x, 0.0, out=out)


@torch.no_grad()
def _foreach_adamw(params, grads, m, v, step, lr, beta1, beta2, wd, eps) -> None:
    """torch.optim.AdamW's update with a tensor step and LR (no host reads)."""
    if wd != 0.0:
        foreach_mul_(params, 1.0 - lr * wd)
    foreach_lerp_(m, grads, 1.0 - beta1)
    foreach_mul_(v, beta2)
    foreach_addcmul_(v, grads, grads, value=1.0 - beta2)
    bias1 = 1.0 - torch.pow(beta1, step)
    bias2_sqrt = torch.sqrt(1.0 - torch.pow(beta2, step))
    step_size = lr / bias1
    denom = foreach_sqrt(v)
    foreach_div_(denom, bias2_sqrt)
    foreach_add_(denom, eps)
    updates = foreach_div(m, denom)
    foreach_mul_(updates, -step_size)
    foreach_add_(params, updates)


def build_optimizer(cfg, model: nn.Module, grads: GradBuffers) -> AdamW:
    """The AdamW and LR schedule a config describes (``optimizer``, ``scheduler``, ``train`` sections)."""
    o, s = cfg.optimizer, cfg.scheduler
    schedule = LRSchedule(o.lr, o.min_lr, s.lr_warmup_iters, s.lr_decay_iters or cfg.train.train_iters, s.lr_decay_style)
    return AdamW(
        model, grads, schedule, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
        weight_decay=o.weight_decay, clip_grad=o.clip_grad, skip_on_nonfinite=cfg.train.skip_step_on_nan,
        check_nonfinite=cfg.train.check_for_nan_on_device,
    )
