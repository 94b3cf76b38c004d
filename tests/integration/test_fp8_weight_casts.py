"""FP8 weight casts once per step (converters/fp8.py WeightCastCache): with gradient accumulation the weight does
not change between micro-batches, so its FP8 cast (scale, cast and the backward's transposed copy) is made at the
first micro-batch and reused by the others -- inside the full-iteration graph too. The casts are deterministic,
so the cached program equals the uncached one bit for bit (losses, weights, delayed scaling's histories and
scales), eagerly and graphed; and a step casts each weight as often with 4 micro-batches as with 1.

The CPU runs use the replay backend (``torch._scaled_mm`` runs on the CPU); the ``cuda`` twin runs the same
comparison with CUDA graphs (scripts/gpu-check).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from graphstep.converters import fp8
from graphstep.cuda_graph.torch_compat import TorchDispatchMode
from graphstep.training.build import RunOptions, build_run
from graphstep.training.loop import train

from helpers.runs import FP8_DEVICES as DEVICES, assert_same_run, eager, tiny_config

try:
    fp8.import_torchao()
except ImportError:  # the test extra installs torchao (pip install 'graphstep[test]')
    pytest.skip("torchao is not installed", allow_module_level=True)

# 2 decoder layers in FP8, 4 micro-batches of 2 x 16 tokens per step (32 rows: no activation has a weight's shape)
ITERS = 4
BASE = ["model.num_layers=2", f"train.train_iters={ITERS}", "checkpoint.save=null", "model.params_dtype=bf16",
        "model.seq_length=16"]
RECIPES = {
    "tensorwise_hybrid": ["mixed_precision.fp8=hybrid", "mixed_precision.fp8_recipe=tensorwise"],
    "delayed": ["mixed_precision=bf16_with_fp8_delayed_scaling_mixed", "mixed_precision.fp8_amax_history_len=3",
                "mixed_precision.first_last_layers_bf16=false"],
}
# weight casts per FP8 layer and step: torchao's tensorwise casts the weight for the forward and, again, for the
# input-gradient matmul of the backward; delayed scaling once
CASTS_PER_LAYER = {"tensorwise_hybrid": 2, "delayed": 1}
FP8_LAYERS = 2 * 4  # 2 layers x (linear_qkv, linear_proj, linear_fc1, linear_fc2)
FULL_ITERATION = ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true",
                  "model.cuda_graph_warmup_steps=1"]  # eager, captured, replayed, replayed
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class WeightCastCounter(TorchDispatchMode):
    """Counts the aten ops -- the backward's included -- that cast to FP8 a tensor of a weight's shape (or its
    transpose): the weight casts (a copy of an FP8 tensor, such as the backward's transposed copy, is no cast)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.shapes = {s for p in model.parameters() if p.dim() == 2 for s in (tuple(p.shape), tuple(p.shape[::-1]))}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = args[0] if args else None
        if (isinstance(out, torch.Tensor) and out.dtype in FP8_DTYPES and isinstance(source, torch.Tensor)
                and source.dtype not in FP8_DTYPES and tuple(out.shape) in self.shapes):
            self.count += 1
        return out


@pytest.fixture
def caches(monkeypatch):
    """The WeightCastCache of every run built while the test runs (None where the run caches nothing)."""
    made: list = []
    real = fp8.cache_weight_casts

    def spy(model, plan):
        made.append(real(model, plan))
        return made[-1]

    monkeypatch.setattr(fp8, "cache_weight_casts", spy)
    return made


@contextlib.contextmanager
def _uncached(monkeypatch):
    """Within the context, runs build no cache: every training forward casts its weight."""
    with monkeypatch.context() as patch:
        patch.setattr(fp8, "cache_weight_casts", lambda model, plan: None)
        yield


def _scaling_state(model: torch.nn.Module) -> list[torch.Tensor]:
    from graphstep.converters import fp8_delayed

    return [t.clone() for m in fp8_delayed.delayed_modules(model) for t in (m.fp8_amax_history, m.fp8_scale)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_weight_casts_once_per_step_equal_the_uncached_program_bit_for_bit(recipe, device, caches, monkeypatch):
    overrides = [*BASE, *RECIPES[recipe], f"train.device={device}"]
    with _uncached(monkeypatch):
        ref = train(eager(tiny_config(*overrides)), keep_model=True)
    cached = train(eager(tiny_config(*overrides)), keep_model=True)
    graphed = train(tiny_config(*overrides, *FULL_ITERATION), keep_model=True)
    assert len(caches) == 2 and all(len(c) == FP8_LAYERS for c in caches)
    assert caches[0].casts == FP8_LAYERS * ITERS  # eagerly: each layer once per step
    assert graphed.rows[-1]["state"] == "replayed"
    state = _scaling_state(ref.model)
    assert bool(state) == (recipe == "delayed")
    for run in (cached, graphed):
        assert_same_run(ref, run)
        after = _scaling_state(run.model)
        assert len(after) == len(state) and all(torch.equal(a, b) for a, b in zip(state, after))


def _batches(cfg, n: int, device: str) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    shape = (cfg.train.micro_batch_size, cfg.model.seq_length)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
        out.append({"tokens": tokens.to(device), "labels": tokens.roll(-1, 1).to(device),
                    "loss_mask": torch.ones(shape, device=device)})
    return out


def _casts_in_one_step(recipe: str, micro_batches: int) -> int:
    cfg = eager(tiny_config(*BASE, *RECIPES[recipe], "train.micro_batch_size=2",
                            f"train.global_batch_size={2 * micro_batches}"))
    run = build_run(cfg, RunOptions(torch.device("cpu")))
    try:
        run.iteration(iter(_batches(cfg, micro_batches, "cpu")))  # a first step: warm (lazy state made)
        with WeightCastCounter(run.model) as counter:
            run.iteration(iter(_batches(cfg, micro_batches, "cpu")))
        return counter.count
    finally:
        run.close()


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_step_casts_each_weight_once_whatever_its_micro_batches(recipe, monkeypatch):
    once = FP8_LAYERS * CASTS_PER_LAYER[recipe]
    assert _casts_in_one_step(recipe, 1) == _casts_in_one_step(recipe, 4) == once
    with _uncached(monkeypatch):  # without the cache each micro-batch casts every weight again
        assert _casts_in_one_step(recipe, 1) == once
        assert _casts_in_one_step(recipe, 4) == 4 * once


def test_no_cache_where_one_graph_serves_every_micro_batch(caches):
    """Per-layer graphs replay one captured forward for every micro-batch: the weight is cast at each."""
    cfg = tiny_config(*BASE, *RECIPES["tensorwise_hybrid"], "model.cuda_graph_impl=local",
                      "model.cuda_graph_modules=[attn,mlp]", "train.train_iters=2", "model.cuda_graph_warmup_steps=1")
    train(cfg)
    assert caches == []  # the builder never asked for one
