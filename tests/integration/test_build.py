"""One build of a run (training/build.py), owned graphs, run hooks and the device-side NaN check.

* the trainer, the doctor and the bench build their run with ``build_run``:
  the bench's iteration gives the trainer's losses bit for bit, and every
  caller seeds the RNG tracker as ``model.use_te_rng_tracker`` says;
* a run owns its graphs: two ``train()`` calls in one process report the same
  capture counts, and a graph made outside a run still replays (without a new
  capture) after the run closed;
* graphs holding collectives meet the other ranks before their capture, once;
* ``RunHooks`` are called with every iteration and inside every save;
* a step's first gradients are copied into the fp32 buffers (no zeroing pass) where only the buffers' hooks
  write them -- eager and the full-iteration graph, not per-layer graphs -- with the zeroed buffers' losses and
  parameters bit for bit;
* ``train.check_for_nan_on_device``: on, a poisoned step is flagged (and
  skipped with ``skip_step_on_nan``); off, no device flag exists and nothing
  is skipped -- with the full-iteration and optimizer graphs captured either way.
"""

from __future__ import annotations

import pytest
import torch

import graphstep
from helpers.runs import assert_same_run, eager, poison_iteration, tiny_config
from graphstep.config import ConfigError
from graphstep.cuda_graph.registry import get_backend
from graphstep.data import build_data
from graphstep.training import build as build_mod
from graphstep.training.build import RunOptions, build_run
from graphstep.training.distributed import DataParallel
from graphstep.training.loop import RunHooks, train

CPU = torch.device("cpu")
FULL = ["model.cuda_graph_impl=full_iteration"]
LAYERS = ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"]


# --------------------------------------------------------------------------
# a run owns, counts and closes its graphs


@pytest.mark.slow
@pytest.mark.parametrize("graphs, captured", [(FULL, 1), (LAYERS, 2)], ids=["full_iteration", "attn_mlp"])
def test_two_runs_in_one_process_each_count_their_own_graphs(graphs, captured):
    """full iteration: the training graph (no evaluation); per-layer: a forward and a backward graph, the 2 layers'
    attn and mlp one run replayed as one graph (cuda_graph/chains.py)."""
    first = train(tiny_config(*graphs, "train.train_iters=5"))
    second = train(tiny_config(*graphs, "train.train_iters=5"))
    assert (first.graphs, second.graphs) == (captured, captured)
    assert first.capture_seconds > 0 and second.capture_seconds > 0
    assert [r["state"] for r in second.rows] == ["eager"] * 3 + ["captured", "replayed"]
    assert first.losses == second.losses  # the same run twice


def test_graph_made_outside_a_run_still_replays_after_the_run_closed():
    w = torch.arange(8, dtype=torch.float32)
    outside = graphstep.graph_step(lambda x: (w * x).sum() + 1.0, warmup_steps=0, device="cpu")
    outside(torch.ones(8))
    assert outside.state == "captured"
    train(tiny_config(*FULL, "optimizer.optimizer_cuda_graph=true", "train.train_iters=5"))  # captures and closes
    x = torch.linspace(-1.0, 1.0, 8)
    out = outside(x)
    assert outside.state == "replayed"  # the same graph, not a new capture
    assert torch.equal(out, (w * x).sum() + 1.0)


def test_run_close_resets_its_graphs_and_only_them():
    outside = graphstep.graph_step(lambda x: x * 2.0, warmup_steps=0, device="cpu")
    outside(torch.ones(4))
    cfg = tiny_config(*FULL, "optimizer.optimizer_cuda_graph=true", "model.cuda_graph_warmup_steps=1")
    run = build_run(cfg, RunOptions(CPU))
    data = build_data(cfg, split="train")
    for _ in range(3):
        run.iteration(data)
    mine = run.runner.backend.live_graphs()
    assert sorted(g.name for g in mine) == ["optimizer", "train"]
    assert [r.name for r in run.runner.reports] == ["train", "optimizer"]
    run.close()
    run.close()  # harmless twice
    assert not any(g.captured for g in mine)
    assert outside.graph.captured and get_backend("cpu").live_graphs() == [outside.graph]
    assert torch.equal(outside(torch.full((4,), 3.0)), torch.full((4,), 6.0)) and outside.state == "replayed"


# --------------------------------------------------------------------------
# the gradient buffers: overwritten by a step's first gradients where nothing else writes them


@pytest.mark.parametrize("graphs, overwrites", [([], True), (FULL, True), (LAYERS, False)],
                         ids=["eager", "full_iteration", "attn_mlp"])
def test_the_trainer_overwrites_the_gradient_buffers_where_only_their_hooks_write_them(graphs, overwrites):
    """Overwritten where only the buffers' hooks write them; and the run, closed and dropped, leaves nothing
    alive: a hook reaching its own parameter would keep the model and the gradient buffers (autograd holds hooks
    where the garbage collector does not look)."""
    import gc
    import weakref

    run = build_run(tiny_config(*graphs), RunOptions(CPU))
    assert (run.grads._first is not None) is overwrites  # per-layer graphs add into main_grad in their backward
    run.iteration(build_data(run.cfg, split="train"))
    param, grads = weakref.ref(next(run.model.parameters())), weakref.ref(run.grads)
    run.close()
    del run
    gc.collect()
    assert param() is None and grads() is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.slow
def test_overwritten_gradient_buffers_train_as_the_zeroed_ones_bit_for_bit(monkeypatch, device):
    """4 micro-batches a step, the full-iteration and optimizer graphs captured (CUDA graphs, or the replay
    backend on the CPU)."""
    overrides = [*FULL, "optimizer.optimizer_cuda_graph=true", "train.train_iters=6", f"train.device={device}"]
    overwritten = train(tiny_config(*overrides), keep_model=True)
    monkeypatch.setattr(build_mod, "_overwrites_gradients", lambda *args: False)
    zeroed = train(tiny_config(*overrides), keep_model=True)
    assert [r["state"] for r in overwritten.rows][3:5] == ["captured", "replayed"]
    assert_same_run(overwritten, zeroed)


# --------------------------------------------------------------------------
# the trainer, the doctor and the bench build the same run


@pytest.mark.slow
def test_bench_iteration_equals_the_trainer_bit_for_bit():
    from graphstep.bench.harness import graphstep_row

    overrides = [*FULL, "optimizer.optimizer_cuda_graph=true", "train.train_iters=4"]  # the LR schedule's length
    trained = train(tiny_config(*overrides))
    step, workload, owner = graphstep_row(tiny_config(*overrides), CPU)
    data = workload.data()  # 4 iterations of batches, the trainer's first 4
    losses = [step(data)[0]["loss"].item() for _ in range(4)]
    assert [r.name for r in owner.reports] == ["train", "optimizer"]
    owner.close()
    assert losses == trained.losses


@pytest.mark.parametrize("tracker", [True, False])
def test_trainer_doctor_and_bench_seed_the_tracker_as_configured(monkeypatch, tracker):
    from graphstep.bench.harness import make_workload
    from graphstep.doctor import check_recipe

    seen: list[tuple[str, bool]] = []
    real = build_mod.initialize_rng_tracker

    def spy(seed, device, *, graph_safe, **kw):
        seen.append((caller, graph_safe))
        return real(seed, device, graph_safe=graph_safe, **kw)

    monkeypatch.setattr(build_mod, "initialize_rng_tracker", spy)
    flags = [f"model.use_te_rng_tracker={str(tracker).lower()}", f"rng.te_rng_tracker={str(tracker).lower()}"]
    caller = "trainer"
    train(eager(tiny_config(*flags, "train.train_iters=1")))
    caller = "doctor"
    report = check_recipe(eager(tiny_config(*flags)), name="llama3_tiny")
    assert not [f for f in report.findings if f.category == "config"]
    caller = "bench"
    make_workload(eager(tiny_config(*flags)), CPU, n_steps=1).close()
    assert seen == [("trainer", tracker), ("doctor", tracker), ("bench", tracker)]


def test_doctor_captures_through_its_own_backend_without_touching_the_process_backend():
    from graphstep.doctor import check_recipe
    from graphstep.training import graphs as graphs_mod

    report = check_recipe(tiny_config(*FULL), name="llama3_tiny")
    assert any("judged: full iteration (doctor backend)" in n for n in report.notes), report.notes
    assert not any("no region was captured" in n for n in report.notes)
    assert not hasattr(graphs_mod, "get_backend")  # the graph parts are handed the run's backend
    assert get_backend("cpu").live_graphs() == []  # the doctor's graphs never reached the process backend


# --------------------------------------------------------------------------
# capture barrier (GraphedStep's before_capture hook): once per capture of a graph holding collectives


def test_ranks_meet_once_before_each_capture_of_a_collective_graph():
    cfg = tiny_config(*FULL, "optimizer.optimizer_cuda_graph=true", "model.cuda_graph_warmup_steps=2",
                      "train.eval_iters=2")
    from graphstep.doctor import capture_error_hook

    met: list[str] = []
    calls: list[str] = []

    class MeetingRanks(DataParallel):  # one process that says it has company: its barrier is the capture barrier
        enabled = True

        def barrier(self) -> None:
            met.append(f"call {len(calls)}")

    run = build_run(cfg, RunOptions(CPU, dp=MeetingRanks(), on_capture_error=capture_error_hook))
    runner = run.runner
    data, valid = build_data(cfg, split="train"), build_data(cfg, split="valid")
    for _ in range(4):
        runner.optimizer_step(runner.train_step(data))
        calls.append(runner.state())
    assert calls == ["eager", "eager", "captured", "replayed"]
    assert met == ["call 2"]  # the training graph's capture; the optimizer graph holds no collective
    for _ in range(4):
        runner.evaluate(valid, 2)
        calls.append("eval")
    assert met == ["call 2", "call 6"]  # the evaluation graph's capture, at its third call
    assert [r.name for r in runner.reports] == ["train", "optimizer", "eval"]
    # the hook the trainer passes (training/loop.py: a failed capture is diagnosed by the doctor) reaches every graph
    assert runner.graphs[0].name == "train" and runner.graphs[0].on_capture_error is capture_error_hook
    assert runner.optimizer_step.on_capture_error is capture_error_hook
    runner.close()


# --------------------------------------------------------------------------
# run hooks


@pytest.mark.slow
def test_run_hooks_see_every_iteration_and_every_save_before_its_rename(tmp_path):
    ckpt = tmp_path / "ck"
    seen: list[tuple[str, int]] = []

    def before_rename(it: int) -> None:
        folders = sorted(p.name for p in ckpt.iterdir())
        assert f"iter_{it:07d}" not in folders and any(f.startswith(f"iter_{it:07d}.tmp-") for f in folders)
        seen.append(("save", it))

    hooks = RunHooks(after_iteration=lambda it: seen.append(("iteration", it)), before_checkpoint_rename=before_rename)
    result = train(eager(tiny_config("train.train_iters=4", f"checkpoint.save={ckpt}", "checkpoint.save_interval=2")),
                   hooks=hooks)
    assert result.iterations == 4
    assert seen == [("iteration", 1), ("save", 2), ("iteration", 2), ("iteration", 3), ("save", 4), ("iteration", 4)]


# --------------------------------------------------------------------------
# train.check_for_nan_on_device


NAN_RUN = FULL + ["optimizer.optimizer_cuda_graph=true", "train.train_iters=7"]


@pytest.mark.slow
def test_device_nan_check_on_flags_and_skips_the_poisoned_step(monkeypatch):
    poison_iteration(monkeypatch, 5)
    result = train(tiny_config(*NAN_RUN, "train.check_for_nan_on_device=true", "train.skip_step_on_nan=true"),
                   keep_model=True)
    assert [r["state"] for r in result.rows][3:5] == ["captured", "replayed"]
    assert result.nonfinite_iterations == [5]
    assert [r["nonfinite"] for r in result.rows] == [0.0] * 4 + [1.0] + [0.0] * 2
    assert result.rows[4]["loss"] == "nan"
    assert all(isinstance(r["loss"], float) for r in result.rows[5:])  # the update was skipped
    assert all(torch.isfinite(p).all() for p in result.model.parameters())


def test_device_nan_check_off_has_no_flag_and_skips_nothing(monkeypatch):
    poison_iteration(monkeypatch, 5)
    result = train(tiny_config(*NAN_RUN, "train.check_for_nan_on_device=false"), keep_model=True)
    assert [r["state"] for r in result.rows][3:5] == ["captured", "replayed"]
    assert all("nonfinite" not in r for r in result.rows)
    assert result.nonfinite_iterations == []
    assert [r["loss"] for r in result.rows][4:] == ["nan"] * 3  # nothing skipped: NaN weights from iteration 5 on
    assert not all(torch.isfinite(p).all() for p in result.model.parameters())


@pytest.mark.slow
def test_device_nan_check_off_computes_no_flag_in_the_steps():
    cfg = tiny_config(*FULL, "optimizer.optimizer_cuda_graph=true", "model.cuda_graph_warmup_steps=1",
                      "train.check_for_nan_on_device=false")
    run = build_run(cfg, RunOptions(CPU))
    data = build_data(cfg, split="train")
    for _ in range(3):
        out, opt = run.iteration(data)
    assert run.runner.state() == "replayed"
    assert sorted(out) == ["loss"] and sorted(opt) == ["grad_norm", "lr"]
    assert run.nonfinite(out, opt) is None
    run.close()


def test_skip_step_on_nan_without_the_device_check_is_refused():
    cfg = tiny_config(*FULL, "train.check_for_nan_on_device=false", "train.skip_step_on_nan=true")
    with pytest.raises(ConfigError, match="train.skip_step_on_nan=true needs .* train.check_for_nan_on_device=true"):
        build_run(cfg, RunOptions(CPU))


# --------------------------------------------------------------------------
# the same on a GPU (CudaGraphBackend, bf16): run by scripts/gpu-check

GPU = ["train.device=cuda", "model.params_dtype=bf16"]


@pytest.mark.parametrize("graphs, captured", [(FULL, 1), (LAYERS, 2)], ids=["full_iteration", "attn_mlp"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_two_runs_in_one_process_each_count_their_own_graphs(graphs, captured):
    first = train(tiny_config(*GPU, *graphs, "train.train_iters=5"))
    second = train(tiny_config(*GPU, *graphs, "train.train_iters=5"))
    assert (first.graphs, second.graphs) == (captured, captured)
    assert [r["state"] for r in second.rows] == ["eager"] * 3 + ["captured", "replayed"]
    assert first.losses == second.losses


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graph_made_outside_a_run_still_replays_after_the_run_closed():
    w = torch.arange(8, dtype=torch.float32, device="cuda")
    outside = graphstep.graph_step(lambda x: (w * x).sum() + 1.0, warmup_steps=1, device="cuda")
    for _ in range(2):
        outside(torch.ones(8, device="cuda"))
    assert outside.state == "captured"
    train(tiny_config(*GPU, *FULL, "optimizer.optimizer_cuda_graph=true", "train.train_iters=5"))
    x = torch.linspace(-1.0, 1.0, 8, device="cuda")
    out = outside(x)
    assert outside.state == "replayed"
    assert torch.equal(out, (w * x).sum() + 1.0)


@pytest.mark.parametrize("tracker", [True, False])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bench_workload_seeds_the_tracker_as_configured(tracker):
    from graphstep.bench.harness import make_workload
    from graphstep.cuda_graph.rng import get_rng_tracker

    flags = [f"model.use_te_rng_tracker={str(tracker).lower()}", f"rng.te_rng_tracker={str(tracker).lower()}"]
    w = make_workload(eager(tiny_config(*GPU, *flags)), torch.device("cuda", torch.cuda.current_device()), n_steps=1)
    assert get_rng_tracker().graph_safe is tracker
    w.close()


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_device_nan_check_on_and_off(monkeypatch, check):
    poison_iteration(monkeypatch, 5)
    flags = ["train.check_for_nan_on_device=true", "train.skip_step_on_nan=true"] if check else \
        ["train.check_for_nan_on_device=false"]
    result = train(tiny_config(*GPU, *NAN_RUN, *flags), keep_model=True)
    assert [r["state"] for r in result.rows][3:5] == ["captured", "replayed"]
    finite = all(torch.isfinite(p).all() for p in result.model.parameters())
    if check:
        assert result.nonfinite_iterations == [5] and result.rows[4]["loss"] == "nan" and finite
        assert all(isinstance(r["loss"], float) for r in result.rows[5:])
    else:
        assert all("nonfinite" not in r for r in result.rows) and result.nonfinite_iterations == []
        assert [r["loss"] for r in result.rows][4:] == ["nan"] * 3 and not finite


@pytest.mark.slow
def test_doctor_builds_a_hugging_face_run_as_the_trainer_does(tmp_path):
    """model.hf_path: the doctor judges the checkpoint's shape with its weights, or a proxy from random weights."""
    pytest.importorskip("transformers")
    from graphstep.doctor import check_recipe
    from helpers.data import make_hf, sft_overrides, write_sft

    make_hf("llama", tmp_path / "hf")
    common = [*sft_overrides(write_sft(tmp_path / "sft.jsonl", n=24)), f"model.hf_path={tmp_path / 'hf'}", *FULL]
    as_configured = check_recipe(tiny_config(*common), name="hf", proxy="never")
    assert as_configured.ok and not any("random weights" in n for n in as_configured.notes), as_configured
    proxy = check_recipe(tiny_config(*common), name="hf", proxy="always")
    assert proxy.ok, proxy
    assert any(n == f"the proxy starts from random weights, not model.hf_path={tmp_path / 'hf'}" for n in proxy.notes)
