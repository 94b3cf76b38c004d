"""``graphstep`` on a command line: in this process or a subprocess, a command line that fails, a tiny training
run, one killed with SIGKILL."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from unittest import mock

import graphstep
from helpers.runs import TINY

from .launch import subprocess_env

SRC = Path(graphstep.__file__).resolve().parents[1]
QUICK_TRAIN = ["train.train_iters=1", "train.eval_iters=0", "logger.progress_bar=false", "logger.metrics_path=null",
               "data.corpus_max_bytes=200000"]
QUICK_TRAIN += ["model.cuda_graph_impl=none"]  # one iteration is shorter than any graph warm-up (V19)


def run_cli(*args: str, cwd: Path, in_process: bool = True) -> subprocess.CompletedProcess:
    """``graphstep ARGS`` in ``cwd`` (the memory check off), as ``python -m graphstep`` would end.

    By default ``graphstep.cli.main`` runs in this process (a Python start with torch costs seconds, the command
    itself milliseconds): its exit code, stdout and stderr, and an escaping exception printed as the interpreter
    prints it (a traceback, exit 1). ``in_process=False`` starts ``python -m graphstep``
    (``test_user_errors.py`` checks that both give the same result).
    """
    if not in_process:
        env = dict(os.environ, PYTHONPATH=str(SRC), GRAPHSTEP_SKIP_MEMORY_CHECK="1")
        return subprocess.run([sys.executable, "-m", "graphstep", *args], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=600)
    from graphstep.cli import main

    out, err = io.StringIO(), io.StringIO()
    logger = logging.getLogger("graphstep")
    saved = logger.handlers[:], logger.level, logger.propagate
    logger.handlers.clear()  # setup_logging binds a new handler to this command's stderr
    try:
        with mock.patch.dict(os.environ, GRAPHSTEP_SKIP_MEMORY_CHECK="1"), contextlib.chdir(cwd), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:
                code = exc.code
            except BaseException:  # what the interpreter does with an exception that reaches the top
                traceback.print_exc()
                code = 1
            if isinstance(code, str):
                print(code, file=sys.stderr)
                code = 1
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    return subprocess.CompletedProcess(["graphstep", *args], code or 0, out.getvalue(), err.getvalue())


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


def run_train(*overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    """``graphstep train`` on the tiny llama and ``overrides``, in ``cwd``, in this process (``run_cli``)."""
    return run_cli("train", *TINY, *overrides, cwd=cwd)


def killed_at(iteration: int, *overrides: str, hook: str = "after_iteration") -> str:
    """Train with ``graphstep train``'s config of ``overrides``; the ``hook`` of iteration N SIGKILLs the process."""
    cmd = [sys.executable, "-m", "helpers.kill_driver", hook, str(iteration), *TINY, *overrides]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-4000:]
    return proc.stderr
