"""MoE and hybrid models through the trainer: every graph scope equals eager bit for bit.

On the CPU (replay backend, fp32) in CI, and on a GPU (CUDA graphs, bf16, ``torch._grouped_mm`` experts on
sm90+) through scripts/gpu-check.
"""

from __future__ import annotations

import functools

import pytest
import torch

from helpers.runs import assert_same_run, eager, tiny_config
from graphstep.training.loop import train

pytestmark = pytest.mark.slow

LONG, SHORT = 100, 16  # one long run for the full-iteration graph over MoE routing that changes every step;
# the scopes differ in what they capture, which a short run shows
COMMON = ["train.micro_batch_size=2", "train.global_batch_size=8",
          "model.attention_dropout=0.1", "model.hidden_dropout=0.1", "train.eval_iters=0", "logger.log_interval=25"]
MOE_KEYS = ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance")
DEVICE_OVERRIDES = {"cpu": ["train.device=cpu"], "cuda": ["train.device=cuda", "model.params_dtype=bf16"]}
DEVICES = [
    pytest.param("cpu"),
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]


def _run(recipe: str, device: str, *overrides: str, graphs: bool = True, iters: int = SHORT):
    cfg = tiny_config(*COMMON, f"train.train_iters={iters}", *DEVICE_OVERRIDES[device], *overrides, recipe=recipe)
    return train(cfg if graphs else eager(cfg), keep_model=True)


@functools.cache
def _eager(recipe: str, device: str, iters: int = SHORT):
    return _run(recipe, device, graphs=False, iters=iters)


def _same_moe_stats(a, b) -> None:
    for ra, rb in zip(a.rows, b.rows):
        for key in MOE_KEYS:
            assert ra[key] == rb[key], f"iteration {ra['iteration']}: {key} {ra[key]!r} != {rb[key]!r}"


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,moe_router,moe_preprocess]"],
        ["model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[attn,moe_router,moe_preprocess]"],
        ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[moe_router]"],
        ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[moe]"],
        ["model.cuda_graph_impl=full_iteration"],
    ],
    ids=["megatron_partial", "te_partial", "router_only", "whole_moe_sync_free", "full_iteration"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_qwen3_moe_scopes_equal_eager(device, overrides):
    iters = LONG if overrides == ["model.cuda_graph_impl=full_iteration"] else SHORT
    qwen_eager = _eager("qwen3_moe_tiny", device, iters)
    graphed = _run("qwen3_moe_tiny", device, *overrides, iters=iters)
    assert len(graphed.rows) == iters
    assert [r["state"] for r in graphed.rows][3:5] == ["captured", "replayed"]
    assert_same_run(qwen_eager, graphed)
    _same_moe_stats(qwen_eager, graphed)  # the aux loss is identical with graphs (Megatron-LM issue 1494)
    assert all(r["moe_aux_loss"] > 0 for r in graphed.rows)


@pytest.mark.parametrize(
    "overrides",
    [["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mamba]"], ["model.cuda_graph_impl=full_iteration"]],
    ids=["attn_mamba", "full_iteration"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_nemotron_h_scopes_equal_eager(device, overrides):
    nemotron_eager = _eager("nemotron_h_tiny", device)
    graphed = _run("nemotron_h_tiny", device, *overrides)
    assert_same_run(nemotron_eager, graphed)
    _same_moe_stats(nemotron_eager, graphed)


@pytest.mark.parametrize("graph", [["model.cuda_graph_impl=full_iteration"],
                                   ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,moe_router]"]],
                         ids=["full_iteration", "partial"])
@pytest.mark.parametrize("device", DEVICES)
def test_expert_bias_is_not_moved_by_warmup_or_capture(device, graph):
    """Aux-loss-free balancing (Megatron-LM PR 4433): the bias moves only in the eager update after each step."""
    bias = ["model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
            "model.moe_router_bias_update_rate=0.01"]
    base = _run("qwen3_moe_tiny", device, *bias, graphs=False, iters=12)
    graphed = _run("qwen3_moe_tiny", device, *bias, *graph, iters=12)
    assert_same_run(base, graphed)
    for (name, a), (_, b) in zip(base.model.named_buffers(), graphed.model.named_buffers()):
        if name.endswith("expert_bias"):
            assert a.abs().sum() > 0  # it did move, by 12 updates
            assert torch.equal(a, b), name


def test_full_recompute_counts_the_router_statistics_once():
    """Full recompute re-runs each MoE block's forward in the backward; the router counts its statistics (aux and
    z-losses, token counts, the expert-bias counts) in the first forward only, so a graphed run with full recompute
    equals the eager run without it bit for bit, the logged MoE metrics and the moved expert biases included."""
    no_dropout = ["model.attention_dropout=0.0", "model.hidden_dropout=0.0", "model.moe_router_score_function=sigmoid",
                  "model.moe_router_enable_expert_bias=true", "model.moe_router_bias_update_rate=0.01"]
    plain = _run("qwen3_moe_tiny", "cpu", *no_dropout, graphs=False, iters=8)
    full = _run("qwen3_moe_tiny", "cpu", *no_dropout, "model.recompute_granularity=full", "model.recompute_method=uniform",
                "model.recompute_num_layers=1", "model.cuda_graph_impl=full_iteration", iters=8)
    assert [r["state"] for r in full.rows][3:5] == ["captured", "replayed"]
    assert_same_run(plain, full)
    _same_moe_stats(plain, full)
    biases = [m.expert_bias for m in full.model.modules() if getattr(m, "expert_bias", None) is not None]
    assert biases and all(b.abs().sum() > 0 for b in biases)
