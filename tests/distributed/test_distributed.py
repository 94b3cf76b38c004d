"""Data parallel with 2 gloo processes under torchrun, on the CPU replay backend.

One torchrun launch runs this file as its worker (``__main__`` below): each
rank trains several configurations in one process group and writes its
per-iteration losses and a digest of its final parameters. The tests then
check: graphed runs equal the eager run bit for bit, every rank holds the
same losses and weights, and 2 ranks x 2 micro-batches equal 1 process x 4
micro-batches within fp32 rounding. Dropout is off here: Megatron's seeding
gives every data-parallel rank the same dropout stream, so with dropout on the
2-rank run draws other masks than the single process does.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest
import torch

from helpers.launch import exact_list, param_digest, report_runs, subprocess_env, torchrun, torchrun_reports
from helpers.reports import graphed_states

pytestmark = pytest.mark.slow

ITERS = 4

# name -> overrides on top of helpers.runs.TINY (dropout off, see the module docstring)
DP_RUNS = {
    "eager": ["model.cuda_graph_impl=none"],
    "full_iteration": ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"],
    "attn_mlp": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"],
}
COMMON = ["model.attention_dropout=0.0", "model.hidden_dropout=0.0", "logger.log_interval=1"]
# the CPU runs: one warm-up iteration, captured at 2, replayed at 3 and 4; an evaluation after each iteration (the
# last one at the end): the evaluation graph warms up at 1, captures at 2 and replays at 3 and 4
CPU_SCHEDULE = [f"train.train_iters={ITERS}", "model.cuda_graph_warmup_steps=1", "train.eval_iters=1",
                "train.eval_interval=1"]
CPU_RUNS = {name: [*overrides, *CPU_SCHEDULE] for name, overrides in DP_RUNS.items()}


# --------------------------------------------------------------------------
# the torchrun worker


def dp_worker(out: str, device: str, runs: str) -> None:
    """The torchrun worker: each run of ``runs`` (JSON: name -> overrides), then the resume case."""
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    def run(overrides: list[str]) -> dict:
        if overrides == "resume":
            return _resume_case(Path(out), device)
        t0 = time.perf_counter()
        result = train(tiny_config(*COMMON, f"train.device={device}", *overrides), keep_model=True)
        return {"losses": [r["loss"] for r in result.rows], "states": [r["state"] for r in result.rows],
                "eval": result.eval_losses, "step_ms": [r["step_ms"] for r in result.rows],
                "params": param_digest(result.model), "seconds": time.perf_counter() - t0}

    report_runs(Path(out), device, {**json.loads(runs), "resume": "resume"}, run)


def _resume_case(out: Path, device: str) -> dict:
    """2 ranks: save at iteration 3 (after the first replay), resume from it; iterations 4 and 5 (warm-up and
    capture) must equal the uninterrupted run's."""
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    ckpt = out / "ckpt"
    base = [f"train.device={device}", "model.cuda_graph_impl=full_iteration", "train.train_iters=5",
            "logger.log_interval=1", "model.cuda_graph_warmup_steps=1", f"checkpoint.save={ckpt}",
            "checkpoint.save_interval=3"]
    whole = train(tiny_config(*base))  # dropout on: per-rank RNG streams are in the checkpoint
    resumed = train(tiny_config(*base, f"checkpoint.load={ckpt}/iter_0000003"))
    return {"whole": [r["loss"] for r in whole.rows], "resumed": [r["loss"] for r in resumed.rows],
            "resumed_iters": [r["iteration"] for r in resumed.rows]}


def run_workers(tmp: Path, device: str, runs: dict[str, list[str]], timeout: float) -> list[dict]:
    """2 ranks of this file's worker; each rank's report."""
    return torchrun_reports(__file__, "dp_worker", tmp, 2, device, json.dumps(runs), timeout=timeout)


# --------------------------------------------------------------------------
# tests


@pytest.fixture(scope="module")
def dp_reports(tmp_path_factory):
    return run_workers(tmp_path_factory.mktemp("dp"), "cpu", CPU_RUNS, timeout=240)


@pytest.fixture(scope="module")
def single_process():
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    return train(tiny_config(*COMMON, *CPU_SCHEDULE, "model.cuda_graph_impl=none"))


@pytest.mark.parametrize("name", ["full_iteration", "attn_mlp"])
def test_graphed_data_parallel_equals_eager_bit_for_bit(dp_reports, name):
    for report in dp_reports:
        run, eager = report[name], report["eager"]
        assert len(run["losses"]) == ITERS
        assert exact_list(run["losses"]) == exact_list(eager["losses"])
        assert run["params"] == eager["params"]
        assert len(run["eval"]) == ITERS and run["eval"] == eager["eval"]  # the eval graph holds the loss all-reduce
        assert run["states"] == graphed_states(ITERS)


@pytest.mark.parametrize("name", list(DP_RUNS))
def test_ranks_agree_on_losses_and_weights(dp_reports, name):
    r0, r1 = dp_reports[0][name], dp_reports[1][name]
    assert r0["losses"] == r1["losses"]  # the logged loss is the all-reduced average
    assert r0["eval"] == r1["eval"]
    assert r0["params"] == r1["params"]  # every rank applied the same averaged gradients


@pytest.mark.parametrize("name", list(DP_RUNS))
def test_two_ranks_equal_one_process_with_the_same_global_batch(dp_reports, single_process, name):
    two = torch.tensor(dp_reports[0][name]["losses"], dtype=torch.float32)
    one = torch.tensor(single_process.losses, dtype=torch.float32)
    assert two.shape == one.shape == (ITERS,)
    torch.testing.assert_close(two, one, rtol=2e-6, atol=0)  # only the summation order differs
    assert one[-1] < one[0]


def test_data_parallel_resume_is_exact(dp_reports):
    case = dp_reports[0]["resume"]
    assert case["resumed_iters"] == [4, 5] and len(case["whole"]) == 5
    assert exact_list(case["resumed"]) == exact_list(case["whole"][3:])
    assert dp_reports[1]["resume"] == case


def test_sigterm_stops_every_rank_after_the_same_step_and_exits_without_hang(tmp_path):
    from graphstep.training.metrics import read_metrics

    metrics = tmp_path / "metrics.jsonl"
    overrides = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.seq_length=32",
                 "train.micro_batch_size=2", "train.global_batch_size=8", "train.eval_iters=0", "train.device=cpu",
                 "logger.progress_bar=false", "data.corpus_max_bytes=300000", "data.split=90,10,0",
                 "model.cuda_graph_impl=full_iteration", "model.cuda_graph_warmup_steps=1",
                 "train.train_iters=100000", "logger.log_interval=1",
                 f"logger.metrics_path={metrics}"]
    proc = subprocess.Popen(torchrun(2, "-m", "graphstep", "train", *overrides), env=subprocess_env(), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # how long the two ranks take to start is not under test (two suites and a training run at once on 2
        # cores took over a minute); stopping once they train is
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # past the capture (at 2)
            assert proc.poll() is None, f"training ended before the signal:\n{proc.communicate()[0][-3000:]}"
            assert time.monotonic() < deadline, "training did not start within 300 s"
            time.sleep(0.1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to both workers
        output, _ = proc.communicate(timeout=25)  # torchrun would SIGKILL hung workers after 30 s
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "received SIGTERM: stopping after the current step" in output
    assert "rank 1: received SIGTERM" in output
    assert "stopped by signal" in output  # rank 0's summary: the loop ended through the stop flag
    assert "process group destroyed (after every graph was freed)" in output
    assert "forcefully exiting" not in output and "graphstep/training" not in output  # no hang, no worker traceback
    rows = read_metrics(metrics)
    assert [r["iteration"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) < 100000
    print(f"SIGTERM to exit: {elapsed:.1f} s, stopped after iteration {rows[-1]['iteration']}")


@pytest.mark.parametrize("how", ["normal", "exception", "sigterm"])
def test_graphs_are_freed_before_the_process_group_is_destroyed(monkeypatch, how):
    from helpers.runs import tiny_config
    from graphstep.training import graphs as run_graphs, loop
    from graphstep.training.distributed import DataParallel

    events: list[str] = []
    graphs: list = []  # the run's captured graphs, seen just before it closes them

    class Recorded(DataParallel):
        def close(self) -> None:
            live = sum(g.captured for g in graphs)
            events.append(f"process group destroyed; {len(graphs)} graphs of the run, still captured: {live}")

    real_close = run_graphs.Runner.close

    def close(self) -> None:
        graphs.extend(self.backend.live_graphs())
        real_close(self)
        events.append("graphs closed")

    def fail_at_3(iteration: int) -> None:  # after iteration 3: the graphs were captured at 2, replayed at 3
        if iteration == 3 and how == "exception":
            raise RuntimeError("boom")
        if iteration == 3 and how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(loop, "init_data_parallel", lambda cfg, settings: Recorded())
    monkeypatch.setattr(run_graphs.Runner, "close", close)
    cfg = tiny_config("model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true",
                      "model.cuda_graph_warmup_steps=1", "train.train_iters=4")
    hooks = loop.RunHooks(after_iteration=fail_at_3)
    if how == "exception":
        with pytest.raises(RuntimeError, match="boom"):
            loop.train(cfg, hooks=hooks)
    else:
        result = loop.train(cfg, hooks=hooks)
        assert result.stopped_by_signal == (how == "sigterm")
    assert events == ["graphs closed", "process group destroyed; 2 graphs of the run, still captured: 0"]


def test_grad_reducer_buckets_are_views_of_the_flat_buffer():
    from graphstep.parallel.data_parallel import GradReducer

    flat = torch.arange(10, dtype=torch.float32)
    reducer = GradReducer(flat, 2, bucket_size=4, backend="gloo")
    assert [b.numel() for b in reducer.buckets] == [4, 4, 2]
    assert all(b.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for b in reducer.buckets)
    assert reducer.op == torch.distributed.ReduceOp.SUM  # gloo has no AVG: pre-divide
    assert GradReducer(flat, 2, average_in_collective=True, backend="nccl").op == torch.distributed.ReduceOp.AVG
    assert len(GradReducer(flat, 2).buckets) == 1  # default 40M elements


def test_collective_env_checks():
    from graphstep.validation import resolve_cuda_graph_settings
    from graphstep.training.distributed import check_collective_env

    from helpers.runs import tiny_config

    full = resolve_cuda_graph_settings(tiny_config("model.cuda_graph_impl=full_iteration"))
    layers = resolve_cuda_graph_settings(tiny_config("model.cuda_graph_impl=local",
                                                     "model.cuda_graph_modules=[attn,mlp]"))
    assert check_collective_env("gloo", full, 2) == []
    assert check_collective_env("nccl", layers, 2) == []  # per-layer graphs: the reduction runs eagerly
    notes = check_collective_env("nccl", full, 2)
    assert any("warmed up with one all-reduce before any capture" in n for n in notes)
    assert any("not tracked by the NCCL watchdog" in n for n in notes)


def test_r16_stops_a_data_parallel_nccl_run_before_the_process_group_exists():
    from graphstep.validation import ConfigValidationError, resolve_cuda_graph_settings

    from helpers.runs import tiny_config

    cfg = tiny_config("model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[attn]",
                      "train.device=cuda")
    env = {"WORLD_SIZE": "2", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    with pytest.raises(ConfigValidationError, match="R16.*NCCL_GRAPH_REGISTER=0"):
        resolve_cuda_graph_settings(cfg, env=env)
    resolve_cuda_graph_settings(tiny_config("model.cuda_graph_impl=transformer_engine",
                                            "model.cuda_graph_modules=[attn]", "train.device=cuda"),
                                env={**env, "NCCL_GRAPH_REGISTER": "0"})


GPU_ITERS = 30
GPU_RUNS = {name: [*overrides, f"train.train_iters={GPU_ITERS}", "train.eval_iters=2", "train.eval_interval=4"]
            for name, overrides in DP_RUNS.items()}


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_graphs_equal_eager_and_exit_without_hang(tmp_path, capsys):
    reports = run_workers(tmp_path, "cuda", GPU_RUNS, timeout=600)  # a hang at exit fails here
    for report in reports:
        for name in ("full_iteration", "attn_mlp"):
            assert exact_list(report[name]["losses"]) == exact_list(report["eager"]["losses"]), name
            assert report[name]["params"] == report["eager"]["params"], name
            assert report[name]["states"][2:5] == ["eager", "captured", "replayed"], name
        resume = report["resume"]
        assert resume["resumed_iters"] == [4, 5]
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
