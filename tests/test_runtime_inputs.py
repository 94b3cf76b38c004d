"""Bad inputs found at run time: one line naming the field or file and the fix, exit code 2, nothing lost.

Output folders TensorBoard and W&B cannot write (found by the trainer's preflight, before the run is
built), ``train.device=cuda`` under torchrun without a GPU, ``scripts/gpu-check`` without a GPU, checkpoints
that do not fit the run (another model, nothing left to train, a file), ``export_hf`` over existing
files, ``graphstep doctor --full-size`` of a model the host cannot hold -- and the tests themselves,
which must not write into the checkout. The command-line cases run ``python -m graphstep`` as a user would
(tests/test_user_errors.py's helpers); the others call the functions.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from graphstep.config import ConfigError, ModelConfig
from graphstep.training.checkpoint_verify import CheckpointError
from test_distributed import subprocess_env, torchrun
from test_user_errors import QUICK_TRAIN, SRC, assert_one_line_error, run_cli

ROOT = Path(__file__).resolve().parents[1]
TINY_SHAPE = ["model.hidden_size=64", "model.ffn_hidden_size=128", "model.seq_length=32",
              "train.micro_batch_size=2", "train.global_batch_size=4", "train.device=cpu"]


def _graphstep_frames(output: str) -> list[str]:
    """Traceback frames inside graphstep's own code (a launcher's traceback, e.g. torchrun's, is not ours)."""
    return [line for line in output.splitlines() if line.strip().startswith("File ") and str(SRC / "graphstep") in line]


# --------------------------------------------------------------------------
# 1. TensorBoard and W&B folders: the preflight of training/rundir.py


@pytest.mark.parametrize("field", ["logger.tensorboard_dir", "logger.wandb_save_dir"])
def test_preflight_checks_the_tensorboard_and_wandb_folders(tmp_path, field):
    from graphstep.training.rundir import RunSetupError, check_outputs_writable

    (tmp_path / "afile").write_text("x")
    cases = {"/proc/graphstep-test": "cannot be created there", str(tmp_path / "afile"): "afile is a file",
             str(tmp_path / "afile" / "below"): "afile is a file"}
    for path, why in cases.items():
        cfg = tiny_config(f"{field}={path}", "logger.wandb_project=p")
        with pytest.raises(RunSetupError) as err:
            check_outputs_writable(cfg)
        message = str(err.value)
        assert message.startswith(f"{field}={path}: ") and why in message, message
        assert f"choose another path for {field}" in message and "\n" not in message
    ok = tiny_config(f"{field}={tmp_path / 'new' / 'folder'}", "logger.wandb_project=p")
    check_outputs_writable(ok)  # created, probed, left empty
    assert list((tmp_path / "new" / "folder").iterdir()) == []
    check_outputs_writable(ok, metrics=False)  # other ranks write neither


def test_wandb_folder_is_not_checked_without_a_project(tmp_path):
    from graphstep.training.rundir import check_outputs_writable

    check_outputs_writable(tiny_config("logger.wandb_save_dir=/proc/graphstep-test"))  # nothing will write there


@pytest.mark.slow
def test_unwritable_tensorboard_dir_is_one_line_before_the_run(tmp_path):
    (tmp_path / "afile").write_text("x")
    proc = run_cli("train", *QUICK_TRAIN, "logger.tensorboard_dir=/proc/tb", cwd=tmp_path)
    assert_one_line_error(proc, "logger.tensorboard_dir=/proc/tb", "choose another path for logger.tensorboard_dir")
    proc = run_cli("train", *QUICK_TRAIN, "logger.tensorboard_dir=afile", cwd=tmp_path)
    assert_one_line_error(proc, "logger.tensorboard_dir=afile", "afile is a file, not a directory")
    assert "replay backend" not in proc.stderr  # refused before the run was built (its graphs set up)


@pytest.mark.slow
def test_unwritable_wandb_save_dir_is_one_line_before_the_run(tmp_path):
    pytest.importorskip("wandb", reason="the wandb package is not installed")
    proc = run_cli("train", *QUICK_TRAIN, "logger.wandb_project=p", "logger.wandb_save_dir=/proc/wb", cwd=tmp_path)
    assert_one_line_error(proc, "logger.wandb_save_dir=/proc/wb", "choose another path for logger.wandb_save_dir")


# --------------------------------------------------------------------------
# 2. train.device=cuda under torchrun on a machine without a GPU


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_device_under_torchrun_without_a_gpu_is_one_line_per_rank(tmp_path):
    cmd = torchrun(2, "-m", "graphstep", "train", "train.device=cuda", *QUICK_TRAIN)
    proc = subprocess.run(cmd, env=subprocess_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert not _graphstep_frames(output), output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("graphstep train:")]
    assert 1 <= len(lines) <= 2 and len(set(lines)) == 1, output[-3000:]  # every rank that got there says the same
    assert lines[0] == ("graphstep train: train.device=cuda but this machine has no CUDA device; "
                        "use train.device=cpu or auto")
    assert re.search(r"exitcode\s*: 2\b", output), output[-3000:]  # torchrun's summary: the worker exited 2


# --------------------------------------------------------------------------
# 3. scripts/gpu-check on a machine without a GPU


def _can_run_scripts() -> bool:
    """scripts/bootstrap.sh reuses this Python when it has these modules (else it would build a .venv)."""
    return all(importlib.util.find_spec(m) for m in ("torch", "numpy", "yaml", "rich", "pytest", "hypothesis"))


def _gpu_check(out: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    clean.update(GRAPHSTEP_PYTHON=sys.executable, OUT=str(out), **env)
    clean.pop("GRAPHSTEP_FORCE_VENV", None)
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check")], env=clean, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.skipif(not _can_run_scripts(), reason="scripts/bootstrap.sh would build a virtual environment")
def test_gpu_check_without_a_gpu_says_so_and_fails(tmp_path):
    proc = _gpu_check(tmp_path / "out")
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2, output[-3000:]
    assert "Traceback" not in output and len(output.splitlines()) == 1, output[-3000:]
    assert output.startswith("scripts/gpu-check: no CUDA device is visible") and "a machine with a GPU" in output
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written


@pytest.mark.cuda
@pytest.mark.skipif(not _can_run_scripts(), reason="scripts/bootstrap.sh would build a virtual environment")
def test_gpu_check_on_a_gpu_goes_on_past_the_device_check(tmp_path):
    """On a GPU the script runs as before (here without its tests and benchmarks: they are what runs this)."""
    proc = _gpu_check(tmp_path / "out", GPU_CHECK_TESTS="0", GPU_CHECK_BENCH=" ")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "no CUDA device" not in output and "gpu-check summary" in output
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert torch.cuda.get_device_name(0) in summary
