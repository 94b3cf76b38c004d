"""``graphstep`` as a subprocess: a command line that fails, a tiny training run, one killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import graphstep
from helpers.runs import TINY

from .launch import subprocess_env

SRC = Path(graphstep.__file__).resolve().parents[1]
QUICK_TRAIN = ["train.train_iters=1", "train.eval_iters=0", "logger.progress_bar=false", "logger.metrics_path=null",
               "data.corpus_max_bytes=200000"]
QUICK_TRAIN += ["model.cuda_graph_impl=none"]  # one iteration is shorter than any graph warm-up (V19)


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m graphstep ARGS`` in ``cwd`` (the memory check off)."""
    env = dict(os.environ, PYTHONPATH=str(SRC), GRAPHSTEP_SKIP_MEMORY_CHECK="1")
    return subprocess.run([sys.executable, "-m", "graphstep", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit code 2, one ``graphstep ...:`` error line holding every needle, and no traceback."""
    both = proc.stdout + proc.stderr
    assert "Traceback" not in both, both[-3000:]
    assert proc.returncode == 2, both[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("graphstep ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def run_train(*overrides: str, **env: str) -> subprocess.CompletedProcess:
    """``graphstep train`` on conftest's tiny llama and ``overrides``."""
    cmd = [sys.executable, "-m", "graphstep", "train", *TINY, *overrides]
    return subprocess.run(cmd, env=subprocess_env(**env), capture_output=True, text=True, timeout=120)


def killed_at(iteration: int, *overrides: str, hook: str = "after_iteration") -> str:
    """Train with ``graphstep train``'s config of ``overrides``; the ``hook`` of iteration N SIGKILLs the process."""
    cmd = [sys.executable, "-m", "helpers.kill_driver", hook, str(iteration), *TINY, *overrides]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-4000:]
    return proc.stderr
