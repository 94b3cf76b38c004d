"""Sources of the datasets that read files: Megatron indexed datasets and SFT jsonl.

:func:`indexed_source` opens every dataset of ``data.data_path`` (a prefix, a
list, or a weighted blend), checks its tokens against ``data.tokenizer`` and
``model.vocab_size``, and builds Megatron's GPT samples of the split
(:mod:`graphstep.data.megatron`), sized for the samples the run will read
(:func:`requested_samples`, Megatron's ``train_iters * global_batch_size``).
:func:`sft_source` reads prompt/response examples (:mod:`graphstep.data.sft`).
"""

from __future__ import annotations

import numpy as np

from graphstep.config import Config, ConfigError
from graphstep.data.buckets import parse_buckets
from graphstep.data.corpus import split_documents
from graphstep.data.indexed import IndexedDataset, check_tokens
from graphstep.data.megatron import BlendedSamples, GPTSamples, component_sizes, parse_blend
from graphstep.data.packing import PackedSFTSamples, packing_spec
from graphstep.data.sft import SFTSamples, read_examples
from graphstep.data.tokenizer import Tokenizer, build_tokenizer


def checked_tokenizer(cfg: Config) -> Tokenizer:
    """``data.tokenizer``, after checking that the model's embedding holds its ids."""
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the {cfg.data.tokenizer} tokenizer's "
            f"{tokenizer.vocab_size} token ids; set model.vocab_size>={tokenizer.vocab_size}"
        )
    return tokenizer


def requested_samples(cfg: Config, split: str) -> int | None:
    """Samples a run reads from ``split`` (Megatron sizes its indexed datasets by them); None = one epoch."""
    tr = cfg.train
    if split == "train":
        return tr.train_iters * tr.global_batch_size
    evaluations = (tr.train_iters // tr.eval_interval + 1) if (split == "valid" and tr.eval_interval) else 1
    return evaluations * tr.eval_iters * tr.global_batch_size or None


def indexed_source(cfg: Config, split: str) -> GPTSamples | BlendedSamples:
    tokenizer = checked_tokenizer(cfg)
    blend = parse_blend(cfg.data.data_path)
    wanted = requested_samples(cfg, split)
    datasets = [IndexedDataset(prefix) for _, prefix in blend]
    for ds in datasets:
        check_tokens(ds, tokenizer, cfg.data.tokenizer, cfg.model.vocab_size)
    ranges = [split_documents(cfg.data.split, ds.num_documents)[split] for ds in datasets]
    for ds, (first, last) in zip(datasets, ranges):
        if first == last:
            raise ConfigError(f"{ds.prefix}: the {split} split holds none of its {ds.num_documents} documents "
                              f"(data.split={cfg.data.split!r}); give the {split} split a larger share")

    def samples(ds: IndexedDataset, docs: tuple[int, int], count: int | None) -> GPTSamples:
        return GPTSamples(ds, np.arange(*docs), seq_length=cfg.model.seq_length, num_samples=count,
                          seed=cfg.rng.seed, shuffle=split == "train")

    if len(datasets) == 1:
        return samples(datasets[0], ranges[0], wanted)
    weights = [w if w is not None else float(ds.document_lengths[a:b].sum())
               for (w, _), ds, (a, b) in zip(blend, datasets, ranges)]
    size = wanted or sum(samples(ds, r, None).num_samples for ds, r in zip(datasets, ranges))
    parts = [samples(ds, r, n) for ds, r, n in zip(datasets, ranges, component_sizes(weights, size))]
    return BlendedSamples(parts, weights, size)


def sft_source(cfg: Config, split: str) -> SFTSamples | PackedSFTSamples:
    """Padded examples, or rows of packed examples with packing on (:mod:`graphstep.data.packing`)."""
    tokenizer = checked_tokenizer(cfg)
    buckets = parse_buckets(cfg)
    packing = packing_spec(cfg)
    path = cfg.data.data_path
    if not isinstance(path, str) or not path:
        raise ConfigError(f"data.dataset=sft needs data.data_path=<file.jsonl> (one path), got {path!r}")
    width = packing.max_example if packing else buckets[-1] if buckets else cfg.model.seq_length
    examples = read_examples(path, tokenizer, max_tokens=width, truncate=cfg.data.sft_truncate,
                             width_name=packing.describe() if packing else None)
    first, last = split_documents(cfg.data.split, len(examples))[split]
    if first == last:
        raise ConfigError(f"{path}: the {split} split holds none of its {len(examples)} examples "
                          f"(data.split={cfg.data.split!r}); give the {split} split a larger share")
    pad_id = getattr(tokenizer, "pad", tokenizer.eod)
    if packing is not None:
        return PackedSFTSamples(examples[first:last], path, pad_id, packing, seed=cfg.rng.seed, split=split)
    return SFTSamples(examples[first:last], path, pad_id)
