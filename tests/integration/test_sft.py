"""SFT data (prompt/response jsonl) and sequence-length buckets, through the trainer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.runs import assert_same_run, eager, tiny_config
from graphstep.config import Config, ConfigError, apply_overrides
from graphstep.data import SFTDataError, build_data
from graphstep.data.buckets import BucketError, pick_bucket
from graphstep.training.loop import train
from helpers.data import sft_overrides, write_sft

BUCKETS = "data.seq_length_buckets=[16,32,64]"


@pytest.fixture(scope="module")
def sft_file(tmp_path_factory) -> Path:
    return write_sft(tmp_path_factory.mktemp("sft") / "train.jsonl")


def make_cfg(*overrides: str) -> Config:
    return apply_overrides(Config(), ["train.train_iters=4", *overrides])


# --- samples ------------------------------------------------------------------------------------


def test_loss_only_on_response_tokens_padded_to_seq_length(tmp_path):
    path = tmp_path / "two.jsonl"
    path.write_text(json.dumps({"prompt": "Q:", "response": "ab"}) + "\n"
                    + json.dumps({"prompt": "", "response": "xyz", "meta": 1}) + "\n")
    cfg = make_cfg("data.dataset=sft", f"data.data_path={path}", "data.split=100,0,0", "model.seq_length=8",
                   "train.micro_batch_size=2", "train.global_batch_size=2")
    source = build_data(cfg).source
    batch = source.batch(np.array([0, 1]), 8)
    q, a, b = ord("Q"), ord("a"), ord("b")
    # seq = Q : a b eod; tokens = seq[:-1], labels = seq[1:], targets: a, b, eod
    assert batch["tokens"][0].tolist() == [q, ord(":"), a, b, 0, 0, 0, 0]
    assert batch["labels"][0].tolist() == [ord(":"), a, b, 0, 0, 0, 0, 0]
    assert batch["loss_mask"][0].tolist() == [0, 1, 1, 1, 0, 0, 0, 0]
    assert batch["loss_mask"][1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]  # no prompt: every label counts
    assert batch["tokens"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
    assert source.describe(1) == f"{path}:2"


def test_bad_lines_name_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"prompt": "p", "response": "r"})
    cases = {
        json.dumps({"prompt": "only a prompt"}): r"bad.jsonl:3: no 'response' key",
        json.dumps({"prompt": "p", "response": 7}): r"bad.jsonl:3: 'response' must be a string",
        "{not json": r"bad.jsonl:3: not valid JSON",
        json.dumps({"prompt": "p" * 10, "response": "r" * 10}): r"bad.jsonl:3: the example is 20 tokens .* padded width of 16",
    }
    for line, message in cases.items():
        path.write_text(f"{good}\n\n{line}\n")
        with pytest.raises(SFTDataError, match=message):
            build_data(make_cfg("data.dataset=sft", f"data.data_path={path}", "model.seq_length=16",
                                "data.split=100,0,0"))
    cfg = make_cfg("data.dataset=sft", f"data.data_path={path}", "model.seq_length=16", "data.split=100,0,0",
                   "data.sft_truncate=true", "train.micro_batch_size=2", "train.global_batch_size=2")
    batch = next(build_data(cfg))  # truncation only when asked for
    assert batch["tokens"].shape == (2, 16)
    with pytest.raises(ConfigError, match=r"data.data_path='.*nothing.jsonl': no such SFT file"):
        build_data(make_cfg("data.dataset=sft", f"data.data_path={tmp_path / 'nothing.jsonl'}"))


# --- buckets ------------------------------------------------------------------------------------


def step_widths(cfg: Config, steps: int, dp_size: int = 1) -> list[int]:
    iters = [build_data(cfg, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    widths = []
    for _ in range(steps):
        shapes = {mb["tokens"].shape[1] for it in iters for mb in it.next_step()}
        assert len(shapes) == 1  # one width per step, on every rank
        widths.append(shapes.pop())
    return widths


def test_each_step_is_padded_to_the_bucket_of_its_global_batch(sft_file):
    cfg = make_cfg(*sft_overrides(sft_file, BUCKETS, "train.global_batch_size=4"))
    it = build_data(cfg)
    source, order = it.source, it.order
    for step, width in enumerate(step_widths(cfg, 12)):
        longest = source.lengths(order.indices(step * 4, 4)).max()
        assert width == min(b for b in (16, 32, 64) if b >= longest)
    assert step_widths(cfg, 12) == step_widths(cfg, 12, dp_size=2)  # ranks agree, without communication
    valid = build_data(make_cfg(*sft_overrides(sft_file, BUCKETS, "data.split=50,50,0")), split="valid")
    assert {next(valid)["tokens"].shape[1] for _ in range(6)} == {64}  # evaluation: the largest bucket


def test_a_sample_longer_than_the_largest_bucket_is_an_error(sft_file):
    with pytest.raises(SFTDataError, match=r"train.jsonl:\d+: the example is \d+ tokens .* padded width of 32"):
        build_data(make_cfg(*sft_overrides(sft_file, "data.seq_length_buckets=[16,32]")))
    with pytest.raises(BucketError, match=r"x.jsonl:4: 40 tokens is longer than the largest bucket 32"):
        pick_bucket([16, 32], 40, lambda: "x.jsonl:4")
    # buckets beyond model.seq_length, and fixed-length data without model.seq_length as a bucket: rule V22
    # (tests/unit/test_value_rules_inputs.py), refused before any data is read


# --- training -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_sft_full_iteration_equals_eager(sft_file):
    common = sft_overrides(sft_file, "train.train_iters=8", "train.global_batch_size=4", "train.micro_batch_size=2",
                           "model.cuda_graph_warmup_steps=2")
    base = train(eager(tiny_config(*common)), keep_model=True)
    graphed = train(tiny_config(*common, "model.cuda_graph_impl=full_iteration"), keep_model=True)
    assert [r["state"] for r in graphed.rows][1:4] == ["eager", "captured", "replayed"]
    assert_same_run(base, graphed)


@pytest.mark.slow
def test_three_buckets_each_get_a_graph_and_equal_eager(sft_file):
    common = sft_overrides(sft_file, BUCKETS, "train.train_iters=20", "model.cuda_graph_warmup_steps=1")
    widths = step_widths(tiny_config(*common), 20)
    assert sorted(set(widths)) == [16, 32, 64] and min(widths.count(w) for w in (16, 32, 64)) >= 3
    base = train(eager(tiny_config(*common)), keep_model=True)
    graphed = train(tiny_config(*common, "model.cuda_graph_impl=full_iteration"), keep_model=True)
    assert_same_run(base, graphed)
    assert graphed.graphs == 3 and graphed.describe.startswith("full iteration, a graph per bucket of [16, 32, 64]")
    for w in (16, 32, 64):  # every bucket warms up once, captures, then replays
        states = [r["state"] for r, width in zip(graphed.rows, widths) if width == w]
        assert states[:2] == ["eager", "captured"] and set(states[2:]) == {"replayed"}


def test_per_layer_graphs_with_buckets_are_refused(sft_file):
    cfg = tiny_config(*sft_overrides(sft_file, BUCKETS, "train.train_iters=2"), "model.cuda_graph_impl=local",
                      "model.cuda_graph_modules=[attn]", "model.variable_seq_lengths=true")
    with pytest.raises(ConfigError, match=r"data.seq_length_buckets=\[16, 32, 64\] with per-layer graphs .* "
                                          r"model.cuda_graph_impl=full_iteration"):
        train(cfg)


@pytest.mark.slow
def test_sft_from_a_graphstep_checkpoint(sft_file, tmp_path):
    """checkpoint.load + checkpoint.finetune: SFT starts from the pretrained weights, at iteration 1."""
    no_dropout = ["model.attention_dropout=0.0", "model.hidden_dropout=0.0", "model.seq_length=64"]
    pre = train(eager(tiny_config(*no_dropout, "train.train_iters=2", f"checkpoint.save={tmp_path}")),
                keep_model=True)
    cfg = eager(tiny_config(*sft_overrides(sft_file, "train.train_iters=1"), *no_dropout,
                            f"checkpoint.load={tmp_path}", "checkpoint.finetune=true"))
    tuned = train(cfg)
    assert [r["iteration"] for r in tuned.rows] == [1]
    batches = build_data(cfg).next_step()
    total = torch.zeros(())
    with torch.no_grad():
        for mb in batches:
            total.add_(pre.model(mb["tokens"], mb["labels"], mb["loss_mask"]))
    assert tuned.rows[0]["loss"] == pytest.approx(float(total / len(batches)), rel=1e-6)
