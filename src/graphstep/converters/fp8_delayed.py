"""FP8 delayed scaling (``fp8_recipe=delayed``): an amax history per tensor, updated inside the step, on the device.

Transformer Engine's ``DelayedScaling`` recipe, which torchao dropped, in plain PyTorch over ``torch._scaled_mm``
(engines_compat.scaled_mm). :class:`DelayedFloat8Linear` replaces a decoder layer's ``nn.Linear`` (the same
``weight`` parameter) and owns two persistent buffers on the weight's device:

* ``fp8_amax_history`` -- ``(fp8_amax_history_len, 3)`` fp32, columns input, weight, grad_output. Row 0 is the
  current step's: every training forward takes ``max(row 0, amax(x))`` and ``max(row 0, amax(w))``, every
  backward ``max(row 0, amax(grad_output))`` (so micro-batches, and a recomputed forward, add nothing new);
* ``fp8_scale`` -- ``(3,)`` fp32, the scales the casts use: ``fp8 = saturate(hp * scale)``, and the matmul
  multiplies by ``1 / scale``. They start at 1.

:meth:`DelayedScaling.update` runs once at the end of every training step (training/step.py's ``after_backward``:
inside the full-iteration graph when there is one) with tensor ops only -- no ``.item()``, no host sync:

1. with data-parallel replicas, row 0 of every history is all-reduced with MAX in one collective (TE's
   ``reduce_amax``), so every replica casts with the same scales;
2. ``amax`` = the maximum over the whole history (``fp8_amax_compute_algo=max``) or row 0 (``most_recent``);
3. ``scale = fp8_max / amax / 2**fp8_margin`` (fp8_max 448 for e4m3, 57344 for e5m2), kept as it was where
   ``amax`` is 0 or not finite;
4. the history rolls one row (row 0 moves to the end, the oldest row is dropped) and row 0 is zeroed.

This is TE's ``amax_and_scale_update``: the scales of step ``t`` come from the amaxes of the steps before it.
``fp8=hybrid`` casts input and weight to e4m3 and grad_output to e5m2; ``fp8=e4m3`` all three to e4m3.
Evaluation forwards (``model.eval()`` or no grad) record nothing. The histories and scales are module
buffers, so checkpoints save and restore them (the resumed run continues exactly).

With ``weight_casts_per_step`` (converters/fp8.py :class:`~graphstep.converters.fp8.WeightCastCache`) the weight
is cast once per step: the scales change only in the end-of-step update and the weight only in the optimizer
step, so the step's first training forward records the weight's amax and casts it (and makes the backward's
column-major copy), and the later micro-batches reuse both -- recording the same amax again would leave row 0 as
it is, so the histories and scales are the uncached ones bit for bit.

Under torch.compile the module traces whole (no graph break): the forward's casts and amax records are plain
tensor ops of :meth:`DelayedFloat8Linear.forward`, and the autograd function holds the matmuls and the backward's
grad_output cast and record, every tensor it reads or writes one of its arguments -- AOTAutograd keeps that
in-place update of a buffer in the backward graph. As the scale is known before the cast, the cast of a tensor
needs no pass of its own: Inductor can fuse it with the tensor's producer (the norm, the SwiGLU) and with the
amax, which is taken per row and then over the rows (``max`` is exact, so the value is the one-reduction one) --
the shape of reduction Inductor fuses with a pointwise loop over the same rows.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..engines_compat import scaled_mm

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
ALGOS = ("max", "most_recent")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)  # 448 (e4m3), 57344 (e5m2): TE's fp8_dtype_max


def cast_to_fp8(hp: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``saturate(hp * scale)`` in ``dtype`` (the multiply in fp32, as torchao's and TE's casts)."""
    limit = fp8_max(dtype)
    return (hp.float() * scale).clamp(min=-limit, max=limit).to(dtype)


def _record(history: torch.Tensor, column: int, hp: torch.Tensor) -> None:
    """Row 0 of ``history`` at ``column`` becomes ``max(itself, amax(hp))``, in place."""
    slot = history[0, column]
    amax = torch.linalg.vector_norm(hp.detach(), float("inf"), dim=-1).amax()  # max |hp| (exact: no rounding)
    torch.maximum(slot, amax.float(), out=slot)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


class _DelayedMatmul(torch.autograd.Function):
    """``x @ weight.t()`` from the FP8 casts the module made (``x8``, ``w8``); the backward casts grad_output with
    ``scale[GRAD_OUTPUT]`` and, when ``record``, records its amax into ``history``.

    Every tensor it reads or writes is an argument (no module, no host value but the flags), so torch.compile
    traces it whole: the history is a graph input that the backward mutates (AOTAutograd keeps such a mutation of
    a buffer in the backward graph and writes it back there)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, x8: torch.Tensor, x_inv: torch.Tensor,
                w8: torch.Tensor, w8_col: torch.Tensor, w_inv: torch.Tensor, history: torch.Tensor,
                scale: torch.Tensor, record: bool, grad_dtype: torch.dtype) -> torch.Tensor:
        out = scaled_mm(x8, w8.t(), x_inv, w_inv, x.dtype, fast_accum=True)
        ctx.save_for_backward(x8, w8_col, x_inv, w_inv, history, scale)
        ctx.record, ctx.grad_dtype, ctx.x_shape, ctx.dtypes = record, grad_dtype, x.shape, (x.dtype, weight.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x8, w8_col, x_inv, w_inv, history, scale = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        g_scale = scale[GRAD_OUTPUT].clone()
        g8 = cast_to_fp8(g2, g_scale, ctx.grad_dtype)
        if ctx.record:
            _record(history, GRAD_OUTPUT, g2)
        g_inv = g_scale.reciprocal()
        x_dtype, w_dtype = ctx.dtypes
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_mm(g8, w8_col, g_inv, w_inv, x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = scaled_mm(g8.t().contiguous(), _column_major(x8), g_inv, x_inv, w_dtype)
        return grad_x, grad_w, *(None,) * 9


# a weight's casts: the FP8 weight, its column-major copy (the input-gradient matmul's operand), 1 / scale
WeightCasts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class DelayedFloat8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in FP8 with delayed scaling (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, history_len: int, fmt: str,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fmt = fmt
        self.forward_dtype = E4M3
        self.backward_dtype = E5M2 if fmt == "hybrid" else E4M3
        buf_device = self.weight.device
        self.register_buffer("fp8_amax_history", torch.zeros(history_len, 3, dtype=torch.float32, device=buf_device))
        self.register_buffer("fp8_scale", torch.ones(3, dtype=torch.float32, device=buf_device))

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, history_len: int, fmt: str) -> DelayedFloat8Linear:
        """A module over ``linear``'s own parameters (the same objects: the optimizer and checkpoints see no
        difference), its buffers on the weight's device."""
        new = cls(linear.in_features, linear.out_features, bias=False, history_len=history_len, fmt=fmt,
                  device="meta", dtype=linear.weight.dtype)
        new.weight, new.bias = linear.weight, linear.bias
        device = linear.weight.device
        new.fp8_amax_history = torch.zeros(history_len, 3, dtype=torch.float32, device=device)
        new.fp8_scale = torch.ones(3, dtype=torch.float32, device=device)
        return new

    weight_casts_per_step = False  # WeightCastCache (converters/fp8.py) turns it on
    weight_casts_made = 0  # counted where the casts are cached (a host count: no Python state under torch.compile)
    _weight_casts: WeightCasts | None = None

    def drop_weight_casts(self) -> None:
        self._weight_casts = None

    @torch.no_grad()
    def cast_weight(self, record: bool) -> WeightCasts:
        """The weight's amax recorded (training forwards) and its casts with this step's weight scale."""
        w_scale = self.fp8_scale[WEIGHT].clone()
        w8 = cast_to_fp8(self.weight, w_scale, self.forward_dtype)
        if record:
            _record(self.fp8_amax_history, WEIGHT, self.weight)
        if self.weight_casts_per_step:
            self.weight_casts_made += 1
        return w8, _column_major(w8), w_scale.reciprocal()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        record = self.training and torch.is_grad_enabled()
        x2 = x.reshape(-1, x.shape[-1])
        if record and self.weight_casts_per_step:
            if self._weight_casts is None:  # the step's first training forward of this layer
                self._weight_casts = self.cast_weight(record)
            w8, w8_col, w_inv = self._weight_casts
        else:
            w8, w8_col, w_inv = self.cast_weight(record)
        x_scale = self.fp8_scale[INPUT].clone()
        x8 = cast_to_fp8(x2.detach(), x_scale, self.forward_dtype)
        if record:
            _record(self.fp8_amax_history, INPUT, x2)
        out = _DelayedMatmul.apply(x, self.weight, x8, x_scale.reciprocal(), w8, w8_col, w_inv,
                                   self.fp8_amax_history, self.fp8_scale, record, self.backward_dtype)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fmt}, delayed scaling, history={self.fp8_amax_history.shape[0]}"


class DelayedScaling:
    """The once-per-step update of every :class:`DelayedFloat8Linear` of a model (see the module docstring).

    Args:
        modules: the converted modules, in a fixed order (the order of the stacked histories).
        margin: ``fp8_margin``; algo: ``fp8_amax_compute_algo`` (max or most_recent).
        reduce: max-reduces a tensor in place over the data-parallel replicas (a device all-reduce), so
            they share their amaxes; None: one replica.
    """

    def __init__(self, modules: list[DelayedFloat8Linear], *, margin: int, algo: str,
                 reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        if algo not in ALGOS:
            raise ValueError(f"fp8_amax_compute_algo={algo!r}: one of {', '.join(ALGOS)}")
        self.modules = modules
        self.algo = algo
        self.reduce = reduce
        self.margin = margin
        first = modules[0]
        # the largest scaled value per column (input, weight in the forward format; grad_output in the backward's)
        self.scaled_max = torch.tensor([fp8_max(first.forward_dtype), fp8_max(first.forward_dtype),
                                        fp8_max(first.backward_dtype)], dtype=torch.float32,
                                       device=first.fp8_scale.device) * (2.0 ** -margin)

    def update(self) -> None:
        """Reduce, compute the next scales from the histories, roll: tensor ops only (no host sync)."""
        with torch.no_grad():
            history = torch.stack([m.fp8_amax_history for m in self.modules], dim=1)  # (len, modules, 3)
            scale = torch.stack([m.fp8_scale for m in self.modules])  # (modules, 3)
            if self.reduce is not None:
                self.reduce(history[0])
            amax = history.amax(dim=0) if self.algo == "max" else history[0]
            usable = (amax > 0) & torch.isfinite(amax)
            scale = torch.where(usable, self.scaled_max / amax, scale)
            history = history.roll(-1, dims=0)
            history[0].zero_()
            for i, m in enumerate(self.modules):
                m.fp8_amax_history.copy_(history[:, i])
                m.fp8_scale.copy_(scale[i])


def convert(model: nn.Module, eligible: Any, *, history_len: int, fmt: str) -> list[str]:
    """Swap every ``nn.Linear`` for which ``eligible(module, name)`` holds for a :class:`DelayedFloat8Linear`,
    in place. Returns the converted names."""
    converted: list[str] = []
    for name, module in list(model.named_modules()):
        if not eligible(module, name):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, DelayedFloat8Linear.from_linear(module, history_len=history_len, fmt=fmt))
        converted.append(name)
    return converted


def delayed_modules(model: nn.Module) -> list[DelayedFloat8Linear]:
    return [m for m in model.modules() if isinstance(m, DelayedFloat8Linear)]
