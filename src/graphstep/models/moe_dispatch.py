"""Token dispatch and expert GEMMs of the MoE layer, all with device-side metadata.

The routing decision (``idx [N, k]``, ``probs [N, k]``) becomes a *layout*:
a static number of expert-input rows ``P`` and the row of each (token,
choice) pair (``row [N, k]``; ``P`` = dropped). Every tensor in it has a
shape that depends only on the configuration, never on the routing, so
building it and running the experts needs no host sync.

:func:`dispatch` writes each token into its rows (rows nobody owns stay
zero) and the combine reads them back with ``expert_out[row]``. Both index
with ``row``, whose entries are unique: their backward passes are plain
gathers/scatters without duplicate accumulation (a gather by "token of each
row" would accumulate the many padding rows into one index, which is slow
on GPUs and not deterministic).

Layouts:

* dropless (:func:`dropless_layout`): rows sorted by expert, each expert's
  group padded to a multiple of ``align`` rows; the slack up to the static
  bound ``P`` goes to the last expert so the group offsets always end at
  ``P``. ``align=1`` is the plain sorted permutation.
* capacity (:func:`capacity_layout`, drop-and-pad): every expert has exactly
  ``capacity`` slots, filled with its routed tokens in descending probability
  order (Megatron's ``drop_policy=probs``); overflow is dropped, free slots
  stay zero.

Expert GEMMs (:class:`GroupedExperts`), SwiGLU experts with stacked weights:

* ``grouped_mm``: ``torch._grouped_mm`` with device-side group offsets
  (CUTLASS grouped GEMM on sm90+ in bf16);
* ``tiled``: the padded fallback -- rows in tiles of ``align``, each tile
  owned by one expert, one batched GEMM with each tile's expert weights
  gathered on the device; mathematically the same, no host sync, about
  ``E * align`` extra zero rows of work;
* ``loop``: one GEMM per expert with group sizes read on the host. This is
  the host sync that rules R11/R12 are about; it exists to show it. The
  expert-parallel ``alltoall`` dispatcher (moe_parallel.py) runs the same
  per-expert GEMMs on the sizes it has read on the host anyway.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ..cuda_graph.torch_compat import grouped_mm, grouped_mm_available


def dropless_rows(num_pairs: int, num_experts: int, align: int) -> int:
    """Static row bound of a dropless layout: ``num_pairs`` rows plus worst-case padding."""
    if align == 1:
        return num_pairs
    return math.ceil((num_pairs + num_experts * (align - 1)) / align) * align


def tile_size(num_pairs: int, num_experts: int) -> int:
    """Tile rows of the ``tiled`` fallback: about the mean group size, a power of two in [8, 128]."""
    mean = max(1, math.ceil(num_pairs / num_experts))
    return min(128, max(8, 1 << (mean - 1).bit_length()))


def dropless_layout(idx: torch.Tensor, num_experts: int, align: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row [N, k], tokens_per_expert [E] int64, offsets [E] int32), all on the device."""
    N, k = idx.shape
    flat = idx.reshape(-1)
    P = dropless_rows(flat.numel(), num_experts, align)
    order = torch.argsort(flat, stable=True)  # sorted position -> flat (token, choice)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=idx.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + align - 1) // align * align
    # The slack up to P belongs to the last expert: offsets end at P, so no row is left undefined.
    padded = torch.cat([padded[:-1], (P - padded[:-1].sum()).view(1)])
    pad_end = torch.cumsum(padded, 0)
    sorted_expert = flat[order]
    rank = torch.arange(flat.numel(), device=idx.device) - (torch.cumsum(counts, 0) - counts)[sorted_expert]
    dest = (pad_end - padded)[sorted_expert] + rank  # padded row of each sorted pair
    row = torch.empty_like(flat).scatter_(0, order, dest).view(N, k)
    return row, counts, pad_end.to(torch.int32)


def expert_parallel_layout(
    idx: torch.Tensor, first: int, num_local: int, align: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The dropless layout of the pairs routed to experts ``first .. first + num_local - 1`` (one expert-parallel
    rank's), every other pair dropped: (row [N, k] (``P`` = dropped), tokens_per_expert [num_local],
    offsets [num_local] int32, ``P``).

    The other ranks' experts collect into one extra group after this rank's (its rows are never read), so the
    static bound ``P`` holds the worst case: every pair routed here.
    """
    local = (idx >= first) & (idx < first + num_local)
    row, counts, offsets = dropless_layout(torch.where(local, idx - first, num_local), num_local + 1, align)
    P = dropless_rows(idx.numel(), num_local + 1, align)
    return torch.where(local, row, P), counts[:num_local], offsets[:num_local], P


def tile_owner(offsets: torch.Tensor, num_rows: int, tile: int) -> torch.Tensor:
    """The expert that owns each tile of ``tile`` rows (groups are padded to whole tiles)."""
    starts = torch.arange(0, num_rows, tile, device=offsets.device)
    owner = (offsets.unsqueeze(0) <= starts.unsqueeze(1)).sum(dim=1)
    return owner.clamp_(max=offsets.numel() - 1)


def capacity_layout(
    probs: torch.Tensor, idx: torch.Tensor, num_experts: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop-and-pad: (row [N, k] (E*C = dropped), kept tokens_per_expert [E], offsets [E] int32)."""
    N, _ = idx.shape
    C = capacity
    # Unrouted pairs get -1 so that every routed token outranks them.
    gates = torch.full((N, num_experts), -1.0, device=idx.device).scatter(1, idx, probs.float())
    slot_token = torch.topk(gates, C, dim=0).indices  # [C, E]: highest probabilities first
    valid = gates.gather(0, slot_token) >= 0
    token = torch.where(valid, slot_token, N)
    slot_id = torch.arange(num_experts * C, device=idx.device).view(num_experts, C).t()
    # table[n, e] = slot of token n at expert e; E*C (a zero row) when dropped or unrouted.
    table = torch.full((N + 1, num_experts), num_experts * C, dtype=torch.int64, device=idx.device)
    table = table.scatter(0, token, torch.where(valid, slot_id, num_experts * C))
    row = table[:N].gather(1, idx)
    offsets = torch.arange(1, num_experts + 1, device=idx.device, dtype=torch.int32) * C
    return row, valid.sum(dim=0), offsets


def dispatch(normed: torch.Tensor, row: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Expert input [num_rows, h]: token n at ``row[n, j]`` for each choice j; other rows zero."""
    N, k = row.shape
    h = normed.shape[-1]
    src = normed.unsqueeze(1).expand(N, k, h).reshape(N * k, h)
    # One extra row takes the dropped pairs (row == num_rows) and is cut off.
    out = normed.new_zeros(num_rows + 1, h).index_put((row.reshape(-1),), src)
    return out[:num_rows]


class StackedLinear(nn.Module):
    """``E`` bias-free linear maps in one [E, out, in] weight (named like Megatron's linear_fc1/fc2)."""

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        nn.init.normal_(self.weight, 0.0, 0.02)


_GROUPED_MM_OK: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs the sync-free kernel here, tested once per (device, dtype).

    Only CUDA sm90+ in bf16 qualifies: elsewhere the op exists but may fall
    back to a per-group loop that reads the offsets on the host.
    """
    key = (str(device), dtype)
    if key in _GROUPED_MM_OK:
        return _GROUPED_MM_OK[key]
    ok = (
        grouped_mm_available()
        and device.type == "cuda"
        and dtype == torch.bfloat16
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )
    if ok and torch.cuda.is_current_stream_capturing():
        # The probe reads a result on the host, impossible while capturing:
        # take the fallback for this block and leave the decision open.
        return False
    _GROUPED_MM_OK[key] = ok and _probe_grouped_mm(device, dtype)
    return _GROUPED_MM_OK[key]


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Run ``_grouped_mm`` once on unaligned groups (one empty) and compare with per-group products."""
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(37, 64, device=device, generator=gen).to(dtype)
        w = torch.randn(3, 32, 64, device=device, generator=gen).to(dtype)
        offs = torch.tensor([5, 5, 37], device=device, dtype=torch.int32)  # unaligned, one empty group
        out = grouped_mm(x, w.transpose(-2, -1), offs)
        ref = torch.cat([x[:5] @ w[0].t(), x[5:37] @ w[2].t()])
        return bool(torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts: ``linear_fc1.weight`` [E, 2*ffn, hidden], ``linear_fc2.weight`` [E, hidden, ffn]."""

    def __init__(self, num_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.linear_fc1 = StackedLinear(num_experts, 2 * ffn, hidden)
        self.linear_fc2 = StackedLinear(num_experts, hidden, ffn)
        # True while a hook on this module reads the group sizes on the host (the all-to-all token exchange of
        # parallel/expert_parallel.py): the MoE block then runs an unpadded GEMM and is not sync-free.
        self.sizes_on_host = False

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacked weights of this rank's experts (the local part under expert parallelism)."""
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        if isinstance(w1, DTensor):  # sharded over the expert-parallel ranks (parallel/expert_parallel.py)
            return w1.to_local(), w2.to_local()
        return w1, w2

    def forward(self, x: torch.Tensor, gemm: str, groups: torch.Tensor | list[int] | None) -> torch.Tensor:
        """x through :meth:`grouped` (``groups``: the offsets), :meth:`per_expert` or :meth:`loop` (``gemm="loop"``,
        ``groups``: the sizes on the host or on the device) or :meth:`tiled` (the tile owners) as a module call, so
        that hooks on the experts run: FSDP2 gathers the expert-parallel experts it shards (parallel/fsdp.py), the
        alltoall dispatcher moves the rows to their experts' ranks and back (parallel/expert_parallel.py)."""
        if gemm == "grouped_mm":
            return self.grouped(x, groups)
        if gemm == "loop":
            return self.per_expert(x, groups) if isinstance(groups, list) else self.loop(x, groups)
        return self.tiled(x, groups)

    def grouped(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x [P, hidden] grouped by ``offsets`` (int32 cumulative ends) -> [P, hidden]."""
        w1, w2 = self.weights()
        h = grouped_mm(x, w1.transpose(-2, -1), offsets)
        gate, up = h.chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offsets)

    def tiled(self, x: torch.Tensor, owner: torch.Tensor | None) -> torch.Tensor:
        """x [T*tile, hidden] in tiles of one expert each (``owner [T]``; None = tile t is expert t)."""
        T = self.num_experts if owner is None else owner.numel()
        w1, w2 = self.weights()
        if owner is not None:
            # index_select, not w[owner]: the backward of advanced indexing accumulates the
            # tiles of one expert with atomic adds on the CPU (run-to-run rounding noise);
            # index_select's backward (index_add_) adds them in index order.
            w1, w2 = w1.index_select(0, owner), w2.index_select(0, owner)
        h = torch.bmm(x.view(T, -1, x.shape[-1]), w1.transpose(1, 2))
        gate, up = h.chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, w2.transpose(1, 2)).view(x.shape)

    def loop(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [P, hidden] sorted by expert; one GEMM per expert, sizes read on the host (a sync)."""
        # THE host sync that dropless MoE normally has: the device->host copy of
        # the group sizes. It is what makes this path impossible to capture.
        return self.per_expert(x, [int(n) for n in tokens_per_expert.cpu()])

    def per_expert(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """x [sum(sizes), hidden] sorted by expert, ``sizes`` rows each (host ints): one GEMM per expert."""
        w1, w2 = self.weights()
        outs = []
        for e, xe in enumerate(torch.split(x, sizes)):
            gate, up = F.linear(xe, w1[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, w2[e]))
        return torch.cat(outs)
