"""FP8 training of the decoder layers' linear layers, on torchao's float8 (Megatron Bridge's ``mixed_precision``).

Megatron Bridge's FP8 recipes run Transformer Engine's FP8 linear layers; graphstep runs torchao's
``Float8Linear`` (``convert_to_float8_training``), pure PyTorch over ``torch._scaled_mm``:

* ``fp8_recipe=tensorwise`` is Bridge's current scaling: each operand is scaled by its own amax, computed on the
  device in the same step (no history, no host sync), so a graph replays it exactly; ``fp8=hybrid`` casts the
  forward operands to e4m3 and the gradients to e5m2 (torchao's default), ``fp8=e4m3`` all of them to e4m3;
* ``fp8_recipe=delayed`` is Bridge's delayed scaling (Transformer Engine's ``DelayedScaling``: an amax history per
  tensor, ``fp8_amax_history_len`` rows, ``fp8_amax_compute_algo``, ``fp8_margin``), which torchao dropped:
  graphstep's own :class:`~graphstep.converters.fp8_delayed.DelayedFloat8Linear`, whose histories and scales are
  module buffers updated inside the step (converters/fp8_delayed.py);
* ``rowwise`` and ``rowwise_with_gw_hp`` are torchao's row-wise scalings (a graphstep extension; all e4m3, the
  second keeps the weight-gradient matmul in high precision);
* ``first_last_layers_bf16`` keeps ``num_layers_at_start_in_bf16`` leading and ``num_layers_at_end_in_bf16``
  trailing decoder layers in bf16, as Bridge does;
* the embedding, the output layer, the MoE routers and experts (not ``nn.Linear``) stay in bf16, as do linear
  layers whose dimensions ``torch._scaled_mm`` cannot take (not multiples of 16).

The parameters stay bf16 (or fp32) ``nn.Parameter`` objects -- the same ones, so checkpoints and the optimizer
see no difference -- and the step casts them (the cast of a weight is part of the step, inside the graph).

Weight casts once per step (:class:`WeightCastCache`, as Transformer Engine caches its FP8 weights across
micro-batches): a weight changes only in the optimizer step, so within a training step every micro-batch would
cast the same weight to the same FP8 tensor. With ``tensorwise`` and ``delayed`` scaling the first micro-batch's
training forward casts it -- the scale, the FP8 weight and its transposed (column-major) copy for the backward's
input-gradient matmul -- and the step's later micro-batches (and recomputed forwards) reuse them; the first
training forward of the next step casts again. Inside a full-iteration graph the casts are the graph's own
tensors, written by the first micro-batch's part of every replay. The casts are deterministic, so the losses and
weights are the uncached program's bit for bit (tests/integration/test_fp8_weight_casts.py). Evaluation forwards
cast as before. Not with per-layer graphs (one layer graph serves every micro-batch, so it cannot cast at the
first and reuse at the others), torch.compile, FSDP2 (the cache would keep every gathered weight's FP8 copy for
the whole step) or the row-wise recipes (their weight casts for the forward and the backward differ): there each
use casts, as torchao does.

What does not combine is refused by rule R32 (docs/rules.md).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..engines_compat import dtensor_local, fsdp_float8_scale, fsdp_float8_weight, set_fsdp_float8_scale
from ..models.transformer import decoder_layer_of
from . import fp8_delayed

RECIPES = ("tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp")
TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
FORMATS = ("e4m3", "hybrid")
ALIGN = 16  # torch._scaled_mm takes operands whose dimensions are multiples of 16


@dataclass(frozen=True)
class FP8Plan:
    """What to convert: the scaling recipe, the format, and the decoder layers kept in bf16."""

    recipe: str
    format: str
    bf16_layers: frozenset[int]
    fsdp_all_gather: bool = False  # FSDP2 with fp8_param_gather: torchao's FP8 all-gather of the weights
    margin: int = 0  # delayed scaling only: fp8_margin, fp8_amax_history_len, fp8_amax_compute_algo
    history_len: int = 1
    amax_algo: str = "most_recent"

    def describe(self, converted: int, total: int) -> str:
        kept = f"; decoder layers {sorted(self.bf16_layers)} kept in bf16" if self.bf16_layers else ""
        engine = "torchao float8" if self.recipe in TORCHAO_RECIPES else (
            f"graphstep, amax history {self.history_len} ({self.amax_algo}), margin {self.margin}")
        return (f"FP8 ({engine}, {self.recipe} scaling, {self.format}): {converted} of {total} linear layers"
                f"{kept}; the embedding, the output layer and layers off the 16-multiple shapes in high precision")


def plan_from(mixed_precision: Any, num_layers: int, fsdp: bool = False) -> FP8Plan | None:
    """The plan of a validated config's ``mixed_precision`` section (None without ``fp8``); ``fsdp``: the run
    shards its parameters with FSDP2 and asks for ``fp8_param_gather`` (torchao's FP8 all-gather)."""
    mp = mixed_precision
    if mp.fp8 is None:
        return None
    bf16: set[int] = set()
    if mp.first_last_layers_bf16:
        bf16 |= set(range(min(num_layers, mp.num_layers_at_start_in_bf16)))
        bf16 |= set(range(max(0, num_layers - mp.num_layers_at_end_in_bf16), num_layers))
    return FP8Plan(recipe=str(mp.fp8_recipe), format=str(mp.fp8), bf16_layers=frozenset(bf16), fsdp_all_gather=fsdp,
                   margin=int(mp.fp8_margin), history_len=int(mp.fp8_amax_history_len),
                   amax_algo=str(mp.fp8_amax_compute_algo))


def delayed_scaling(model: nn.Module, plan: FP8Plan, reduce: Any = None) -> fp8_delayed.DelayedScaling | None:
    """The once-per-step scale update of a model converted with ``fp8_recipe=delayed`` (None otherwise, or without
    converted layers); ``reduce``: max-reduces the amaxes over data-parallel replicas in place."""
    modules = fp8_delayed.delayed_modules(model)
    if plan.recipe != "delayed" or not modules:
        return None
    return fp8_delayed.DelayedScaling(modules, margin=plan.margin, algo=plan.amax_algo, reduce=reduce)


class FsdpWeightScales:
    """The FP8 all-gather's weight scales under FSDP2, computed once per step inside the optimizer step.

    With FSDP2 and ``fp8_param_gather``, torchao's ``Float8Linear`` weights are sharded as
    ``WeightWithDynamicFloat8CastTensor``: FSDP2 casts each shard to FP8 before the all-gather, with a scale from
    the whole weight's amax -- an all-reduce per weight and gather, unless a scale was precomputed
    (torchao's ``precompute_float8_dynamic_scale_for_fsdp``, which assigns new tensors every step: a graph
    captured earlier would keep reading the old ones). Here the scales live in one persistent fp32 tensor,
    handed to the weights once (``set_fsdp_float8_scale``), and :meth:`update` -- after every optimizer step,
    inside the optimizer graph when there is one, and once when the run is built -- rewrites it in place from
    the new weights with one MAX all-reduce of their shards' amaxes, with torchao's arithmetic
    (``fp8_max / max(amax, EPS)`` in float64, then fp32), so the gathered FP8 weights are the ones torchao's own
    per-gather scaling would give.
    """

    def __init__(self, model: nn.Module, reduce: Any) -> None:
        from torch.distributed.tensor import DTensor

        import_torchao()
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.float8_utils import EPS

        self.eps = EPS
        self.locals = [dtensor_local(m.weight) for m in model.modules()
                       if isinstance(m, Float8Linear) and isinstance(m.weight, DTensor)
                       and fsdp_float8_weight(dtensor_local(m.weight))]
        self.reduce = reduce
        self.fp8_max = float(torch.finfo(torch.float8_e4m3fn).max)
        device = self.locals[0].device if self.locals else torch.device("cpu")
        self.scales = torch.ones(len(self.locals), dtype=torch.float32, device=device)
        for i, local in enumerate(self.locals):
            set_fsdp_float8_scale(local, self.scales[i])

    def __len__(self) -> int:
        return len(self.locals)

    @torch.no_grad()
    def update(self) -> None:
        """The scales of the current weights: tensor ops and one all-reduce, no host sync."""
        amax = torch.stack([torch.linalg.vector_norm(local, float("inf")).float() for local in self.locals])
        self.reduce(amax)  # the whole weights' amaxes from the shards'
        scale = self.fp8_max / torch.clamp(amax.to(torch.float64), min=self.eps)
        self.scales.copy_(scale.to(torch.float32))

    def installed(self) -> bool:
        """Whether every weight still reads its scale from :attr:`scales` (FSDP2 kept the shards' tensors)."""
        return all(fsdp_float8_scale(local) is not None and fsdp_float8_scale(local).data_ptr()
                   == self.scales[i].data_ptr() for i, local in enumerate(self.locals))


def fsdp_weight_scales(model: nn.Module, plan: FP8Plan, reduce: Any) -> FsdpWeightScales | None:
    """The per-step weight scales of FSDP2's FP8 all-gather (None without it, or without FP8 weights)."""
    if not plan.fsdp_all_gather:
        return None
    scales = FsdpWeightScales(model, reduce)
    return scales if len(scales) else None


def import_torchao() -> Any:
    """``torchao.float8``. Its compiled extensions are not needed for float8 training (they fail to load on some
    Pythons): unless you say otherwise, torchao is told to skip them."""
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    import torchao.float8 as float8

    return float8


def float8_config(recipe: str, fmt: str, fsdp_all_gather: bool = False) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe`` and ``fmt`` (e4m3: the gradients in e4m3 too)."""
    float8 = import_torchao()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    if fmt == "e4m3" and recipe == "tensorwise":
        e4m3 = torch.float8_e4m3fn
        config = dataclasses.replace(
            config,
            cast_config_grad_output=dataclasses.replace(config.cast_config_grad_output, target_dtype=e4m3),
            cast_config_grad_output_for_grad_weight=dataclasses.replace(
                config.cast_config_grad_output_for_grad_weight, target_dtype=e4m3))
    if fsdp_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def _eligible(plan: FP8Plan, module: nn.Module, name: str) -> bool:
    if type(module) is not nn.Linear:
        return False
    layer = decoder_layer_of(name)
    if layer is None or layer in plan.bf16_layers:
        return False  # outside the decoder layers (the output layer), or a layer kept in bf16
    return module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0


def convert(model: nn.Module, plan: FP8Plan) -> tuple[list[str], int]:
    """Swap the eligible ``nn.Linear`` of ``model`` for torchao's ``Float8Linear`` (delayed scaling: graphstep's
    ``DelayedFloat8Linear``), in place, before anything holds on to the modules (tensor parallel, FSDP2, graphs).
    Returns the converted names and the number of linears."""
    total = sum(1 for m in model.modules() if type(m) is nn.Linear)
    if plan.recipe == "delayed":
        names = fp8_delayed.convert(model, lambda module, name: _eligible(plan, module, name),
                                    history_len=plan.history_len, fmt=plan.format)
        return names, total
    float8 = import_torchao()
    converted: list[str] = []

    def take(module: nn.Module, name: str) -> bool:
        if _eligible(plan, module, name):
            converted.append(name)
            return True
        return False

    float8.convert_to_float8_training(model, module_filter_fn=take,
                                      config=float8_config(plan.recipe, plan.format, plan.fsdp_all_gather))
    return converted, total


# --------------------------------------------------------------------------
# weight casts once per step


class WeightCastCache:
    """The once-per-step weight casts of a model's FP8 linear layers (module docstring).

    :meth:`begin_step` runs at the start of every training step (training/step.py's ``before_step``), on the
    host: it drops the previous step's casts, so the step's first training forward of each layer casts anew.
    :attr:`casts` counts the weight casts made (a host count of the eager and captured calls, not of replays).
    """

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        for m in modules:
            m.weight_casts_per_step = True
            m.drop_weight_casts()

    def __len__(self) -> int:
        return len(self.modules)

    def begin_step(self) -> None:
        for m in self.modules:
            m.drop_weight_casts()

    @property
    def casts(self) -> int:
        return sum(m.weight_casts_made for m in self.modules)


def cache_weight_casts(model: nn.Module, plan: FP8Plan) -> WeightCastCache | None:
    """Make the FP8 linear layers of ``model`` cast their weights once per training step (module docstring):
    ``tensorwise`` (torchao's ``Float8Linear`` without the FP8 all-gather) and ``delayed`` scaling. None when no
    layer qualifies. The caller calls ``begin_step`` at the start of every training step."""
    if plan.recipe == "delayed":
        modules: list[nn.Module] = list(fp8_delayed.delayed_modules(model))
    elif plan.recipe == "tensorwise" and not plan.fsdp_all_gather:
        cls = _once_per_step_float8_linear()
        modules = [m for m in model.modules() if isinstance(m, cls.__mro__[1])]
        for m in modules:
            m.__class__ = cls  # the same module, its forward reusing the step's casts (FSDP2 swaps classes alike)
    else:
        return None
    return WeightCastCache(modules) if modules else None


@functools.cache
def _once_per_step_float8_linear() -> type:
    """``OncePerStepFloat8Linear``, made on first use (torchao is imported only by FP8 runs)."""
    import_torchao()
    from torchao.float8.config import ScalingType
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    def cast(t: torch.Tensor, cast_config: Any, role: Any, mm_config: Any, config: Any, dim: int) -> torch.Tensor:
        """``t`` cast as torchao's Float8Linear casts it (high precision where the config disables the cast)."""
        if cast_config.scaling_type is ScalingType.DISABLED:
            return t
        return hp_tensor_to_float8_dynamic(t, cast_config.target_dtype, mm_config, gemm_input_role=role,
                                           scaling_granularity=cast_config.scaling_granularity,
                                           axiswise_dim=get_maybe_axiswise_dim(dim, cast_config.scaling_granularity),
                                           round_scales_to_power_of_2=config.round_scales_to_power_of_2)

    class CachedWeightMatmul(torch.autograd.Function):
        """torchao's Float8Linear matmul (``x @ w_t``, forward and backward with the same casts and gemm
        configs) with the weight's two casts given: ``w8_t`` for the forward, ``w8_t_for_grad`` (row-major, so
        its transpose is the column-major operand the input-gradient matmul takes) for the backward."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, weight_t: torch.Tensor, w8_t: torch.Tensor,
                    w8_t_for_grad: torch.Tensor, mm_config: Any, config: Any) -> torch.Tensor:
            ctx.save_for_backward(x, w8_t_for_grad)
            ctx.mm_config, ctx.config = mm_config, config
            x8 = cast(x, config.cast_config_input, GemmInputRole.INPUT, mm_config, config, -1)
            out = torch.mm(x8.reshape(-1, x8.shape[-1]), w8_t)
            return out.reshape(*x8.shape[:-1], out.shape[-1])

        @staticmethod
        def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            x, w8_t_for_grad = ctx.saved_tensors
            c, mm_config = ctx.config, ctx.mm_config
            g = grad_out.reshape(-1, grad_out.shape[-1])
            g8 = cast(g, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, mm_config, c, -1)
            grad_x = torch.mm(g8, w8_t_for_grad.t()).reshape(*grad_out.shape[:-1], -1)
            x2 = x.reshape(-1, x.shape[-1])
            g8_w = cast(g, c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT, mm_config, c, 0)
            x8_w = cast(x2, c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, mm_config, c, 0)
            grad_w = torch.mm(g8_w.t(), x8_w)
            return grad_x, grad_w.t(), None, None, None, None

    class OncePerStepFloat8Linear(Float8Linear):
        """torchao's ``Float8Linear`` (tensorwise) whose training forwards cast the weight once per step."""

        weight_casts_per_step = False

        def drop_weight_casts(self) -> None:
            self._weight_casts: tuple[torch.Tensor, torch.Tensor] | None = None
            self.weight_casts_made = getattr(self, "weight_casts_made", 0)

        @torch.no_grad()
        def _cast_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
            c, weight_t = self.config, self.weight.t()
            w8_t = cast(weight_t, c.cast_config_weight, GemmInputRole.WEIGHT, self.linear_mm_config, c, 0)
            w8_t_for_grad = cast(weight_t, c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT,
                                 self.linear_mm_config, c, -1).contiguous()  # the backward's transposed copy
            self.weight_casts_made += 1
            return w8_t, w8_t_for_grad

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not (self.weight_casts_per_step and self.training and torch.is_grad_enabled()):
                return super().forward(x)
            if torch.is_autocast_enabled():
                x = x.to(torch.get_autocast_gpu_dtype())
            if self._weight_casts is None:  # the step's first training forward of this layer
                self._weight_casts = self._cast_weight()
            out = CachedWeightMatmul.apply(x, self.weight.t(), *self._weight_casts, self.linear_mm_config,
                                           self.config)
            return out + self.bias.to(out.dtype) if self.bias is not None else out

    return OncePerStepFloat8Linear
