"""Full activation recompute (Megatron's recompute_granularity=full with recompute_method/recompute_num_layers):
which layers run twice, equality with no recompute and inside the full-iteration graph, and the rules."""

from __future__ import annotations

import pytest
import torch

from helpers.runs import assert_same_run, eager, graph_config, tiny_config
from graphstep.models import build_model
from graphstep.models.transformer import recompute_runs
from graphstep.training.loop import train
from graphstep.validation import validate_config

NO_DROPOUT = ["model.attention_dropout=0.0", "model.hidden_dropout=0.0"]
ITERS = 10


@pytest.mark.parametrize("full, runs", [
    (None, [(0, 5, False)]),
    (("uniform", None), [(0, 1, True), (1, 2, True), (2, 3, True), (3, 4, True), (4, 5, True)]),
    (("uniform", 2), [(0, 2, True), (2, 4, True), (4, 5, True)]),
    (("uniform", 9), [(0, 5, True)]),
    (("block", 2), [(0, 1, True), (1, 2, True), (2, 5, False)]),
    (("block", None), [(i, i + 1, True) for i in range(5)]),
])
def test_recompute_runs_follow_megatron_core(full, runs):
    assert recompute_runs(5, full) == runs


@pytest.mark.parametrize("method, num_layers, layer_calls", [
    ("uniform", 1, [2, 2, 2, 2]), ("uniform", 3, [2, 2, 2, 2]), ("block", 1, [2, 1, 1, 1]),
    (None, None, [2, 2, 2, 2]),
])
def test_full_recompute_reruns_each_recomputed_layer_in_backward(method, num_layers, layer_calls):
    cfg = tiny_config(*NO_DROPOUT, "model.num_layers=4", "model.recompute_granularity=full",
                      f"model.recompute_method={method or 'null'}", f"model.recompute_num_layers={num_layers or 'null'}")
    model = build_model(cfg.model).train()
    calls = [0] * 4
    for i, layer in enumerate(model.graph_layers()):
        layer.register_forward_pre_hook(lambda *_a, i=i: calls.__setitem__(i, calls[i] + 1))
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length))
    model(tokens, tokens).backward()
    assert calls == layer_calls
    calls[:] = [0] * 4
    with torch.no_grad():
        model.eval()(tokens)
    assert calls == [1, 1, 1, 1]  # not training: nothing is recomputed


@pytest.fixture(scope="module")
def plain_run():
    return train(eager(tiny_config(*NO_DROPOUT, f"train.train_iters={ITERS}")), keep_model=True)


@pytest.mark.parametrize("method", ["uniform", "block"])
def test_full_recompute_trains_exactly_as_without(plain_run, method):
    recomputed = train(eager(tiny_config(*NO_DROPOUT, f"train.train_iters={ITERS}", "model.recompute_granularity=full",
                                         f"model.recompute_method={method}", "model.recompute_num_layers=1")),
                       keep_model=True)
    assert_same_run(plain_run, recomputed)


def test_full_recompute_inside_the_full_iteration_graph_equals_eager(plain_run):
    overrides = [*NO_DROPOUT, f"train.train_iters={ITERS}", "model.recompute_granularity=full",
                 "model.recompute_method=uniform", "model.recompute_num_layers=2"]
    eager_recompute = train(eager(tiny_config(*overrides)), keep_model=True)
    graphed = train(tiny_config(*overrides, "model.cuda_graph_impl=full_iteration"), keep_model=True)
    states = [r["state"] for r in graphed.rows]
    assert "captured" in states and states[-1] == "replayed"
    assert_same_run(eager_recompute, graphed)
    assert_same_run(plain_run, graphed)


def _rules(*overrides: str) -> dict[str, list[tuple[str, ...]]]:
    found: dict[str, list[tuple[str, ...]]] = {}
    for v in validate_config(graph_config(*overrides), env={}):
        found.setdefault(v.rule, []).append(tuple(v.fields))
    return found


def test_full_recompute_rules():
    full = ["model.recompute_granularity=full", *NO_DROPOUT]
    assert not _rules(*full, "model.recompute_method=block", "model.recompute_num_layers=2")
    assert not _rules(*full, "model.cuda_graph_impl=full_iteration")
    # the method is read only with full recompute (as in Megatron Core, which refuses it otherwise)
    assert _rules("model.recompute_method=uniform") == {
        "R35": [("model.recompute_method", "model.recompute_granularity")]}
    # recompute without RNG replay: no dropout in a recomputed layer
    assert _rules("model.recompute_granularity=full", "model.hidden_dropout=0.1", "model.attention_dropout=0.0") == {
        "R35": [("model.recompute_granularity", "model.hidden_dropout")]}
    # MoE models too: the router counts its statistics in the first forward only (test_moe_training.py)
    assert "R35" not in _rules(*full, "model.num_moe_experts=4", "model.moe_ffn_hidden_size=32")
    assert "V" in _rules(*full, "model.recompute_method=layerwise")
    assert "V" in _rules(*full, "model.recompute_num_layers=0")
    assert _rules("model.cpu_offloading=true") == {"R36": [("model.cpu_offloading",)]}


def test_selective_attention_recompute_with_dropout_is_refused_wherever_attention_runs_eagerly():
    selective = ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn]",
                 "model.attention_dropout=0.1", "model.hidden_dropout=0.0"]
    assert _rules(*selective) == {"R35": [("model.recompute_modules", "model.attention_dropout")]}
    assert "R35" in _rules(*selective, "model.cuda_graph_impl=local", "model.cuda_graph_modules=[mlp]")
    graphed = _rules(*selective, "model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn]")
    assert "R15" in graphed and "R35" not in graphed  # one rule per case: R15 judges graphed attention


def test_full_recompute_of_a_hybrid_model_trains_exactly_as_without():
    overrides = [*NO_DROPOUT, "train.train_iters=4", "train.eval_iters=0", "train.device=cpu",
                 "model.hybrid_override_pattern=M-*-", "model.num_moe_experts=null"]  # Mamba, MLP, attention, MLP
    plain = train(eager(tiny_config(*overrides, recipe="nemotron_h_tiny")), keep_model=True)
    recomputed = train(eager(tiny_config(*overrides, "model.recompute_granularity=full", recipe="nemotron_h_tiny")),
                       keep_model=True)
    assert_same_run(plain, recomputed)
