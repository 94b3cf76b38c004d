"""The tiny trainer runs the tests share: a small llama3_tiny config (4 micro-batches, dropout 0.1), the
graph-friendly rule baseline, eager twins, the "same run" assertion (every loss and the final parameters bit
for bit), an iteration poisoned with NaN, and a stand-in graph that is never captured."""

from __future__ import annotations

import pytest
import torch

from graphstep.config import Config, apply_overrides
from graphstep.cuda_graph.backend import Graph
from graphstep.recipes import get_recipe

# llama3_tiny at a test size: 4 micro-batches, dropout 0.1 everywhere.
TINY = [
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.seq_length=32",
    "model.attention_dropout=0.1", "model.hidden_dropout=0.1",
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.eval_iters=0",
    "logger.progress_bar=false", "data.corpus_max_bytes=300000", "data.split=90,10,0", "train.device=cpu",
]

# Both spellings of the full-iteration graph, and the optimizer graph (CPU and GPU tests).
FULL_ITERATION_SETTINGS = [
    ["model.cuda_graph_impl=full_iteration"],
    ["model.cuda_graph_impl=local", "model.cuda_graph_scope=[full_iteration]"],
    ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"],
]
FULL_ITERATION_IDS = ["full_iteration", "legacy_local_scope", "with_optimizer_graph"]


def tiny_config(*overrides: str, recipe: str = "llama3_tiny", tmp_path=None) -> Config:
    cfg = get_recipe(recipe)
    apply_overrides(cfg, TINY if recipe == "llama3_tiny" else ["logger.progress_bar=false"])
    apply_overrides(cfg, list(overrides))
    cfg.logger.metrics_path = str(tmp_path / "metrics.jsonl") if tmp_path is not None else None
    return cfg


def graph_config(*overrides: str) -> Config:
    """The default config made graph-friendly (the RNG tracker on, the host-side NaN checks off), plus overrides:
    the baseline of the rule tests."""
    cfg = Config()
    cfg.model.use_te_rng_tracker = True
    cfg.rerun_state_machine.check_for_nan_in_loss = False
    cfg.ddp.check_for_nan_in_grad = False
    return apply_overrides(cfg, list(overrides))


def eager(cfg: Config) -> Config:
    cfg.model.cuda_graph_impl = "none"
    cfg.model.cuda_graph_modules = []
    cfg.model.cuda_graph_scope = None
    cfg.optimizer.optimizer_cuda_graph = False
    return cfg


def params_of(result) -> list[torch.Tensor]:
    """The run's final parameters, as this rank holds them (a DTensor's local shard: its mesh's process group is
    gone with the run)."""
    from graphstep.parallel.dims import local_tensor

    return [local_tensor(p).detach().clone() for p in result.model.parameters()]


def assert_same_run(a, b) -> None:
    """Every iteration's loss bit-identical, and the final parameters too."""
    assert len(a.rows) == len(b.rows) > 0
    for ra, rb in zip(a.rows, b.rows):
        assert ra["iteration"] == rb["iteration"]
        la, lb = torch.tensor(ra["loss"], dtype=torch.float32), torch.tensor(rb["loss"], dtype=torch.float32)
        assert torch.equal(la, lb), f"iteration {ra['iteration']}: {ra['loss']!r} != {rb['loss']!r}"
    if a.model is not None and b.model is not None:
        for pa, pb in zip(params_of(a), params_of(b)):
            assert torch.equal(pa, pb)


def poison_iteration(monkeypatch, bad: int) -> None:
    """Every micro-batch of iteration ``bad`` gets a NaN loss mask (the loss is NaN)."""
    from graphstep.training import loop

    real = loop.build_data

    def poisoned(cfg, split="train", **kw):
        it = real(cfg, split=split, **kw)
        if split != "train":
            return it
        n = cfg.train.global_batch_size // cfg.train.micro_batch_size

        def gen():
            k = 0
            while True:
                mb = next(it)
                if k // n == bad - 1:
                    mb = dict(mb, loss_mask=torch.full_like(mb["loss_mask"], float("nan")))
                k += 1
                yield mb

        return gen()

    monkeypatch.setattr(loop, "build_data", poisoned)


class NeverCapturedGraph(Graph):
    """The graph of a stand-in backend whose capture always fails: never captured, never replayed."""

    name, report, captured = "step", None, False

    def replay(self):
        raise AssertionError("never captured")

    def reset(self):
        pass


# the FP8 tests' devices: the CPU, and a GPU with FP8 tensor cores (its twins are marked cuda)
FP8_DEVICES = [
    pytest.param("cpu"),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a GPU with FP8 tensor cores (compute capability 8.9+)")]),
]
