"""Megatron indexed datasets: the ``.bin``/``.idx`` pair, read, written and checked.

A dataset is a *prefix*: ``<prefix>.bin`` holds every token of every
sequence back to back in one dtype; ``<prefix>.idx`` (Megatron's
``MMapIndexedDataset`` index) says where each one starts::

    9 bytes   header b"MMIDIDX\\x00\\x00"
    8 bytes   version, little-endian uint64 = 1
    1 byte    dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    8 bytes   S = number of sequences (uint64)
    8 bytes   D = number of document indices (uint64) = documents + 1
    S int32   sequence lengths, in tokens
    S int64   sequence pointers, byte offsets into the .bin
    D int64   document indices: document d is sequences [doc[d], doc[d+1])

graphstep's preprocessing writes one sequence per document (as Megatron's
``preprocess_data.py`` without sentence splitting); a document's tokens are
the contiguous run of its sequences. Both files are memory-mapped, never read
whole.

:class:`IndexedDataset` validates what it opens and names the file and the
position of any problem: a missing ``.bin`` or ``.idx``, a bad header, an
``.idx`` shorter than its counts, pointers that do not follow the lengths, and
a truncated ``.bin`` (the first document that runs past its end).
:class:`IndexedDatasetBuilder` writes the same format
(``add_document`` then ``finalize``). Megatron reads what it writes and
graphstep reads what Megatron writes.

``<prefix>.graphstep.json``, written beside the pair by ``graphstep
preprocess``, records the tokenizer's fingerprint; Megatron ignores it, and
graphstep uses it to refuse training with another tokenizer.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from graphstep.config import ConfigError
from graphstep.errors import IndexedDatasetError

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODES = {np.dtype(t): c for c, t in DTYPES.items()}
META_SUFFIX = ".graphstep.json"


def optimal_dtype(vocab_size: int) -> type:
    """Megatron's choice: uint16 below 65500 token ids, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def strip_suffix(path: str | os.PathLike) -> str:
    """A dataset prefix from ``prefix``, ``prefix.bin`` or ``prefix.idx``."""
    text = os.fspath(path)
    return text[:-4] if text.endswith((".bin", ".idx")) else text


class IndexedDataset:
    """A read-only, memory-mapped Megatron dataset, validated on opening."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = strip_suffix(prefix)
        self.idx_path, self.bin_path = Path(self.prefix + ".idx"), Path(self.prefix + ".bin")
        for path, other in ((self.idx_path, self.bin_path), (self.bin_path, self.idx_path)):
            if not path.is_file():
                found = "" if not other.is_file() else f" ({other.name} is there)"
                raise IndexedDatasetError(
                    f"{path}: no such file{found}; an indexed dataset is the pair <prefix>.bin + <prefix>.idx, "
                    f"made by `graphstep preprocess` or Megatron's preprocess_data.py; data.data_path takes the prefix"
                )
        self._read_index()
        self._check_bin()
        self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r") if self.bin_size else np.empty(0, self.dtype)

    def _read_index(self) -> None:
        path = self.idx_path
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(34)
        if len(head) < 34 or head[:9] != INDEX_HEADER:
            raise IndexedDatasetError(f"{path}: not a Megatron index (expected the header {INDEX_HEADER!r}, "
                                      f"got {head[:9]!r}{' in a file of ' + str(size) + ' bytes' if size < 34 else ''})")
        version, code = struct.unpack("<QB", head[9:18])
        if version != INDEX_VERSION:
            raise IndexedDatasetError(f"{path}: index version {version}, graphstep reads version {INDEX_VERSION}")
        if code not in DTYPES:
            raise IndexedDatasetError(f"{path}: unknown dtype code {code} at byte 17 (known: {sorted(DTYPES)})")
        self.dtype = np.dtype(DTYPES[code])
        self.num_sequences, num_doc_indices = struct.unpack("<QQ", head[18:34])
        expected = 34 + self.num_sequences * (4 + 8) + num_doc_indices * 8
        if size < expected:
            raise IndexedDatasetError(
                f"{path}: truncated index: {size} bytes, but its header announces {self.num_sequences} sequences and "
                f"{num_doc_indices} document indices ({expected} bytes)"
            )
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        offset = 34
        self.sequence_lengths = np.frombuffer(mm, np.int32, self.num_sequences, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(mm, np.int64, self.num_sequences, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(mm, np.int64, num_doc_indices, offset)
        doc = self.document_indices
        if num_doc_indices < 1 or doc[0] != 0 or doc[-1] != self.num_sequences or np.any(np.diff(doc) < 0):
            raise IndexedDatasetError(
                f"{path}: document indices must rise from 0 to the sequence count {self.num_sequences}; "
                f"got {doc[:3].tolist()}...{doc[-3:].tolist()}"
            )
        itemsize = self.dtype.itemsize
        expected_ptr = np.concatenate([[0], np.cumsum(self.sequence_lengths.astype(np.int64) * itemsize)[:-1]])
        bad = np.flatnonzero((self.sequence_pointers != expected_ptr) | (self.sequence_lengths < 0))
        if bad.size:
            s = int(bad[0])
            raise IndexedDatasetError(
                f"{path}: sequence {s} (document {self.document_of_sequence(s)}) has pointer "
                f"{int(self.sequence_pointers[s])} and length {int(self.sequence_lengths[s])}; the pointers must "
                f"follow the lengths back to back (expected pointer {int(expected_ptr[s])})"
            )
        self.num_documents = num_doc_indices - 1
        self.sequence_ends = self.sequence_pointers + self.sequence_lengths.astype(np.int64) * itemsize
        # The pointers are back to back, so token offsets are the cumulative lengths.
        seq_cum = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
        self.document_starts = seq_cum[doc[:-1]]
        self.document_lengths = seq_cum[doc[1:]] - self.document_starts

    def document_of_sequence(self, seq: int) -> int:
        return int(np.searchsorted(self.document_indices, seq, side="right")) - 1

    def _check_bin(self) -> None:
        self.bin_size = self.bin_path.stat().st_size
        needed = int(self.sequence_ends[-1]) if self.num_sequences else 0
        if self.bin_size < needed:
            seq = int(np.searchsorted(self.sequence_ends, self.bin_size, side="right"))
            raise IndexedDatasetError(
                f"{self.bin_path}: truncated: {self.bin_size} bytes, but {self.idx_path.name} needs {needed}; "
                f"document {self.document_of_sequence(seq)} (sequence {seq}, bytes {int(self.sequence_pointers[seq])}"
                f"..{int(self.sequence_ends[seq])}) is the first that runs past the end of the file"
            )
        if self.bin_size % self.dtype.itemsize:
            raise IndexedDatasetError(f"{self.bin_path}: {self.bin_size} bytes is not a whole number of "
                                      f"{self.dtype.name} tokens")

    def __len__(self) -> int:
        return self.num_documents

    def document(self, d: int) -> np.ndarray:
        """The tokens of document ``d`` (a view of the memory map)."""
        start = int(self.document_starts[d])
        return self.tokens[start : start + int(self.document_lengths[d])]

    @property
    def num_tokens(self) -> int:
        return int(self.document_lengths.sum())

    def first_token_at_least(self, limit: int) -> tuple[int, int, int] | None:
        """(document, position in it, token id) of the first token >= ``limit``, or None.

        Scans the whole .bin once per file (the maximum is cached per process).
        """
        stat = os.stat(self.bin_path)
        if self.num_tokens == 0 or _max_token(str(self.bin_path), stat.st_size, stat.st_mtime_ns, self.dtype.str) < limit:
            return None
        for i in range(0, len(self.tokens), _CHUNK):
            hits = np.flatnonzero(self.tokens[i : i + _CHUNK] >= limit)
            if hits.size:
                element = i + int(hits[0])
                # The last document starting at or before the element that is not empty.
                doc = int(np.searchsorted(self.document_starts, element, side="right")) - 1
                while self.document_lengths[doc] == 0:
                    doc -= 1
                return doc, element - int(self.document_starts[doc]), int(self.tokens[element])
        return None

    def metadata(self) -> dict[str, Any] | None:
        """What ``graphstep preprocess`` recorded beside the pair, if anything."""
        path = Path(self.prefix + META_SUFFIX)
        return json.loads(path.read_text()) if path.is_file() else None

    def __repr__(self) -> str:
        return f"IndexedDataset({self.prefix!r}, documents={self.num_documents}, tokens={self.num_tokens}, {self.dtype})"


_CHUNK = 1 << 24


@functools.lru_cache(maxsize=32)
def _max_token(bin_path: str, size: int, mtime: int, dtype: str) -> int:
    del size, mtime  # cache keys: a rewritten file is scanned again
    tokens = np.memmap(bin_path, dtype=np.dtype(dtype), mode="r")
    return max((int(tokens[i : i + _CHUNK].max()) for i in range(0, len(tokens), _CHUNK)), default=-1)


class IndexedDatasetBuilder:
    """Writes ``<prefix>.bin`` and ``<prefix>.idx`` (Megatron's ``IndexedDatasetBuilder``, one sequence per document)."""

    def __init__(self, prefix: str | os.PathLike, dtype: type = np.uint16) -> None:
        self.prefix = strip_suffix(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise ValueError(f"dtype {self.dtype} has no Megatron code (known: {[str(np.dtype(t)) for t in DTYPES.values()]})")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self.prefix + ".bin", "wb")
        self.lengths: list[int] = []
        self.document_indices = [0]

    def add_document(self, tokens: list[int] | np.ndarray) -> None:
        """Append one document (one sequence)."""
        array = np.asarray(tokens)
        if array.size and (array.min() < 0 or array.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids {int(array.min())}..{int(array.max())} do not fit in {self.dtype}")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self.lengths.append(int(array.size))
        self.document_indices.append(len(self.lengths))

    def discard(self) -> None:
        """Close and delete the partial .bin (nothing was written worth keeping)."""
        self._bin.close()
        Path(self.prefix + ".bin").unlink(missing_ok=True)

    def finalize(self) -> str:
        """Close the .bin and write the .idx; returns the prefix."""
        self._bin.close()
        lengths = np.asarray(self.lengths, dtype=np.int32)
        pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64) * self.dtype.itemsize)[:-1]]).astype(np.int64)
        with open(self.prefix + ".idx", "wb") as fh:
            fh.write(INDEX_HEADER)
            fh.write(struct.pack("<Q", INDEX_VERSION))
            fh.write(struct.pack("<B", CODES[self.dtype]))
            fh.write(struct.pack("<Q", len(lengths)))
            fh.write(struct.pack("<Q", len(self.document_indices)))
            fh.write(lengths.tobytes(order="C"))
            fh.write(pointers[: len(lengths)].tobytes(order="C"))
            fh.write(np.asarray(self.document_indices, dtype=np.int64).tobytes(order="C"))
        return self.prefix


def check_tokens(ds: IndexedDataset, tokenizer: Any, tokenizer_name: str, vocab_size: int) -> None:
    """Refuse data made with another tokenizer, or with ids the model's embedding does not have."""
    meta = ds.metadata()
    fingerprint = getattr(tokenizer, "fingerprint", None)
    if meta and fingerprint and meta.get("tokenizer_fingerprint") not in (None, fingerprint):
        raise ConfigError(
            f"{ds.prefix}: the dataset was tokenized with {meta.get('tokenizer')!r} ({meta.get('tokenizer_fingerprint')}), "
            f"but data.tokenizer={tokenizer_name!r} is another tokenizer ({fingerprint}); set data.tokenizer to the "
            f"one the data was made with, or run `graphstep preprocess` again"
        )
    for limit, what in ((tokenizer.vocab_size, f"the tokenizer {tokenizer_name!r} has {tokenizer.vocab_size} ids"),
                        (vocab_size, f"model.vocab_size={vocab_size}")):
        hit = ds.first_token_at_least(limit)
        if hit is not None:
            doc, pos, token = hit
            raise ConfigError(
                f"{ds.bin_path}: document {doc}, token {pos} is id {token}, but {what}: the data does not match "
                f"the tokenizer (data.tokenizer) or the model (model.vocab_size)"
            )
