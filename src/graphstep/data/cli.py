"""``graphstep preprocess``: jsonl or text files -> a Megatron indexed dataset (.bin/.idx).

    graphstep preprocess --input corpus.jsonl --output-prefix data/corpus --tokenizer tokenizer.json
    graphstep preprocess --input a.txt b.txt --output-prefix data/notes              # byte tokenizer

Like Megatron's ``tools/preprocess_data.py``: each jsonl line is a document
(the ``--json-keys`` fields, default ``text``), each other file is one
document; documents are tokenized without special tokens and followed by the
tokenizer's ``eod`` (``--no-append-eod`` to leave it out); empty documents
are skipped. Output: ``<prefix>_<key>_document.bin/.idx`` per key, tokens as
uint16 below 65500 ids else int32, plus ``<prefix>_<key>_document.graphstep.json``
recording the tokenizer (training with another one is then refused).
Train on it with ``data.dataset=indexed data.data_path=<prefix>_text_document``
and the same ``data.tokenizer``.

A line that is not JSON or lacks a key stops the run with ``file:line``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Iterator

from ..errors import PreprocessError
from .indexed import META_SUFFIX, IndexedDatasetBuilder, optimal_dtype
from .tokenizer import Tokenizer, build_tokenizer

log = logging.getLogger("graphstep")


def _utf8(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise PreprocessError(f"{path}:{line}: byte 0x{raw[exc.start]:02x} is not UTF-8; graphstep preprocess "
                              "reads UTF-8 text and jsonl files") from None


def read_documents(path: Path, keys: list[str]) -> Iterator[dict[str, str]]:
    """The documents of one input: a dict key -> text per jsonl line, or the whole file as ``keys[0]``."""
    text = _utf8(path)
    if path.suffix not in (".jsonl", ".json"):
        yield {keys[0]: text}
        return
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PreprocessError(f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        missing = [k for k in keys if not isinstance(obj, dict) or k not in obj]
        if missing:
            raise PreprocessError(f"{path}:{number}: no {missing[0]!r} key (--json-keys {' '.join(keys)})")
        bad = [k for k in keys if not isinstance(obj[k], str)]
        if bad:
            raise PreprocessError(f"{path}:{number}: {bad[0]!r} is a {type(obj[bad[0]]).__name__}, not a string")
        yield {k: obj[k] for k in keys}


def _add_documents(paths: list[Path], builders: dict[str, IndexedDatasetBuilder], tokenizer: Tokenizer,
                   append_eod: bool) -> tuple[dict[str, int], dict[str, int]]:
    """Tokenize every document of every input into its key's builder; the counts per key."""
    documents, tokens = dict.fromkeys(builders, 0), dict.fromkeys(builders, 0)
    for path in paths:
        for doc in read_documents(path, list(builders)):
            for key, text in doc.items():
                if not text:
                    continue
                ids = tokenizer.encode(text) + ([tokenizer.eod] if append_eod else [])
                builders[key].add_document(ids)
                documents[key] += 1
                tokens[key] += len(ids)
                if documents[key] % 100_000 == 0:
                    log.info("%s: %d documents, %d tokens", key, documents[key], tokens[key])
    return documents, tokens


def preprocess(inputs: list[str | Path], output_prefix: str, tokenizer: Tokenizer, tokenizer_name: str, *,
               json_keys: tuple[str, ...] = ("text",), append_eod: bool = True) -> list[str]:
    """Write one indexed dataset per key; returns their prefixes (what data.data_path takes)."""
    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.is_file():
            raise PreprocessError(f"{p}: no such input file")
    dtype = optimal_dtype(tokenizer.vocab_size)
    builders = {k: IndexedDatasetBuilder(f"{output_prefix}_{k}_document", dtype) for k in json_keys}
    try:
        documents, tokens = _add_documents(paths, builders, tokenizer, append_eod)
        empty = [key for key, count in documents.items() if count == 0]
        if empty:
            raise PreprocessError(f"{', '.join(map(str, paths))}: no document with text under {empty[0]!r} (empty "
                                  "input); give files with text, or the jsonl key that holds it with --json-keys")
    except BaseException:
        for builder in builders.values():
            builder.discard()  # no partial .bin left behind
        raise
    prefixes = []
    for key, builder in builders.items():
        prefix = builder.finalize()
        meta = {"tokenizer": tokenizer_name, "tokenizer_fingerprint": getattr(tokenizer, "fingerprint", None),
                "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod, "append_eod": append_eod,
                "inputs": [str(p) for p in paths], "json_key": key, "documents": documents[key],
                "tokens": tokens[key]}
        Path(prefix + META_SUFFIX).write_text(json.dumps(meta, indent=2) + "\n")
        prefixes.append(prefix)
    return prefixes


def add_preprocess(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("preprocess", help="tokenize jsonl/text files into a Megatron indexed dataset (.bin/.idx)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="jsonl files (a document per line) or text files")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    p.add_argument("--tokenizer", "--tokenizer-model", dest="tokenizer", default="byte",
                   help="byte (default), or a Hugging Face tokenizer.json (or its directory)")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="jsonl fields to tokenize (default: text)")
    p.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="end every document with the tokenizer's eod (default: on)")
    p.set_defaults(fn=cmd_preprocess)


def cmd_preprocess(args: argparse.Namespace) -> int:
    # a PreprocessError or a tokenizer's ConfigError is printed by graphstep's main as one line (exit 2)
    tokenizer = build_tokenizer(args.tokenizer)
    prefixes = preprocess(args.input, args.output_prefix, tokenizer, args.tokenizer,
                          json_keys=tuple(args.json_keys), append_eod=args.append_eod)
    for prefix in prefixes:
        meta = json.loads(Path(prefix + META_SUFFIX).read_text())
        print(f"{prefix}: {meta['documents']} documents, {meta['tokens']} tokens "
              f"(train with data.dataset=indexed data.data_path={prefix} data.tokenizer={args.tokenizer})")
    return 0
