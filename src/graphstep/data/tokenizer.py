"""Tokenizers: the byte tokenizer, and the protocol any other one must meet.

graphstep's embedded corpus is read as raw UTF-8 bytes, so the default
tokenizer is the identity on bytes: token id = byte value, ``vocab_size`` 256.
Id 0 (the NUL byte, which never appears in source text; the corpus skips any
file that contains one) doubles as the end-of-document token ``eod`` that
separates documents in the token stream, as Megatron's tokenizers append
``eod`` after every document.

The :class:`Tokenizer` protocol is the whole contract the data pipeline relies
on (``vocab_size``, ``eod``, ``encode``, ``decode``), so that a Hugging Face
``tokenizer.json`` can be plugged in later through :func:`build_tokenizer`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

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

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # A window cut from the byte stream can split a multi-byte character:
        # show it as U+FFFD instead of failing.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256, eod=0)"


def build_tokenizer(name: str) -> Tokenizer:
    """The tokenizer named by ``data.tokenizer``."""
    if name == "byte":
        return ByteTokenizer()
    raise ConfigError(
        f"data.tokenizer={name!r}: only the byte tokenizer is implemented so far "
        "(Hugging Face tokenizer.json support is planned); set data.tokenizer=byte"
    )
