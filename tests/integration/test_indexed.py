"""Megatron indexed datasets: the .bin/.idx format, preprocessing, GPT samples, blends, training, errors."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest

from helpers.runs import assert_same_run, eager, tiny_config
from graphstep.cli import main
from graphstep.config import Config, ConfigError, apply_overrides
from graphstep.data import HFTokenizer, IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError, build_data
from graphstep.data.megatron import GPTSamples, blending_indices, parse_blend
from graphstep.training.loop import train

WORDS = "the quick brown fox jumps over a lazy dog while graphs capture and replay every tensor".split()


def make_tokenizer(path: Path, texts: list[str], vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer.json trained here (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) for _ in range(n)]


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """A jsonl corpus, its tokenizer.json, and the dataset `graphstep preprocess` made of them."""
    root = tmp_path_factory.mktemp("indexed")
    texts = documents(160)
    jsonl = write_jsonl(root / "corpus.jsonl", texts)
    tokenizer = make_tokenizer(root / "tokenizer.json", texts)
    assert main(["preprocess", "--input", str(jsonl), "--output-prefix", str(root / "corpus"),
                 "--tokenizer", str(tokenizer)]) == 0
    return {"root": root, "jsonl": jsonl, "tokenizer": tokenizer, "prefix": root / "corpus_text_document",
            "texts": texts}


def make_cfg(*overrides: str) -> Config:
    base = ["model.seq_length=16", "train.micro_batch_size=2", "train.global_batch_size=4", "train.train_iters=5"]
    return apply_overrides(Config(), base + list(overrides))


# --- the format -----------------------------------------------------------------------------


def test_builder_writes_the_megatron_index_and_the_reader_reads_it(tmp_path):
    docs = [[5, 6, 7], [], [1, 2, 3, 4, 65000], [9]]
    builder = IndexedDatasetBuilder(tmp_path / "d", dtype=np.uint16)
    for d in docs:
        builder.add_document(d)
    prefix = builder.finalize()
    raw = (tmp_path / "d.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", raw[9:34]) == (1, 8, 4, 5)  # version, uint16 code, sequences, doc indices
    lengths = np.frombuffer(raw, np.int32, 4, 34)
    pointers = np.frombuffer(raw, np.int64, 4, 34 + 16)
    doc_idx = np.frombuffer(raw, np.int64, 5, 34 + 16 + 32)
    assert lengths.tolist() == [3, 0, 5, 1] and pointers.tolist() == [0, 6, 6, 16]
    assert doc_idx.tolist() == [0, 1, 2, 3, 4] and len(raw) == 34 + 16 + 32 + 40
    assert (tmp_path / "d.bin").stat().st_size == 9 * 2
    ds = IndexedDataset(prefix + ".bin")  # a suffix is accepted and stripped
    assert len(ds) == 4 and ds.dtype == np.uint16 and ds.num_tokens == 9
    assert [ds.document(i).tolist() for i in range(4)] == docs
    big = IndexedDatasetBuilder(tmp_path / "big", dtype=np.int32)
    big.add_document([70000])
    assert IndexedDataset(big.finalize()).document(0).tolist() == [70000]


def test_preprocess_jsonl_and_text_round_trip(corpus, tmp_path):
    ds = IndexedDataset(corpus["prefix"])
    tok = HFTokenizer(corpus["tokenizer"])
    assert len(ds) == len(corpus["texts"]) and ds.dtype == np.uint16
    for i in (0, 7, len(ds) - 1):
        ids = ds.document(i).tolist()
        assert ids[-1] == tok.eod and tok.decode(ids[:-1]) == corpus["texts"][i]
    meta = json.loads(Path(str(corpus["prefix"]) + ".graphstep.json").read_text())
    assert meta["documents"] == len(ds) and meta["tokenizer_fingerprint"] == tok.fingerprint
    (tmp_path / "a.txt").write_text("héllo\n")
    (tmp_path / "b.txt").write_text("")  # empty: skipped
    assert main(["preprocess", "--input", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"),
                 "--output-prefix", str(tmp_path / "t"), "--no-append-eod"]) == 0
    text = IndexedDataset(tmp_path / "t_text_document")
    assert len(text) == 1 and bytes(text.document(0).tolist()).decode() == "héllo\n"


def reference_samples(ds: IndexedDataset, docs: np.ndarray, seq: int, wanted: int, seed: int) -> np.ndarray:
    """Megatron's GPTDataset spelled out: materialised stream, same RandomState draws."""
    tokens_per_epoch = int(ds.document_lengths[docs].sum())
    epochs = 1
    while epochs * tokens_per_epoch < wanted * seq + 1:
        epochs += 1
    rng = np.random.RandomState(seed)
    per_epoch = (tokens_per_epoch - 1) // seq
    before_last = ((epochs - 1) * tokens_per_epoch - 1) // seq
    separate = epochs > 1 and wanted - before_last < int(0.8 * per_epoch)
    if separate:
        first = np.tile(docs.astype(np.int32), epochs - 1)
        rng.shuffle(first)
        last = docs.astype(np.int32).copy()
        rng.shuffle(last)
        doc_index = np.concatenate([first, last])
    else:
        doc_index = np.tile(docs.astype(np.int32), epochs)
        rng.shuffle(doc_index)
    stream = np.concatenate([ds.document(d) for d in doc_index]).astype(np.int64)
    total = (len(stream) - 1) // seq
    head = np.arange(before_last if separate else total, dtype=np.uint32)
    rng.shuffle(head)
    if separate:
        tail = np.arange(before_last, total, dtype=np.uint32)
        rng.shuffle(tail)
        head = np.concatenate([head, tail])
    return np.stack([stream[s * seq : s * seq + seq + 1] for s in head.astype(np.int64)])


@pytest.mark.parametrize("wanted", [10, 200, 330], ids=["one_epoch", "separate_last_epoch", "joint_epochs"])
def test_gpt_samples_are_megatrons(corpus, wanted):
    ds = IndexedDataset(corpus["prefix"])
    docs = np.arange(5, 40)
    samples = GPTSamples(ds, docs, seq_length=16, num_samples=wanted, seed=1234, shuffle=True)
    expected = reference_samples(ds, docs, 16, wanted, 1234)
    assert samples.num_samples == len(expected) >= wanted
    assert np.array_equal(samples.windows(np.arange(samples.num_samples)), expected)


def test_unshuffled_split_reads_every_token_once_in_order(corpus):
    ds = IndexedDataset(corpus["prefix"])
    samples = GPTSamples(ds, np.arange(3, 9), seq_length=8, num_samples=None, seed=0, shuffle=False)
    stream = np.concatenate([ds.document(d) for d in range(3, 9)])
    windows = samples.windows(np.arange(samples.num_samples))
    assert np.array_equal(windows[:, 1:].reshape(-1), stream[1 : 1 + samples.num_samples * 8])


def test_blends_parse_normalise_and_mix_by_weight(corpus, tmp_path):
    assert parse_blend("0.7 a 0.3 b") == [(0.7, "a"), (0.3, "b")]
    assert parse_blend([0.7, "a", 0.3, "b"]) == parse_blend(["0.7 a", "0.3 b"])
    assert parse_blend(["a", "b"]) == [(None, "a"), (None, "b")]
    for bad in ("0.7 a b", "0.5 a -1 b", "a 0.5"):
        with pytest.raises(ConfigError, match="data.data_path"):
            parse_blend(bad)
    which, sample = blending_indices([0.75, 0.25], 400)
    counts = np.bincount(which, minlength=2)
    assert counts.tolist() == [300, 100]
    assert all(np.array_equal(sample[which == i], np.arange(c)) for i, c in enumerate(counts))
    # a blend of the corpus with a byte-level copy made of other documents, through the loader
    other = write_jsonl(tmp_path / "other.jsonl", documents(40, seed=9))
    assert main(["preprocess", "--input", str(other), "--output-prefix", str(tmp_path / "o"),
                 "--tokenizer", str(corpus["tokenizer"])]) == 0
    path = f"data.data_path=2 {corpus['prefix']} 1 {tmp_path / 'o_text_document'}"
    cfg = make_cfg("data.dataset=indexed", path, f"data.tokenizer={corpus['tokenizer']}", "model.vocab_size=300")
    it = build_data(cfg)
    assert it.source.weights == pytest.approx([2 / 3, 1 / 3])
    assert it.num_samples == 5 * 4  # train_iters x global_batch_size, as Megatron sizes a blend
    assert np.bincount(it.source.which).tolist() == [13, 7]
    first = [next(it)["tokens"] for _ in range(4)]
    again = build_data(cfg)
    assert all((a == next(again)["tokens"]).all() for a in first)  # deterministic


@pytest.mark.slow
def test_train_on_preprocessed_jsonl_full_iteration_equals_eager(corpus):
    common = ["data.dataset=indexed", f"data.data_path={corpus['prefix']}", f"data.tokenizer={corpus['tokenizer']}",
              "model.vocab_size=320", "train.train_iters=8", "model.cuda_graph_warmup_steps=2"]
    base = train(eager(tiny_config(*common)), keep_model=True)
    graphed = train(tiny_config(*common, "model.cuda_graph_impl=full_iteration"), keep_model=True)
    assert [r["state"] for r in graphed.rows][1:4] == ["eager", "captured", "replayed"]
    assert_same_run(base, graphed)
    assert base.rows[-1]["loss"] < base.rows[0]["loss"]


# --- errors name the file and the position --------------------------------------------------


def copy_dataset(src: Path, dst: Path) -> Path:
    for suffix in (".bin", ".idx", ".graphstep.json"):
        (dst.parent / (dst.name + suffix)).write_bytes(Path(str(src) + suffix).read_bytes())
    return dst


def test_truncated_bin_names_the_file_and_the_first_document_past_the_end(corpus, tmp_path):
    prefix = copy_dataset(corpus["prefix"], tmp_path / "cut")
    ds = IndexedDataset(prefix)
    cut = int(ds.document_starts[100]) * 2 + 3  # inside document 100
    bin_path = tmp_path / "cut.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:cut])
    with pytest.raises(IndexedDatasetError, match=rf"{bin_path}: truncated: {cut} bytes.*document 100 \(sequence 100"):
        IndexedDataset(prefix)


def test_missing_idx_and_bad_header(corpus, tmp_path):
    prefix = copy_dataset(corpus["prefix"], tmp_path / "m")
    (tmp_path / "m.idx").unlink()
    with pytest.raises(IndexedDatasetError, match=rf"{tmp_path / 'm.idx'}: no such file \(m.bin is there\)"):
        IndexedDataset(prefix)
    (tmp_path / "m.idx").write_bytes(b"NOTANIDX" + bytes(40))
    with pytest.raises(IndexedDatasetError, match=r"m.idx: not a Megatron index"):
        IndexedDataset(prefix)
    cfg = make_cfg("data.dataset=indexed", f"data.data_path={tmp_path / 'missing'}")
    with pytest.raises(IndexedDatasetError, match=r"missing.idx: no such file"):
        build_data(cfg)
    with pytest.raises(ConfigError, match=r"data.data_path is not set"):
        build_data(make_cfg("data.dataset=indexed"))


def test_tokenizer_that_does_not_match_the_data(corpus, tmp_path):
    # the recorded fingerprint: data made with the BPE tokenizer, training asks for bytes
    cfg = make_cfg("data.dataset=indexed", f"data.data_path={corpus['prefix']}", "data.tokenizer=byte")
    with pytest.raises(ConfigError, match=r"corpus_text_document: the dataset was tokenized with .*tokenizer.json.*"
                                          r"data.tokenizer='byte' is another tokenizer"):
        build_data(cfg)
    # without the record (a Megatron-made dataset): the first id the tokenizer does not have, with its position
    prefix = copy_dataset(corpus["prefix"], tmp_path / "nometa")
    Path(str(prefix) + ".graphstep.json").unlink()
    ds = IndexedDataset(prefix)
    doc, pos, token = ds.first_token_at_least(256)
    assert ds.document(doc)[pos] == token >= 256 and (ds.document(doc)[:pos] < 256).all()
    cfg = make_cfg("data.dataset=indexed", f"data.data_path={prefix}", "data.tokenizer=byte")
    with pytest.raises(ConfigError, match=rf"nometa.bin: document {doc}, token {pos} is id {token}, but the "
                                          r"tokenizer 'byte' has 256 ids"):
        build_data(cfg)
    cfg = make_cfg("data.dataset=indexed", f"data.data_path={corpus['prefix']}",
                   f"data.tokenizer={corpus['tokenizer']}", "model.vocab_size=256")
    with pytest.raises(ConfigError, match=r"model.vocab_size=256 is smaller than .* 300 token ids"):
        build_data(cfg)


def test_preprocess_errors_name_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    assert main(["preprocess", "--input", str(bad), "--output-prefix", str(tmp_path / "x")]) == 2
    assert f"{bad}:2: no 'text' key" in capsys.readouterr().err
    bad.write_text('{"text": "ok"}\n\n{"text": oops}\n')
    assert main(["preprocess", "--input", str(bad), "--output-prefix", str(tmp_path / "x")]) == 2
    assert f"{bad}:3: not valid JSON" in capsys.readouterr().err
    assert main(["preprocess", "--input", str(tmp_path / "none.jsonl"), "--output-prefix", str(tmp_path / "x"),
                 "--tokenizer", str(tmp_path / "nope.json")]) == 2
    assert "data.tokenizer=" in capsys.readouterr().err


def test_hf_tokenizer_eod_and_pad_from_tokenizer_config(corpus, tmp_path):
    tok = HFTokenizer(corpus["tokenizer"])
    assert tok.vocab_size == 300 and tok.eod == tok._tok.token_to_id("<|endoftext|>") == tok.pad
    assert tok.decode(tok.encode("the lazy dog")) == "the lazy dog"
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes(Path(corpus["tokenizer"]).read_bytes())
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<unk>"},
                                                                 "pad_token": "<|endoftext|>"}))
    tok = HFTokenizer(directory)  # a directory holding tokenizer.json
    assert tok.eod == tok._tok.token_to_id("<unk>") and tok.pad == tok._tok.token_to_id("<|endoftext|>")


def test_resume_continues_and_refuses_another_sample_order(corpus):
    common = ["data.dataset=indexed", f"data.data_path={corpus['prefix']}", f"data.tokenizer={corpus['tokenizer']}",
              "model.vocab_size=300"]
    it = build_data(make_cfg(*common))
    for _ in range(3):
        it.next_step()
    state = it.state_dict()
    expected = it.next_step()
    resumed = build_data(make_cfg(*common, "train.train_iters=6"))  # a longer run, the same single epoch
    resumed.load_state_dict(state)
    assert all((a["tokens"] == b["tokens"]).all() for a, b in zip(expected, resumed.next_step()))
    other = build_data(make_cfg(*common, "train.train_iters=400"))  # more epochs: Megatron's order changes
    with pytest.raises(ValueError, match=r"saved with (num_samples|sample_order)="):
        other.load_state_dict(state)
