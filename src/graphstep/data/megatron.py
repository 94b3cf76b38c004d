"""GPT samples and weighted blends of indexed datasets, as Megatron Core builds them.

GPT samples (``GPTDataset._build_document_sample_shuffle_indices``). The
documents of a split are repeated for as many *epochs* as the requested
number of samples needs (``num_samples * seq_length + 1`` tokens). The
*document index* lists them, epoch after epoch, shuffled by
``numpy.random.RandomState(rng.seed)``: all epochs together, or -- when the
last epoch would contribute fewer than 80 % of an epoch's samples -- the
earlier epochs together and the last one apart. Documents are concatenated
in that order into one virtual token stream; sample ``s`` is the window
``stream[s*S : s*S + S + 1]`` (``S = model.seq_length``; windows cross
document boundaries and overlap by one token), and ``(E*T - 1) // S``
samples exist for ``E`` epochs of ``T`` tokens. The *shuffle index*, drawn
next from the same generator, orders the samples (the samples of a separate
last epoch are shuffled among themselves, after the others). The stream is
never built: a window is gathered from the memory-mapped ``.bin`` through
the cumulative document lengths.

Validation and test splits are read in order, unshuffled (graphstep's
convention for every dataset; Megatron shuffles them too).

Blends (``BlendedDataset``). ``data.data_path='0.7 pathA 0.3 pathB'`` (or the
list ``[0.7, pathA, 0.3, pathB]``): the weights are normalised; component
``i`` is built for ``ceil(N * w_i * 1.005)`` samples, and sample ``n`` of the
blend comes from the component whose share lags its weight most
(``w_i * max(n, 1) - taken_i``, first on ties) -- deterministic, no
randomness beyond each component's own shuffle. A list of prefixes without
weights blends them in proportion to their tokens.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from graphstep.config import ConfigError
from graphstep.data.indexed import IndexedDataset


def num_epochs_for(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    """Megatron's ``_get_num_epochs``: epochs until ``num_samples * S + 1`` tokens are there."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, math.ceil(needed / tokens_per_epoch))


def document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState | None,
                   separate_final_epoch: bool) -> np.ndarray:
    """Documents repeated ``num_epochs`` times, shuffled (``_build_document_index``)."""
    if separate_final_epoch and num_epochs > 1:
        first = document_index(documents, num_epochs - 1, rng, False)
        return np.concatenate([first, document_index(documents, 1, rng, False)])
    index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    if rng is not None:
        rng.shuffle(index)
    return index


def shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """``_build_shuffle_index``: the first ``num_samples`` shuffled, then the rest apart."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


class GPTSamples:
    """Megatron GPT samples over documents ``documents`` of an indexed dataset."""

    name = "indexed"
    ordered = True  # the source orders its samples itself: the loader reads positions in order

    def __init__(self, dataset: IndexedDataset, documents: np.ndarray, *, seq_length: int,
                 num_samples: int | None, seed: int, shuffle: bool) -> None:
        self.dataset, self.seq_length = dataset, seq_length
        lengths = dataset.document_lengths[documents]
        tokens_per_epoch = int(lengths.sum())
        if tokens_per_epoch < 2:
            raise ConfigError(f"{dataset.prefix}: the documents {documents[:1].tolist()}..{documents[-1:].tolist()} "
                              f"of this split hold {tokens_per_epoch} token(s); a sample needs at least 2")
        epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_length)
        rng = np.random.RandomState(seed) if shuffle else None
        separate = False
        if shuffle and epochs > 1:
            before_last = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
            per_epoch = (tokens_per_epoch - 1) // seq_length
            separate = (num_samples - before_last) < int(0.80 * per_epoch)
        self.document_index = document_index(documents, epochs, rng, separate)
        # What fixes the order besides the seed: a resumed iterator must find it unchanged.
        self.identity = {"sample_order": f"{epochs} epoch(s){', the last shuffled apart' if separate else ''}"}
        self.ends = np.cumsum(dataset.document_lengths[self.document_index], dtype=np.int64)
        self.num_samples = int((self.ends[-1] - 1) // seq_length)
        self.epoch_samples = self.num_samples  # depends only on the epochs: the order's identity
        if self.num_samples < 1:
            raise ConfigError(f"{dataset.prefix}: {tokens_per_epoch} tokens in this split is less than one sample "
                              f"of model.seq_length+1={seq_length + 1} tokens; lower model.seq_length")
        self.order = None
        if shuffle:
            first = before_last if separate else self.num_samples
            self.order = shuffle_index(first, self.num_samples, rng)
        self._offsets = np.arange(seq_length + 1, dtype=np.int64)

    def windows(self, indices: np.ndarray) -> np.ndarray:
        samples = np.asarray(indices, dtype=np.int64)
        if self.order is not None:
            samples = self.order[samples].astype(np.int64)
        positions = samples[:, None] * self.seq_length + self._offsets
        slot = np.searchsorted(self.ends, positions, side="right")
        doc = self.document_index[slot]
        within = positions - (self.ends[slot] - self.dataset.document_lengths[doc])
        return np.asarray(self.dataset.tokens[self.dataset.document_starts[doc] + within], dtype=np.int64)


# --------------------------------------------------------------------------
# blends


def parse_blend(data_path: str | list[Any] | None) -> list[tuple[float | None, str]]:
    """``data.data_path`` as ``[(weight or None, prefix), ...]``."""
    if data_path is None or data_path == [] or data_path == "":
        raise ConfigError("data.data_path is not set: give a dataset prefix, a list of prefixes, or a weighted "
                          "blend such as '0.7 /data/a_text_document 0.3 /data/b_text_document'")
    items = [data_path] if isinstance(data_path, str) else list(data_path)
    words = [w for item in items for w in str(item).split()]

    def number(word: str) -> float | None:
        try:
            return float(word)
        except ValueError:
            return None

    if len(words) == 1:
        return [(None, words[0])]
    if all(number(w) is None for w in words):
        return [(None, w) for w in words]
    pairs = list(zip(words[0::2], words[1::2]))
    if len(words) % 2 or any(number(w) is None or number(p) is not None for w, p in pairs):
        raise ConfigError(f"data.data_path={data_path!r}: expected a prefix, a list of prefixes, or alternating "
                          "weights and prefixes such as '0.7 pathA 0.3 pathB'")
    weights = [number(w) for w, _ in pairs]
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"data.data_path={data_path!r}: blend weights must be non-negative with a positive sum")
    return [(w, p) for w, (_, p) in zip(weights, pairs)]


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's ``build_blending_indices``: (component of each sample, its sample index in the component)."""
    which = np.empty(size, dtype=np.int16)
    sample = np.empty(size, dtype=np.int64)
    taken = [0] * len(weights)
    for n in range(size):
        scale = max(float(n), 1.0)
        best, best_error = 0, weights[0] * scale - taken[0]
        for i in range(1, len(weights)):
            error = weights[i] * scale - taken[i]
            if error > best_error:
                best, best_error = i, error
        which[n], sample[n] = best, taken[best]
        taken[best] += 1
    return which, sample


class BlendedSamples:
    """Samples of several sources mixed by weight (Megatron's ``BlendedDataset``)."""

    name = "indexed"
    ordered = True

    def __init__(self, sources: list[Any], weights: list[float], size: int) -> None:
        total = sum(weights)
        self.sources, self.weights = sources, [w / total for w in weights]
        self.num_samples = size
        self.epoch_samples = sum(s.epoch_samples for s in sources)
        self.identity = {"sample_order": "; ".join(f"{w:.6g}: {s.identity['sample_order']}"
                                                   for w, s in zip(self.weights, sources))}
        self.which, self.sample = blending_indices(self.weights, size)

    def windows(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        which, sample = self.which[indices], self.sample[indices]
        out = None
        for i, source in enumerate(self.sources):
            mask = which == i
            if mask.any():
                rows = source.windows(sample[mask] % source.num_samples)
                if out is None:
                    out = np.empty((len(indices), rows.shape[1]), dtype=np.int64)
                out[mask] = rows
        return out


def component_sizes(weights: list[float], size: int) -> list[int]:
    """Samples each component is built for: ``ceil(size * w * 1.005)`` (Megatron's margin)."""
    total = sum(weights)
    return [int(math.ceil(size * w / total * 1.005)) for w in weights]
