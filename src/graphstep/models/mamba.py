"""A Mamba-2 mixer block in pure PyTorch (scope ``mamba``), for hybrid models.

:class:`MambaBlock` is input RMSNorm + :class:`MambaMixer` + hidden dropout +
residual, one block of a :class:`~graphstep.models.transformer.DecoderLayer`.
The mixer follows Mamba-2 / Megatron Core's ``MambaMixer``:

1. ``in_proj`` maps x to (z, xBC, dt): the gate, the conv input (x of width
   ``d_inner = 2 * hidden`` plus B and C of ``groups * state`` each) and
   one dt per head;
2. a causal depthwise conv1d (width 4) over xBC, then SiLU;
3. the selective state-space model per head ``h``, with scalar decay
   ``A = -exp(A_log)`` and step ``dt = softplus(dt + dt_bias)``:
   ``s_t = exp(dt_t A) s_{t-1} + dt_t x_t B_t^T``, ``y_t = s_t C_t + D x_t``;
4. gated RMSNorm ``norm(y * silu(z))`` per group, then ``out_proj``.

Step 3 runs as the chunked SSD algorithm of the Mamba-2 paper ("ssd_minimal"):
the sequence is cut into chunks of ``mamba_chunk_size``; inside a chunk the
output is a masked quadratic form (the "diagonal blocks", with decays from
:func:`segsum`); between chunks only the per-head states are carried by a
short recurrence (itself written as one more segsum product). Everything is
static-shape tensor algebra in fp32 -- no host syncs, so it captures. A
sequence that is not a multiple of the chunk is padded at the end with zero
input and zero decay, which cannot change earlier (causal) outputs.

Under context parallel (``context``, set by parallel/context_parallel.py) a
rank holds only its chunks of each sequence, but steps 2 and 3 run along the
whole sequence. The projections stay on the rank's tokens; the conv input and
dt are exchanged by one all-to-all so that each rank holds the whole
sequences of ``1 / cp`` of the heads (and of their groups' B and C), runs the
conv and the scan over them with its heads' slices of the conv weights, A, D
and dt_bias, and the scan's output goes back to the rank's tokens by the
inverse all-to-all before the gated norm (per token) and ``out_proj``.
Megatron Core's ``MambaContextParallel`` splits the same way.

Under tensor parallel (``tp_size``, set by parallel/tensor_parallel.py) a
rank holds ``1 / tp`` of the heads and of the groups of B and C: ``in_proj``'s
output is its parts of z, x, B, C and dt, the conv, A, D, dt_bias and the
gated norm's weight are its rows (read through ``to_local``), and ``out_proj``
sums the ranks' outputs. Context parallel then splits each rank's heads again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ..cuda_graph.rng import DATA_PARALLEL_RNG
from .transformer import ModelShape, RMSNorm, hidden_dropout

D_CONV = 4  # Megatron's mamba d_conv
EXPAND = 2  # d_inner = EXPAND * hidden


@dataclass(frozen=True)
class MambaShape:
    hidden: int
    d_inner: int
    heads: int
    head_dim: int
    state: int
    groups: int
    chunk: int
    eps: float

    @classmethod
    def from_config(cls, m) -> MambaShape:
        d_inner = EXPAND * m.hidden_size
        errors = []
        if d_inner % m.mamba_head_dim:
            errors.append(f"model.mamba_head_dim={m.mamba_head_dim} must divide 2 * hidden_size = {d_inner}")
        elif (d_inner // m.mamba_head_dim) % m.mamba_num_groups:
            heads = d_inner // m.mamba_head_dim
            errors.append(f"model.mamba_num_groups={m.mamba_num_groups} must divide the {heads} heads")
        if m.mamba_chunk_size < 1:
            errors.append(f"model.mamba_chunk_size must be >= 1, got {m.mamba_chunk_size}")
        if errors:
            raise ValueError("invalid Mamba configuration:\n  " + "\n  ".join(errors))
        return cls(
            hidden=m.hidden_size,
            d_inner=d_inner,
            heads=d_inner // m.mamba_head_dim,
            head_dim=m.mamba_head_dim,
            state=m.mamba_state_dim,
            groups=m.mamba_num_groups,
            chunk=m.mamba_chunk_size,
            eps=m.layernorm_epsilon,
        )


def segsum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum(x[..., j+1 : i+1])`` for j <= i, -inf above the diagonal (stable form)."""
    T = x.shape[-1]
    x = x.unsqueeze(-1).expand(*x.shape, T)
    below = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=-1)
    x = x.masked_fill(~below, 0.0)
    out = torch.cumsum(x, dim=-2)
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=0)
    return out.masked_fill(~keep, -torch.inf)


def ssd_chunked(x: torch.Tensor, a: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk: int) -> torch.Tensor:
    """The SSM scan by chunks (no initial state).

    x [b, l, h, p] (already times dt), a [b, l, h] (= dt * A), B and C
    [b, l, h, n] -> y [b, l, h, p]; any length ``l`` (padded to a chunk multiple).
    """
    length = x.shape[1]
    pad = (-length) % chunk
    if pad:
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        a = F.pad(a, (0, 0, 0, pad))
    b, L, h, p = x.shape
    c = L // chunk
    x, B, C = (t.reshape(b, c, chunk, h, -1) for t in (x, B, C))
    a = a.reshape(b, c, chunk, h).permute(0, 3, 1, 2)  # [b, h, c, l]
    a_cum = torch.cumsum(a, dim=-1)
    # 1. intra-chunk outputs (diagonal blocks)
    decay = torch.exp(segsum(a))
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, decay, x)
    # 2. each chunk's final state from its own inputs
    decay_states = torch.exp(a_cum[..., -1:] - a_cum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_states, x)
    # 3. states at chunk boundaries: the recurrence over chunks, as one product
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = torch.exp(segsum(F.pad(a_cum[..., -1], (1, 0))))
    states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)[:, :-1]
    # 4. contribution of the carried state to each position
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, torch.exp(a_cum))
    return (y_diag + y_off).reshape(b, L, h, p)[:, :length]


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class GatedRMSNorm(nn.Module):
    """Mamba-2's ``RMSNormGated`` (norm_before_gate=False): RMSNorm of ``y * silu(z)`` per group."""

    def __init__(self, dim: int, groups: int, eps: float) -> None:
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        acc = _acc_dtype(y)
        weight = _local(self.weight)  # under tensor parallel this rank's channels: whole groups of them
        groups = self.groups * weight.shape[0] // self.weight.shape[0]
        g = (y.to(acc) * F.silu(z.to(acc))).unflatten(-1, (groups, -1))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return (g.flatten(-2) * weight.to(acc)).to(y.dtype)


class MambaMixer(nn.Module):
    """Mamba-2 mixer: x [b, l, hidden] -> [b, l, hidden] (no norm, no residual)."""

    def __init__(self, ms: MambaShape) -> None:
        super().__init__()
        self.ms = ms
        self.conv_dim = ms.d_inner + 2 * ms.groups * ms.state
        self.in_proj = nn.Linear(ms.hidden, ms.d_inner + self.conv_dim + ms.heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, D_CONV, groups=self.conv_dim, padding=D_CONV - 1)
        self.A_log = nn.Parameter(torch.empty(ms.heads))
        self.D = nn.Parameter(torch.empty(ms.heads))
        self.dt_bias = nn.Parameter(torch.empty(ms.heads))
        self.norm = GatedRMSNorm(ms.d_inner, ms.groups, ms.eps)
        self.out_proj = nn.Linear(ms.d_inner, ms.hidden, bias=False)
        self.context = None  # parallel/context_parallel.py: this rank's chunks of every sequence
        self.tp_size = 1  # parallel/tensor_parallel.py: this rank runs heads / tp_size heads (and groups)
        self.reset_special_parameters()

    @torch.no_grad()
    def reset_special_parameters(self) -> None:
        """Mamba-2's init of A, D and dt (GPTModel's generic init zeros 1-D parameters)."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        self.D.fill_(1.0)
        lo, hi = math.log(1e-3), math.log(1e-1)
        dt = torch.exp(torch.rand_like(self.dt_bias) * (hi - lo) + lo).clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ms, tp = self.ms, self.tp_size
        b = x.shape[0]
        # this rank's heads, groups and x channels (all of them without tensor parallel)
        heads, groups, inner = ms.heads // tp, ms.groups // tp, ms.d_inner // tp
        weight, bias, A_log, D, dt_bias = (_local(p) for p in (self.conv1d.weight, self.conv1d.bias, self.A_log,
                                                                self.D, self.dt_bias))
        z, xbc, dt = self.in_proj(x).split([inner, inner + 2 * groups * ms.state, heads], dim=-1)
        if self.context is not None:  # context parallel: the whole sequences of part of the heads (module docstring)
            cp, part = self.context, self.context.rank
            channels = [self.part_channels(j, cp.size, inner, groups) for j in range(cp.size)]
            heads, inner = heads // cp.size, inner // cp.size
            xbc = cp.sequences_of_parts([torch.cat([*(xbc[..., c] for c in channels[j]),
                                                    dt[..., j * heads:(j + 1) * heads]], dim=-1)
                                         for j in range(cp.size)])
            xbc, dt = xbc.split([xbc.shape[-1] - heads, heads], dim=-1)
            weight, bias = (torch.cat([p[c] for c in channels[part]]) for p in (weight, bias))
            A_log, D, dt_bias = (p[part * heads:(part + 1) * heads] for p in (A_log, D, dt_bias))
            groups = max(groups // cp.size, 1)
        length = xbc.shape[1]
        xbc = F.conv1d(xbc.transpose(1, 2), weight, bias, padding=D_CONV - 1, groups=weight.shape[0])
        xbc = F.silu(xbc[..., :length].transpose(1, 2))
        xs, B, C = xbc.split([inner, groups * ms.state, groups * ms.state], dim=-1)
        acc = _acc_dtype(x)  # the scan runs in fp32 (fp64 for fp64 checks)
        dt = F.softplus(dt.to(acc) + dt_bias.to(acc))  # [b, l, h]
        A = -torch.exp(A_log.to(acc))
        xs = xs.to(acc).view(b, length, heads, ms.head_dim)
        y = ssd_chunked(xs * dt.unsqueeze(-1), A * dt, _per_head(B, acc, heads, groups),
                        _per_head(C, acc, heads, groups), ms.chunk)
        y = (y + xs * D.to(acc).view(-1, 1)).reshape(b, length, heads * ms.head_dim).to(x.dtype)
        if self.context is not None:  # back to this rank's tokens, every head of this rank
            y = self.context.tokens_of_parts(y)
        return self.out_proj(self.norm(y, z))

    def part_channels(self, part: int, parts: int, inner: int, groups: int) -> list[slice]:
        """The conv channels (of x, B and C) of heads part ``part`` of ``parts`` among ``inner`` x channels and
        ``groups`` groups: its heads' x and their groups' B and C (a group shared by several parts when there are
        fewer groups than parts)."""
        state = self.ms.state
        x_width, g_width = inner // parts, max(groups // parts, 1) * state
        b_first = inner + (part * groups // parts) * state
        c_first = b_first + groups * state
        return [slice(part * x_width, (part + 1) * x_width), slice(b_first, b_first + g_width),
                slice(c_first, c_first + g_width)]


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a parameter tensor parallel sharded (a DTensor: differentiably), else ``p``."""
    return p.to_local() if isinstance(p, DTensor) else p


def _per_head(t: torch.Tensor, acc: torch.dtype, heads: int, groups: int) -> torch.Tensor:
    """[b, l, groups*state] -> [b, l, heads, state] in ``acc``; heads share their group's B/C."""
    b, length, _ = t.shape
    t = t.to(acc).view(b, length, groups, 1, -1)
    return t.expand(b, length, groups, heads // groups, t.shape[-1]).reshape(b, length, heads, -1)


class MambaBlock(nn.Module):
    """Scope ``mamba``: input RMSNorm + Mamba-2 mixer + hidden dropout + residual."""

    def __init__(self, s: ModelShape, ms: MambaShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.eps)
        self.mixer = MambaMixer(ms)
        self.dropout = s.hidden_dropout
        self.dropout_rng = DATA_PARALLEL_RNG  # model-parallel under sequence parallel (parallel/tensor_parallel.py)

    def graph_scopes(self) -> dict:
        return {"mamba": self}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + hidden_dropout(self.mixer(self.input_layernorm(x)), self.dropout, self.training, self.dropout_rng)
