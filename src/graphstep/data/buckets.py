"""Sequence-length buckets: pad each step to the smallest bucket that holds it (spec section 5).

Graphs need static shapes, and padding every sample to ``model.seq_length``
wastes work when most samples are short. ``data.seq_length_buckets=[64,128,256]``
pads each step's micro-batches to the smallest bucket that holds the longest
sample *of the whole global batch* -- every micro-batch of the step, on every
data-parallel rank, has the same width, computed from the data alone (no
communication), so a step has one shape and the trainer keeps one graph per
bucket (training/graphs.py).

A sample longer than the largest bucket is an error naming the sample (the
file and line of an SFT example), never a silent truncation. Validation and
test batches are padded to the largest bucket (one evaluation graph).

Padding is at the end: ``tokens`` and ``labels`` get the tokenizer's pad id,
``loss_mask`` 0. Attention is causal, so padding changes no real position's
output, and the loss divides by the mask's sum.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from graphstep.config import Config
from graphstep.errors import BucketError


def parse_buckets(cfg: Config) -> list[int] | None:
    """``data.seq_length_buckets`` sorted (validation's V22 has checked each against ``model.seq_length``)."""
    buckets = cfg.data.seq_length_buckets
    return None if buckets is None else sorted(set(buckets))


def pick_bucket(buckets: list[int], length: int, describe: Callable[[], str]) -> int:
    """The smallest bucket >= ``length``; a clear error naming the sample when none is."""
    for b in buckets:
        if length <= b:
            return b
    raise BucketError(
        f"{describe()}: {length} tokens is longer than the largest bucket {buckets[-1]} of "
        f"data.seq_length_buckets={buckets}; samples are never truncated silently: add a larger bucket "
        "(up to model.seq_length), or shorten or drop the sample"
    )


def pad_batch(tokens: list[np.ndarray], labels: list[np.ndarray], masks: list[np.ndarray], width: int,
              pad_id: int) -> dict[str, torch.Tensor]:
    """Stack variable-length samples into ``[n, width]`` tensors, padded at the end."""
    n = len(tokens)
    out_tokens = np.full((n, width), pad_id, dtype=np.int64)
    out_labels = np.full((n, width), pad_id, dtype=np.int64)
    out_mask = np.zeros((n, width), dtype=np.float32)
    for i, (t, lab, m) in enumerate(zip(tokens, labels, masks)):
        if len(t) > width:
            raise BucketError(f"sample of {len(t)} tokens does not fit the padded width {width}")
        out_tokens[i, : len(t)], out_labels[i, : len(t)], out_mask[i, : len(t)] = t, lab, m
    return {"tokens": torch.from_numpy(out_tokens), "labels": torch.from_numpy(out_labels),
            "loss_mask": torch.from_numpy(out_mask)}
