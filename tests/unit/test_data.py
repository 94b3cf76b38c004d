"""Tests of graphstep.data: samples, order, sharding, resume, mock data, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from graphstep.config import Config, ConfigError, apply_overrides
from graphstep.data import (
    ByteTokenizer,
    CorpusNotFoundError,
    Tokenizer,
    build_data,
    build_tokenizer,
    load_corpus,
    split_documents,
)
from graphstep.data import corpus as corpus_mod
from graphstep.data.corpus import select_source_files


def make_cfg(*overrides: str) -> Config:
    base = ["model.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=8"]
    return apply_overrides(Config(), base + list(overrides))


def take(it, n: int) -> list[dict[str, torch.Tensor]]:
    return [next(it) for _ in range(n)]


def cat(batches: list[dict[str, torch.Tensor]], key: str = "tokens") -> torch.Tensor:
    return torch.cat([b[key] for b in batches])


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for key in ("tokens", "labels", "loss_mask"):
            assert torch.equal(x[key], y[key]), key


@pytest.fixture
def fake_stdlib(tmp_path: Path) -> Path:
    """A tiny standard library with files the corpus must keep and skip."""
    files = {
        "b.py": "print('b')\n",
        "a.py": "x = 'é'\n",
        "pkg/c.py": "def c():\n    return 1\n",
        "test/test_a.py": "skipped = True\n",
        "site-packages/mod.py": "skipped = True\n",
        "tkinter/__init__.py": "skipped = True\n",
        "notes.txt": "not python\n",
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    (tmp_path / "latin1.py").write_bytes(b"x = '\xe9'\n")  # not UTF-8: skipped
    (tmp_path / "nul.py").write_bytes(b"x = 1\0\n")  # contains the EOD id: skipped
    return tmp_path


# --- tokenizer ----------------------------------------------------------------


def test_byte_tokenizer_round_trip() -> None:
    tok = build_tokenizer("byte")
    assert isinstance(tok, Tokenizer) and isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eod) == (256, 0)
    ids = tok.encode("def f():\n    return 'é'\n")
    assert all(0 < i < 256 for i in ids)
    assert tok.decode(ids) == "def f():\n    return 'é'\n"
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"  # a split character is replaced, not an error


def test_unknown_tokenizer_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"data\.tokenizer"):
        build_tokenizer("/some/tokenizer.json")


# --- corpus -----------------------------------------------------------------


def test_corpus_selection_and_eod_separation(fake_stdlib: Path) -> None:
    corpus = load_corpus(root=fake_stdlib)
    assert corpus.files == ("a.py", "b.py", "pkg/c.py")
    assert corpus.tokens.dtype == np.uint8
    assert int((corpus.tokens == 0).sum()) == corpus.num_documents
    tok = ByteTokenizer()
    for i, name in enumerate(corpus.files):
        doc = corpus.tokens[corpus.doc_starts[i] : corpus.doc_starts[i + 1]]
        assert doc[-1] == tok.eod
        assert tok.decode(doc[:-1].tolist()) == (fake_stdlib / name).read_text(encoding="utf-8")


def test_corpus_cap_and_cache(fake_stdlib: Path) -> None:
    small = load_corpus(root=fake_stdlib, max_bytes=25)
    assert small.files == ("a.py", "b.py")  # whole documents, in sorted order, that fit
    assert len(small.tokens) <= 25
    assert load_corpus(root=fake_stdlib, max_bytes=25) is small


def test_real_corpus_is_deterministic_and_capped() -> None:
    corpus = load_corpus()
    assert 1_000_000 < len(corpus.tokens) <= corpus_mod.DEFAULT_MAX_BYTES
    assert list(corpus.files) == sorted(corpus.files)
    assert not any(part in corpus_mod.SKIPPED_DIRS for f in corpus.files for part in f.split("/")[:-1])
    assert select_source_files(Path(corpus.root))[0].name == Path(corpus.files[0]).name


def test_missing_stdlib_names_directory_and_mock(tmp_path: Path) -> None:
    with pytest.raises(CorpusNotFoundError, match=r"data\.dataset=mock") as info:
        load_corpus(root=tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(info.value)


def test_split_documents_megatron_style() -> None:
    assert split_documents("98,2,0", 100) == {"train": (0, 98), "valid": (98, 100), "test": (100, 100)}
    assert split_documents("1", 7) == {"train": (0, 7), "valid": (7, 7), "test": (7, 7)}
    assert split_documents("0,50,50", 3)["train"] == (0, 0)
    ranges = split_documents("33,33,34", 10)
    assert ranges["train"][0] == 0 and ranges["test"][1] == 10
    with pytest.raises(ConfigError, match=r"data\.split"):
        split_documents("a,b", 10)


# --- samples ----------------------------------------------------------------


def test_shapes_dtypes_and_shifted_labels() -> None:
    it = build_data(make_cfg())
    assert it.num_micro_batches == 4
    batch = next(it)
    assert set(batch) == {"tokens", "labels", "loss_mask"}
    for key, dtype in (("tokens", torch.int64), ("labels", torch.int64), ("loss_mask", torch.float32)):
        assert batch[key].shape == (2, 32) and batch[key].dtype == dtype and batch[key].device.type == "cpu"
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert bool((batch["loss_mask"] == 1.0).all())


def test_windows_are_megatron_gpt_samples() -> None:
    it = build_data(make_cfg("data.split=100,0,0"))
    stream = load_corpus().tokens.astype(np.int64)
    sample = int(it.order.indices(0, 1)[0])
    batch = next(it)
    window = stream[sample * 32 : sample * 32 + 33]
    assert batch["tokens"][0].tolist() == window[:-1].tolist()
    assert batch["labels"][0].tolist() == window[1:].tolist()
    assert it.num_samples == (len(stream) - 1) // 32


def test_same_seed_same_batches_other_seed_other_order() -> None:
    a = take(build_data(make_cfg()), 6)
    b = take(build_data(make_cfg()), 6)
    c = take(build_data(make_cfg("rng.seed=7")), 6)
    assert_same(a, b)
    assert not torch.equal(cat(a), cat(c))


def test_epochs_reshuffle_and_cover_every_sample() -> None:
    it = build_data(make_cfg())
    n = it.num_samples
    first, second = it.order.indices(0, n), it.order.indices(n, n)
    assert sorted(first.tolist()) == list(range(n)) == sorted(second.tolist())
    assert not np.array_equal(first, second)


def test_validation_is_in_order_and_holds_the_valid_documents() -> None:
    it = build_data(make_cfg(), split="valid")
    assert it.order.indices(0, 5).tolist() == [0, 1, 2, 3, 4]
    corpus = load_corpus()
    ranges = split_documents("98,2,0", corpus.num_documents)
    assert ranges["train"][1] == ranges["valid"][0] < ranges["valid"][1]
    assert np.array_equal(it.source.stream, corpus.document_tokens(*ranges["valid"]))
    window = corpus.document_tokens(*ranges["valid"])[:33].astype(np.int64)
    assert next(it)["tokens"][0].tolist() == window[:-1].tolist()


# --- data parallel sharding and resume ------------------------------------------


@pytest.mark.parametrize("dataset", ["corpus", "mock"])
def test_dp_sharding_covers_the_same_global_batch(dataset: str) -> None:
    one = build_data(make_cfg(f"data.dataset={dataset}"), dp_rank=0, dp_size=1)
    ranks = [build_data(make_cfg(f"data.dataset={dataset}"), dp_rank=r, dp_size=2) for r in range(2)]
    assert one.num_micro_batches == 4 and all(r.num_micro_batches == 2 for r in ranks)
    for _step in range(3):
        single = one.next_step()
        split = ranks[0].next_step() + ranks[1].next_step()
        assert_same(single, split)


def test_resume_continues_with_the_next_batches() -> None:
    reference = build_data(make_cfg())
    take(reference, 4 * 3 + 1)  # three steps and one micro-batch of the fourth
    expected = take(reference, 10)

    first = build_data(make_cfg())
    take(first, 4 * 3 + 1)
    state = first.state_dict()
    assert state["consumed_samples"] == 24 and state["micro_batch"] == 1 and state["epoch"] == 0

    resumed = build_data(make_cfg())
    resumed.load_state_dict(state)
    assert_same(take(resumed, 10), expected)


def test_resume_across_an_epoch_boundary() -> None:
    cfg = make_cfg("model.seq_length=16384", "train.micro_batch_size=1", "train.global_batch_size=2")
    it = build_data(cfg)
    n = it.num_samples
    take(it, n + 2)  # into the second epoch
    state = it.state_dict()
    assert state["epoch"] == 1
    expected = take(it, 4)
    resumed = build_data(cfg)
    resumed.load_state_dict(state)
    assert_same(take(resumed, 4), expected)


def test_resume_refuses_other_data() -> None:
    state = build_data(make_cfg()).state_dict()
    with pytest.raises(ValueError, match="seed"):
        build_data(make_cfg("rng.seed=1")).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_length"):
        build_data(make_cfg("model.seq_length=64")).load_state_dict(state)


# --- mock data -----------------------------------------------------------------


def test_mock_is_deterministic_and_seeded() -> None:
    cfg = make_cfg("data.dataset=mock", "model.vocab_size=1000")
    a, b = take(build_data(cfg), 3), take(build_data(cfg), 3)
    assert_same(a, b)
    tokens = cat(a)
    assert int(tokens.max()) < 1000 and int(tokens.max()) >= 256  # uses the model's vocabulary
    assert torch.equal(a[0]["tokens"][:, 1:], a[0]["labels"][:, :-1])
    other = take(build_data(make_cfg("data.dataset=mock", "model.vocab_size=1000", "rng.seed=5")), 3)
    assert not torch.equal(tokens, cat(other))
    valid = take(build_data(cfg, split="valid"), 3)
    assert not torch.equal(tokens, cat(valid))
    assert build_data(cfg).num_samples is None


# --- errors --------------------------------------------------------------------


def test_byte_corpus_needs_256_vocab() -> None:
    with pytest.raises(ConfigError, match=r"model\.vocab_size=100.*256"):
        build_data(make_cfg("model.vocab_size=100"))


def test_corpus_shorter_than_one_sample(fake_stdlib: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus_mod, "stdlib_dir", lambda: fake_stdlib)
    with pytest.raises(ConfigError, match=r"model\.seq_length") as info:
        build_data(make_cfg("model.seq_length=1000"))
    assert "data.split" in str(info.value)


def test_missing_stdlib_through_build_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus_mod, "stdlib_dir", lambda: tmp_path)
    with pytest.raises(CorpusNotFoundError, match=r"data\.dataset=mock"):
        build_data(make_cfg())
    assert next(build_data(make_cfg("data.dataset=mock")))["tokens"].shape == (2, 32)


def test_batch_sizes_must_divide() -> None:
    with pytest.raises(ConfigError, match=r"train\.global_batch_size=8.*train\.micro_batch_size=2"):
        build_data(make_cfg(), dp_rank=0, dp_size=3)
    with pytest.raises(ValueError, match="dp_rank"):
        build_data(make_cfg(), dp_rank=2, dp_size=2)


def test_indexed_and_unknown_datasets() -> None:
    with pytest.raises(ConfigError, match=r"data\.data_path is not set"):  # indexed data: tests/integration/test_indexed.py
        build_data(make_cfg("data.dataset=indexed"))
    with pytest.raises(ConfigError, match=r"data\.dataset='web'"):
        build_data(make_cfg("data.dataset=web"))


def test_empty_validation_split() -> None:
    with pytest.raises(ConfigError, match=r"valid split"):
        build_data(make_cfg("data.split=100,0,0"), split="valid")
