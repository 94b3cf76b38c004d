"""A Llama/Qwen-style decoder whose layers expose graph scopes.

RMSNorm, rotary position embeddings, grouped-query attention through
``scaled_dot_product_attention``, SwiGLU MLP, tied or untied embeddings,
attention and hidden dropout. Projections are fused as in Megatron
(``linear_qkv``, ``linear_fc1`` = gate and up) to keep the kernel count low.

Scopes (see graphstep.cuda_graph.scopes): ``attn`` is input norm + attention +
output projection + dropout + residual (:class:`AttentionBlock`); ``mlp`` is
pre-MLP norm + MLP + dropout + residual (:class:`MLPBlock`). MoE and Mamba
blocks (models/moe.py, models/mamba.py) plug into :class:`DecoderLayer` in the
same way.

All dropout draws from the graph-safe RNG tracker: attention dropout from
``model-parallel-rng``, hidden dropout from ``data-parallel-rng`` (from
``model-parallel-rng`` under sequence parallelism). Tensor parallelism
(parallel/tensor_parallel.py) shards the projections with DTensor and tells the
model how many heads it holds and how its final hidden state is laid out.

Packed rows (data/packing.py): a micro-batch with ``cu_seqlens`` holds
several documents per row. :class:`PackedRows` turns the offsets into each
token's position in its document and a block-diagonal causal mask, on the
device and into tensors of fixed address that every layer's attention reads
(so per-layer graphs replay with the current micro-batch's documents); RoPE
reads the positions, which restart at 0 in every document. The attention
kernel is chosen by speed, as measured (``python -m
graphstep.bench.packed_attention``, docs/data.md): ``scaled_dot_product_attention``
with the block-diagonal mask, or -- on a GPU, in bf16/fp16, without attention
dropout, for rows of ``VARLEN_MIN_SEQ`` tokens or more -- flash attention over
the documents laid end to end (``torch.nn.attention.varlen.varlen_attn``),
which never builds the ``[seq, seq]`` mask.

Context parallel (parallel/context_parallel.py) sets ``context`` on the model
and its attentions: each rank then holds chunks of every sequence, RoPE reads
their positions, the attention gathers every rank's keys and values under a
causal mask of those positions, and the loss is the rank's share of the
sequences' mean.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate
from torch.utils.checkpoint import checkpoint

from ..cuda_graph.rng import DATA_PARALLEL_RNG, MODEL_PARALLEL_RNG, get_rng_tracker


@dataclass(frozen=True)
class ModelShape:
    """The subset of ``ModelConfig`` a model needs (kept free of training fields)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    seq_length: int
    vocab_size: int
    tie_embeddings: bool
    eps: float
    rotary_base: int
    qk_layernorm: bool
    add_qkv_bias: bool
    attention_dropout: float
    hidden_dropout: float
    init_std: float
    recompute_core_attn: bool = False
    recompute_mlp: bool = False
    recompute_layers: tuple[str, int | None] | None = None  # full recompute: (method, num_layers)

    @classmethod
    def from_config(cls, m) -> "ModelShape":
        heads = m.num_attention_heads
        if m.hidden_size % heads and m.kv_channels is None:
            raise ValueError(f"model.hidden_size={m.hidden_size} is not divisible by num_attention_heads={heads}")
        groups = m.num_query_groups or heads
        if heads % groups:
            raise ValueError(f"model.num_attention_heads={heads} is not divisible by num_query_groups={groups}")
        selective = m.recompute_granularity == "selective"
        return cls(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            ffn_hidden_size=m.ffn_hidden_size,
            num_attention_heads=heads,
            num_query_groups=groups,
            kv_channels=m.kv_channels or m.hidden_size // heads,
            seq_length=m.seq_length,
            vocab_size=m.vocab_size,
            tie_embeddings=m.share_embeddings_and_output_weights,
            eps=m.layernorm_epsilon,
            rotary_base=m.rotary_base,
            qk_layernorm=m.qk_layernorm,
            add_qkv_bias=m.add_qkv_bias,
            attention_dropout=m.attention_dropout,
            hidden_dropout=m.hidden_dropout,
            init_std=m.init_method_std,
            recompute_core_attn=selective and "core_attn" in m.recompute_modules,
            recompute_mlp=selective and "mlp" in m.recompute_modules,
            recompute_layers=((m.recompute_method or "uniform", m.recompute_num_layers)
                              if m.recompute_granularity == "full" else None),
        )


def recompute_runs(n: int, full: tuple[str, int | None] | None) -> list[tuple[int, int, bool]]:
    """A stage's ``n`` layers as runs ``(start, stop, recomputed)`` under full recompute, Megatron Core's meaning.

    ``uniform`` (the default): runs of ``num_layers`` (default 1) layers, each run
    keeping only its input for the backward and recomputing the rest; ``block``:
    the first ``num_layers`` layers (default all) one by one, the others kept.
    """
    if full is None:
        return [(0, n, False)]
    method, k = full
    if method == "block":
        k = n if k is None else min(k, n)
        return [(i, i + 1, True) for i in range(k)] + ([(k, n, False)] if k < n else [])
    k = k or 1
    return [(i, min(i + k, n), True) for i in range(0, n, k)]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            # PyTorch's fused kernel (fp32 math inside, one launch each way instead of ~20
            # small ones): on a launch-bound model the norms are a third of all kernels.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Exactly one op reads x (``float()`` is a no-op on fp32, hence the clone):
        # when a graph boundary separates this norm from x's other consumer (the
        # residual of an MoE block captured as router + combine graphs), x's
        # gradient is then a sum of two terms, which rounds the same either way.
        xf = x.float() if x.dtype != torch.float32 else x.clone()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def hidden_dropout(x: torch.Tensor, p: float, training: bool, stream: str = DATA_PARALLEL_RNG) -> torch.Tensor:
    """Dropout on a block output, drawn from the tracker's data-parallel stream (model-parallel with
    sequence parallelism, where each tensor-parallel rank holds other tokens: parallel/tensor_parallel.py)."""
    if p == 0.0 or not training:
        return x
    with get_rng_tracker().fork(stream):
        return F.dropout(x, p, True)


class Rotary(nn.Module):
    """cos/sin tables for rotate-half RoPE (Llama / Hugging Face layout)."""

    def __init__(self, head_dim: int, seq_length: int, base: int) -> None:
        super().__init__()
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        pos = torch.arange(seq_length, dtype=torch.float64)
        freqs = torch.outer(pos, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x`` of shape [batch, heads, seq, head_dim] at positions 0..seq-1, or at ``positions``
        ([batch, seq], each below the table's length: packed rows, whose width R41 bounds)."""
        seq = x.shape[-2]
        if seq > self.cos.shape[0]:
            raise ValueError(f"sequence length {seq} exceeds model.seq_length={self.cos.shape[0]}")
        if positions is None:
            cos, sin = self.cos[:seq].to(x.dtype), self.sin[:seq].to(x.dtype)
        else:  # [batch, 1, seq, head_dim]: the same rows of the table, gathered per token
            cos, sin = self.cos[positions].unsqueeze(1).to(x.dtype), self.sin[positions].unsqueeze(1).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# Packed rows of at least this many tokens use flash attention over the documents end to end (varlen) where it
# runs; shorter ones the SDPA mask. Measured fwd+bwd on an H100 (benchmarks/results/packed_attention_*_2026-12-07):
# at 2048 tokens the mask 1.19 ms, varlen 1.27 ms; at 8192 tokens the mask 12.19 ms, varlen 2.23 ms.
VARLEN_MIN_SEQ = 4096


@functools.cache
def varlen_attention():
    """``torch.nn.attention.varlen.varlen_attn``, or None where this torch has none (looked up once)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _varlen_causal_kwargs(gqa: bool) -> dict:
    """The keywords that make ``varlen_attn`` causal (and pair grouped-query heads) in this torch, read once from its
    signature: torch >= 2.12 takes a window reaching no token to the right, earlier ones ``is_causal``."""
    params = inspect.signature(varlen_attention()).parameters
    kw = {"enable_gqa": True} if gqa and "enable_gqa" in params else {}
    kw.update({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True})
    return kw


def flat_offsets(cu_rows: torch.Tensor, seq: int) -> torch.Tensor:
    """``[batch, slots]`` row offsets -> the documents end to end, as varlen attention takes them: row ``r``'s
    offsets shifted by ``r * seq``; the repeated ends of padded slots stay (empty documents), and each row's
    leading 0 is the previous row's end. int32, ``1 + batch * (slots - 1)`` entries."""
    shift = (torch.arange(cu_rows.shape[0], device=cu_rows.device) * seq)[:, None]
    return torch.cat([cu_rows.new_zeros(1), (cu_rows + shift)[:, 1:].reshape(-1)]).to(torch.int32)


def varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Causal attention within each document: q ``[batch, heads, seq, dim]``, k/v ``[batch, groups, seq, dim]``,
    ``offsets`` from :func:`flat_offsets`; the output as q. Flash attention pairs query heads with key/value
    groups itself (grouped-query attention without repeating the keys)."""
    b, h, s, d = q.shape
    flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]
    out = varlen_attention()(*flat, offsets, offsets, s, s, **_varlen_causal_kwargs(k.shape[1] != h))
    return out.view(b, s, h, d).transpose(1, 2)


class PackedRows:
    """Where the documents of a micro-batch of packed rows lie, in tensors of fixed address.

    ``update(cu_seqlens, seq, dtype)`` (``[batch, slots]`` offsets, see data/packing.py) computes on
    the device, without a host sync: each token's document (how many document ends lie at or before
    it), its position in that document, and what the attention kernel (:meth:`kernel_for`) reads:
    the additive mask ``[batch, 1, seq, seq]`` (0 or -inf, in the attention's dtype) that lets a
    token attend to the tokens of its own document up to itself (``kernel == "mask"``), or the
    documents' offsets end to end (``"varlen"``, :func:`flat_offsets`). The first call of a shape
    allocates that shape's tensors; later calls of the shape copy into them, so a graph that read them
    at capture reads the current micro-batch at replay (the input contract: static tensors, rewritten
    by the model's forward before its layers run; a graph of one shape is replayed only with inputs of
    that shape). The model owns one and hands it to every layer's attention.

    Training and evaluation forwards each have their own view (:meth:`view`, by the model's
    ``training`` flag): what the last forward of that mode set, or None after a forward of that mode
    without ``cu_seqlens`` (plain causal attention). A training split and an evaluation split have other
    numbers of offset slots, so their varlen offsets live in tensors of their own; per-layer graphs,
    captured at the start of a training step, after an evaluation, read the training view's tensors --
    the ones the training forwards rewrite -- never the evaluation's. ``positions``, ``mask``,
    ``offsets`` and ``kernel`` are the last packed forward's, whichever its mode.
    ``attention_dropout``: the model's (varlen attention has none, so with dropout the mask is used).
    """

    def __init__(self, attention_dropout: float = 0.0) -> None:
        self.attention_dropout = attention_dropout
        self.positions: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self.offsets: torch.Tensor | None = None
        self.kernel = "mask"
        self._static: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (shape, device, dtype, kernel) -> tensors
        # per mode (training: True/False): (positions, mask, offsets) of its last forward, None: not packed
        self._views: dict[bool, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None] = {}

    def view(self, training: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """``(positions, mask, offsets)`` of the last forward in this mode (one of mask and offsets is None), or
        None when that forward had no ``cu_seqlens``."""
        return self._views.get(training)

    def clear(self, training: bool = True) -> None:
        """A forward of this mode without ``cu_seqlens``: its attention is plain causal."""
        self._views[training] = None

    def kernel_for(self, device: torch.device, dtype: torch.dtype, seq: int) -> str:
        """``"varlen"`` for rows of ``VARLEN_MIN_SEQ`` tokens or more on a GPU in bf16/fp16 without attention
        dropout where torch has varlen attention; else ``"mask"``. ``dtype``: what the attention computes in
        (autocast's dtype where autocast is on)."""
        if torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        if (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
                and seq >= VARLEN_MIN_SEQ and self.attention_dropout == 0.0 and varlen_attention() is not None):
            return "varlen"
        return "mask"

    def update(self, cu_seqlens: torch.Tensor, seq: int, dtype: torch.dtype, training: bool = True) -> None:
        kernel = self.kernel_for(cu_seqlens.device, dtype, seq)
        token = torch.arange(seq, device=cu_seqlens.device)
        document = (cu_seqlens[:, None, 1:] <= token[None, :, None]).sum(-1)  # [batch, seq]
        positions = token - cu_seqlens.gather(1, document)
        if kernel == "varlen":
            reads = flat_offsets(cu_seqlens, seq)
        else:
            causal = token[None, :] <= token[:, None]
            allowed = ((document[:, :, None] == document[:, None, :]) & causal).unsqueeze(1)
            # An additive mask in the attention's dtype, made once for all layers: SDPA would turn a boolean one
            # into such a tensor in every layer's call (and each layer's backward would keep its own copy).
            reads = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed,
                                                                                                float("-inf"))
        key = (tuple(positions.shape), tuple(reads.shape), reads.device, dtype, kernel)
        if key not in self._static:
            self._static[key] = (positions, reads)
        else:
            self._static[key][0].copy_(positions)
            self._static[key][1].copy_(reads)
        self.kernel = kernel
        self.positions, reads = self._static[key]
        self.mask, self.offsets = (None, reads) if kernel == "varlen" else (reads, None)
        self._views[training] = (self.positions, self.mask, self.offsets)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE (no residual, no norm)."""

    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.s = s
        self.heads, self.groups, self.head_dim = s.num_attention_heads, s.num_query_groups, s.kv_channels
        qkv = (self.heads + 2 * self.groups) * self.head_dim
        self.linear_qkv = nn.Linear(s.hidden_size, qkv, bias=s.add_qkv_bias)
        self.linear_proj = nn.Linear(self.heads * self.head_dim, s.hidden_size, bias=False)
        if s.qk_layernorm:
            self.q_layernorm = RMSNorm(self.head_dim, s.eps)
            self.k_layernorm = RMSNorm(self.head_dim, s.eps)
        self.rotary = Rotary(self.head_dim, s.seq_length, s.rotary_base)
        self.packed: PackedRows | None = None  # set by GPTModel: the documents of packed rows
        self.context = None  # parallel/context_parallel.py: this rank's chunks of every sequence

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention, or (packed rows) attention within each document: with ``mask``, or through
        varlen attention over the documents at ``offsets`` (:class:`PackedRows`)."""
        if offsets is not None:
            return varlen_causal(q, k, v, offsets)
        p = self.s.attention_dropout if self.training else 0.0
        gqa = self.groups != self.heads
        if mask is not None and mask.dtype != q.dtype:  # made in the parameters' dtype; the queries differ
            mask = mask.to(q.dtype)
        if mask is not None and gqa:
            # The fused GPU kernels that take a mask (memory-efficient, cuDNN) want as many key/value heads as
            # query heads; repeat them here (a copy, no host sync) rather than fall back to the math kernel.
            k, v = (_repeat_heads(t, self.heads // self.groups) for t in (k, v))
            gqa = False
        if p == 0.0:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        with get_rng_tracker().fork(MODEL_PARALLEL_RNG):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None,
                                                  enable_gqa=gqa)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.linear_qkv(x)
        b, t, _ = qkv.shape  # the whole sequence: under sequence parallelism x holds a shard of it
        q, k, v = qkv.split([self.heads * self.head_dim, self.groups * self.head_dim, self.groups * self.head_dim], -1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.groups, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.groups, self.head_dim).transpose(1, 2)
        if self.s.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        # packed rows: this mode's documents (PackedRows.view); offsets: varlen attention (PackedRows.kernel_for)
        packed = self.packed.view(self.training) if self.packed is not None else None
        positions, mask, offsets = packed if packed is not None else (None, None, None)
        if self.context is not None:  # context parallel (R41: never with packed rows)
            positions, mask = self.context.positions(t, q.device), self.context.mask(t, q.device, q.dtype)
        q, k = self.rotary(q, positions), self.rotary(k, positions)
        if self.context is not None:  # the whole sequences' keys and values (and queries: a2a), rotated where held
            q, k, v = self.context.exchange(q, k, v)
        if self.s.recompute_core_attn and self.training:
            # Recompute without RNG replay: rule R15 forbids attention dropout here.
            out = checkpoint(self.core_attention, q, k, v, mask, offsets, use_reentrant=False,
                             preserve_rng_state=False)
        else:
            out = self.core_attention(q, k, v, mask, offsets)
        if self.context is not None:  # a2a: this rank's tokens and every head again
            out = self.context.heads_back(out)
        return self.linear_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


def _repeat_heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """[batch, groups, seq, dim] -> [batch, groups * n, seq, dim], each group's head ``n`` times in a row (the
    query heads ``g * n .. g * n + n - 1`` read group ``g``, as ``enable_gqa`` pairs them)."""
    b, g, t, d = x.shape
    return x[:, :, None].expand(b, g, n, t, d).reshape(b, g * n, t, d)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, 2 * ffn, bias=False)
        self.linear_fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)


class AttentionBlock(nn.Module):
    """Scope ``attn``: input norm + attention + dropout + residual."""

    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.eps)
        self.self_attention = Attention(s)
        self.dropout = s.hidden_dropout
        self.dropout_rng = DATA_PARALLEL_RNG

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.self_attention(self.input_layernorm(x))
        return x + hidden_dropout(y, self.dropout, self.training, self.dropout_rng)


class MLPBlock(nn.Module):
    """Scope ``mlp``: pre-MLP norm + SwiGLU + dropout + residual."""

    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.pre_mlp_layernorm = RMSNorm(s.hidden_size, s.eps)
        self.mlp = SwiGLU(s.hidden_size, s.ffn_hidden_size)
        self.dropout = s.hidden_dropout
        self.dropout_rng = DATA_PARALLEL_RNG
        self.recompute = s.recompute_mlp

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.pre_mlp_layernorm(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and self.training:
            y = checkpoint(self._mlp, x, use_reentrant=False, preserve_rng_state=False)
        else:
            y = self._mlp(x)
        return x + hidden_dropout(y, self.dropout, self.training, self.dropout_rng)


class DecoderLayer(nn.Module):
    """A sequence of blocks (mixer then channel mixer), each a graph scope."""

    def __init__(self, blocks: dict[str, nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict(blocks)

    def graph_scopes(self) -> dict:
        scopes: dict = {}
        for block in self.blocks.values():
            scopes.update(block.graph_scopes() if hasattr(block, "graph_scopes") else {})
        for name, block in self.blocks.items():
            scopes.setdefault(name, block)
        return scopes

    def graph_runs(self) -> list[list[nn.Module]]:
        """What this forward calls one after the other with nothing in between (cuda_graph/scopes.py): the blocks,
        and each block with the modules its own forward starts with (``graph_head()``, e.g. an MoE block's router
        and preprocess stages)."""
        blocks = list(self.blocks.values())
        runs = [blocks]
        for k, block in enumerate(blocks):
            head = list(block.graph_head()) if hasattr(block, "graph_head") else []
            if head:
                runs.append(blocks[k - 1:k] + head)
        return runs

    def graph_entry(self) -> list[nn.Module]:
        """The modules one of which this forward calls first, whichever is graphed: the first block, or the first
        module that block's forward calls (its ``graph_head()``)."""
        first = list(self.blocks.values())[0]
        return [first, *(list(first.graph_head())[:1] if hasattr(first, "graph_head") else [])]

    def graph_exit(self) -> list[nn.Module]:
        """The modules one of which this forward calls last, whichever is graphed: the last block, or the last
        module that block's forward calls (its ``graph_tail()``)."""
        last = list(self.blocks.values())[-1]
        return [last, *(list(last.graph_tail())[-1:] if hasattr(last, "graph_tail") else [])]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


def _vocab_parallel_logits(h: torch.Tensor, weight: DTensor, placement: Placement) -> torch.Tensor:
    """Full logits from this rank's hidden state (sequence-sharded or replicated) and a vocabulary-sharded weight."""
    mesh = weight.device_mesh
    hidden = DTensor.from_local(h, mesh, [placement], run_check=False)
    if not placement.is_replicate():
        hidden = hidden.redistribute(mesh, [Replicate()])
    return F.linear(hidden, weight).full_tensor()


_DECODER_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def decoder_layer_of(name: str) -> int | None:
    """The index of the decoder layer a module of the model lies in, from its name (``layers.3.mlp.linear_fc1``:
    3); None outside the decoder layers (the embedding, the output layer)."""
    found = _DECODER_LAYER.search(name + ".")
    return int(found.group(1)) if found is not None else None


class GPTModel(nn.Module):
    """Embedding -> decoder layers -> final norm -> output layer; returns the mean token loss."""

    def __init__(self, s: ModelShape, layers: list[DecoderLayer] | None = None) -> None:
        super().__init__()
        self.shape = s
        self.embedding = nn.Embedding(s.vocab_size, s.hidden_size)
        if layers is None:
            layers = [DecoderLayer({"attn": AttentionBlock(s), "mlp": MLPBlock(s)}) for _ in range(s.num_layers)]
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = RMSNorm(s.hidden_size, s.eps)
        self.output_layer = None if s.tie_embeddings else nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        self.hidden_placement: Placement = Replicate()  # Shard(1) under sequence parallelism
        self.packed = PackedRows(s.attention_dropout)
        self.context = None  # parallel/context_parallel.py: the loss over sequences split between ranks
        for module in self.modules():
            if isinstance(module, Attention):
                module.packed = self.packed
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.shape.init_std
        out_std = std / math.sqrt(2.0 * max(1, len(self.layers)))
        for name, p in self.named_parameters():
            if p.dim() < 2 or name.endswith("norm.weight"):
                continue
            nn.init.normal_(p, 0.0, out_std if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else std)
        for name, p in self.named_parameters():
            if p.dim() == 1 and not name.endswith("weight"):
                nn.init.zeros_(p)

    def graph_layers(self) -> list[nn.Module]:
        return [layer for _, layer in self.layers.named_children()]

    def graph_runs(self) -> list[list[nn.Module]]:
        """Across layers (cuda_graph/scopes.py): :meth:`stage_forward` calls each layer on the one before's output
        with nothing in between, so a layer, or its last module (``graph_exit()``), may be followed by the next
        layer, or its first module (``graph_entry()``) -- not across a full recompute's runs of layers (each run's
        backward re-runs it)."""
        layers = self.graph_layers()
        runs: list[list[nn.Module]] = []
        for start, stop, recomputed in recompute_runs(len(layers), self.shape.recompute_layers):
            for before, after in zip(layers[start:stop], layers[start + 1:stop]):
                if recomputed:
                    continue
                exits = [before, *(before.graph_exit() if hasattr(before, "graph_exit") else [])]
                entries = [after, *(after.graph_entry() if hasattr(after, "graph_entry") else [])]
                runs += [[a, b] for a in exits for b in entries]
        return runs

    def stage_forward(self, x: torch.Tensor) -> torch.Tensor:
        """What this model holds of the network, from its input to its output.

        The whole model: tokens -> logits. A pipeline stage
        (parallel/pipeline.py) holds the embedding only on the first stage and
        the final norm and output layer only on the last: it maps tokens or a
        hidden state to a hidden state or the logits.
        """
        h = self.embedding(x) if self.embedding is not None else x
        layers = self.graph_layers()
        full = self.shape.recompute_layers if self.training else None
        for start, stop, recomputed in recompute_runs(len(layers), full):
            if recomputed:
                # Full recompute: only the run's input is kept; its backward re-runs the layers without replaying
                # the RNG, which rule R35 makes safe (no dropout in a recomputed layer).
                h = checkpoint(_RecomputedRun(layers[start:stop]), h, use_reentrant=False, preserve_rng_state=False)
            else:
                h = _run_layers(layers[start:stop], h)
        if self.final_layernorm is None:
            return h
        h = self.final_layernorm(h)
        weight = self.embedding.weight if self.output_layer is None else self.output_layer.weight
        if isinstance(weight, DTensor):  # tensor parallel: the vocabulary is sharded (parallel/tensor_parallel.py)
            return _vocab_parallel_logits(h, weight, self.hidden_placement)
        return F.linear(h, weight)

    def logits(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """The logits of ``tokens``; ``cu_seqlens``: the rows are packed documents (:class:`PackedRows`)."""
        if cu_seqlens is None:
            self.packed.clear(self.training)
        else:
            self.packed.update(cu_seqlens, tokens.shape[-1], self.embedding.weight.dtype, self.training)
        return self.stage_forward(tokens)

    def forward(
        self, tokens: torch.Tensor, labels: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The mean token loss (the logits without ``labels``); ``cu_seqlens``: the rows are packed documents."""
        logits = self.logits(tokens, cu_seqlens)
        if labels is None:
            return logits
        if self.context is not None:
            return self.context.loss(logits, labels, loss_mask)
        return token_loss(logits, labels, loss_mask)


def _run_layers(layers: list[nn.Module], h: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        h = layer(h)
    return h


_RECOMPUTING = [False]


def is_recomputing() -> bool:
    """Whether the layers running now are a full recompute's second forward (in the backward): state updated in
    place during a forward -- the MoE router's statistics -- is updated by the first forward only."""
    return _RECOMPUTING[0]


class _RecomputedRun:
    """A run of layers under full recompute: its first call is the forward, every later one the recompute."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers, self.calls = layers, 0

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            return _run_layers(self.layers, h)
        _RECOMPUTING[0] = True
        try:
            return _run_layers(self.layers, h)
        finally:
            _RECOMPUTING[0] = False


def token_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mean cross-entropy over tokens (over the tokens ``loss_mask`` keeps)."""
    losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    if loss_mask is None:
        return losses.mean()
    mask = loss_mask.flatten().to(losses.dtype)
    # Divide by the token count on the device: no host sync, static shapes.
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)
