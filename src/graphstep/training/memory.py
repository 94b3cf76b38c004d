"""Will the run fit? A memory estimate before anything is built.

``estimate_memory(cfg, device)`` counts the parameters exactly by building
the model on PyTorch's ``meta`` device (shapes only, no storage), then adds
what graphstep keeps per parameter and what one micro-batch keeps for its
backward. With ``P`` parameters, ``B`` buffer elements and ``e`` bytes per
element of the parameter dtype (2 for bf16, 4 for fp32)::

    weights      P * e  +  B * e
    gradients    P * 4                 fp32 main_grad buffer (training/optim.py)
    optimizer    P * 8  (+ P * 4)      Adam exp_avg and exp_avg_sq in fp32, plus an
                                       fp32 master copy when the weights are not fp32
    activations  b * s * (sum over layers of the block terms + logits)

per token (``b`` = micro-batch, ``s`` = sequence, ``h`` = hidden, ``f`` = FFN
width, ``kv`` = key/value width, masks 1 byte per element)::

    attn   e * (5h + 3kv) + h           norms, qkv, RoPE'd q/k, attention output, dropout mask
    mlp    e * (2h + 4f) + h            norm, SwiGLU fc1 (2f), SiLU and product (2f), dropout mask
    moe    e * (2h + k * (h + 4f_e)) + 4 * E   top-k routed copies through the experts, router logits
    mamba  e * (2h + 8h) + 4 * heads * chunk   in_proj, conv, gate (d_inner = 2h), SSD chunk matrices (fp32)
    logits V * (e + 8)                  logits, fp32 log-softmax and its gradient

With ``model.recompute_granularity=full`` a layer keeps only its input
(``e * h`` per token) plus one layer's full terms during its recompute. On
the CPU with attention dropout, PyTorch's math attention also keeps the
scores: ``b * heads * s^2 * (e + 1)`` per layer. The estimate is a lower
bound of what a step uses -- allocator fragmentation, workspaces and graph
pools come on top -- so ``check_memory_fits`` refuses only when it exceeds
95% of the memory the device has free (``torch.cuda.mem_get_info`` on a
GPU, ``MemAvailable`` of ``/proc/meminfo`` on the CPU).
``GRAPHSTEP_SKIP_MEMORY_CHECK=1`` skips the check.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from ..config import Config
from ..cuda_graph.devices import GiB
from ..models import build_model, resolve_dtype
from ..models.hybrid import layer_kinds
from .rundir import RunSetupError

log = logging.getLogger("graphstep")

HEADROOM = 0.95  # refuse only when the estimate exceeds this share of the free memory
SKIP_ENV = "GRAPHSTEP_SKIP_MEMORY_CHECK"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a run needs on one device, by kind (see the module docstring)."""

    parameters: int
    weights: int
    gradients: int
    optimizer: int
    activations_per_sample: int
    micro_batch_size: int

    @property
    def static(self) -> int:
        return self.weights + self.gradients + self.optimizer

    @property
    def activations(self) -> int:
        return self.activations_per_sample * self.micro_batch_size

    @property
    def total(self) -> int:
        return self.static + self.activations

    def breakdown(self) -> str:
        return (f"weights {_gib(self.weights)} + fp32 gradients {_gib(self.gradients)} + optimizer state "
                f"{_gib(self.optimizer)} + activations {_gib(self.activations)} (micro-batch "
                f"{self.micro_batch_size}) = {_gib(self.total)} for {self.parameters / 1e9:.2f}B parameters")


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def count_parameters(cfg: Config) -> tuple[int, int]:
    """``(parameters, buffer elements)`` of the model ``cfg.model`` describes, built on the meta device."""
    with torch.device("meta"):
        model = build_model(cfg.model, "meta")
    return sum(p.numel() for p in model.parameters()), sum(b.numel() for b in model.buffers())


def estimate_memory(cfg: Config, device: torch.device) -> MemoryEstimate:
    """The memory ``cfg`` needs on ``device`` (one data-parallel replica)."""
    params, buffers = count_parameters(cfg)
    e = torch.empty((), dtype=resolve_dtype(cfg.model.params_dtype, device)).element_size()
    master = 0 if e == 4 else params * 4  # fp32 weights serve as their own master copy
    return MemoryEstimate(
        parameters=params, weights=(params + buffers) * e, gradients=params * 4, optimizer=params * 8 + master,
        activations_per_sample=activation_bytes_per_sample(cfg, e, device), micro_batch_size=cfg.train.micro_batch_size,
    )


def activation_bytes_per_sample(cfg: Config, e: int, device: torch.device) -> int:
    """Bytes one sample keeps for its backward (the block terms of the module docstring)."""
    m = cfg.model
    s, h = m.seq_length, m.hidden_size
    heads = m.num_attention_heads
    head_dim = m.kv_channels or h // heads
    kv = (m.num_query_groups or heads) * head_dim
    ffn = m.ffn_hidden_size
    expert_ffn = (m.moe_ffn_hidden_size or ffn) + (m.moe_shared_expert_intermediate_size or 0)
    mamba_heads = 2 * h // max(1, m.mamba_head_dim)
    scores = heads * s * (e + 1) if device.type != "cuda" and m.attention_dropout > 0 else 0
    block = {
        "attn": e * (5 * h + 3 * kv) + h + scores,
        "mlp": e * (2 * h + 4 * ffn) + h,
        "moe": e * (2 * h + m.moe_router_topk * (h + 4 * expert_ffn)) + 4 * (m.num_moe_experts or 0),
        "mamba": e * 10 * h + 4 * mamba_heads * m.mamba_chunk_size,
    }
    layers = [sum(block[k] for k in kinds) for kinds in layer_kinds(m)]
    if m.recompute_granularity == "full":
        per_token = e * h * len(layers) + max(layers)
    else:
        per_token = sum(layers)
    return s * (per_token + m.vocab_size * (e + 8))


def available_memory(device: torch.device) -> int:
    """Bytes free for this run on ``device``: free GPU memory, or the host's available RAM."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory_fits(cfg: Config, device: torch.device, *, replicas: int = 1) -> MemoryEstimate | None:
    """Raise ``RunSetupError`` when the estimate clearly exceeds the device's free memory.

    ``replicas``: ranks sharing this device's memory (CPU ranks of one host); each gets an equal share.
    """
    if os.environ.get(SKIP_ENV) == "1":
        return None
    try:
        estimate = estimate_memory(cfg, device)
    except Exception as exc:  # a shape the meta build cannot take: the real build will say why
        log.debug("no memory estimate (%s: %s)", type(exc).__name__, exc)
        return None
    free = available_memory(device) // max(1, replicas)
    budget = HEADROOM * free
    if estimate.total <= budget:
        return estimate
    where = "GPU memory free" if device.type == "cuda" else "RAM available"
    if replicas > 1:
        where += f" per rank ({replicas} ranks share it)"
    raise RunSetupError(f"the run needs about {_gib(estimate.total)} on {device} but {_gib(free)} of {where}: "
                        f"{estimate.breakdown()}; {_what_fits(estimate, budget)} ({SKIP_ENV}=1 skips this check)")


def _what_fits(estimate: MemoryEstimate, budget: float) -> str:
    per = max(1, estimate.activations_per_sample)
    room = budget - estimate.static
    if room >= per:
        return (f"train.micro_batch_size={int(room // per)} would fit (more micro-batches keep "
                "train.global_batch_size), or model.recompute_granularity=full")
    if room > 0:
        return ("one sample's activations do not fit beside the weights and optimizer state: "
                "model.recompute_granularity=full or a shorter model.seq_length")
    if budget <= per:
        return "even one sample's activations alone do not fit: use a device with more memory or a smaller model"
    devices = max(2, -(-estimate.static // int(budget - per)))
    return (f"weights, gradients and optimizer state alone need {_gib(estimate.static)}: about {devices} such "
            "devices with FSDP sharding (not yet available in graphstep), or a smaller model")
