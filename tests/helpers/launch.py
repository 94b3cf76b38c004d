"""Subprocesses and torchrun launches of the tests, and the per-rank reports their workers write."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a test's subprocess: graphstep's sources and the tests' helpers importable, one thread."""
    env = dict(os.environ)
    env.update(PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{TESTS}", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    env.update(extra)
    return env


def torchrun(nproc: int, *args: str) -> list[str]:
    """``torchrun --standalone`` (a free port picked by torchrun's own rendezvous) as a command line."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


def worker(test_file: str | Path, function: str, *args: Any) -> list[str]:
    """The arguments that run ``function(*args)`` of ``test_file`` in a fresh process (helpers/worker.py)."""
    return ["-m", "helpers.worker", f"{Path(test_file).resolve()}::{function}", *map(str, args)]


def torchrun_reports(test_file: str | Path, function: str, tmp: Path, nproc: int, *args: Any,
                     timeout: float) -> list[dict]:
    """``function(tmp, *args)`` of ``test_file`` on ``nproc`` torchrun ranks; each rank's ``tmp/rank<r>.json``.
    Each rank's output is also kept in its own file (torchrun's ``--log-dir``/``--tee``), so that a failure shows
    the end of every rank's, not only of the last rank to fail. On the CPU the ranks are forked by torchrun's
    launcher from a process that imported torch and graphstep once (helpers/fork_launch.py); a launch with a
    ``"cuda"`` argument runs the command-line torchrun, each rank a fresh process."""
    logs = Path(tmp) / "torchrun-logs"
    if "cuda" in map(str, args):
        cmd = torchrun(nproc, f"--log-dir={logs}", "--tee=3", *worker(test_file, function, tmp, *args))
    else:
        target = f"{Path(test_file).resolve()}::{function}"
        cmd = [sys.executable, "-m", "helpers.fork_launch", str(nproc), str(logs), target, str(tmp), *map(str, args)]
    proc = run_group(cmd, timeout=timeout, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:] + rank_logs(logs)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(nproc)]


def rank_logs(logs: Path, chars: int = 1500) -> str:
    """The end of each rank's stderr under torchrun's ``--log-dir`` ``logs`` (``<run>/attempt_<n>/<rank>/``)."""
    out = []
    for path in sorted(logs.glob("*/attempt_*/*/stderr.log"), key=lambda p: (p.parent.parent.name, int(p.parent.name))):
        out.append(f"\n--- rank {path.parent.name} ({path.parent.parent.name}), stderr ---\n"
                   f"{path.read_text(errors='replace')[-chars:]}")
    return "".join(out)


def run_group(cmd: list[str], *, timeout: float, cwd: Path, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess:
    """``cmd`` in a session of its own, its output captured (default outputs land in ``cwd``). Past ``timeout``
    the whole session is killed -- torchrun and every rank it started, not the launcher alone -- and the test fails
    with the output so far: a hung rank never outlives its test."""
    proc = subprocess.Popen(cmd, env=env if env is not None else subprocess_env(), cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd[:6])} ... did not end within {timeout:.0f} s; killed with its "
                             f"processes\n{out[-4000:]}{err[-8000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def report_runs(out: Path, device: str, runs: dict[str, Any], run: Callable[[Any], dict]) -> None:
    """A torchrun worker's body: join the group, ``run(spec)`` for each named run, and write this rank's reports
    to ``out/rank<r>.json`` (also when a run fails, so the test shows what came before)."""
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")  # train() uses the caller's group
    report: dict[str, dict] = {}
    try:
        for name, spec in runs.items():
            report[name] = run(spec)
    finally:
        (Path(out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


def param_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def exact_list(values: list) -> list[int]:
    """float32 values as their bit patterns: lists equal only when every value is bit-identical."""
    return [torch.tensor(v, dtype=torch.float32).view(torch.int32).item() for v in values]
