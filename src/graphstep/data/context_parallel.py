"""Which tokens of each sequence a context-parallel rank holds: Megatron's load-balanced causal chunks.

With ``model.context_parallel_size`` = ``cp``, every sample's sequence of
``S`` tokens is cut into ``2 x cp`` chunks of ``S / (2 x cp)`` tokens, and
context-parallel rank ``r`` holds chunks ``r`` and ``2 x cp - 1 - r``, in
that order (Megatron Core's ``get_batch_on_this_cp_rank``). Under causal
attention a query attends to every key before it, so a rank holding only
early chunks would do little work and one holding late chunks much: pairing
chunk ``r`` with its mirror gives every rank the same number of
query-key pairs.

The context-parallel ranks of a data-parallel rank read the same samples
(the loader's ``dp_rank`` / ``dp_size`` do not count them) and each keeps
its chunks of every ``[micro_batch, S]`` tensor of the micro-batch
(:func:`context_parallel_shard`, called where the micro-batches are built,
data/loader.py). The model finds the positions of the tokens it holds with
:func:`context_parallel_positions` (rotary embeddings, the causal mask:
parallel/context_parallel.py).
"""

from __future__ import annotations

import torch

SEQUENCE_KEYS = ("tokens", "labels", "loss_mask")  # a micro-batch's [micro_batch, S] tensors


def context_parallel_positions(seq: int, cp_rank: int, cp_size: int,
                               device: torch.device | str | None = None) -> torch.Tensor:
    """The positions (int64, ``[2 x seq / (2 x cp_size)]``, on ``device``) of the tokens rank ``cp_rank`` holds of
    ``seq``: made there, without a host-to-device copy (which a CUDA graph capture would refuse)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is not a rank of context_parallel_size={cp_size}")
    if seq % (2 * cp_size):
        raise ValueError(f"a sequence of {seq} tokens does not cut into 2 x {cp_size} equal chunks (rule R30)")
    chunk = seq // (2 * cp_size)
    mirror = 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device),
                      torch.arange(mirror * chunk, (mirror + 1) * chunk, device=device)])


def context_parallel_shard(batch: dict[str, torch.Tensor], cp_rank: int, cp_size: int) -> dict[str, torch.Tensor]:
    """This rank's chunks of every sequence of ``batch`` (a micro-batch of whole sequences); ``batch`` itself
    with one context-parallel rank."""
    if cp_size == 1:
        return batch
    other = sorted(set(batch) - set(SEQUENCE_KEYS))
    if other:  # packed rows carry cu_seqlens: rule R41 refuses packing with context parallel
        raise ValueError(f"context parallel splits tokens, labels and loss_mask; the micro-batch also has {other}")
    index = context_parallel_positions(batch["tokens"].shape[-1], cp_rank, cp_size)
    return {key: value.index_select(-1, index) for key, value in batch.items()}
