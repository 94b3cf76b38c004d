"""Exact resume on a GPU after SIGKILL, with graphs. Run by scripts/gpu-check.

Each test starts a real ``python -m graphstep train`` killed with SIGKILL
(test_distributed.py holds the two-GPU data-parallel case, beside its CPU
form).
"""

from __future__ import annotations

import pytest
import torch

from helpers.runs import tiny_config
from graphstep.training.checkpoint import find_checkpoint
from graphstep.training.loop import train
from graphstep.training.metrics import read_metrics
from helpers.cli import killed_at
from helpers.launch import exact_list

pytestmark = pytest.mark.cuda
one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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
