"""Packed SFT rows: several prompt/response examples in one fixed-size row, each attending only to itself.

Switched on by ``data.packed_sequences=true``, Bridge's ``dataset.enable_offline_packing=true``, or a
positive ``packed_sequence_size`` in Bridge's ``dataset.packed_sequence_specs`` /
``dataset.offline_packing_specs`` (:func:`packing_spec`; rule R41 says what packing runs with).

How rows are built. Every example of the split is read as for unpacked SFT (:mod:`graphstep.data.sft`:
``prompt + response + eod``, the loss mask on the response and the eod) against the row width ``S`` =
``packed_sequence_size`` (default ``model.seq_length``); with ``pad_seq_to_mult=m`` each example is padded
at its end to a multiple of ``m`` tokens (pad tokens, loss mask 0: still part of its document), so the
widest example is ``S`` rounded down to a multiple of ``m``, and a longer one is the usual SFT error
naming ``file:line`` (or is cut with ``data.sft_truncate=true``). The examples are then packed
**first-fit over a shuffled order** (Bridge's default ``first_fit_shuffle``): the split's examples are
shuffled once by ``(rng.seed, split)`` and each goes into the first row with room for it, a new row when
none has. First-fit fills rows nearly as well as first-fit-decreasing, and the shuffle keeps every row a
mix of long and short examples instead of grouping them by length (with decreasing order the long
examples would share rows, and a step's rows would differ in how many documents feed the loss). The
packing is made once per run, before training, and is a pure function of the file, the tokenizer, the
seed and the spec: every data-parallel rank builds the same rows without communication, and the loader
shuffles the *rows* per epoch as it shuffles any samples (:mod:`graphstep.data.loader`). The row's end
after its last document is padding (loss mask 0), attended only by itself.

A micro-batch of packed rows has ``tokens``, ``labels``, ``loss_mask`` ``[micro_batch_size, S]`` and
``cu_seqlens`` ``[micro_batch_size, slots]`` (int64): the documents' start offsets then the row's end
offsets, ``[0, e1, e2, ..., en, S, S, ...]`` where ``en`` ends the last document and the row's padding
tail ``en..S`` is a segment of its own. Its width is fixed for the split (Bridge's ``pad_cu_seqlens``:
the largest number of documents in any row, plus the tail, plus one), so graphs see one shape; a shorter
row repeats ``S`` (empty segments). The model derives each token's document and position from it on the
device (models/transformer.py :class:`~graphstep.models.transformer.PackedRows`): per-document causal
attention, RoPE positions restarting at 0 in every document.

Packing efficiency is the fraction of a split's row tokens that are example tokens (not padding), logged
once per split when the data is built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphstep.data.corpus import SPLIT_NAMES
from graphstep.data.sft import SFTExample

log = logging.getLogger("graphstep")

SPEC_FIELDS = ("packed_sequence_size", "pad_seq_to_mult", "pad_cu_seqlens", "tokenizer_model_name",
               "num_tokenizer_workers", "packed_train_data_path", "packed_val_data_path", "packed_metadata_path")
# Bridge's files of data it packed offline: graphstep packs data.data_path itself when a run starts (R41).
SPEC_PATHS = ("packed_train_data_path", "packed_val_data_path", "packed_metadata_path")
SPEC_SECTIONS = ("data.packed_sequence_specs", "data.offline_packing_specs")


@dataclass(frozen=True)
class PackingSpec:
    """What packing the config asks for: rows of ``size`` tokens, each example padded to ``multiple``."""

    size: int
    multiple: int = 1

    @property
    def max_example(self) -> int:
        """The widest example a row takes: ``size`` rounded down to a multiple of ``multiple``."""
        return self.size // self.multiple * self.multiple

    def describe(self) -> str:
        """Where the widest example's width comes from, for the SFT error message."""
        mult = f" rounded down to a multiple of pad_seq_to_mult={self.multiple}" if self.multiple > 1 else ""
        return f"a packed row, packed_sequence_size={self.size}{mult}"


def spec_fields(cfg: Any) -> dict[str, Any]:
    """Bridge's packing fields as written: ``data.packed_sequence_specs`` merged over by ``offline_packing_specs``
    (the mappings are checked by rule R41)."""
    out: dict[str, Any] = {}
    for value in (cfg.data.packed_sequence_specs, cfg.data.offline_packing_specs):  # the later wins
        if isinstance(value, dict):
            out.update(value)
    return out


def packing_on(cfg: Any) -> bool:
    """Whether the config packs SFT examples into rows (any of the four switches)."""
    size = spec_fields(cfg).get("packed_sequence_size")
    return (cfg.data.packed_sequences is True or cfg.data.enable_offline_packing is True
            or (isinstance(size, int) and not isinstance(size, bool) and size > 0))


def packing_spec(cfg: Any) -> PackingSpec | None:
    """The packing of a validated config, or None when it does not pack."""
    if not packing_on(cfg):
        return None
    fields = spec_fields(cfg)
    size = fields.get("packed_sequence_size")
    size = size if isinstance(size, int) and size > 0 else cfg.model.seq_length
    return PackingSpec(size=size, multiple=int(fields.get("pad_seq_to_mult") or 1))


def padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def first_fit(lengths: np.ndarray, capacity: int, order: np.ndarray) -> list[list[int]]:
    """Rows of example indices: each example, in ``order``, goes into the first row with room for it."""
    free = np.empty(max(1, len(lengths)), dtype=np.int64)
    rows: list[list[int]] = []
    for i in order:
        length = int(lengths[i])
        fits = np.flatnonzero(free[: len(rows)] >= length)
        if len(fits):
            row = int(fits[0])
            rows[row].append(int(i))
            free[row] -= length
        else:
            free[len(rows)] = capacity - length
            rows.append([int(i)])
    return rows


class PackedSFTSamples:
    """SFT examples packed into rows of ``spec.size`` tokens; a sample is a row."""

    name = "sft"

    def __init__(self, examples: list[SFTExample], path: str | Path, pad_id: int, spec: PackingSpec, *,
                 seed: int, split: str) -> None:
        self.examples, self.path, self.pad_id, self.spec = examples, str(path), pad_id, spec
        self.padded = np.asarray([padded_length(len(e.seq) - 1, spec.multiple) for e in examples], dtype=np.int64)
        order = np.random.default_rng([seed, SPLIT_NAMES.index(split)]).permutation(len(examples))
        self.rows = first_fit(self.padded, spec.size, order)
        self.num_samples = self.epoch_samples = len(self.rows)
        self.slots = max(len(r) for r in self.rows) + 2  # start, one end per document, the tail's end
        self.identity = {"packed_sequence_size": spec.size, "pad_seq_to_mult": spec.multiple}
        real = sum(len(e.seq) - 1 for e in examples)
        self.efficiency = real / (len(self.rows) * spec.size)
        log.info("packed %d SFT examples of %s (%s split) into %d rows of %d tokens (first-fit over a shuffled "
                 "order, up to %d per row): packing efficiency %.1f%% real tokens", len(examples), self.path,
                 split, len(self.rows), spec.size, self.slots - 2, 100.0 * self.efficiency)

    def describe(self, index: int) -> str:
        lines = [self.examples[i].line for i in self.rows[int(index)]]
        return f"{self.path}: row of lines {', '.join(map(str, lines))}"

    def batch(self, indices: np.ndarray, width: int) -> dict[str, torch.Tensor]:
        size, n = self.spec.size, len(indices)
        tokens = np.full((n, size), self.pad_id, dtype=np.int64)
        labels = np.full((n, size), self.pad_id, dtype=np.int64)
        mask = np.zeros((n, size), dtype=np.float32)
        cu = np.full((n, self.slots), size, dtype=np.int64)
        for b, row in enumerate(np.asarray(indices, dtype=np.int64)):
            at = 0
            cu[b, 0] = 0
            for k, i in enumerate(self.rows[int(row)]):
                ex, length = self.examples[i], len(self.examples[i].seq) - 1
                tokens[b, at:at + length] = ex.seq[:-1]
                labels[b, at:at + length] = ex.seq[1:]
                # label j is seq[j+1]: a target when it is a response token or the eod (as unpacked SFT)
                mask[b, at:at + length] = np.arange(1, length + 1) >= ex.prompt_len
                at += int(self.padded[i])
                cu[b, k + 1] = at
        return {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(labels),
                "loss_mask": torch.from_numpy(mask), "cu_seqlens": torch.from_numpy(cu)}
