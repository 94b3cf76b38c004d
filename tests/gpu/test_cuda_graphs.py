"""The equality tests of the capture engine on a GPU (CudaGraphBackend, bf16). Run by scripts/gpu-check."""

from __future__ import annotations

import pytest
import torch

from helpers.runs import FULL_ITERATION_IDS, FULL_ITERATION_SETTINGS, assert_same_run, eager, tiny_config
from graphstep.cuda_graph.backend import CudaGraphBackend
from graphstep.cuda_graph.registry import get_backend
from graphstep.cuda_graph.full_iteration import GraphedStep
from graphstep.training.loop import train

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ITERS = 100
GPU = ["train.device=cuda", "model.params_dtype=bf16", f"train.train_iters={ITERS}"]


@pytest.fixture(scope="module")
def eager_run():
    return train(eager(tiny_config(*GPU)), keep_model=True)


def test_eager_bf16_is_deterministic(eager_run):
    again = train(eager(tiny_config(*GPU)), keep_model=True)
    assert_same_run(eager_run, again)


@pytest.mark.parametrize("overrides", FULL_ITERATION_SETTINGS, ids=FULL_ITERATION_IDS)
def test_full_iteration_bf16_equals_eager(eager_run, overrides):
    graphed = train(tiny_config(*GPU, *overrides), keep_model=True)
    assert next(graphed.model.parameters()).dtype == torch.bfloat16
    assert [r["state"] for r in graphed.rows][3:5] == ["captured", "replayed"]
    assert_same_run(eager_run, graphed)


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
@pytest.mark.parametrize("modules", ["[attn]", "[mlp]", "[attn,mlp]", "[]"])
def test_scoped_graphs_bf16_equal_eager(eager_run, impl, modules):
    graphed = train(tiny_config(*GPU, f"model.cuda_graph_impl={impl}", f"model.cuda_graph_modules={modules}"),
                    keep_model=True)
    assert [r["state"] for r in graphed.rows][3:5] == ["captured", "replayed"]
    assert_same_run(eager_run, graphed)


def test_cuda_backend_reports_memory_and_frees_on_close():
    backend = get_backend("cuda")
    assert isinstance(backend, CudaGraphBackend)
    w = torch.randn(1024, 1024, device="cuda")
    x = torch.randn(1024, 1024, device="cuda")
    step = GraphedStep(lambda x: (w @ x).relu().sum(), backend, warmup_steps=1)
    step(x)  # eager warm-up on the capture stream: cuBLAS workspace for that stream, static input buffer
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(2):
        out = step(x)
    assert step.state == "replayed"
    torch.testing.assert_close(out, (w @ x).relu().sum())
    report = step.graph.report
    assert report.seconds > 0  # (allocation deltas around a capture also see frees of unrelated garbage)
    del out
    step.close()
    backend.close()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    static_input = 1024 * 1024 * 4  # freed by close() too
    assert after <= before - static_input + 4096
    print(f"capture {report.seconds * 1e3:.1f} ms, +{report.allocated_delta / 2**20:.1f} MiB allocated; "
          f"allocated before capture {before / 2**20:.1f} MiB, after close {after / 2**20:.1f} MiB")


def test_memory_the_allocator_caches_counts_as_free_for_the_next_run():
    """A run started after another in the same process sees the first run's cached blocks as free: the
    allocator reuses them, so the memory check must not refuse the second run for memory the first left cached."""
    from graphstep.training.memory import available_memory

    device = torch.device("cuda")
    block = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)
    before = available_memory(device)
    del block  # back to the allocator's cache: the driver still counts it as taken
    driver_free, _total = torch.cuda.mem_get_info(device)
    after = available_memory(device)
    assert after >= driver_free + 2 * 2**30
    assert after >= before + 2 * 2**30
    torch.cuda.empty_cache()
