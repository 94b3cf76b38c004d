"""GPT samples and the micro-batch iterator, built the way Megatron builds them.

Samples. The documents of a split are one token stream, each document
followed by ``eod``. Sample ``i`` is the window ``stream[i*S : i*S + S + 1]``
with ``S = model.seq_length``: consecutive windows overlap by one token, so
every token of the stream is a label exactly once (Megatron's GPTDataset with
``add_extra_token_to_sequence``). ``tokens = window[:-1]``,
``labels = window[1:]``, ``loss_mask`` is 1.0 everywhere (float32); windows
cross document boundaries, and ``eod`` is an ordinary token to predict.

Order. Epoch ``e`` visits all samples once in the order of a permutation
drawn from a generator seeded by ``(rng.seed, e)``; epochs repeat as long as
training asks. Global position ``g`` (counting samples over all ranks since
the start of training) is sample ``perm_e[g % N]`` of epoch ``e = g // N``.
Unlike Megatron, which also re-shuffles the documents before concatenating
each epoch, the stream and its windows stay fixed and only their order
changes. Validation and test splits are read in order, without shuffling.
The mock dataset is unbounded and read in order (its samples are already
random).

Sharding. Global batch ``b`` is the ``global_batch_size`` consecutive global
positions starting at ``b * global_batch_size``. Data-parallel rank ``r``
takes its contiguous slice of ``micro_batch_size * num_micro_batches``
positions, cut into ``num_micro_batches`` micro-batches, so one rank with four
micro-batches sees exactly the samples that two ranks with two micro-batches
each see together. The context-parallel ranks of a data-parallel rank
(``cp_rank`` / ``cp_size``) read its samples too, each keeping its chunks of
every sequence (:mod:`graphstep.data.context_parallel`).

State. ``state_dict()`` holds ``consumed_samples`` (global samples of the
completed global batches, all ranks together, as Megatron counts them), the
``epoch`` and the next ``micro_batch`` of the current step; it is the same on
every rank, so rank 0 can save it for all. ``load_state_dict()`` continues
with exactly the next micro-batch an uninterrupted iterator would have given.

Other datasets. ``data.dataset=indexed`` reads Megatron ``.bin``/``.idx``
datasets (a prefix, a list, or a weighted blend in ``data.data_path``) with
Megatron's own sample order -- documents shuffled over epochs, samples
shuffled by seed, blends mixed by weight (:mod:`graphstep.data.megatron`);
such a source is ``ordered``, and the loader reads its positions in order.
``data.dataset=sft`` reads prompt/response jsonl (:mod:`graphstep.data.sft`):
variable-length samples that the source pads itself, to ``model.seq_length``
or, with ``data.seq_length_buckets``, to the bucket of the step's longest
sample over the whole global batch (:mod:`graphstep.data.buckets`); with
``data.packed_sequences`` its samples are rows of packed examples
(:mod:`graphstep.data.packing`), whose micro-batches also carry ``cu_seqlens``.

Micro-batches are dicts of CPU tensors (``tokens``/``labels`` int64 and
``loss_mask`` float32, all ``[micro_batch_size, seq_length]``, or the step's
bucket width with ``data.seq_length_buckets``); the trainer
copies them into its static buffers. ``pin_memory=True`` pins them when CUDA
is available, for asynchronous host-to-device copies.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol

import numpy as np
import torch

from graphstep.config import Config, ConfigError
from graphstep.data.context_parallel import context_parallel_shard
from graphstep.data.buckets import parse_buckets, pick_bucket
from graphstep.data.corpus import DEFAULT_MAX_BYTES, SPLIT_NAMES, load_corpus, split_documents
from graphstep.data.mock import MockSamples
from graphstep.data.sources import checked_tokenizer, indexed_source, sft_source

MicroBatch = dict[str, torch.Tensor]
STATE_VERSION = 1


class SampleSource(Protocol):
    """Fixed-length sample windows, addressed by sample index.

    Optional members: ``ordered = True`` (the source orders its samples
    itself: no per-epoch shuffle on top), ``epoch_samples`` (the sample
    count a resumed iterator must find unchanged, default ``num_samples``),
    ``identity`` (more such values, a dict), and for
    variable-length samples ``lengths(indices)``, ``describe(index)`` and
    ``batch(indices, width)`` that pads them (used instead of ``windows``).
    """

    name: str
    num_samples: int | None  # None = unbounded

    def windows(self, indices: np.ndarray) -> np.ndarray:
        """``[len(indices), seq_length + 1]`` int64 token windows."""
        ...


class TokenWindows:
    """Megatron GPT samples cut from one token stream (stride ``seq_length``)."""

    name = "corpus"

    def __init__(self, stream: np.ndarray, seq_length: int) -> None:
        self.stream = stream
        self.seq_length = seq_length
        self.num_samples = max(0, (len(stream) - 1) // seq_length)
        self._offsets = np.arange(seq_length + 1, dtype=np.int64)

    def windows(self, indices: np.ndarray) -> np.ndarray:
        starts = np.asarray(indices, dtype=np.int64) * self.seq_length
        return self.stream[starts[:, None] + self._offsets].astype(np.int64)


class SampleOrder:
    """Maps global positions to sample indices: shuffled per epoch, or in order."""

    def __init__(self, num_samples: int | None, *, seed: int, shuffle: bool) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle and num_samples is not None
        self._cached_epoch = -1
        self._cached_perm = np.empty(0, dtype=np.int64)

    def epoch_of(self, position: int) -> int:
        return 0 if self.num_samples is None else position // self.num_samples

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch`` (the last one is kept)."""
        if epoch != self._cached_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._cached_perm = rng.permutation(self.num_samples)
            self._cached_epoch = epoch
        return self._cached_perm

    def indices(self, start: int, count: int) -> np.ndarray:
        """Sample indices of global positions ``start .. start+count-1``."""
        positions = np.arange(start, start + count, dtype=np.int64)
        if self.num_samples is None:
            return positions
        local = positions % self.num_samples
        if not self.shuffle:
            return local
        epochs = positions // self.num_samples
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):  # a micro-batch spans at most a few epochs
            where = epochs == epoch
            out[where] = self.permutation(int(epoch))[local[where]]
        return out


class MicroBatchIterator:
    """This rank's micro-batches, in training order; resumable with its state."""

    def __init__(
        self,
        source: SampleSource,
        order: SampleOrder,
        *,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        cp_rank: int = 0,
        cp_size: int = 1,
        identity: dict[str, Any] | None = None,
        pin_memory: bool = False,
        width: int | None = None,
        buckets: list[int] | None = None,
    ) -> None:
        self.source = source
        self.order = order
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.num_micro_batches = global_batch_size // (micro_batch_size * dp_size)
        self.identity = dict(identity or {})
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.consumed_samples = 0
        self.micro_batch = 0
        # Padded width of variable-length samples: fixed, or the bucket of each step.
        self.width, self.buckets = width, buckets
        self._bucket_of: tuple[int, int] | None = None  # (consumed_samples, width)

    @property
    def num_samples(self) -> int | None:
        """Samples in one epoch of this split (None for unbounded mock data)."""
        return self.source.num_samples

    @property
    def epoch(self) -> int:
        return self.order.epoch_of(self.consumed_samples)

    def __iter__(self) -> Iterator[MicroBatch]:
        return self

    def __next__(self) -> MicroBatch:
        start = (
            self.consumed_samples
            + self.dp_rank * self.micro_batch_size * self.num_micro_batches
            + self.micro_batch * self.micro_batch_size
        )
        batch = self._make_batch(self.order.indices(start, self.micro_batch_size))
        self._advance()
        return batch

    def next_step(self) -> list[MicroBatch]:
        """The remaining micro-batches of the current step (all of them at a step boundary)."""
        return [next(self) for _ in range(self.num_micro_batches - self.micro_batch)]

    def _advance(self) -> None:
        self.micro_batch += 1
        if self.micro_batch == self.num_micro_batches:
            self.micro_batch = 0
            self.consumed_samples += self.global_batch_size

    def step_width(self) -> int | None:
        """The padded width of the current step: the bucket of the global batch's longest sample."""
        if self.buckets is None:
            return self.width
        if self._bucket_of is None or self._bucket_of[0] != self.consumed_samples:
            # Every rank computes the same width from the whole global batch: one shape per step everywhere.
            indices = self.order.indices(self.consumed_samples, self.global_batch_size)
            lengths = self.source.lengths(indices)
            longest = int(np.argmax(lengths))
            width = pick_bucket(self.buckets, int(lengths[longest]), lambda: self.source.describe(indices[longest]))
            self._bucket_of = (self.consumed_samples, width)
        return self._bucket_of[1]

    def _make_batch(self, sample_indices: np.ndarray) -> MicroBatch:
        if hasattr(self.source, "batch"):
            batch = self.source.batch(sample_indices, self.step_width())
        else:
            window = torch.from_numpy(self.source.windows(sample_indices))
            batch = {
                "tokens": window[:, :-1].contiguous(),
                "labels": window[:, 1:].contiguous(),
                "loss_mask": torch.ones(window.shape[0], window.shape[1] - 1, dtype=torch.float32),
            }
        batch = context_parallel_shard(batch, self.cp_rank, self.cp_size)
        if self.pin_memory:
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return batch

    # --- checkpointing ------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the iterator is; identical on every data-parallel rank."""
        return {
            "version": STATE_VERSION,
            "consumed_samples": self.consumed_samples,
            "epoch": self.epoch,
            "micro_batch": self.micro_batch,
            "global_batch_size": self.global_batch_size,
            **self.identity,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; refuses state saved for other data."""
        for key, value in self.identity.items():
            if key in state and state[key] != value:
                raise ValueError(
                    f"data iterator state was saved with {key}={state[key]!r}, but this run has "
                    f"{key}={value!r}: resuming would not continue the same sample order; "
                    f"restore the original setting or start the data from scratch"
                )
        consumed, micro = int(state["consumed_samples"]), int(state.get("micro_batch", 0))
        if micro and state.get("global_batch_size", self.global_batch_size) != self.global_batch_size:
            raise ValueError(
                f"data iterator state was saved in the middle of a step with train.global_batch_size="
                f"{state['global_batch_size']}; resume mid-step only with the same global batch size"
            )
        if not 0 <= micro < self.num_micro_batches:
            raise ValueError(f"data iterator state has micro_batch={micro}, expected 0..{self.num_micro_batches - 1}")
        if "epoch" in state and state["epoch"] != self.order.epoch_of(consumed):
            raise ValueError(
                f"data iterator state is inconsistent: epoch={state['epoch']} but consumed_samples={consumed} "
                f"is in epoch {self.order.epoch_of(consumed)} of this dataset"
            )
        self.consumed_samples, self.micro_batch = consumed, micro


# --------------------------------------------------------------------------
# building from the config


def check_batch_sizes(cfg: Config, dp_rank: int, dp_size: int) -> None:
    """Batch sizes that divide evenly over micro-batches and ranks."""
    mbs, gbs = cfg.train.micro_batch_size, cfg.train.global_batch_size
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is not a rank of dp_size={dp_size}")
    if mbs < 1:
        raise ConfigError(f"train.micro_batch_size={mbs}: must be at least 1")
    if gbs < 1 or gbs % (mbs * dp_size):
        raise ConfigError(
            f"train.global_batch_size={gbs} is not a positive multiple of train.micro_batch_size={mbs} "
            f"x {dp_size} data-parallel rank(s) = {mbs * dp_size}; set train.global_batch_size to a multiple "
            f"of {mbs * dp_size}"
        )


def _corpus_source(cfg: Config, split: str) -> TokenWindows:
    tokenizer = checked_tokenizer(cfg)
    # data.corpus_max_bytes is not (yet) a config field; the default cap applies until it is.
    max_bytes = getattr(cfg.data, "corpus_max_bytes", None) or DEFAULT_MAX_BYTES
    corpus = load_corpus(tokenizer, max_bytes=max_bytes)
    first, last = split_documents(cfg.data.split, corpus.num_documents)[split]
    source = TokenWindows(corpus.document_tokens(first, last), cfg.model.seq_length)
    if source.num_samples < 1:
        raise ConfigError(
            f"the {split} split of the corpus (documents {first}..{last} of {corpus.num_documents}, "
            f"{len(source.stream)} tokens, data.split={cfg.data.split!r}) is shorter than one sample of "
            f"model.seq_length+1={cfg.model.seq_length + 1} tokens; lower model.seq_length or give the "
            f"{split} split a larger share in data.split"
        )
    return source


def build_source(cfg: Config, split: str) -> SampleSource:
    """The samples of ``split`` for ``cfg.data.dataset``."""
    if split not in SPLIT_NAMES:
        raise ValueError(f"split={split!r}: expected one of {', '.join(SPLIT_NAMES)}")
    if cfg.model.seq_length < 1:
        raise ConfigError(f"model.seq_length={cfg.model.seq_length}: must be at least 1")
    dataset = cfg.data.dataset
    if dataset == "corpus":
        return _corpus_source(cfg, split)
    if dataset == "mock":
        if cfg.model.vocab_size < 1:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size}: must be at least 1")
        return MockSamples(seq_length=cfg.model.seq_length, vocab_size=cfg.model.vocab_size, seed=cfg.rng.seed, split=split)
    if dataset == "indexed":
        return indexed_source(cfg, split)
    if dataset == "sft":
        return sft_source(cfg, split)
    raise ConfigError(f"data.dataset={dataset!r}: expected corpus, mock, indexed or sft")


def build_data(
    cfg: Config, *, split: str = "train", dp_rank: int = 0, dp_size: int = 1, cp_rank: int = 0, cp_size: int = 1,
    pin_memory: bool = False,
) -> MicroBatchIterator:
    """This rank's micro-batch iterator over ``split`` of the configured dataset (``cp_rank`` of ``cp_size``
    context-parallel ranks: this rank's chunks of each sequence).

    Training data is shuffled per epoch by ``rng.seed``; validation and test
    data are read in order.
    """
    check_batch_sizes(cfg, dp_rank, dp_size)
    if cfg.rng.seed < 0:
        raise ConfigError(f"rng.seed={cfg.rng.seed}: data shuffling needs a non-negative seed")
    source = build_source(cfg, split)
    shuffle = split == "train" and not getattr(source, "ordered", False)
    order = SampleOrder(source.num_samples, seed=cfg.rng.seed, shuffle=shuffle)
    identity = {
        "dataset": cfg.data.dataset,
        "split": split,
        "seq_length": cfg.model.seq_length,
        "num_samples": getattr(source, "epoch_samples", source.num_samples),
        "seed": cfg.rng.seed,
        **getattr(source, "identity", {}),
    }
    width, buckets = _widths(cfg, source, split)
    return MicroBatchIterator(
        source,
        order,
        micro_batch_size=cfg.train.micro_batch_size,
        global_batch_size=cfg.train.global_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        cp_rank=cp_rank,
        cp_size=cp_size,
        identity=identity,
        pin_memory=pin_memory,
        width=width,
        buckets=buckets,
    )


def _widths(cfg: Config, source: SampleSource, split: str) -> tuple[int | None, list[int] | None]:
    """(fixed padded width, per-step buckets) of ``source``'s batches; see data/buckets.py."""
    buckets = parse_buckets(cfg)
    seq = cfg.model.seq_length
    if not hasattr(source, "batch"):  # fixed-length windows: model.seq_length is a bucket (V22), nothing to pick
        return None, None
    if buckets is None:
        return seq, None
    if split != "train":  # evaluation: the largest bucket, one graph
        return buckets[-1], None
    return None, buckets
