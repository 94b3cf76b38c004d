"""The tests' launch helper (helpers/launch.py): a launch past its timeout is killed with every process it
started, so that a hung torchrun rank never outlives its test."""

from __future__ import annotations

import os
import time

import pytest

from helpers.launch import run_group


def test_a_launch_past_its_timeout_is_killed_with_the_processes_it_started(tmp_path):
    # a launcher that starts a child and waits on it, as torchrun does with its ranks
    script = f"sleep 120 & echo $! > {tmp_path / 'child'}; echo started; wait"
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"did not end within 2 s; killed with its processes\nstarted"):
        run_group(["bash", "-c", script], timeout=2, cwd=tmp_path)
    assert time.monotonic() - start < 30
    child = int((tmp_path / "child").read_text())
    for _ in range(50):  # the kill is delivered at once; reaping by init may take a moment
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":  # a zombie: dead, not yet reaped
                break
        time.sleep(0.1)
    else:
        pytest.fail(f"the launcher's child {child} outlived the timeout")


def test_a_launch_within_its_timeout_returns_its_output_and_exit_status(tmp_path):
    proc = run_group(["bash", "-c", "echo out; echo err >&2; exit 3"], timeout=30, cwd=tmp_path)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out\n", "err\n")


def failing_worker(out: str) -> None:
    """A torchrun worker whose rank 0 fails with a message of its own while rank 1 fails with a long traceback."""
    import os

    if os.environ["RANK"] == "0":
        raise SystemExit("rank 0's own reason")
    raise RuntimeError("x" * 20000)


def test_a_failed_launch_shows_the_end_of_every_rank_s_output(tmp_path):
    from helpers.launch import torchrun_reports

    with pytest.raises(AssertionError) as failed:
        torchrun_reports(__file__, "failing_worker", tmp_path, 2, timeout=120)
    assert "--- rank 0 " in str(failed.value) and "rank 0's own reason" in str(failed.value)
    assert "--- rank 1 " in str(failed.value)
