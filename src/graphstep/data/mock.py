"""Deterministic mock GPT data, as Megatron Bridge's mock dataset makes it.

Sample ``i`` of a split is ``seq_length + 1`` token ids drawn uniformly from
``[0, model.vocab_size)`` by a NumPy generator seeded by ``(rng.seed, split,
i)`` -- the same sample on every rank, in every run, whatever order it is
asked for, and without storing anything. ``tokens`` and ``labels`` are then cut
from the window like any other sample (labels = tokens shifted by one), so the
mock path exercises exactly the code of the real one.

The dataset is unbounded: every sample is already independent random data,
so there is nothing to shuffle and no epoch ends.
"""

from __future__ import annotations

import numpy as np

SPLIT_IDS = {"train": 0, "valid": 1, "test": 2}


class MockSamples:
    """Random windows of ``seq_length + 1`` tokens, generated on demand."""

    name = "mock"
    num_samples: int | None = None  # unbounded

    def __init__(self, *, seq_length: int, vocab_size: int, seed: int, split: str = "train") -> None:
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.split_id = SPLIT_IDS[split]

    def window(self, index: int) -> np.ndarray:
        """Sample ``index``: ``seq_length + 1`` int64 token ids."""
        rng = np.random.default_rng([self.seed, self.split_id, int(index)])
        return rng.integers(0, self.vocab_size, size=self.seq_length + 1, dtype=np.int64)

    def windows(self, indices: np.ndarray) -> np.ndarray:
        """Samples ``indices`` stacked: ``[len(indices), seq_length + 1]`` int64."""
        return np.stack([self.window(i) for i in indices])
