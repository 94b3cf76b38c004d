"""Will the run fit? A memory estimate per rank, before anything is built.

``estimate_memory(cfg, device, layout)`` counts the parameters exactly by
building the model on PyTorch's ``meta`` device (shapes only, no storage),
then adds what one rank of the run's layout (parallel/dims.py: ``dp``
data-parallel x ``cp`` context-parallel x ``tp`` tensor-parallel ranks, FSDP2
or not) keeps per
parameter and what one micro-batch keeps for its backward. ``layout=None``
is one unsharded replica. With ``P`` parameters, ``B`` buffer elements and
``e`` bytes per element of the parameter dtype (2 for bf16, 4 for fp32)::

                 replicated data parallel          FSDP2 (p = P / (tp * dp * cp))
    weights      P/tp * e  +  B * e                p * 4  +  G * e  +  B * e
    gradients    P/tp * 4                          p * 4
    optimizer    P/tp * 8  (+ P/tp * 4)            p * 8
    activations  b * s * (sum over layers of the block terms + logits)

Gradients are graphstep's fp32 ``main_grad`` buffer (training/optim.py), the
optimizer Adam's exp_avg and exp_avg_sq in fp32, plus an fp32 master copy
when replicated weights are not fp32. With LoRA (``peft=lora``, converters/lora.py)
gradients and optimizer count only the ``T`` trainable (adapter) elements --
``T/tp * 4`` and ``T/tp * 8 (+ T/tp * 4)`` -- and the weights include the
adapters. Under FSDP2 the fp32 shards are the
master weights themselves, and ``G`` is the compute copy gathered in the
model dtype: with ``optim_grads_params`` (ZeRO-3) two of the largest decoder
layers (the one being computed and the last, kept gathered into the backward)
plus the root module's parameters (embedding, final norm, output layer),
which FSDP2 keeps gathered from forward to backward, divided by ``tp``; with
``optim_grads`` (ZeRO-2) every layer stays gathered to its backward:
``P/tp``. Every parameter counts as split over the tensor-parallel ranks;
the norm weights, which are replicated, are small enough to ignore. With
``ep`` expert-parallel ranks the routed experts' parameters count ``1/ep``,
and ``1/tp`` only under expert tensor parallel (``etp`` = ``tp``: with
``expert_tensor_parallel_size`` 1 each tensor-parallel rank holds whole experts)
(the dispatch buffer of the block's all-gather is not counted).

With ``pp`` pipeline stages every pipeline rank is estimated and the
heaviest one reported. A rank holds the decoder layers of its chunks in the
run's stage split (validation/stage_split.py, the split parallel/pipeline.py
builds: uneven splits, layouts and virtual stages included), the embedding on
the first rank, the final norm and output layer (a tied copy of the
embedding) on the last; buffers count whole on every rank. Its activations
are those of its layers for each micro-batch it keeps in flight, ``m``
being the micro-batches of a step (``global / (micro x dp)``)::

    GPipe                 m                                        (every forward before the backwards)
    1F1B                  min(pp - rank, m)                        (the first rank: pp)
    interleaved (v)       min(2 (pp - rank - 1) + (v - 1) pp + 1, m v) / v
                          the first rank: pp (1 + (pp - 1) / (pp v)), Megatron's formula

(interleaved zero bubble is counted as interleaved 1F1B), plus the logits
on the last rank: one micro-batch's, all ``m`` under GPipe.

Per token (``b`` = micro-batch, ``s`` = sequence, ``h`` = hidden, ``f`` = FFN
width, ``kv`` = key/value width, masks 1 byte per element), each block keeps
residual-stream terms ``r`` and inner terms ``i``, ``r + i/tp`` on a rank
(``(r + i)/tp`` with ``sequence_parallel``, which splits the sequence)::

    attn   r = e * 2h + h        i = e * (3h + 3kv)       norm in/out, dropout mask | qkv, RoPE'd q/k, attention out
    mlp    r = e * 2h + h        i = e * 4f               norm in/out, dropout mask | SwiGLU fc1 (2f), SiLU, product
    moe    r = e * 2h + 4 * E    i = e * k * (h + 4f_e)   router logits | top-k routed copies through the experts
    mamba  r = e * 2h            i = e * 8h + 4 * heads * chunk   in_proj, conv, gate (d_inner = 2h), SSD chunks
    logits V * (e + 8)           logits, fp32 log-softmax and its gradient: gathered whole on every rank

With ``cp`` context-parallel ranks a rank holds ``s / cp`` tokens of each
sequence, and each attention layer also keeps the all-gathered keys and
values of the whole sequence, ``e * 2kv * s / tp`` per sample.

With ``model.recompute_granularity=full`` each recomputed run of layers
(``recompute_method``: runs of ``recompute_num_layers`` layers, or the first
``recompute_num_layers`` layers one by one) keeps only its input (``e * h``
per token, a residual term), plus the largest run's full terms during its
recompute; the layers outside the runs keep theirs. On the CPU with attention dropout, PyTorch's math attention also
keeps the scores, an inner term: ``b * heads * s^2 * (e + 1)`` per layer.
The estimate is a lower bound of what a step uses -- allocator
fragmentation, workspaces, graph pools, FSDP2's prefetched layer and its
unsharded gradients, the pipeline's send/receive buffers come on top -- so
``check_memory_fits`` refuses only
when it exceeds 95% of the memory the device has free
(``torch.cuda.mem_get_info`` plus what the caching allocator holds unused on a GPU, ``MemAvailable`` of
``/proc/meminfo`` on the CPU). When it refuses because the weights, their
gradients and optimizer state, or one sample's activations do not fit, it
names the smallest layout (at most 1024 ranks) whose per-rank estimate fits
the same device and whose overrides the layout rules (R25-R31, V13) accept
at its world size: FSDP2 ZeRO-3 data parallel x tensor x pipeline x context
parallel for dense models, FSDP2 x expert parallel for MoE models (a hybrid
Mamba model as either, by whether it has MoE layers; see ``suggest_layout``). ``layout_report`` says the same before
a run, for ``graphstep config validate``: the layout's GPU count, its
estimate against a stated GPU memory, and the nearest layout the rules accept
when they refuse this one. ``GRAPHSTEP_SKIP_MEMORY_CHECK=1`` skips the check.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import itertools
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..config import Config
from ..cuda_graph.devices import GiB
from ..converters import lora
from ..models import build_model, resolve_dtype
from ..models.hybrid import layer_kinds
from ..models.transformer import recompute_runs
from ..parallel.dims import ParallelDims
from ..parallel.pipeline import model_chunks
from ..validation.stage_split import chunks_of_rank, virtual_stages
from .rundir import RunSetupError

log = logging.getLogger("graphstep")

HEADROOM = 0.95  # refuse only when the estimate exceeds this share of the free memory
SKIP_ENV = "GRAPHSTEP_SKIP_MEMORY_CHECK"
ZERO3 = "optim_grads_params"
ZERO3_OVERRIDES = f"ddp.use_megatron_fsdp=true ddp.data_parallel_sharding_strategy={ZERO3}"
MAX_RANKS = 1024  # the largest layout suggest_layout tries
TP_SIZES = (1, 2, 4, 8)  # tensor-parallel ranks stay inside one node


@dataclass(frozen=True)
class ParameterCounts:
    """Parameter and buffer elements of a model, and the parts FSDP2 gathers one at a time."""

    parameters: int
    buffers: int
    largest_layer: int  # parameters of the largest decoder layer
    root: int  # parameters outside the decoder layers: embedding, final norm, output layer
    experts: int = 0  # parameters of the routed experts (split over expert-parallel ranks)
    trainable: int | None = None  # parameters the optimizer updates (LoRA: the adapters); None: all of them
    layers: tuple[int, ...] = ()  # parameters of each decoder layer, in order
    embedding: int = 0  # parameters of the embedding (part of ``root``; the first pipeline stage holds it)
    tied: bool = False  # the output layer reads the embedding's weight (the last stage then holds a copy)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a run needs on one rank, by kind (see the module docstring)."""

    parameters: int
    weights: int
    gradients: int
    optimizer: int
    activations_per_sample: int
    micro_batch_size: int
    layout: ParallelDims = ParallelDims()
    stage: int = 0  # the pipeline rank this estimate is for: the heaviest one
    in_flight: float = 1.0  # micro-batches whose activations that rank keeps at once (pipeline schedules)

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
        flight = f", {self.in_flight:g} in flight" if self.layout.pp > 1 else ""
        where = f" on pipeline rank {self.stage}" if self.layout.pp > 1 else ""
        return (f"weights {_gib(self.weights)} + fp32 gradients {_gib(self.gradients)} + optimizer state "
                f"{_gib(self.optimizer)} + activations {_gib(self.activations)} (micro-batch "
                f"{self.micro_batch_size}{flight}) = {_gib(self.total)} for {self.parameters / 1e9:.2f}B "
                f"parameters{where}")


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _split(n: int, ways: int) -> int:
    """One rank's share of ``n`` over ``ways`` ranks (rounded up)."""
    return -(-n // ways)


_COUNTS: dict[str, ParameterCounts] = {}  # parameter_counts by the fields that decide them
_NOT_STRUCTURE = ("cuda_graph_", "enable_cuda_graph", "external_cuda_graph", "use_te_rng_tracker")  # how it runs


def parameter_counts(cfg: Config) -> ParameterCounts:
    """The counts of the model ``cfg.model`` describes (with ``cfg.peft``'s adapters), built on the meta device
    once per distinct model and adapter fields in a process (a sweep, a test's runs)."""
    key = repr(([(f.name, getattr(cfg.model, f.name)) for f in dataclasses.fields(cfg.model)
                 if not f.name.startswith(_NOT_STRUCTURE)], cfg.peft))
    counts = _COUNTS.get(key)
    if counts is None:
        if len(_COUNTS) >= 64:
            _COUNTS.clear()
        counts = _COUNTS[key] = _count_parameters(cfg)
    return counts


def _count_parameters(cfg: Config) -> ParameterCounts:
    with torch.device("meta"):
        model = build_model(cfg.model, "meta")
        plan = lora.plan_from(cfg.peft)
        if plan is not None:
            lora.apply_lora(model, plan)
    params = sum(p.numel() for p in model.parameters())
    layers = [sum(p.numel() for p in layer.parameters()) for layer in getattr(model, "layers", [])]
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts.experts." in n)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) if plan is not None else None
    embedding = getattr(model, "embedding", None)
    return ParameterCounts(parameters=params, buffers=sum(b.numel() for b in model.buffers()),
                           largest_layer=max(layers, default=0), root=params - sum(layers), experts=experts,
                           trainable=trainable, layers=tuple(layers),
                           embedding=sum(p.numel() for p in embedding.parameters()) if embedding is not None else 0,
                           tied=getattr(model, "output_layer", 0) is None)


def count_parameters(cfg: Config) -> tuple[int, int]:
    """``(parameters, buffer elements)`` of the model ``cfg.model`` describes."""
    counts = parameter_counts(cfg)
    return counts.parameters, counts.buffers


def element_size(cfg: Config, device: torch.device) -> int:
    """Bytes per element of the parameter dtype on ``device``, without allocating there."""
    return resolve_dtype(cfg.model.params_dtype, device).itemsize


def estimate_memory(cfg: Config, device: torch.device, layout: ParallelDims | None = None) -> MemoryEstimate:
    """The memory ``cfg`` needs on one rank of ``layout`` on ``device`` (None: one unsharded replica)."""
    return _estimate(cfg, device, layout or ParallelDims(), parameter_counts(cfg))


def _estimate(cfg: Config, device: torch.device, layout: ParallelDims, counts: ParameterCounts) -> MemoryEstimate:
    """The heaviest rank's estimate: the only rank without pipeline stages, else the pipeline rank needing most."""
    if layout.pp == 1:
        return _rank_estimate(cfg, device, layout, counts, None)
    ranks = [_rank_estimate(cfg, device, layout, counts, r) for r in range(layout.pp)]
    return max(ranks, key=lambda est: est.total)


def _rank_estimate(cfg: Config, device: torch.device, layout: ParallelDims, counts: ParameterCounts,
                   stage: int | None) -> MemoryEstimate:
    e = element_size(cfg, device)
    held = None if stage is None else rank_layers(cfg, layout.pp, stage)
    if held is not None:  # this pipeline rank's decoder layers, and the embedding / output layer it holds
        counts = _stage_counts(counts, *held)
    if layout.ep > 1 or layout.tp > layout.etp:  # each rank holds its share of the routed experts
        experts = _split(counts.experts, layout.ep)
        # static_bytes splits every parameter over tp; whole experts on each tensor-parallel rank (etp 1) are not
        local = counts.parameters - counts.experts + experts * (layout.tp // layout.etp)
        counts = dataclasses.replace(counts, parameters=local, experts=experts)
    weights, gradients, optimizer = static_bytes(counts, e, layout)
    if held is None:
        per_sample, in_flight = activation_bytes_per_sample(cfg, e, device, layout), 1.0
    else:
        per_sample, in_flight = stage_activation_bytes_per_sample(cfg, e, device, layout, stage)
    return MemoryEstimate(
        parameters=counts.parameters, weights=weights, gradients=gradients, optimizer=optimizer,
        activations_per_sample=per_sample, micro_batch_size=cfg.train.micro_batch_size, layout=layout,
        stage=stage or 0, in_flight=in_flight,
    )


def rank_layers(cfg: Config, pp: int, rank: int) -> tuple[list[int], bool, bool]:
    """``(decoder layers, embedding?, loss?)`` of pipeline rank ``rank``: its chunks of the run's stage split
    (validation/stage_split.py, the split parallel/pipeline.py builds), every virtual stage of the rank."""
    chunks = model_chunks(cfg.model, pp)
    mine = [chunks[c] for c in chunks_of_rank(rank, pp, len(chunks) // pp)]
    return [i for c in mine for i in c.layers], any(c.embedding for c in mine), any(c.loss for c in mine)


def _stage_counts(counts: ParameterCounts, layers: list[int], embedding: bool, loss: bool) -> ParameterCounts:
    """The counts of one pipeline rank: its decoder layers, the embedding on the first, the final norm and output
    layer on the last (a tied output layer is a copy of the embedding there)."""
    head = counts.root - counts.embedding + (counts.embedding if counts.tied and not embedding else 0)
    root = (counts.embedding if embedding else 0) + (head if loss else 0)
    per_layer = [counts.layers[i] for i in layers] if counts.layers else [counts.largest_layer] * len(layers)
    share = len(layers) / max(1, len(counts.layers))  # routed experts: spread evenly over the layers
    trainable = None if counts.trainable is None else _split(counts.trainable * len(layers), max(1, len(counts.layers)))
    return dataclasses.replace(counts, parameters=sum(per_layer) + root, largest_layer=max(per_layer, default=0),
                               root=root, experts=int(counts.experts * share), trainable=trainable,
                               layers=tuple(per_layer), embedding=counts.embedding if embedding else 0)


def static_bytes(counts: ParameterCounts, e: int, layout: ParallelDims) -> tuple[int, int, int]:
    """``(weights, gradients, optimizer)`` bytes on one rank of ``layout`` (the table of the module docstring)."""
    tp = layout.tp
    buffers = counts.buffers * e
    if layout.fsdp is None:
        local = _split(counts.parameters, tp)
        trained = local if counts.trainable is None else _split(counts.trainable, tp)  # frozen: no state
        master = 0 if e == 4 else trained * 4  # fp32 weights serve as their own master copy
        return local * e + buffers, trained * 4, trained * 8 + master
    shard = _split(counts.parameters, tp * layout.grad_ranks)  # FSDP2 shards over dp x cp (parallel/dims.py)
    gathered = min(2 * counts.largest_layer + counts.root, counts.parameters) if layout.fsdp == ZERO3 \
        else counts.parameters
    return shard * 4 + _split(gathered, tp) * e + buffers, shard * 4, shard * 8


def activation_bytes_per_sample(cfg: Config, e: int, device: torch.device, layout: ParallelDims | None = None) -> int:
    """Bytes one sample keeps for its backward on one rank of ``layout`` (the block terms of the module docstring)."""
    layout = layout or ParallelDims()
    per_token, gathered = _layer_bytes(cfg, e, device, layout)
    tokens = _split(cfg.model.seq_length, layout.cp)  # context parallel: this rank's chunks of each sequence
    return _stack_bytes(cfg, e, layout, per_token, gathered, tokens) + tokens * _logits_per_token(cfg, e)


def stage_activation_bytes_per_sample(cfg: Config, e: int, device: torch.device, layout: ParallelDims,
                                      rank: int) -> tuple[int, float]:
    """``(bytes, in flight)``: what one sample of every micro-batch pipeline rank ``rank`` keeps at once, and how
    many micro-batches that is (the schedules of the module docstring)."""
    layers, _embedding, loss = rank_layers(cfg, layout.pp, rank)
    per_token, gathered = _layer_bytes(cfg, e, device, layout)
    tokens = _split(cfg.model.seq_length, layout.cp)
    stack = _stack_bytes(cfg, e, layout, [per_token[i] for i in layers], [gathered[i] for i in layers], tokens)
    in_flight, logits_in_flight = micro_batches_in_flight(cfg, layout, rank)
    logits = tokens * _logits_per_token(cfg, e) if loss else 0
    return int(stack * in_flight) + logits * logits_in_flight, in_flight


def micro_batches_in_flight(cfg: Config, layout: ParallelDims, rank: int) -> tuple[float, int]:
    """``(decoder-layer micro-batches, logits micro-batches)`` pipeline rank ``rank`` keeps for their backward.

    GPipe runs every forward first: all ``m`` micro-batches of the step. 1F1B: ``min(pp - rank, m)``. Interleaved
    (``v`` virtual stages): Megatron's warm-up of ``2 (pp - rank - 1) + (v - 1) pp`` chunk forwards plus the one in
    its steady state, at most ``m v``, each ``1 / v`` of the rank's layers -- on the first rank
    ``pp (1 + (pp - 1) / (pp v))`` micro-batches; zero bubble is counted the same. The loss's logits are computed
    and used by the same micro-batch's backward at once, except under GPipe.
    """
    pp, t, m = layout.pp, cfg.train, cfg.model
    per_step = max(1, t.global_batch_size // max(1, t.micro_batch_size * layout.dp))
    if m.pipeline_schedule == "gpipe":
        return float(per_step), per_step
    v = virtual_stages(m.pipeline_model_parallel_layout, m.virtual_pipeline_model_parallel_size, pp)
    if v == 1:
        return float(min(pp - rank, per_step)), 1
    chunks = min(2 * (pp - rank - 1) + (v - 1) * pp + 1, per_step * v)
    return chunks / v, 1


def _logits_per_token(cfg: Config, e: int) -> int:
    return cfg.model.vocab_size * (e + 8)


def _layer_bytes(cfg: Config, e: int, device: torch.device, layout: ParallelDims) -> tuple[list[int], list[int]]:
    """Per decoder layer on one rank: bytes per token (``r + i/tp``) and the gathered keys and values per sample."""
    m = cfg.model
    blocks = _block_terms(cfg, e, device)
    tp, sp = layout.tp, layout.sequence_parallel and layout.tp > 1

    def on_rank(residual: int, inner: int) -> int:
        return _split(residual + inner, tp) if sp else residual + _split(inner, tp)

    kinds = layer_kinds(m)
    per_token = [on_rank(sum(blocks[k][0] for k in ks), sum(blocks[k][1] for k in ks)) for ks in kinds]
    gathered = [0] * len(kinds)
    if layout.cp > 1:  # each attention keeps the whole sequence's keys and values (all-gathered) for its backward
        kv = (m.num_query_groups or m.num_attention_heads) * (m.kv_channels or m.hidden_size // m.num_attention_heads)
        gathered = [_split(e * 2 * kv * m.seq_length, tp) if "attn" in ks else 0 for ks in kinds]
    return per_token, gathered


def _stack_bytes(cfg: Config, e: int, layout: ParallelDims, per_token: list[int], gathered: list[int],
                 tokens: int) -> int:
    """Bytes one sample keeps through a run of decoder layers (one stage's, or all), recompute counted."""
    m = cfg.model
    tp, sp = layout.tp, layout.sequence_parallel and layout.tp > 1
    kept_input = _split(e * m.hidden_size, tp) if sp else e * m.hidden_size  # a recomputed run keeps its input
    full = (m.recompute_method or "uniform", m.recompute_num_layers) if m.recompute_granularity == "full" else None
    runs = recompute_runs(len(per_token), full)
    total = sum(kept_input if recomputed else sum(per_token[a:b]) for a, b, recomputed in runs)
    total += max((sum(per_token[a:b]) for a, b, recomputed in runs if recomputed), default=0)
    return tokens * total + sum(gathered)


def _block_terms(cfg: Config, e: int, device: torch.device) -> dict[str, tuple[int, int]]:
    """Per-token ``(residual, inner)`` bytes of each block kind (the module docstring's table)."""
    m = cfg.model
    s, h = m.seq_length, m.hidden_size
    heads = m.num_attention_heads
    head_dim = m.kv_channels or h // heads
    kv = (m.num_query_groups or heads) * head_dim
    ffn = m.ffn_hidden_size
    expert_ffn = (m.moe_ffn_hidden_size or ffn) + (m.moe_shared_expert_intermediate_size or 0)
    mamba_heads = 2 * h // max(1, m.mamba_head_dim)
    scores = heads * s * (e + 1) if device.type != "cuda" and m.attention_dropout > 0 else 0
    return {
        "attn": (e * 2 * h + h, e * (3 * h + 3 * kv) + scores),
        "mlp": (e * 2 * h + h, e * 4 * ffn),
        "moe": (e * 2 * h + 4 * (m.num_moe_experts or 0), e * m.moe_router_topk * (h + 4 * expert_ffn)),
        "mamba": (e * 2 * h, e * 8 * h + 4 * mamba_heads * m.mamba_chunk_size),
    }


def available_memory(device: torch.device) -> int:
    """Bytes free for this run on ``device``: free GPU memory, or the host's available RAM.

    On a GPU, memory this process's caching allocator holds but no tensor uses counts as free: the run's
    tensors reuse it. An earlier run in the same process leaves its blocks cached (and, until the garbage
    collector breaks its reference cycles, some of its tensors alive), so the driver alone would report
    that memory as taken.
    """
    if device.type == "cuda":
        gc.collect()  # tensors of an earlier run that only cycles keep alive go back to the allocator's cache
        free, _total = torch.cuda.mem_get_info(device)
        return int(free) + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory_fits(cfg: Config, device: torch.device, *, replicas: int = 1,
                      layout: ParallelDims | None = None) -> MemoryEstimate | None:
    """Raise ``RunSetupError`` when one rank's estimate clearly exceeds the device's free memory.

    ``replicas``: ranks sharing this device's memory (CPU ranks of one host); each gets an equal share.
    ``layout``: the run's data-parallel x tensor-parallel layout (None: one unsharded replica).
    """
    if os.environ.get(SKIP_ENV) == "1":
        return None
    layout = layout or ParallelDims()
    try:
        counts = parameter_counts(cfg)
        estimate = _estimate(cfg, device, layout, counts)
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
    raise RunSetupError(f"the run needs about {_gib(estimate.total)} per rank on {device} as {layout.describe()} "
                        f"but {_gib(free)} of {where}: {estimate.breakdown()}; "
                        f"{_what_fits(cfg, device, estimate, budget, counts)} ({SKIP_ENV}=1 skips this check)")


def _what_fits(cfg: Config, device: torch.device, estimate: MemoryEstimate, budget: float,
               counts: ParameterCounts) -> str:
    per = max(1, estimate.activations_per_sample)
    room = budget - estimate.static
    recompute = "model.recompute_granularity=full or " if _recompute_helps(cfg, estimate.layout) else ""
    if room >= per:
        return (f"train.micro_batch_size={int(room // per)} would fit (more micro-batches keep "
                f"train.global_batch_size), or {recompute}a shorter model.seq_length")
    if room > 0:
        why = ("one sample's activations do not fit beside the weights and optimizer state: "
               f"{recompute}a shorter model.seq_length")
    elif budget <= per:
        why = f"one sample's activations alone need {_gib(per)}"
    else:
        why = f"weights, gradients and optimizer state alone need {_gib(estimate.static)}"
    return f"{why}; {_layout_advice(cfg, device, budget, counts)}"


def _recompute_helps(cfg: Config, layout: ParallelDims) -> bool:
    """Whether full recompute is advice worth giving: not on yet, and taken by the layout rules over ``layout``."""
    if cfg.model.recompute_granularity == "full":
        return False
    return _accepted(with_fields(cfg, {"model.recompute_granularity": "full"}), layout)


def candidate_layouts(cfg: Config) -> list[ParallelDims]:
    """The layouts ``suggest_layout`` tries, fewest ranks first; at equal ranks fewest pipeline stages, then fewest
    context-parallel, then fewest tensor-parallel ranks (the most data-parallel ones).

    Dense models: FSDP2 ZeRO-3 over the ``dp`` data-parallel ranks (plain ranks when ``dp`` is 1) x ``tp`` in 1,
    2, 4, 8 dividing the heads, query groups, MLP width and vocabulary (R25), with sequence parallel whenever it
    divides the sequence, x ``pp`` pipeline stages that split the layers evenly (R28) x ``cp`` context-parallel
    ranks whose chunks cut the sequence evenly (R30), with or without stages. MoE models: FSDP2 x ``ep`` expert-parallel
    ranks (R27, R31: no tensor parallel, stages or context parallel with them), ``ep`` the largest power of 2
    dividing both the experts and ``dp``. Hybrid (Mamba) models as dense or MoE ones (the rules check their Mamba
    heads and groups against ``tp``).
    """
    m = cfg.model
    if m.num_moe_experts is not None:
        out, ranks = [], 2
        while ranks <= MAX_RANKS:
            ep = math.gcd(ranks, m.num_moe_experts)
            if ep >= 2:
                out.append(ParallelDims(dp_shard=ranks, ep=ep, fsdp=ZERO3))
            ranks *= 2
        return out
    sizes = (m.num_attention_heads, m.num_query_groups or m.num_attention_heads, m.ffn_hidden_size, m.vocab_size)
    tps = [tp for tp in TP_SIZES if all(n % tp == 0 for n in sizes)]
    pps = [pp for pp in (1, 2, 4, 8, 16, 32) if pp == 1 or (m.num_layers % pp == 0 and m.num_layers >= pp)]
    cps = [cp for cp in (1, 2, 4, 8) if m.seq_length % (2 * cp) == 0 or cp == 1]
    out = []
    ranks = 2
    while ranks <= MAX_RANKS:
        found = []
        for pp, cp, tp in itertools.product(pps, cps, tps):
            if ranks % (pp * cp * tp):
                continue
            dp = ranks // (pp * cp * tp)
            sp = tp > 1 and (m.seq_length // cp) % tp == 0
            found.append(ParallelDims(pp=pp, dp_shard=dp, cp=cp, tp=tp, sequence_parallel=sp,
                                      fsdp=ZERO3 if dp > 1 else None))
        out += sorted(found, key=lambda d: (d.pp, d.cp, d.tp))
        ranks *= 2
    return out


LAYOUT_RULES = {"R25", "R26", "R27", "R28", "R29", "R30", "R31", "V13"}


def suggest_layout(cfg: Config, device: torch.device, budget: float,
                   counts: ParameterCounts | None = None) -> tuple[ParallelDims, MemoryEstimate] | None:
    """The first of ``candidate_layouts`` whose per-rank estimate fits ``budget`` bytes and whose overrides the
    layout rules accept at its world size, with that estimate. None when none does.

    The run's activation recompute is kept: the layout rules take it over every candidate (no virtual stages, no
    expert parallel over stages), and the estimate counts what full recompute saves.
    """
    counts = counts or parameter_counts(cfg)
    for layout in candidate_layouts(cfg):
        fields = layout_fields(cfg, layout)
        moved = with_fields(cfg, fields)
        estimate = _estimate(moved, device, layout, counts)
        if estimate.total > budget:
            continue
        if _accepted(moved, layout) or (_graph_fallback(cfg) and _accepted(
                with_fields(cfg, {**fields, **_graph_fallback(cfg)}), layout)):
            return layout, estimate
    return None


def _accepted(cfg: Config, layout: ParallelDims) -> bool:
    from ..validation import validate_config

    return not [v for v in validate_config(cfg, env={}, world_size=layout.ranks) if v.rule in LAYOUT_RULES]


def _graph_fallback(cfg: Config) -> dict[str, Any]:
    """Per-layer graphs as one full-iteration graph: what R27 (FSDP2 ZeRO-3) and R31 (the MoE block's scopes
    with expert parallel) ask of per-layer graphs over these layouts."""
    if cfg.model.cuda_graph_impl in ("none", "full_iteration"):
        return {}
    return {"model.cuda_graph_impl": "full_iteration", "model.cuda_graph_scope": None, "model.cuda_graph_modules": []}


def layout_fields(cfg: Config, layout: ParallelDims) -> dict[str, Any]:
    """The config fields (``section.field``: value) that ask for ``layout``, a layout from ``candidate_layouts``:
    its sizes, plain pipeline stages (an even split, 1F1B), and what the layout rules refuse with it turned off."""
    m, t = cfg.model, cfg.train
    out: dict[str, Any] = {}
    if layout.fsdp is not None:
        out.update({"ddp.use_megatron_fsdp": True, "ddp.data_parallel_sharding_strategy": layout.fsdp})
    out.update({"model.tensor_model_parallel_size": layout.tp, "model.sequence_parallel": layout.sequence_parallel,
                "model.pipeline_model_parallel_size": layout.pp, "model.context_parallel_size": layout.cp,
                "model.expert_model_parallel_size": layout.ep})
    split = ("model.virtual_pipeline_model_parallel_size", "model.pipeline_model_parallel_layout",
             "model.num_layers_in_first_pipeline_stage", "model.num_layers_in_last_pipeline_stage")
    out.update({f: None for f in split})
    out.update({"model.account_for_embedding_in_pipeline_split": False,
                "model.account_for_loss_in_pipeline_split": False})
    if layout.pp > 1:
        out["model.pipeline_schedule"] = "1f1b"
        out["ddp.overlap_grad_reduce"] = False  # R29
        out["model.pipeline_dtype"] = None
    elif m.pipeline_schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        out["model.pipeline_schedule"] = "1f1b"
    per_step = t.micro_batch_size * layout.dp  # V13: whole micro-batches per rank; 1F1B: at least pp of them
    out["train.global_batch_size"] = max(_split(t.global_batch_size, per_step), layout.pp) * per_step
    return out


def with_fields(cfg: Config, fields: dict[str, Any]) -> Config:
    """A copy of ``cfg`` with ``fields`` set."""
    out = copy.deepcopy(cfg)
    for key, value in fields.items():
        section, name = key.split(".")
        setattr(getattr(out, section), name, value)
    return out


def layout_overrides(cfg: Config, layout: ParallelDims) -> list[str]:
    """The overrides that ask for ``layout`` (a layout from ``candidate_layouts``): the fields that change."""
    out, fields = [], layout_fields(cfg, layout)
    if not _accepted(with_fields(cfg, fields), layout):
        fields.update(_graph_fallback(cfg))
    for key, value in fields.items():
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) != value:
            out.append(f"{key}={_override_value(value)}")
    return out


def _override_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def launch(ranks: int, device: torch.device) -> str:
    """How to start ``ranks`` processes: one node of up to 8 GPUs, nodes of 8 beyond, one CPU rank per host."""
    if device.type != "cuda":
        return f"launch on {ranks} hosts like this one (torchrun --nnodes {ranks} --nproc_per_node 1)"
    if ranks <= 8:
        return f"launch with torchrun --nproc_per_node {ranks}"
    return f"launch on {ranks} GPUs, {ranks // 8} nodes x 8 (torchrun --nnodes {ranks // 8} --nproc_per_node 8)"


def _layout_advice(cfg: Config, device: torch.device, budget: float, counts: ParameterCounts) -> str:
    """One sentence: the smallest layout that fits, how to ask for it, or why there is none."""
    found = suggest_layout(cfg, device, budget, counts)
    if found is None:
        return (f"no layout of up to {MAX_RANKS} such devices fits either (FSDP2 x tensor x pipeline x context "
                "parallel): a smaller model or a shorter model.seq_length")
    layout, estimate = found
    return (f"as {layout.describe()} it needs about {_gib(estimate.total)} per rank: "
            f"add {' '.join(layout_overrides(cfg, layout))} and {launch(layout.ranks, device)}")


# ---- what a layout needs, before a run: ``graphstep config validate`` -----------------------------------

H100_GIB = 80  # the GPU memory ``graphstep config validate`` judges against without a GPU or --gpu-memory


def layout_world_size(cfg: Config) -> int:
    """The fewest ranks the config's layout takes: pipeline x context x tensor-parallel ranks x the fewest
    data-parallel ones (one, or the expert-parallel ranks, which are data-parallel ranks: R31)."""
    m = cfg.model
    return (m.pipeline_model_parallel_size * m.context_parallel_size * m.tensor_model_parallel_size
            * max(1, m.expert_model_parallel_size))


def _relaxations(cfg: Config) -> list[tuple[str, dict[str, Any]]]:
    """Layout features to turn off to reach a layout the rules accept at the same world size (``nearest_accepted``
    turns off the fewest; among as many, the first here): the newest combinations first (virtual stages, then
    context parallel, whose ranks become data-parallel ones)."""
    m, out = cfg.model, []
    if m.virtual_pipeline_model_parallel_size is not None or m.pipeline_model_parallel_layout is not None:
        fields: dict[str, Any] = {"model.virtual_pipeline_model_parallel_size": None,
                                  "model.pipeline_model_parallel_layout": None}
        if m.pipeline_schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
            fields["model.pipeline_schedule"] = "1f1b"
        out.append(("without virtual stages", fields))
    if m.context_parallel_size > 1:
        out.append(("without context parallel (its ranks data-parallel)", {"model.context_parallel_size": 1}))
    if m.pipeline_model_parallel_size > 1 and cfg.ddp.overlap_grad_reduce:
        out.append(("without overlapped gradient reduction", {"ddp.overlap_grad_reduce": False}))
    return out


def nearest_accepted(cfg: Config, world: int) -> tuple[str, dict[str, Any]] | None:
    """The fewest of ``cfg``'s relaxations (together; among as many, the first in their order) that the layout
    rules accept on ``world`` ranks, as ``(what they drop, the fields)``; None when the config passes already or
    none does."""
    from ..validation import validate_config

    def refused(c: Config) -> bool:
        return any(v.rule in LAYOUT_RULES for v in validate_config(c, env={}, world_size=world))

    if not refused(cfg):
        return None
    relaxations = _relaxations(cfg)
    for size in range(1, len(relaxations) + 1):
        for chosen in itertools.combinations(relaxations, size):
            fields = {k: v for _, more in chosen for k, v in more.items()}
            if not refused(with_fields(cfg, fields)):
                return ", ".join(name for name, _ in chosen), fields
    return None


def layout_report(cfg: Config, world: int, gpu_memory: float, device: torch.device | None = None) -> list[str]:
    """Lines saying what ``cfg``'s layout needs on ``world`` ranks: the GPU count, the heaviest rank's memory
    estimate against ``gpu_memory`` bytes per GPU (fits under ``HEADROOM`` of it, or the smallest layout that
    does), and, when the layout rules refuse it, the nearest layout they accept with its estimate."""
    device = device or torch.device("cuda")  # never touched: the estimate needs the dtype's element size only
    layout = ParallelDims.from_config(cfg, world)
    gpus = f"{layout.ranks} GPU" + ("s" if layout.ranks > 1 else "")
    vpp = cfg.model.virtual_pipeline_model_parallel_size if layout.pp > 1 else None
    lines = [f"layout: {layout.describe()}: {gpus} (tp {layout.tp} x pp {layout.pp} x cp {layout.cp} x dp {layout.dp}"
             + (f", {vpp} virtual stages per pipeline rank" if isinstance(vpp, int) and vpp > 1 else "")
             + (f", ep {layout.ep} of the dp ranks" if layout.ep > 1 else "") + ")"]
    budget = HEADROOM * gpu_memory
    try:
        counts = parameter_counts(cfg)
        lines += _fit_lines(cfg, device, layout, counts, budget, gpu_memory)
        kept = _keeping_the_layout(cfg, device, layout, counts, budget)
    except Exception as exc:  # a shape the meta build or the stage split cannot take: the rules say why
        return lines + [f"memory per rank: no estimate ({type(exc).__name__}: {exc})"]
    if kept is not None:
        lines.append(f"  {kept}")
    near = nearest_accepted(cfg, world)
    if near is not None:
        what, fields = near
        moved = with_fields(cfg, fields)
        moved_layout = ParallelDims.from_config(moved, world)
        changed = [f"{k}={_override_value(v)}" for k, v in fields.items()
                   if getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) != v]
        lines.append(f"nearest layout the rules accept ({what}): add {' '.join(changed)}: {moved_layout.describe()}")
        lines += ["  " + line for line in _fit_lines(moved, device, moved_layout, counts, budget, gpu_memory)]
    return lines


def _keeping_the_layout(cfg: Config, device: torch.device, layout: ParallelDims, counts: ParameterCounts,
                        budget: float) -> str | None:
    """For a layout that does not fit ``budget`` bytes per GPU: the GPU memory it needs as it is, and the fewest
    GPUs (up to ``MAX_RANKS``) on which the same tensor x pipeline x context-parallel layout fits with its
    gradients and optimizer state sharded over the data-parallel x context-parallel ranks -- Megatron's
    distributed optimizer (``ddp.use_distributed_optimizer``, FSDP2 ``optim_grads`` here), which more
    data-parallel replicas share -- where the layout rules accept it. None when the layout fits."""
    estimate = _estimate(cfg, device, layout, counts)
    if estimate.total <= budget:
        return None
    needs = f"as it is, it needs GPUs of at least {_gib(estimate.total / HEADROOM)} ({HEADROOM:.0%} usable)"
    fields = {} if layout.fsdp is not None else {"ddp.use_distributed_optimizer": True}
    moved = with_fields(cfg, fields)
    ranks = layout.ranks
    while ranks <= MAX_RANKS:
        wider = ParallelDims.from_config(moved, ranks)
        sharded = _estimate(moved, device, wider, counts)
        if sharded.total <= budget and _accepted(moved, wider):
            how = " ".join(f"{k}={_override_value(v)}" for k, v in fields.items())
            where = f"on the same {ranks} GPUs" if ranks == layout.ranks else launch(ranks, device)
            return (f"{needs}; keeping the layout" + (f" with {how} (gradients and optimizer state sharded over "
                    f"the {wider.grad_ranks} data-parallel x context-parallel ranks)" if how else "")
                    + f", it needs about {_gib(sharded.total)} per rank as {wider.describe()}: {where}")
        ranks *= 2
    return needs


def _fit_lines(cfg: Config, device: torch.device, layout: ParallelDims, counts: ParameterCounts, budget: float,
               gpu_memory: float) -> list[str]:
    estimate = _estimate(cfg, device, layout, counts)
    fits = estimate.total <= budget
    lines = [f"memory per rank: about {_gib(estimate.total)} of {_gib(gpu_memory)} per GPU "
             f"({'fits' if fits else 'does not fit'}, {HEADROOM:.0%} usable): {estimate.breakdown()}"]
    if not fits:
        lines.append(f"  {_what_fits(cfg, device, estimate, budget, counts)}")
    return lines
