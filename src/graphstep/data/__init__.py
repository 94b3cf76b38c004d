"""Training data: the embedded corpus, mock data, and the micro-batch iterator.

``build_data(cfg, split=..., dp_rank=..., dp_size=...)`` is the entry point;
see :mod:`graphstep.data.loader` for how samples, their order and data-parallel
sharding are built, :mod:`graphstep.data.corpus` for the embedded corpus and
:mod:`graphstep.data.mock` for mock data.
"""

from graphstep.data.corpus import Corpus, CorpusNotFoundError, load_corpus, split_documents
from graphstep.data.loader import MicroBatch, MicroBatchIterator, build_data, build_source
from graphstep.data.mock import MockSamples
from graphstep.data.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "ByteTokenizer",
    "Corpus",
    "CorpusNotFoundError",
    "MicroBatch",
    "MicroBatchIterator",
    "MockSamples",
    "Tokenizer",
    "build_data",
    "build_source",
    "build_tokenizer",
    "load_corpus",
    "split_documents",
]
