"""Supervised fine-tuning data: prompt/response pairs from a jsonl file.

Each line of ``data.data_path`` is a JSON object with a ``"prompt"`` and a
``"response"`` string (other keys are ignored). An example is tokenized as
``prompt + response + eod`` (each part encoded on its own, without special
tokens); the model reads ``tokens = seq[:-1]`` and predicts
``labels = seq[1:]``, and ``loss_mask`` is 1 only where the label is a
response token or the final ``eod`` -- the prompt is context, not a target.
The model's loss divides by the mask's sum, so every micro-batch's loss is
the mean over its response tokens.

Shapes are static for graphs: every example is padded at the end (pad id:
the tokenizer's ``pad``, else ``eod``; ``loss_mask`` 0) to ``model.seq_length``,
or with ``data.seq_length_buckets`` to the step's bucket
(:mod:`graphstep.data.buckets`). An example longer than that width is an
error naming ``file:line``; ``data.sft_truncate=true`` cuts it to the width
instead (an example whose prompt alone fills the width is still an error).
With ``data.packed_sequences`` several examples share a row instead
(:mod:`graphstep.data.packing`).

The lines are divided into train/valid/test ranges by ``data.split`` like
documents, and the training examples are shuffled per epoch by the loader.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from graphstep.errors import SFTDataError
from graphstep.data.buckets import pad_batch
from graphstep.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class SFTExample:
    """``seq`` = prompt + response + eod; the first ``prompt_len`` tokens are context."""

    seq: np.ndarray
    prompt_len: int
    line: int


def _field(obj: dict, key: str, where: str) -> str:
    if key not in obj:
        raise SFTDataError(f"{where}: no {key!r} key (an SFT line is {{\"prompt\": ..., \"response\": ...}}; "
                           f"keys here: {', '.join(sorted(obj)) or 'none'})")
    value = obj[key]
    if not isinstance(value, str):
        raise SFTDataError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
    return value


def _text_lines(path: Path) -> list[str]:
    """The file's lines; a binary or non-UTF-8 file is an error naming the line of the first bad byte."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise SFTDataError(f"{path}:{line}: byte 0x{raw[exc.start]:02x} is not UTF-8: an SFT file is jsonl text "
                           "(one {\"prompt\": ..., \"response\": ...} object per line)") from None
    if "\x00" in text:
        line = text[: text.index("\x00")].count("\n") + 1
        raise SFTDataError(f"{path}:{line}: a NUL byte: this is a binary file, not jsonl text; data.data_path of "
                           "data.dataset=sft takes a jsonl file ({\"prompt\": ..., \"response\": ...} per line)")
    return text.split("\n")  # not splitlines(): JSON strings may hold U+2028


def read_examples(path: str | Path, tokenizer: Tokenizer, *, max_tokens: int, truncate: bool,
                  width_name: str | None = None) -> list[SFTExample]:
    """Every example of the file, tokenized and checked against ``max_tokens`` model positions.

    ``width_name`` says where ``max_tokens`` comes from (default: ``model.seq_length`` or the largest bucket).
    """
    width_name = width_name or "model.seq_length, or the largest of data.seq_length_buckets"
    path = Path(path)
    if not path.is_file():
        raise SFTDataError(f"data.data_path={str(path)!r}: no such SFT file (jsonl with prompt/response lines)")
    examples = []
    for number, text in enumerate(_text_lines(path), start=1):
        if not text.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SFTDataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise SFTDataError(f"{where}: expected a JSON object with prompt and response, got {type(obj).__name__}")
        prompt = tokenizer.encode(_field(obj, "prompt", where))
        response = tokenizer.encode(_field(obj, "response", where))
        seq = np.asarray(prompt + response + [tokenizer.eod], dtype=np.int64)
        if len(seq) - 1 > max_tokens:
            if not truncate or len(prompt) > max_tokens:
                why = "its prompt alone fills" if truncate else "it does not fit"
                raise SFTDataError(
                    f"{where}: the example is {len(seq) - 1} tokens (prompt {len(prompt)}, response "
                    f"{len(response)} + eod) and {why} the padded width of {max_tokens} "
                    f"({width_name}); raise it, shorten the "
                    "example, or set data.sft_truncate=true to cut long responses"
                )
            seq = seq[: max_tokens + 1]
        if len(seq) < 2:
            raise SFTDataError(f"{where}: empty example (no prompt and no response tokens)")
        examples.append(SFTExample(seq=seq, prompt_len=len(prompt), line=number))
    if not examples:
        raise SFTDataError(f"{path}: no examples (empty file)")
    return examples


class SFTSamples:
    """Padded prompt/response samples; ``batch(indices, width)`` makes a micro-batch."""

    name = "sft"

    def __init__(self, examples: list[SFTExample], path: str | Path, pad_id: int) -> None:
        self.examples, self.path, self.pad_id = examples, str(path), pad_id
        self.num_samples = len(examples)
        self.epoch_samples = self.num_samples
        self._lengths = np.asarray([len(e.seq) - 1 for e in examples], dtype=np.int64)

    def lengths(self, indices: np.ndarray) -> np.ndarray:
        """Model positions (tokens) of each sample, before padding."""
        return self._lengths[np.asarray(indices, dtype=np.int64)]

    def describe(self, index: int) -> str:
        return f"{self.path}:{self.examples[int(index)].line}"

    def batch(self, indices: np.ndarray, width: int) -> dict[str, torch.Tensor]:
        tokens, labels, masks = [], [], []
        for i in np.asarray(indices, dtype=np.int64):
            ex = self.examples[int(i)]
            tokens.append(ex.seq[:-1])
            labels.append(ex.seq[1:])
            # label j is seq[j+1]: a target when it is a response token or the eod
            masks.append((np.arange(1, len(ex.seq)) >= ex.prompt_len).astype(np.float32))
        return pad_batch(tokens, labels, masks, width, self.pad_id)
