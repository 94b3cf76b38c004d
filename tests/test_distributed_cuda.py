"""Data parallel on two GPUs (NCCL) with graphs, and exact resume on a GPU. Run by scripts/gpu-check.

Each test starts real processes: torchrun with 2 ranks running the worker of
test_distributed.py (eager, full-iteration graph with the optimizer graph,
per-layer ``[attn,mlp]`` graphs, then a checkpoint/resume case), or
``python -m graphstep train`` killed with SIGKILL. A run that hangs at exit
(graphs alive while the process group is destroyed) fails on the timeout.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from conftest import tiny_config
from graphstep.training.checkpoint import find_checkpoint
from graphstep.training.loop import train
from graphstep.training.metrics import read_metrics
from test_checkpoint import killed_at
from test_distributed import DP_RUNS, exact_list, run_workers

pytestmark = pytest.mark.cuda
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPU_ITERS = 30
GPU_RUNS = {name: [*overrides, f"train.train_iters={GPU_ITERS}"] for name, overrides in DP_RUNS.items()}


@two_gpus
def test_two_gpus_graphs_equal_eager_and_exit_without_hang(tmp_path, capsys):
    reports = run_workers(tmp_path, "cuda", GPU_RUNS, timeout=600)  # a hang at exit fails here
    for report in reports:
        for name in ("full_iteration", "attn_mlp"):
            assert exact_list(report[name]["losses"]) == exact_list(report["eager"]["losses"]), name
            assert report[name]["params"] == report["eager"]["params"], name
            assert report[name]["states"][2:5] == ["eager", "captured", "replayed"], name
        resume = report["resume"]
        assert resume["resumed_iters"] == [4, 5, 6]
        assert exact_list(resume["resumed"]) == exact_list(resume["whole"][3:])
    for name in GPU_RUNS:
        assert reports[0][name]["losses"] == reports[1][name]["losses"]
        assert reports[0][name]["params"] == reports[1][name]["params"]
    with capsys.disabled():
        print("\n2 x GPU data parallel (tiny llama, bf16, NCCL), median step time after capture:")
        for name in GPU_RUNS:
            r = reports[0][name]
            steady = [ms for ms, st in zip(r["step_ms"], r["states"]) if st != "captured"][5:]
            print(f"  {name:15s} {statistics.median(steady):7.2f} ms/step   whole run {r['seconds']:.1f} s")


@one_gpu
@pytest.mark.parametrize("graphs", [["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"],
                                    ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"]],
                         ids=["full_iteration", "attn_mlp"])
def test_gpu_resume_after_sigkill_with_graphs_is_bit_exact(tmp_path, graphs):
    common = ["train.device=cuda", "train.train_iters=20", "logger.log_interval=5", *graphs]
    whole = train(tiny_config(*common, tmp_path=tmp_path / "whole"))
    ckpt = tmp_path / "ckpt"
    save = [f"checkpoint.save={ckpt}", "checkpoint.save_interval=10"]
    killed_at(15, *common, *save, "logger.metrics_path=null")
    assert find_checkpoint(ckpt) == ckpt / "iter_0000010"
    train(tiny_config(*common, *save, f"checkpoint.load={ckpt}", tmp_path=tmp_path / "resumed"))
    rows = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == list(range(11, 21))
    assert [r["state"] for r in rows[2:5]] == ["eager", "captured", "replayed"]
    assert exact_list([r["loss"] for r in rows]) == exact_list(whole.losses[10:])
