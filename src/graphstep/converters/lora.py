"""LoRA and DoRA fine-tuning of the decoder layers' projections (Megatron Bridge's ``peft=lora`` / ``peft=dora``).

``apply_lora(model, plan)`` freezes every parameter of the built model (its weights loaded) and swaps the
decoder layers' target ``nn.Linear`` -- Bridge's names ``linear_qkv``, ``linear_proj``, ``linear_fc1``,
``linear_fc2`` -- for :class:`LoRALinear`, in place, before anything holds on to the modules:

    y = x W^T + b + (alpha / dim) * B(A(dropout(x)))

* the base ``weight`` (and ``bias``) are the same ``nn.Parameter`` objects at the same names, frozen
  (``requires_grad=False``): the gradient buffers and the optimizer (training/optim.py) take only parameters
  that require a gradient, so a frozen weight has no gradient, no fp32 master copy and no Adam moments;
* ``lora_A`` (``dim x in``) and ``lora_B`` (``out x dim``) are the only trainable parameters, in the model's
  dtype; A is initialised as Bridge does (``xavier``: Xavier-uniform; ``uniform``: Kaiming-uniform with
  ``a=sqrt(5)``, PyTorch's ``nn.Linear`` default), B with zeros, so the adapted model starts equal to the base;
* adapter dropout (``dropout_position=pre``: on the adapter's input; ``post``: on its output) draws from the
  RNG tracker's data-parallel stream, as the model's hidden dropout does (models/transformer.py), so a graph
  replays it with the generator state the tracker registers.

DoRA (``peft=dora``, :class:`DoRALinear`, Bridge's ``DoRA`` and the DoRA paper's equation 5) adds a trainable
magnitude ``m`` per output row, initialised to the row norms of ``W + s B A`` (of ``W``: B starts at zero), and
rescales each row of the adapted weight to it:

    y = (m / ||W + s B A||_row) * (x W^T + s B(A(x))) + b

The norm is detached, as in the paper (section 4.3), Bridge and HF peft: it follows B and A but takes no gradient.
With adapter dropout (``pre`` only, as Bridge) the base output of the dropped input is corrected as Bridge and peft
do: ``y = x W^T + (m/n - 1) x_d W^T + (m/n) s B(A(x_d)) + b``. The bias is added after the rescaling (the paper and
peft; Bridge's fused ``linear_qkv`` would rescale a q/k/v bias too).

Under tensor parallel (parallel/tensor_parallel.py) the base weight and the adapters are DTensors sharded as
Megatron shards them -- colwise base: ``lora_A`` replicated, ``lora_B`` (and DoRA's magnitude) by output rows;
rowwise base: ``lora_A`` by input columns, ``lora_B`` and the magnitude replicated -- and the forward above runs
on them unchanged: DTensor's ops put the collectives where the math needs them. DoRA's row norm of a rowwise
weight, whose rows are split over the ranks, is the norm of the whole row (the ranks' partial sums of squares
all-reduced). Adapter dropout drops each rank's local part: a sharded one (a rowwise adapter's input) from the
model-parallel stream, which differs per tensor-parallel rank, a replicated or partial one from the data-parallel
stream, the same on every tensor-parallel rank, so the ranks' parts stay one tensor. Under FSDP2 the frozen base
weights are sharded and gathered like the adapters but take no gradient, so only the adapters' gradients are
reduce-scattered.

Inside a CUDA graph's capture (no adapter dropout, no DTensor, not compiled) the adapter's two GEMMs and its
scaling run on a stream beside the capturing one, so the graph holds them as a branch beside the base GEMM and a
replay runs the two side by side; autograd runs their backward on that stream too, so the backward graph has the
adapter's gradient GEMMs beside the base's. The kernels are those of the plain forward, on other streams only:
the graphed step equals eager bit for bit, and eager runs on one stream (no event per call). Not under FSDP2,
which orders a layer's gradient reduce-scatter after the stream autograd ran the layer's backward on, not after a
second one (``adapter_stream`` off).

``merged_state_dict`` folds the adapters into the base weights (``export_hf`` writes that merged model).
What does not combine (lora_dtype, DoRA's post dropout, pipeline or expert parallel, FP8, MoE and hybrid models)
is refused by rule R33 (docs/rules.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ..cuda_graph.rng import DATA_PARALLEL_RNG, MODEL_PARALLEL_RNG
from ..models.transformer import decoder_layer_of, hidden_dropout

SCHEMES = ("lora", "dora")
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # Bridge's LoRA default: all four
DROPOUT_POSITIONS = ("pre", "post")
A_INITS = ("xavier", "uniform")
B_INITS = ("zero",)


@dataclass(frozen=True)
class LoRAPlan:
    """What to adapt and how: the scheme, target names, rank, scaling, dropout and initialisation."""

    scheme: str
    targets: tuple[str, ...]
    dim: int
    alpha: float
    dropout: float
    dropout_position: str
    a_init: str
    b_init: str

    @property
    def scale(self) -> float:
        return self.alpha / self.dim

    def describe(self, adapted: int, trainable: int, frozen: int) -> str:
        return (f"{'DoRA' if self.scheme == 'dora' else 'LoRA'}: {adapted} linear layers ({', '.join(self.targets)}) with rank {self.dim}, alpha "
                f"{self.alpha:g} (scale {self.scale:g}), dropout {self.dropout:g} ({self.dropout_position}); "
                f"{trainable:,} trainable parameters, {frozen:,} frozen")


def plan_from(peft: Any) -> LoRAPlan | None:
    """The plan of a validated config's ``peft`` section (None with ``peft=null``)."""
    if peft.scheme is None:
        return None
    targets = peft.target_modules if peft.target_modules is not None else list(TARGETS)
    return LoRAPlan(scheme=str(peft.scheme), targets=tuple(str(t) for t in targets), dim=int(peft.dim), alpha=float(peft.alpha),
                    dropout=float(peft.dropout), dropout_position=str(peft.dropout_position),
                    a_init=str(peft.lora_A_init_method), b_init=str(peft.lora_B_init_method))


def adapter_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Adapter dropout (the model's hidden dropout, module docstring); of a DTensor, on this rank's part."""
    if p == 0.0 or not training or not isinstance(x, DTensor):
        return hidden_dropout(x, p, training)
    sharded = any(placement.is_shard() for placement in x.placements)
    local = hidden_dropout(x.to_local(), p, training, MODEL_PARALLEL_RNG if sharded else DATA_PARALLEL_RNG)
    return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


_ADAPTER_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _adapter_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _ADAPTER_STREAMS.get(device)
    if stream is None:
        stream = _ADAPTER_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def _overlap(x: torch.Tensor, module: "LoRALinear") -> bool:
    """Whether this call runs the adapter beside the base GEMM: a plain CUDA tensor in a CUDA graph's capture,
    outside torch.compile, without adapter dropout in effect, and the module's ``adapter_stream`` on."""
    return (module.adapter_stream and not torch.compiler.is_compiling() and type(x) is torch.Tensor and x.is_cuda
            and (module.dropout == 0.0 or not module.training) and torch.cuda.is_current_stream_capturing())


class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``(alpha / dim) * B A``.

    It holds the base layer's own ``weight`` and ``bias`` parameters (same objects, same names), so weights
    loaded before the swap and checkpoints of the base model keep their keys.
    """

    def __init__(self, base: nn.Linear, plan: LoRAPlan) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: the weight exists already
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        w = base.weight
        self.lora_A = nn.Linear(self.in_features, plan.dim, bias=False, device=w.device, dtype=w.dtype)
        self.lora_B = nn.Linear(plan.dim, self.out_features, bias=False, device=w.device, dtype=w.dtype)
        self.alpha, self.scale = plan.alpha, plan.scale
        self.dropout = plan.dropout
        self.dropout_position = plan.dropout_position
        # inside a capture, the adapter on a stream of its own (module docstring); off under FSDP2 (parallel/fsdp.py)
        self.adapter_stream = True
        with torch.no_grad():
            if plan.a_init == "xavier":
                nn.init.xavier_uniform_(self.lora_A.weight)
            else:
                nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _overlap(x, self):
            return self._forward_overlapped(x)
        y = F.linear(x, self.weight, self.bias)
        pre = self.dropout_position == "pre"
        a = adapter_dropout(x, self.dropout, self.training) if pre else x
        update = self.lora_B(self.lora_A(a))
        if not pre:
            update = adapter_dropout(update, self.dropout, self.training)
        return y + update * self.scale

    def _forward_overlapped(self, x: torch.Tensor) -> torch.Tensor:
        """The same kernels as :meth:`forward` without dropout, the adapter's on a stream beside the capturing
        one: the captured graph has the base GEMM and the adapter's branch side by side (module docstring)."""
        main = torch.cuda.current_stream(x.device)
        side = _adapter_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            update = self.lora_B(self.lora_A(x)) * self.scale
        x.record_stream(side)  # x is read on the side stream, in this forward and in the backward
        y = F.linear(x, self.weight, self.bias)
        main.wait_stream(side)
        return y + update

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """``W + (alpha / dim) * B A``, computed in fp32 and cast to the weight's dtype."""
        update = self.lora_B.weight.float() @ self.lora_A.weight.float()
        return (self.weight.float() + self.scale * update).to(self.weight.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"dim={self.lora_A.out_features}, scale={self.scale:g}")


class DoRALinear(LoRALinear):
    """:class:`LoRALinear` plus DoRA's trainable magnitude ``lora_magnitude`` (one per output row): each row of
    ``W + s B A`` is rescaled to its magnitude (module docstring)."""

    def __init__(self, base: nn.Linear, plan: LoRAPlan) -> None:
        super().__init__(base, plan)
        self.lora_magnitude = nn.Parameter(self.weight_norm())  # ||W + s B0 A0||_row = ||W||_row: starts as the base

    def weight_norm(self) -> torch.Tensor:
        """``||W + s B A||`` per output row, in the weight's dtype, detached (no gradient flows through it)."""
        with torch.no_grad():
            update = self.lora_B.weight @ self.lora_A.weight
            return torch.linalg.vector_norm(self.weight + self.scale * update, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rescale = self.lora_magnitude / self.weight_norm()
        y = F.linear(x, self.weight)
        if self.dropout > 0.0 and self.training:  # Bridge's and peft's correction for the dropped input
            dropped = adapter_dropout(x, self.dropout, self.training)
            y = y + (rescale - 1) * F.linear(dropped, self.weight) + rescale * (self.lora_B(self.lora_A(dropped))
                                                                                * self.scale)
        else:
            y = rescale * (y + self.lora_B(self.lora_A(x)) * self.scale)
        return y + self.bias if self.bias is not None else y

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """``m / ||W + s B A||_row * (W + s B A)``, computed in fp32 and cast to the weight's dtype."""
        update = self.lora_B.weight.float() @ self.lora_A.weight.float()
        adapted = self.weight.float() + self.scale * update
        rescale = self.lora_magnitude.float() / torch.linalg.vector_norm(adapted, dim=1)
        return (rescale[:, None] * adapted).to(self.weight.dtype)


ADAPTER_KEYS = ("lora_A.weight", "lora_B.weight", "lora_magnitude")


def _target(name: str, module: nn.Module, targets: tuple[str, ...]) -> bool:
    return (type(module) is nn.Linear and name.rsplit(".", 1)[-1] in targets
            and decoder_layer_of(name) is not None)


def apply_lora(model: nn.Module, plan: LoRAPlan) -> list[str]:
    """Freeze ``model`` and put :class:`LoRALinear` (:class:`DoRALinear` with ``peft=dora``) in place of its decoder
    layers' target linear layers.

    Returns the adapted module names. A target name that matches no linear layer of the model is an error
    (the adapters would silently be missing)."""
    for p in model.parameters():
        p.requires_grad_(False)
    found = [(name, m) for name, m in model.named_modules() if _target(name, m, plan.targets)]
    missing = sorted(set(plan.targets) - {name.rsplit(".", 1)[-1] for name, _ in found})
    if missing:
        raise ValueError(f"peft.target_modules has {', '.join(missing)}, which names no linear layer of the "
                         f"model's decoder layers; drop it from peft.target_modules.")
    for name, linear in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, (DoRALinear if plan.scheme == "dora" else LoRALinear)(linear, plan))
    return [name for name, _ in found]


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` (detached) with every adapter merged into its base weight and the adapter entries
    dropped: the plain model the adapters define (what ``export_hf`` writes). A model without adapters: as is."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            prefix = f"{name}." if name else ""
            state[prefix + "weight"] = module.merged_weight()
            for key in ADAPTER_KEYS:
                state.pop(prefix + key, None)
    return state


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return trainable, frozen
