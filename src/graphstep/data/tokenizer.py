"""Tokenizers: the byte tokenizer, and the protocol any other one must meet.

graphstep's embedded corpus is read as raw UTF-8 bytes, so the default
tokenizer is the identity on bytes: token id = byte value, ``vocab_size`` 256.
Id 0 (the NUL byte, which never appears in source text; the corpus skips any
file that contains one) doubles as the end-of-document token ``eod`` that
separates documents in the token stream, as Megatron's tokenizers append
``eod`` after every document.

The :class:`Tokenizer` protocol is the whole contract the data pipeline relies
on (``vocab_size``, ``eod``, ``encode``, ``decode``). :class:`HFTokenizer`
meets it with a local Hugging Face ``tokenizer.json`` (the ``tokenizers``
library; nothing is downloaded): ``data.tokenizer=/path/tokenizer.json``, or
the directory holding it (a Hugging Face model directory). Its end-of-document
id is the ``eos_token`` of a ``tokenizer_config.json`` beside the file when
there is one, else the first of the usual end-of-text tokens the vocabulary
has (``<|endoftext|>``, ``<|end_of_text|>``, ``</s>``, ``<eos>``); its padding
id (SFT) is the ``pad_token`` there, else ``eod``. Text is encoded without
special tokens (no BOS), as Megatron's preprocessing does.

``fingerprint`` identifies a tokenizer (``byte``, or the SHA-256 of the
file): ``graphstep preprocess`` records it beside a dataset so that training
with another tokenizer is refused.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from graphstep.config import ConfigError


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids; the model's ``model.vocab_size`` must be at least this."""
        ...

    @property
    def eod(self) -> int:
        """The end-of-document id placed after every document."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no ``eod`` appended)."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        ...


class ByteTokenizer:
    """Token id = UTF-8 byte; id 0 (NUL) is the end-of-document token."""

    vocab_size: int = 256
    eod: int = 0
    pad: int = 0
    fingerprint: str = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # A window cut from the byte stream can split a multi-byte character:
        # show it as U+FFFD instead of failing.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256, eod=0)"


EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")


def _special(config: dict[str, Any], key: str) -> str | None:
    """A special token of tokenizer_config.json: a string, or a dict with ``content``."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library (a local file only)."""

    def __init__(self, path: str | Path) -> None:
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(
                f"data.tokenizer={str(path)!r}: no such file; give the path of a Hugging Face tokenizer.json "
                "(or the directory holding it), or data.tokenizer=byte"
            )
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:  # pragma: no cover - tokenizers is a dependency
            raise ConfigError("data.tokenizer: a tokenizer.json needs the `tokenizers` package (pip install tokenizers)")
        try:
            self._tok = _Tokenizer.from_file(str(file))
        except Exception as exc:
            raise ConfigError(f"data.tokenizer={str(file)!r}: not a readable tokenizer.json ({exc})") from None
        self.path = file
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self.fingerprint = "sha256:" + hashlib.sha256(file.read_bytes()).hexdigest()
        config_file = file.parent / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        eos = _special(config, "eos_token")
        names = ([eos] if eos in vocab else []) + [n for n in EOD_CANDIDATES if n in vocab]
        if not names:
            raise ConfigError(
                f"data.tokenizer={str(file)!r}: no end-of-document token found (no eos_token in a "
                f"tokenizer_config.json beside it, and none of {', '.join(EOD_CANDIDATES)} in the vocabulary)"
            )
        self.eod = vocab[names[0]]
        pad = _special(config, "pad_token")
        self.pad = vocab[pad] if pad in vocab else self.eod

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eod={self.eod})"


def build_tokenizer(name: str) -> Tokenizer:
    """The tokenizer named by ``data.tokenizer``: ``byte``, or a tokenizer.json (file or directory)."""
    if name == "byte":
        return ByteTokenizer()
    return HFTokenizer(name)
