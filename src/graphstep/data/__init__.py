"""Training data: the embedded corpus, mock data, Megatron indexed datasets, SFT, and the micro-batch iterator.

``build_data(cfg, split=..., dp_rank=..., dp_size=...)`` is the entry point;
see :mod:`graphstep.data.loader` for how samples, their order and data-parallel
sharding are built, :mod:`graphstep.data.corpus` for the embedded corpus and
:mod:`graphstep.data.mock` for mock data, :mod:`graphstep.data.indexed` and
:mod:`graphstep.data.megatron` for Megatron ``.bin``/``.idx`` datasets and
their samples and blends, :mod:`graphstep.data.sft` for prompt/response
fine-tuning data, :mod:`graphstep.data.packing` for packing it into rows and
:mod:`graphstep.data.buckets` for sequence-length buckets; ``graphstep preprocess`` (:mod:`graphstep.data.cli`) writes indexed
datasets.
"""

from graphstep.data.corpus import Corpus, CorpusNotFoundError, load_corpus, split_documents
from graphstep.data.indexed import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError
from graphstep.data.loader import MicroBatch, MicroBatchIterator, build_data, build_source
from graphstep.data.mock import MockSamples
from graphstep.data.sft import SFTDataError, SFTSamples
from graphstep.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "ByteTokenizer",
    "Corpus",
    "CorpusNotFoundError",
    "HFTokenizer",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "MicroBatch",
    "MicroBatchIterator",
    "MockSamples",
    "SFTDataError",
    "SFTSamples",
    "Tokenizer",
    "build_data",
    "build_source",
    "build_tokenizer",
    "load_corpus",
    "split_documents",
]
