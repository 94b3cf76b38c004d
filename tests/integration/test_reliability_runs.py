"""A run never loses a checkpoint or a metric: outputs checked before iteration 1, damaged
checkpoints skipped, metrics kept across a resume, one run per output directory, a memory
estimate before building, a clear error for a missing GPU.

Runs that must die are real processes (``python -m graphstep train``): the command-line
checks assert exit code 2, one line naming the culprit, and no traceback.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers.runs import TINY, eager, tiny_config
from graphstep.training import rundir
from graphstep.training.checkpoint import CheckpointError, choose_checkpoint, verify_checkpoint
from graphstep.training.loop import pick_device, train
from graphstep.training.memory import GiB, check_memory_fits, count_parameters, estimate_memory
from graphstep.training.metrics import keep_history, read_metrics
from graphstep.training.rundir import LOCK_NAME, RunLock, RunSetupError
from helpers.cli import killed_at, run_train
from helpers.launch import exact_list, subprocess_env


def with_metrics(cfg, path: Path | str):
    cfg.logger.metrics_path = str(path)  # tiny_config sets it last, from its tmp_path argument
    return cfg


def assert_one_line_exit_2(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, no traceback, and one ``graphstep train:`` line holding every needle."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("graphstep train:")]
    assert len(lines) == 1, out[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# --------------------------------------------------------------------------
# 1. output paths checked before iteration 1


def test_checkpoint_save_that_is_a_file_fails_before_training(tmp_path):
    target = tmp_path / "a_file"
    target.write_text("not a directory")
    proc = run_train("train.train_iters=50", f"checkpoint.save={target}", "checkpoint.save_interval=50",
                     "logger.metrics_path=null", cwd=tmp_path)
    line = assert_one_line_exit_2(proc, f"checkpoint.save={target}", "not a directory")
    assert "iter " not in proc.stderr, line  # died before the first iteration, not at the first save
    assert target.read_text() == "not a directory"


@pytest.mark.parametrize("field", ["checkpoint.save", "logger.metrics_path"])
def test_output_under_a_file_is_refused_before_building(tmp_path, field):
    (tmp_path / "f").write_text("x")
    bad = tmp_path / "f" / "sub" / ("ck" if field == "checkpoint.save" else "m.jsonl")
    cfg = eager(tiny_config("train.train_iters=2"))
    if field == "checkpoint.save":
        cfg.checkpoint.save = str(bad)
    else:
        with_metrics(cfg, bad)
    with pytest.raises(RunSetupError, match=rf"^{field}={bad}: cannot write .*is a file, not a directory"):
        train(cfg)


def test_metrics_path_that_is_a_directory_is_refused(tmp_path):
    cfg = with_metrics(eager(tiny_config("train.train_iters=2")), tmp_path)
    with pytest.raises(RunSetupError, match=rf"logger.metrics_path={tmp_path} is a directory"):
        train(cfg)


def test_unwritable_directory_is_refused(tmp_path, monkeypatch):
    # Tests run as root, for whom chmod does not bite: the probe reports what a read-only directory would.
    def denied(directory: Path) -> None:
        raise PermissionError(13, "Permission denied", str(directory / ".probe"))

    monkeypatch.setattr(rundir, "probe_directory", denied)
    cfg = eager(tiny_config("train.train_iters=2", f"checkpoint.save={tmp_path / 'ck'}"))
    with pytest.raises(RunSetupError, match=r"checkpoint.save=.*ck: cannot write .*\(permission denied\)"):
        train(cfg)


# --------------------------------------------------------------------------
# 2. damaged checkpoints


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A save directory with iter_0000002 and iter_0000004, and an uninterrupted 6-iteration run."""
    root = tmp_path_factory.mktemp("ckpt")
    train(eager(tiny_config("train.train_iters=4", f"checkpoint.save={root}", "checkpoint.save_interval=2",
                            "logger.log_interval=1")))
    whole = train(eager(tiny_config("train.train_iters=6", "logger.log_interval=1")))
    return root, whole


def _damage(ckpt: Path, how: str) -> str:
    data = ckpt / "__0_0.distcp"
    if how == "truncated":
        data.write_bytes(data.read_bytes()[:100])
        return "__0_0.distcp is truncated"
    if how == "garbage_metadata":
        (ckpt / ".metadata").write_bytes(b"\x80\x04garbage")
        return ".metadata is unreadable"
    data.unlink()
    return "__0_0.distcp is missing"


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "garbage_metadata", "missing_distcp"])
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, saved_run, how, caplog):
    root = _copy(saved_run[0], tmp_path / "ck")
    whole = saved_run[1]
    what = _damage(root / "iter_0000004", how)
    assert verify_checkpoint(root / "iter_0000002") is None
    assert what in verify_checkpoint(root / "iter_0000004")
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        resumed = train(eager(tiny_config("train.train_iters=6", "logger.log_interval=1",
                                          f"checkpoint.load={root}")))
    assert any("iter_0000004" in r.getMessage() and what in r.getMessage() for r in caplog.records)
    assert [r["iteration"] for r in resumed.rows] == [3, 4, 5, 6]  # from iteration 2, the intact one
    assert exact_list(resumed.losses) == exact_list(whole.losses[2:])


def test_damaged_exact_checkpoint_is_refused_with_the_intact_ones(tmp_path, saved_run):
    root = _copy(saved_run[0], tmp_path / "ck")
    _damage(root / "iter_0000004", "truncated")
    proc = run_train("train.train_iters=6", f"checkpoint.load={root / 'iter_0000004'}", "logger.metrics_path=null",
                     cwd=tmp_path)
    assert_one_line_exit_2(proc, "iter_0000004", "__0_0.distcp is truncated", f"intact checkpoints: {root}/iter_0000002")


def test_every_checkpoint_damaged_is_refused(tmp_path, saved_run):
    root = _copy(saved_run[0], tmp_path / "ck")
    _damage(root / "iter_0000004", "missing_distcp")
    _damage(root / "iter_0000002", "garbage_metadata")
    with pytest.raises(CheckpointError, match="every checkpoint there is damaged .*iter_0000004.*iter_0000002"):
        choose_checkpoint(root)


# --------------------------------------------------------------------------
# 3. metrics across a resume


@pytest.mark.slow
def test_metrics_file_is_the_whole_history_after_a_kill_and_resume(tmp_path):
    common = ["train.train_iters=20", "logger.log_interval=5", "model.cuda_graph_impl=full_iteration",
              f"checkpoint.save={tmp_path / 'ck'}", "checkpoint.save_interval=10"]
    metrics = tmp_path / "run" / "metrics.jsonl"
    whole = train(tiny_config(*common[:3], tmp_path=tmp_path / "whole"))
    killed_at(12, *common, f"logger.metrics_path={metrics}")  # rows 1-10 flushed, 11-12 lost with the process
    train(with_metrics(tiny_config(*common, f"checkpoint.load={tmp_path / 'ck'}"), metrics))
    rows = read_metrics(metrics)
    assert [r["iteration"] for r in rows] == list(range(1, 21))
    for key in ("loss", "grad_norm", "lr"):
        assert exact_list([r[key] for r in rows]) == exact_list([r[key] for r in whole.rows]), key


def test_keep_history_drops_rows_past_the_resume_and_torn_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    rows = [json.dumps({"iteration": i, "loss": i / 3}) for i in range(1, 13)]
    path.write_text("\n".join(rows) + '\n{"iteration": 13, "lo')  # a kill cut the last line
    keep_history(path, 10)
    assert [r["iteration"] for r in read_metrics(path)] == list(range(1, 11))
    assert read_metrics(path)[9]["loss"] == 10 / 3
    assert not list(tmp_path.glob(".m.jsonl.tmp-*"))


# --------------------------------------------------------------------------
# 4. one run per output directory


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.slow
def test_second_run_on_the_same_directory_is_refused_and_sigterm_releases_the_lock(tmp_path):
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-m", "graphstep", "train", *TINY, "train.train_iters=100000", "logger.log_interval=1000",
           f"checkpoint.save={ck}", "logger.metrics_path=null"]
    first = subprocess.Popen(cmd, env=subprocess_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.time() + 120
        while not (ck / LOCK_NAME).exists() or not (ck / LOCK_NAME).read_text().strip():
            assert first.poll() is None and time.time() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.2)
        second = run_train("train.train_iters=4", f"checkpoint.save={ck}", "logger.metrics_path=null", cwd=tmp_path)
        assert_one_line_exit_2(second, f"pid {first.pid} on {socket.gethostname()}", str(ck))
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 130, err[-3000:]  # stopped cleanly after the current step
    assert not (ck / LOCK_NAME).exists()


def test_lock_held_by_another_run_is_refused_in_process(tmp_path):
    with RunLock([tmp_path]):
        with pytest.raises(RunSetupError, match=rf"another graphstep run \(pid {os.getpid()} on .*\) is writing to "
                                                 rf"{tmp_path}"):
            train(eager(tiny_config("train.train_iters=1", f"checkpoint.save={tmp_path}")))
    assert not (tmp_path / LOCK_NAME).exists()


def test_stale_lock_of_a_dead_pid_is_taken_over(tmp_path, caplog):
    pid = _dead_pid()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "since": "earlier"}))
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        result = train(eager(tiny_config("train.train_iters=1", f"checkpoint.save={tmp_path}")))
    assert result.iterations == 1
    assert any("stale lock" in r.getMessage() and f"pid {pid}" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / LOCK_NAME).exists()  # released at the end


def test_lock_is_released_when_the_run_raises(tmp_path):
    from graphstep.training.loop import RunHooks

    def broken(iteration: int) -> None:
        raise RuntimeError(f"broken at iteration {iteration}")

    with pytest.raises(RuntimeError, match="broken at iteration 1"):
        train(eager(tiny_config("train.train_iters=1", f"checkpoint.save={tmp_path}")),
              hooks=RunHooks(after_iteration=broken))
    assert not (tmp_path / LOCK_NAME).exists()
    with RunLock([tmp_path]):  # free again
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()


# --------------------------------------------------------------------------
# 5. memory estimate before building


@pytest.mark.parametrize("recipe", ["llama3_tiny", "qwen3_moe_tiny", "nemotron_h_tiny"])
def test_estimate_counts_the_parameters_of_the_built_model_exactly(recipe):
    from graphstep.models import build_model

    cfg = tiny_config(recipe=recipe)
    model = build_model(cfg.model, torch.device("cpu"))
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() for b in model.buffers())
    assert count_parameters(cfg) == (params, buffers)
    est = estimate_memory(cfg, torch.device("cpu"))  # fp32 on the CPU: the weights are their own master copy
    assert (est.weights, est.gradients, est.optimizer) == ((params + buffers) * 4, params * 4, params * 8)
    cfg.model.params_dtype = "bf16"
    est16 = estimate_memory(cfg, torch.device("cpu"))
    assert (est16.weights, est16.optimizer) == ((params + buffers) * 2, params * 12)  # + fp32 master
    assert est16.activations_per_sample < est.activations_per_sample


def test_run_that_does_not_fit_is_refused_with_what_would(monkeypatch):
    from graphstep.training import memory

    # 8 layers: FSDP2 ZeRO-3 keeps two layers and the root gathered, so sharding must have layers to spare
    cfg = eager(tiny_config("train.train_iters=1", "model.num_layers=8"))
    est = estimate_memory(cfg, torch.device("cpu"))
    assert est.micro_batch_size == 2
    free = int((est.static + 1.5 * est.activations_per_sample) / memory.HEADROOM)  # room for 1 sample, not 2
    monkeypatch.setattr(memory, "available_memory", lambda device: free)
    with pytest.raises(RunSetupError, match=r"needs about .* fp32 gradients .* train.micro_batch_size=1 would fit"):
        train(cfg)
    monkeypatch.setattr(memory, "available_memory", lambda device: est.static // 2)
    with pytest.raises(RunSetupError, match=r"optimizer state alone need .*_sharding_strategy=optim_grads_params"):
        check_memory_fits(cfg, torch.device("cpu"))
    monkeypatch.setattr(memory, "available_memory", lambda device: est.total * 2)
    assert check_memory_fits(cfg, torch.device("cpu")) == est


@pytest.mark.slow
@pytest.mark.skipif(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") > 200 * GiB,
                    reason="this machine could hold llama3_8b")
def test_llama3_8b_on_a_small_machine_exits_2_before_building():
    cmd = [sys.executable, "-m", "graphstep", "train", "--recipe", "llama3_8b", "train.device=cpu",
           "logger.metrics_path=null", "logger.progress_bar=false"]
    start = time.time()
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert_one_line_exit_2(proc, "needs about", "RAM available", "8.03B parameters", "weights", "activations")
    assert time.time() - start < 60


# --------------------------------------------------------------------------
# 6. no GPU


def test_device_cuda_without_a_gpu_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RunSetupError) as info:
        pick_device("cuda")
    assert str(info.value) == ("train.device=cuda but this machine has no CUDA device; "
                               "use train.device=cpu or auto")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_exits_2(tmp_path):
    proc = run_train("train.train_iters=4", "train.device=cuda", "logger.metrics_path=null", cwd=tmp_path)
    assert_one_line_exit_2(proc, "train.device=cuda but this machine has no CUDA device")


# --------------------------------------------------------------------------
# on a GPU


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_memory_check_refuses_llama3_8b_and_passes_a_small_model():
    from graphstep.recipes import get_recipe

    device = torch.device("cuda", torch.cuda.current_device())
    free, _ = torch.cuda.mem_get_info(device)
    big = get_recipe("llama3_8b")
    est = estimate_memory(big, device)  # bf16 weights, fp32 grads, master, m and v: 16 bytes + 2 per parameter
    assert est.weights >= est.parameters * 2 and est.optimizer == est.parameters * 12
    if est.total > 0.95 * free:
        with pytest.raises(RunSetupError, match="GPU memory free"):
            check_memory_fits(big, device)
    small = tiny_config("train.device=cuda")
    assert check_memory_fits(small, device) is not None
