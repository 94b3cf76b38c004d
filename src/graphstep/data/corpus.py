"""The embedded corpus: the Python standard library's own source code.

A real corpus that needs no download: every Python installation carries a few
megabytes of well-written text, the ``.py`` files of its standard library
(found through ``sysconfig.get_paths()["stdlib"]``). It gives a training run a
loss curve that falls like a real one, where random mock tokens cannot.

How the corpus is built:

1. Walk the stdlib directory and keep ``*.py`` files, skipping test suites
   (``test``, ``tests``, ``idle_test``), installed packages
   (``site-packages``), GUI code and deprecated tools (``idlelib``,
   ``tkinter``, ``turtledemo``, ``lib2to3``) and generated tables
   (``encodings``, ``pydoc_data``), plus bundled wheels (``ensurepip``).
2. Sort by path relative to the stdlib directory, so the selection depends
   only on the installed Python, never on file-system order.
3. Take files in that order while they fit in ``max_bytes`` (default 4 MB,
   including one separator per document), skipping files that are not valid
   UTF-8 or that contain a NUL byte (id 0 is the end-of-document token).
4. With the byte tokenizer the token stream is the files' bytes, each
   document followed by ``eod``; it is built once per process and cached.

The corpus is therefore deterministic for a given Python installation; a
different Python version ships different sources and so a different corpus.
Reading 4 MB takes a few tens of milliseconds.

:func:`split_documents` divides the documents into train/valid/test ranges
from the ``data.split`` string the way Megatron does ("98,2,0": fractions of
the documents, in order).
"""

from __future__ import annotations

import functools
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphstep.config import ConfigError
from graphstep.errors import CorpusNotFoundError
from graphstep.data.tokenizer import ByteTokenizer, Tokenizer

DEFAULT_MAX_BYTES = 4_000_000

SKIPPED_DIRS = frozenset(
    {
        "__pycache__",
        "test",
        "tests",
        "idle_test",
        "site-packages",
        "dist-packages",
        "idlelib",
        "tkinter",
        "turtledemo",
        "lib2to3",
        "encodings",
        "pydoc_data",
        "ensurepip",
    }
)

SPLIT_NAMES = ("train", "valid", "test")


@dataclass(frozen=True)
class Corpus:
    """Documents as one token stream, each followed by the ``eod`` token.

    ``doc_starts[i]`` is the offset of document ``i`` in ``tokens``;
    ``doc_starts[-1] == len(tokens)``, so document ``i`` with its ``eod`` is
    ``tokens[doc_starts[i]:doc_starts[i + 1]]``.
    """

    tokens: np.ndarray
    doc_starts: np.ndarray
    files: tuple[str, ...]
    root: str

    @property
    def num_documents(self) -> int:
        return len(self.files)

    def document_tokens(self, first: int, last: int) -> np.ndarray:
        """The stream of documents ``first .. last-1`` (a view, no copy)."""
        return self.tokens[self.doc_starts[first] : self.doc_starts[last]]


def stdlib_dir() -> Path:
    """Where this Python keeps its standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def select_source_files(root: Path) -> list[Path]:
    """The corpus candidates under ``root``, sorted by relative path."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _read_document(path: Path) -> bytes | None:
    """The file's bytes, or None when it cannot be a document."""
    try:
        data = path.read_bytes()
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not data or b"\0" in data:
        return None
    return data


def read_documents(root: Path, max_bytes: int) -> tuple[list[bytes], list[str]]:
    """The first source files, in sorted order, that fit in ``max_bytes``."""
    files = select_source_files(root) if root.is_dir() else []
    if not files:
        raise CorpusNotFoundError(
            f"the embedded corpus needs the Python standard library's .py sources, but none were "
            f"found in {root} (a stripped Python installation?); use data.dataset=mock, or install "
            f"a full Python"
        )
    docs: list[bytes] = []
    names: list[str] = []
    total = 0
    for path in files:
        data = _read_document(path)
        if data is None:
            continue
        if total + len(data) + 1 > max_bytes:
            break
        docs.append(data)
        names.append(path.relative_to(root).as_posix())
        total += len(data) + 1
    if not docs:
        raise ConfigError(f"data.corpus_max_bytes={max_bytes} is smaller than the first source file in {root}; "
                          "raise data.corpus_max_bytes (the default is 4000000)")
    return docs, names


@functools.lru_cache(maxsize=4)
def _byte_corpus(root: str, max_bytes: int) -> Corpus:
    docs, names = read_documents(Path(root), max_bytes)
    eod = bytes([ByteTokenizer.eod])
    tokens = np.frombuffer(eod.join(docs) + eod, dtype=np.uint8)  # read-only, shared by all users
    lengths = np.array([len(d) + 1 for d in docs], dtype=np.int64)
    doc_starts = np.concatenate([[0], np.cumsum(lengths)])
    return Corpus(tokens=tokens, doc_starts=doc_starts, files=tuple(names), root=root)


def _tokenized_corpus(root: str, max_bytes: int, tokenizer: Tokenizer) -> Corpus:
    docs, names = read_documents(Path(root), max_bytes)
    encoded = [tokenizer.encode(d.decode("utf-8")) + [tokenizer.eod] for d in docs]
    tokens = np.fromiter((t for doc in encoded for t in doc), dtype=np.int32)
    doc_starts = np.concatenate([[0], np.cumsum([len(e) for e in encoded])]).astype(np.int64)
    return Corpus(tokens=tokens, doc_starts=doc_starts, files=tuple(names), root=root)


def load_corpus(
    tokenizer: Tokenizer | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES, root: str | Path | None = None
) -> Corpus:
    """The standard-library corpus; the byte-tokenized one is cached per process.

    Tokens are ``uint8`` with the byte tokenizer and ``int32`` with any other.
    """
    root = str(root if root is not None else stdlib_dir())
    if max_bytes <= 0:
        raise ConfigError(f"data.corpus_max_bytes={max_bytes}: must be positive (the default is 4000000)")
    if tokenizer is None or isinstance(tokenizer, ByteTokenizer):
        return _byte_corpus(root, max_bytes)
    return _tokenized_corpus(root, max_bytes, tokenizer)


def parse_split(split: str) -> list[float]:
    """``data.split`` as three fractions summing to 1 ("98,2,0" -> [0.98, 0.02, 0.0])."""
    parts = split.replace("/", ",").split(",")
    try:
        weights = [float(p) for p in parts if p.strip()]
    except ValueError:
        raise ConfigError(f"data.split={split!r}: expected comma-separated numbers such as '98,2,0'") from None
    if not weights or len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(
            f"data.split={split!r}: expected up to three non-negative weights with a positive sum "
            "(train,valid,test), such as '98,2,0'"
        )
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def split_documents(split: str, num_documents: int) -> dict[str, tuple[int, int]]:
    """Document ranges ``[first, last)`` of train, valid and test, as Megatron computes them."""
    fractions = parse_split(split)
    bounds = [0]
    for fraction in fractions:
        bounds.append(bounds[-1] + int(round(fraction * num_documents)))
    # Rounding may over- or under-shoot by a document; Megatron shifts every
    # boundary after the first by the difference.
    diff = bounds[-1] - num_documents
    # Clamp so a tiny corpus never gets a negative range.
    bounds = [0] + [min(max(b - diff, 0), num_documents) for b in bounds[1:]]
    bounds = [max(bounds[: i + 1]) for i in range(len(bounds))]
    return {name: (bounds[i], bounds[i + 1]) for i, name in enumerate(SPLIT_NAMES)}
