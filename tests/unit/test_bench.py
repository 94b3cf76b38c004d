"""graphstep bench without a GPU: row names, derived columns, the table, the chart and the recipes' rows;
the multi-rank rows' overrides, refusals and rank plumbing (2 gloo processes under torchrun, ``ranks_worker``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graphstep.bench.harness import Row, finish, peer_of
from graphstep.bench.run import (
    DENSE_ROWS,
    HYBRID_ROWS,
    MOE_ROWS,
    default_rows,
    markdown_table,
    row_overrides,
    run_bench,
    split_rows,
    table,
    write_results,
)
from graphstep.recipes import get_recipe
from graphstep.validation import validate_config

from helpers.launch import torchrun_reports


def test_split_rows_keeps_commas_inside_brackets():
    assert split_rows("eager,local[attn,mlp],te[],compile[reduce-overhead]") == [
        "eager", "local[attn,mlp]", "te[]", "compile[reduce-overhead]"]


def test_row_overrides():
    assert "model.cuda_graph_impl=transformer_engine" in row_overrides("te[attn,mlp]")
    assert "model.cuda_graph_modules=[attn,mlp]" in row_overrides("te[attn,mlp]")
    assert "model.cuda_graph_modules=[]" in row_overrides("local[]")
    assert "optimizer.optimizer_cuda_graph=true" in row_overrides("full_iteration+optimizer")
    # a per-layer row with the optimizer step captured too; its peer ran the optimizer eagerly: none
    with_opt = row_overrides("local[attn,mlp]+optimizer")
    assert with_opt == row_overrides("local[attn,mlp]") + ["optimizer.optimizer_cuda_graph=true"]
    assert peer_of("local[attn,mlp]+optimizer", {"make_graphed_callables"}) is None
    assert row_overrides("make_graphed_callables+optimizer") is None
    assert "model.cuda_graph_impl=full_iteration" in row_overrides("compile+full_iteration")
    assert row_overrides("manual_graph") is None and row_overrides("compile[reduce-overhead]") is None


def test_fp8_rows_are_their_bf16_row_in_fp8_and_have_it_as_peer():
    from graphstep.bench.harness import peer_of
    from graphstep.bench.run import plan_row

    for name in ("fp8_eager", "fp8_full_iteration", "fp8_local[attn,mlp]", "compile+fp8_full_iteration",
                 "compile+fp8_local[attn,mlp]"):
        overrides = row_overrides(name)
        assert {"mixed_precision.fp8=hybrid", "mixed_precision.fp8_recipe=tensorwise"} <= set(overrides), name
        assert set(row_overrides(name.replace("fp8_", ""))) <= set(overrides), name
        cfg = plan_row(get_recipe("small_dense_bench"), name).cfg
        rules = {v.rule for v in validate_config(cfg, device_capability=(9, 0))}
        if name == "compile+fp8_local[attn,mlp]":  # FP8 in compiled per-layer graphs: not implemented yet
            assert "R32" in rules and rules <= {"R32", "R20"}, (name, rules)
        else:  # R20: compile with graphs on the CPU replay backend (this machine may have no GPU)
            assert rules <= {"R20"}, (name, rules)
    assert row_overrides("fp8_manual_graph") is None
    assert peer_of("fp8_full_iteration", {"full_iteration", "fp8_full_iteration"}) == "full_iteration"
    assert peer_of("fp8_local[attn,mlp]", {"make_graphed_callables"}) is None
    assert peer_of("compile+fp8_full_iteration", {"compile+full_iteration", "compile[reduce-overhead]"}) == \
        "compile+full_iteration"


def test_delayed_fp8_rows_are_their_bf16_row_in_delayed_fp8_and_have_it_as_peer():
    from graphstep.bench.harness import peer_of
    from graphstep.bench.run import FP8_ROWS, plan_row

    for name in ("fp8_delayed_full_iteration", "compile+fp8_delayed_full_iteration"):
        assert name in FP8_ROWS
        bf16 = name.replace("fp8_delayed_", "")
        overrides = row_overrides(name)
        assert {"mixed_precision.fp8=hybrid", "mixed_precision.fp8_recipe=delayed"} <= set(overrides), name
        assert set(row_overrides(bf16)) <= set(overrides), name
        cfg = plan_row(get_recipe("small_dense_bench"), name).cfg
        assert cfg.compile.enable is name.startswith("compile+") and cfg.model.cuda_graph_impl == "full_iteration"
        rules = {v.rule for v in validate_config(cfg, device_capability=(9, 0))}
        assert rules <= {"R20"}, (name, rules)  # R20: compile with graphs on the CPU replay backend
        assert peer_of(name, {bf16, "compile[reduce-overhead]", "manual_graph"}) == bf16


LORA_ROWS = ["lora_eager", "lora_full_iteration", "lora_local[attn,mlp]"]


@pytest.mark.parametrize("recipe", ["small_dense_bench", "dense_1b_bench"])
def test_lora_rows_are_the_row_fine_tuning_adapters_with_full_fine_tuning_as_peer(recipe):
    from graphstep.bench.harness import eager_reference, peer_of
    from graphstep.bench.run import plan_row

    for name in LORA_ROWS:
        overrides = row_overrides(name)
        assert "peft=lora" in overrides and set(row_overrides(name[len("lora_"):])) <= set(overrides), name
        cfg = plan_row(get_recipe(recipe), name).cfg
        assert cfg.peft.scheme == "lora" and not validate_config(cfg), name
        assert peer_of(name, {name[len("lora_"):]}) == name[len("lora_"):]
        assert eager_reference(name, {"eager", "lora_eager"}) == "lora_eager"
    assert get_recipe("dense_1b_bench").model.seq_length == 2048  # llama32_1b at seq 2048
    assert row_overrides("lora_manual_graph") is None


def test_lora_rows_build_and_run_on_the_cpu_training_only_the_adapters():
    from graphstep.bench.run import _builder

    base = get_recipe("small_dense_bench")  # at a CPU size; two steps: one eager, one captured
    m = base.model
    m.num_layers, m.seq_length, m.vocab_size, m.cuda_graph_warmup_steps = 2, 64, 512, 1
    losses = {}
    for name in LORA_ROWS:
        step, data, _, runner = _builder(name, base, torch.device("cpu"))()
        run = step.__self__  # the row's Run (training/build.py)
        try:
            start = {n: p.detach().clone() for n, p in run.model.named_parameters()}
            losses[name] = [float(step(data)[0]["loss"]) for _ in range(2)]
            assert runner.state() == ("eager" if name == "lora_eager" else "captured"), name
            for n, p in run.model.named_parameters():
                assert torch.equal(p, start[n]) != (".lora_" in n), n  # the adapters train, the base does not
        finally:
            run.close()
    assert losses["lora_eager"] == losses["lora_full_iteration"] == losses["lora_local[attn,mlp]"], losses


def test_finish_puts_a_lora_rows_memory_beside_full_fine_tuning():
    rows = [Row("eager", step_ms=20.0, peak_allocated_gib=2.0), Row("full_iteration", step_ms=4.0,
                                                                  peak_allocated_gib=2.2),
            Row("lora_eager", step_ms=18.0, peak_allocated_gib=1.0),
            Row("lora_full_iteration", step_ms=3.0, peak_allocated_gib=1.1)]
    finish(rows, tokens_per_step=1024, flops_per_step=1e12, peak_tflops=800.0)
    lora = rows[3]
    assert (lora.peer, lora.vs_peer, lora.memory_vs_peer) == ("full_iteration", 0.75, 0.5)
    assert lora.speedup == pytest.approx(6.0) and lora.memory_vs_eager == pytest.approx(1.1)  # against lora_eager
    env = {"date": "2026-12-06", "gpu": "Test GPU", "gpu_memory_gib": 80.0, "torch": "2.x", "cuda": "13.0",
           "python": "3.12"}
    md = markdown_table({"recipe": "small_dense_bench", "environment": env, "bf16_matmul_tflops": 800.0,
                         "rows": [r.as_dict() for r in rows]})
    assert "0.75x full_iteration, memory 0.50x" in md


@pytest.mark.parametrize("recipe, rows", [("small_dense_bench", DENSE_ROWS), ("gpt_124m_bench", DENSE_ROWS),
                                          ("moe_launch_bound_bench", MOE_ROWS),
                                          ("hybrid_launch_bound_bench", HYBRID_ROWS)])
def test_default_rows_follow_the_model(recipe, rows):
    assert default_rows(get_recipe(recipe)) == rows


def test_bench_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        run_bench(get_recipe("small_dense_bench"), ["eager"], recipe="small_dense_bench")


def _doc() -> dict:
    rows = [Row("eager", step_ms=20.0, busy_ms=3.0, kernels=900, peak_allocated_gib=1.0),
            Row("full_iteration", step_ms=3.3, busy_ms=3.0, kernels=900, peak_allocated_gib=1.05, capture_s=0.2,
                issue_ms=0.8),
            Row("local[attn,mlp]", step_ms=6.0, busy_ms=3.1, kernels=902, peak_allocated_gib=1.02),
            Row("compile[reduce-overhead]", error="RuntimeError: boom\nsecond line")]
    finish(rows, tokens_per_step=1024, flops_per_step=1e12, peak_tflops=800.0)
    env = {"date": "2026-11-30", "gpu": "Test GPU", "gpu_memory_gib": 80.0, "torch": "2.x", "cuda": "13.0",
           "python": "3.12"}
    return {"recipe": "small_dense_bench", "environment": env, "bf16_matmul_tflops": 800.0,
            "rows": [r.as_dict() for r in rows]}


def test_finish_derives_ratios_against_eager():
    doc = _doc()
    full = doc["rows"][1]
    assert full["speedup"] == pytest.approx(20.0 / 3.3)
    assert full["floor_ratio"] == pytest.approx(3.3 / 3.0)
    assert full["host_ms"] == pytest.approx(0.3)
    assert full["memory_vs_eager"] == pytest.approx(1.05)
    assert full["tflops"] == pytest.approx(1e12 / 3.3e-3 / 1e12)
    assert doc["rows"][3]["speedup"] is None  # a failed row has no numbers


def test_table_markdown_and_chart(tmp_path):
    from rich.console import Console

    doc = _doc()
    md = markdown_table(doc)
    assert "| full_iteration | 3.300 | 3.000 | 0.300 | 0.800 | 900 | - | 6.06x | 1.10x |" in md
    assert "| compile[reduce-overhead] | failed: RuntimeError: boom |" in md
    console = Console(width=200, record=True)
    console.print(table(doc))
    assert "local[attn,mlp]" in console.export_text()  # brackets are not taken for rich markup
    pytest.importorskip("matplotlib")
    path = write_results(doc, tmp_path)
    png = path.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert path.with_suffix(".md").read_text() == md


def test_host_sync_counter_counts_synchronizing_calls_not_the_prototype_notice(monkeypatch):
    """Switching sync debug mode on warns once per process that it is a prototype: not a sync of the step."""
    import warnings

    from graphstep.bench import harness

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: warnings.warn(
        "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations")
        if mode == "warn" else None)

    def step(data):
        warnings.warn("called a synchronizing CUDA operation")  # what the mode says for each sync

    assert harness.count_host_syncs(step, iter(())) == 1
    assert harness.count_host_syncs(lambda data: None, iter(())) == 0


def test_issue_time_is_the_hosts_own_time_with_the_device_drained_before_each_step(monkeypatch):
    """The device is synchronised before every step (so no launch waits for queue room) and the host clock runs
    around the step alone: the median of the steps' host times, whatever the synchronisations cost."""
    import time

    from graphstep.bench import harness

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (events.append("sync"), time.sleep(0.02)))
    delays = iter([0.001, 0.004, 0.002])

    def step(data):
        events.append("step")
        time.sleep(next(delays))

    ms = harness.issue_time(step, iter(()), iters=3, device=torch.device("cpu"))
    assert events == ["sync", "step"] * 3 + ["sync"]
    assert 2.0 <= ms < 4.0  # the middle step's 2 ms (sleep overshoots a little), none of the 20 ms syncs


def _busy_host_work(n: int) -> int:
    return sum(i * i for i in range(n))


def test_host_profile_names_the_functions_a_step_spends_its_host_time_in():
    """``--host-profile``: per-iteration calls and times of the step's own functions, heaviest first."""
    from graphstep.bench import harness

    def step(data):
        _busy_host_work(next(data))
        _busy_host_work(next(data))

    profile = harness.host_profile(step, iter([20_000] * 6), iters=3, top=5, device=torch.device("cpu"))
    assert len(profile) == 5
    own = [p["self_ms"] for p in profile]
    assert own == sorted(own, reverse=True)
    mine = [p for p in profile if p["function"].endswith("(_busy_host_work)")]
    assert mine and mine[0]["calls"] == 2 and mine[0]["total_ms"] >= mine[0]["self_ms"] > 0
    assert mine[0]["function"].startswith("test_bench.py:")
    doc = _doc()
    doc["rows"][1]["host_profile"] = profile
    md = markdown_table(doc)
    assert f"Host profile of {doc['rows'][1]['name']} (cProfile" in md
    assert f"| `{mine[0]['function']}` | 2 |" in md
    assert harness._short_path("/x/src/graphstep/cuda_graph/replay.py") == "graphstep/cuda_graph/replay.py"


def test_host_ops_sees_the_backward_of_every_thread():
    """The operator table counts each step's matmuls, the backward's too, per iteration."""
    from graphstep.bench import harness

    w = torch.randn(64, 64, requires_grad=True)

    def step(data):
        (next(data) @ w).sum().backward()

    ops = harness.host_ops(step, iter([torch.randn(32, 64)] * 4), iters=2, top=40, device=torch.device("cpu"))
    by_name = {o["op"]: o for o in ops}
    assert by_name["aten::mm"]["calls"] == 2  # forward x @ w and the backward's x^T @ grad (no input grad)
    assert any("MmBackward" in name for name in by_name)
    assert all(o["total_ms"] >= o["self_ms"] >= 0 for o in ops)
    doc = _doc()
    doc["rows"][1]["host_ops"] = ops
    assert "| `aten::mm` | 2 |" in markdown_table(doc)


def test_bench_rows_as_tensorboard_scalars_side_by_side(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from graphstep.bench.tensorboard import write_tensorboard

    from graphstep.bench.harness import Row

    rows = [Row("eager", step_ms=15.745, busy_ms=2.518, kernels=565),
            Row("full_iteration", step_ms=2.755, busy_ms=2.525, capture_s=0.02), Row("broken", error="capture failed")]
    doc = {"recipe": "small_dense_bench", "bench_format": 1, "bf16_matmul_tflops": 767.0,
           "environment": {"gpu": "NVIDIA H200", "date": "2026-12-01", "torch": "2.11.0", "cuda": "13.0"},
           "rows": [r.as_dict() for r in rows]}
    first = write_tensorboard(doc, tmp_path)
    second = write_tensorboard(doc, tmp_path)  # another run of the same day: its own folder beside the first
    assert first.name == "small_dense_bench_NVIDIA-H200_2026-12-01" and second.name == first.name + "_2"
    events = EventAccumulator(str(first))
    events.Reload()
    scalars = {tag: events.Scalars(tag)[0].value for tag in events.Tags()["scalars"]}
    assert scalars == pytest.approx({"step_ms/eager": 15.745, "busy_ms/eager": 2.518, "kernels/eager": 565,
                                     "step_ms/full_iteration": 2.755, "busy_ms/full_iteration": 2.525,
                                     "capture_s/full_iteration": 0.02})


# ---------------------------------------------------------------------------
# multi-rank rows (bench/layouts.py, bench/ranks.py)

OFF = ["model.cuda_graph_impl=none", "model.cuda_graph_modules=[]", "optimizer.optimizer_cuda_graph=false"]
FULL = OFF + ["model.cuda_graph_impl=full_iteration"]
FSDP3 = ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"]
ZERO2 = ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads"]


def _local(scopes: str) -> list[str]:
    return OFF + ["model.cuda_graph_impl=local", f"model.cuda_graph_modules=[{scopes}]"]


@pytest.mark.parametrize("name, world, expected", [
    ("fsdp_eager", 1, OFF + FSDP3),
    ("fsdp_full_iteration", 1, FULL + FSDP3),
    ("fsdp_full_iteration", 4, FULL + FSDP3),
    ("zero2_eager", 1, OFF + ZERO2),
    ("zero2_[attn,mlp]", 1, _local("attn,mlp") + ZERO2),
    ("zero2_[attn,mlp]", 2, _local("attn,mlp") + ZERO2),
    ("dp_eager", 2, OFF),
    ("dp_full_iteration", 2, FULL),
    ("dp_overlap_full_iteration", 2, FULL + ["ddp.overlap_grad_reduce=true"]),
    ("tp_eager", 2, OFF + ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]),
    ("tp_full_iteration", 4, FULL + ["model.tensor_model_parallel_size=4", "model.sequence_parallel=true"]),
    ("tp_[attn,mlp]", 2, _local("attn,mlp") + ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]),
    ("pp_eager", 2, OFF + ["model.pipeline_model_parallel_size=2", "model.pipeline_schedule=1f1b",
                           "model.share_embeddings_and_output_weights=false"]),
    ("pp_full_iteration", 2, FULL + ["model.pipeline_model_parallel_size=2", "model.pipeline_schedule=1f1b",
                                     "model.share_embeddings_and_output_weights=false"]),
    ("pp_local[attn,mlp]", 4, _local("attn,mlp") + ["model.pipeline_model_parallel_size=4",
                                                    "model.pipeline_schedule=1f1b",
                                                    "model.share_embeddings_and_output_weights=false"]),
    ("ep_eager", 2, OFF + ["model.expert_model_parallel_size=2"]),
    ("ep_full_iteration", 8, FULL + ["model.expert_model_parallel_size=8"]),
    ("ep_[attn,moe]", 2, _local("attn,moe") + ["model.expert_model_parallel_size=2"]),
    ("ep_[attn,moe_router,moe_preprocess]", 2, _local("attn,moe_router,moe_preprocess")
     + ["model.expert_model_parallel_size=2", "model.moe_token_dispatcher_type=alltoall"]),
])
def test_multi_rank_row_overrides(name, world, expected):
    assert row_overrides(name, world) == expected


def test_prefixed_peers_and_nested_prefixes_are_not_graphstep_rows():
    assert row_overrides("dp_manual_graph", 2) is None
    assert row_overrides("tp_fsdp_eager", 2) is None


@pytest.mark.parametrize("recipe, name, world, batch, layout", [
    ("small_dense_bench", "dp_eager", 2, 8, "2 data-parallel ranks"),  # each replica: the recipe's 4 sequences
    ("small_dense_bench", "fsdp_full_iteration", 4, 16, "4 data-parallel (FSDP2 optim_grads_params) ranks"),
    ("small_dense_bench", "fsdp_eager", 1, 4, "1 data-parallel (FSDP2 optim_grads_params) rank"),
    ("small_dense_bench", "zero2_[attn,mlp]", 2, 8, "2 data-parallel (FSDP2 optim_grads) ranks"),
    ("small_dense_bench", "tp_eager", 2, 4, "1 data-parallel x 2 tensor-parallel + sequence-parallel ranks"),
    ("small_dense_bench", "pp_eager", 2, 8, "2 pipeline-stage x 1 data-parallel ranks"),  # 1F1B: 2 micro-batches
    ("small_dense_bench", "pp_full_iteration", 4, 16, "4 pipeline-stage x 1 data-parallel ranks"),
    ("moe_launch_bound_bench", "ep_eager", 2, 4, "2 data-parallel (2 expert-parallel) ranks"),
])
def test_row_plan_batch_and_layout(recipe, name, world, batch, layout):
    from graphstep.bench.layouts import batch_overrides
    from graphstep.bench.run import plan_row

    base = get_recipe(recipe)
    plan = plan_row(base, name, world)
    assert plan.cfg.train.global_batch_size == batch and plan.cfg.train.micro_batch_size == base.train.micro_batch_size
    assert plan.layout.describe() == layout and plan.layout.ranks == world
    assert plan.refusal is None
    expected = [] if batch == base.train.global_batch_size else [f"train.global_batch_size={batch}"]
    from graphstep.bench.run import row_config

    assert batch_overrides(row_config(base, row_overrides(name, world)), world) == expected


def test_pipeline_rows_keep_a_recipe_that_has_a_micro_batch_per_stage():
    from graphstep.bench.run import plan_row
    from graphstep.config import apply_overrides

    base = apply_overrides(get_recipe("small_dense_bench"), ["train.micro_batch_size=1", "train.global_batch_size=4"])
    assert plan_row(base, "pp_eager", 2).cfg.train.global_batch_size == 4  # 4 micro-batches >= 2 stages
    assert plan_row(base, "pp_eager", 8).cfg.train.global_batch_size == 8  # raised to one per stage


@pytest.mark.parametrize("recipe, rows", [
    ("small_dense_bench", ["dp_eager", "dp_full_iteration", "dp_overlap_full_iteration", "fsdp_eager",
                           "fsdp_full_iteration", "zero2_eager", "zero2_[attn,mlp]", "tp_eager", "tp_full_iteration", "tp_[attn,mlp]", "pp_eager",
                           "pp_full_iteration", "pp_local[attn,mlp]", "vpp_eager", "vpp_full_iteration", "cp_eager",
                           "cp_full_iteration", "cp_[attn,mlp]"]),
    ("moe_launch_bound_bench", ["dp_eager", "dp_full_iteration", "dp_overlap_full_iteration", "ep_eager",
                                "ep_full_iteration", "ep_[attn,moe]", "ep_[attn,moe_router,moe_preprocess]"]),
    ("hybrid_launch_bound_bench", ["dp_eager", "dp_full_iteration", "dp_overlap_full_iteration"]),
])
def test_default_rows_under_torchrun_fit_the_model(recipe, rows):
    assert default_rows(get_recipe(recipe), 2) == rows


@pytest.mark.parametrize("recipe", ["small_dense_bench", "moe_launch_bound_bench"])
def test_default_multi_rank_rows_pass_the_rules_at_two_ranks(recipe):
    """Every default row is valid on 2 ranks (its refusal would be a row the bench cannot run)."""
    from graphstep.bench.run import plan_row

    base = get_recipe(recipe)
    assert {name: plan_row(base, name, 2).refusal for name in default_rows(base, 2)} == {
        name: None for name in default_rows(base, 2)}


@pytest.mark.parametrize("recipe, world, added", [
    ("small_dense_bench", 4, ["pp_tp_eager", "pp_tp_full_iteration", "pp_fsdp_eager", "pp_fsdp_full_iteration"]),
    ("small_dense_bench", 8, ["pp_tp_eager", "pp_tp_full_iteration", "pp_fsdp_eager", "pp_fsdp_full_iteration",
                              "3d_eager", "3d_full_iteration"]),
    ("moe_launch_bound_bench", 4, ["ep_tp_eager", "ep_tp_full_iteration"]),
])
def test_combined_layout_rows_from_four_ranks_pass_the_rules(recipe, world, added):
    """From 4 ranks the default rows add the combined layouts (8: the 3-D one); each is valid there."""
    from graphstep.bench.run import plan_row

    base = get_recipe(recipe)
    rows = default_rows(base, world)
    assert rows == default_rows(base, 2) + added
    assert {name: plan_row(base, name, world).refusal for name in added} == {name: None for name in added}


@pytest.mark.parametrize("name, world, layout", [
    ("pp_tp_full_iteration", 4, (2, 1, 2)),  # (pp, dp, tp)
    ("pp_tp_full_iteration", 8, (2, 1, 4)),
    ("pp_fsdp_eager", 8, (2, 4, 1)),
    ("3d_full_iteration", 8, (2, 2, 2)),
    ("3d_eager", 16, (2, 4, 2)),
    ("vpp_full_iteration", 2, (2, 1, 1)),
    ("cp_full_iteration", 4, (1, 1, 1)),
])
def test_combined_layout_rows_split_the_world(name, world, layout):
    from graphstep.bench.run import plan_row

    dims = plan_row(get_recipe("small_dense_bench"), name, world).layout
    assert (dims.pp, dims.dp, dims.tp) == layout
    assert dims.fsdp == ("optim_grads_params" if "fsdp" in name or name.startswith("3d_") else None)


def test_combined_layout_rows_name_the_ranks_they_need():
    from graphstep.bench.layouts import layout_overrides, split_prefix
    from graphstep.config import ConfigError

    assert split_prefix("pp_tp_[attn,mlp]") == ("pp_tp_", "local[attn,mlp]")
    assert split_prefix("ep_tp_full_iteration") == ("ep_tp_", "full_iteration")
    with pytest.raises(ConfigError, match="multiple of 8 ranks, at least 8"):
        layout_overrides("3d_", "full_iteration", 4)
    with pytest.raises(ConfigError, match="multiple of 4 ranks, at least 4"):
        layout_overrides("pp_tp_", "eager", 6)
    from graphstep.bench.run import plan_row
    from graphstep.config import apply_overrides

    base = apply_overrides(get_recipe("small_dense_bench"), ["train.micro_batch_size=1", "train.global_batch_size=3"])
    vpp = plan_row(base, "vpp_full_iteration", 2).cfg
    assert vpp.model.virtual_pipeline_model_parallel_size == 2 and vpp.train.global_batch_size == 4  # rounds of 2
    assert plan_row(base, "cp_eager", 4).layout.cp == 4
    ep_tp = layout_overrides("ep_tp_", "full_iteration", 4)
    assert "model.expert_model_parallel_size=2" in ep_tp and "model.tensor_model_parallel_size=2" in ep_tp


def test_multi_rank_rows_are_refused_at_world_size_one_with_the_torchrun_command(monkeypatch):
    from graphstep.config import ConfigError

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rows = ["fsdp_eager", "tp_eager", "dp_overlap_full_iteration", "pp_local[attn,mlp]", "ep_[attn,moe]"]
    with pytest.raises(ConfigError) as err:  # before the GPU check: the same on a machine without one
        run_bench(get_recipe("small_dense_bench"), rows, recipe="small_dense_bench")
    message = str(err.value)
    assert message.startswith("bench rows tp_eager, dp_overlap_full_iteration, pp_local[attn,mlp], ep_[attn,moe] "
                              "run over several GPUs, one process per GPU")
    assert message.endswith("`torchrun --nproc_per_node 2 -m graphstep bench --recipe small_dense_bench --rows "
                            "'tp_eager,dp_overlap_full_iteration,pp_local[attn,mlp],ep_[attn,moe]'`")
    assert "fsdp_eager" not in message  # FSDP2 keeps its one-rank mesh on one GPU
    with pytest.raises(ConfigError, match=r"^bench row dp_eager runs over several GPUs.* --rows dp_eager`$"):
        run_bench(get_recipe("small_dense_bench"), ["dp_eager"], recipe="small_dense_bench")


def test_one_process_rows_are_refused_under_torchrun():
    from graphstep.bench.layouts import check_world
    from graphstep.config import ConfigError

    with pytest.raises(ConfigError) as err:
        check_world(["eager", "dp_eager", "local[attn,mlp]", "fsdp_eager"], 2, "small_dense_bench")
    assert str(err.value).startswith("bench rows eager, local[attn,mlp] run on one GPU in one process, but torchrun "
                                     "started 2 processes")
    assert "(`graphstep bench --recipe small_dense_bench --rows 'eager,local[attn,mlp]'`)" in str(err.value)
    check_world(["dp_eager", "fsdp_eager", "tp_[attn,mlp]"], 2, "small_dense_bench")  # all prefixed: accepted


def test_a_row_the_rules_refuse_carries_every_violation():
    from graphstep.bench.run import plan_row, row_config
    from graphstep.validation import validate_config

    base = get_recipe("moe_launch_bound_bench")
    plan = plan_row(base, "fsdp_eager", 2)  # FSDP2 over an MoE model without expert parallel: rule R27
    assert plan.cfg.ddp.use_megatron_fsdp is True and plan.cfg.model.expert_model_parallel_size == 1
    violations = validate_config(plan.cfg, world_size=2)
    assert [v.rule for v in violations] == ["R27"]
    assert plan.refusal == "refused by the config rules (R27; 2 ranks): " + str(violations[0])
    assert "model.num_moe_experts=64" in plan.refusal and "Fix: " in plan.refusal
    # 8 decoder layers do not split over 3 stages: R28, at the bench's world size
    three = plan_row(get_recipe("small_dense_bench"), "pp_eager", 3)
    assert three.refusal.startswith("refused by the config rules (R28; 3 ranks): R28 ")
    # Megatron's partial MoE graphs with the alltoall dispatcher across 2 ranks: accepted, the dispatcher set
    alltoall = plan_row(base, "ep_[attn,moe_router,moe_preprocess]", 2)
    assert alltoall.refusal is None and validate_config(alltoall.cfg, world_size=2) == []
    assert alltoall.cfg.model.moe_token_dispatcher_type == "alltoall"


def test_run_bench_under_torchrun_measures_in_lockstep_and_reports_refused_rows(monkeypatch):
    """The bench's flow at 2 ranks with the GPU parts replaced: a refused row is reported, never built; the
    others are measured with the ranks' lockstep; ratios against the layout's eager row; rank 0 gets the doc."""
    from graphstep.bench import run

    measured, joined = [], []

    class FakeRanks:
        def __init__(self, main: bool) -> None:
            self.world_size, self.is_main, self.closed = 2, main, False

        @classmethod
        def join(cls, cfg, world_size):
            joined.append((cfg.train.global_batch_size, world_size))
            ranks = cls(main=len(joined) == 1)  # the first call is rank 0, the second another rank
            return ranks

        def close(self) -> None:
            self.closed = True

    def fake_measure(name, build, *, warmup, iters, profile_iters, device, lockstep, host_top=0):
        measured.append((name, lockstep))
        return Row(name, step_ms={"dp_eager": 10.0, "dp_full_iteration": 5.0}[name], peak_allocated_gib=1.0)

    monkeypatch.setattr(run.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(run, "Ranks", FakeRanks)
    monkeypatch.setattr(run, "normalize_device", lambda _: torch.device("cpu"))
    monkeypatch.setattr(run, "matmul_tflops", lambda device: 800.0)
    monkeypatch.setattr(run, "make_workload", lambda cfg, device, n_steps: type("Probe", (), {"model": None})())
    monkeypatch.setattr(run, "flops_per_step", lambda cfg, model: 1e12)
    monkeypatch.setattr(run, "environment", lambda device: {"date": "2026-12-02", "gpu": "Test GPU", "torch": "2.x",
                                                            "cuda": "13.0"})
    monkeypatch.setattr(run, "measure", fake_measure)
    base = get_recipe("moe_launch_bound_bench")  # micro-batch 2, global batch 2, seq 256
    rows = ["dp_eager", "fsdp_eager", "dp_full_iteration"]
    doc = run.run_bench(base, rows, recipe="moe_launch_bound_bench", world_size=2)
    assert joined == [(4, 2)]  # the process group joined once, with a config valid at 2 ranks
    assert [name for name, _ in measured] == ["dp_eager", "dp_full_iteration"]  # fsdp_eager never built
    assert all(isinstance(lockstep, FakeRanks) for _, lockstep in measured)
    assert doc["world_size"] == 2 and [r["name"] for r in doc["rows"]] == rows
    refused = doc["rows"][1]
    assert refused["note"] == run.REFUSED and refused["error"] == run.plan_row(base, "fsdp_eager", 2).refusal
    full = doc["rows"][2]
    assert (full["layout"], full["ranks"], full["global_batch"], full["tokens_per_step"]) == (
        "2 data-parallel ranks", 2, 4, 1024)
    assert full["speedup"] == pytest.approx(2.0)  # against dp_eager
    assert full["tflops"] == pytest.approx(1e12 * 2 / 5e-3 / 1e12)  # twice the recipe's tokens per step
    assert full["mfu"] == pytest.approx(full["tflops"] / (800.0 * 2))  # against both GPUs
    assert "| fsdp_eager | failed: refused by the config rules (R27; 2 ranks): R27 " in markdown_table(doc)
    measured.clear()
    assert run.run_bench(base, ["dp_eager"], recipe="moe_launch_bound_bench", world_size=2) is None  # not rank 0


def test_finish_compares_each_layout_with_its_own_eager_row():
    rows = [Row("eager", step_ms=20.0), Row("fsdp_eager", step_ms=30.0), Row("fsdp_full_iteration", step_ms=10.0),
            Row("tp_eager", step_ms=40.0, ranks=2), Row("tp_[attn,mlp]", step_ms=16.0, ranks=2),
            Row("dp_eager", step_ms=25.0, ranks=2), Row("dp_overlap_full_iteration", step_ms=5.0, ranks=2)]
    finish(rows, tokens_per_step=1024, flops_per_step=1e12, peak_tflops=800.0)
    speedups = {r.name: r.speedup for r in rows}
    assert speedups == pytest.approx({"eager": 1.0, "fsdp_eager": 20 / 30, "fsdp_full_iteration": 2.0,
                                      "tp_eager": 1.0, "tp_[attn,mlp]": 2.5, "dp_eager": 1.0,
                                      "dp_overlap_full_iteration": 5.0})
    torchrun_rows = [Row("fsdp_eager", step_ms=30.0, ranks=2), Row("fsdp_full_iteration", step_ms=10.0, ranks=2)]
    finish(torchrun_rows, tokens_per_step=1024, flops_per_step=1e12, peak_tflops=800.0)
    assert torchrun_rows[1].speedup == pytest.approx(3.0)  # no plain eager row under torchrun: fsdp_eager


def test_multi_rank_results_name_the_ranks_and_each_rows_layout(tmp_path):
    doc = _doc()
    doc["world_size"] = 2
    doc["rows"][1].update(layout="2 data-parallel ranks", global_batch=8)
    md = markdown_table(doc)
    assert md.startswith("small_dense_bench -- 2 x Test GPU, torch 2.x, CUDA 13.0, 2026-11-30 (bf16 matmul 800 "
                         "TFLOP/s measured; 2 ranks under torchrun: step = rank 0's, peak = the maximum over ranks")
    assert "| MFU | vs peer | layout |" in md
    lines = md.splitlines()
    assert lines[4].startswith("| eager |") and lines[4].endswith("| 6.2% | - | - |")  # no peer, no layout recorded
    assert lines[5].startswith("| full_iteration |") and lines[5].endswith("| 2 data-parallel ranks, global batch 8 |")
    assert lines[7] == "| compile[reduce-overhead] | failed: RuntimeError: boom | | | | | | | | | | | | | - |"
    from rich.console import Console

    from graphstep.bench.run import result_stem

    console = Console(width=250, record=True)
    console.print(table(doc))
    text = console.export_text()
    assert "small_dense_bench on 2 x Test GPU" in text and "2 data-parallel ranks, global batch 8" in text
    assert result_stem(doc) == "small_dense_bench_2xTest-GPU_2026-11-30"
    assert result_stem(_doc()) == "small_dense_bench_Test-GPU_2026-11-30"
    path = write_results(doc, tmp_path)  # beside the one-GPU results, not over them
    assert path.name == "small_dense_bench_2xTest-GPU_2026-11-30.json"
    assert json.loads(path.read_text())["world_size"] == 2 and path.with_suffix(".md").read_text() == md


@pytest.mark.parametrize("env, message", [({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not a whole number"),
                                          ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 is not a valid WORLD_SIZE")])
def test_world_size_from_env_refuses_garbage(env, message):
    from graphstep.bench.ranks import world_size_from_env
    from graphstep.config import ConfigError

    assert world_size_from_env({}) == 1 and world_size_from_env({"WORLD_SIZE": "4"}) == 4
    with pytest.raises(ConfigError, match=message):
        world_size_from_env(env)


def ranks_worker(out: str) -> None:
    """A torchrun worker: join as the bench does (gloo on the CPU), agree on rows, write this rank's view."""
    from graphstep.bench.ranks import Ranks, max_over_ranks
    from graphstep.bench.run import plan_row
    from graphstep.config import apply_overrides

    cfg = plan_row(apply_overrides(get_recipe("llama3_tiny"), ["train.device=cpu"]), "dp_eager", 2).cfg
    ranks = Ranks.join(cfg, 2)
    r = ranks.rank
    report: dict = {"rank": r, "world": ranks.world_size, "main": ranks.is_main, "backend": ranks.dp.backend}
    try:
        report["max"] = max_over_ranks([1.0 + r, 5.0 - r, -2.0 * r])
        failing = Row("tp_eager", peak_allocated_gib=1.5 + r, peak_reserved_gib=3.0 - r, error="boom" if r else None)
        ranks.reduce_row(failing)
        missing = Row("tp_full_iteration", peak_allocated_gib=None if r == 0 else 0.25, peak_reserved_gib=None)
        ranks.reduce_row(missing)
        report["rows"] = [[row.peak_allocated_gib, row.peak_reserved_gib, row.error] for row in (failing, missing)]
        try:
            ranks.all_built(built=r == 0)  # rank 1 could not build
            report["built"] = "ok"
        except RuntimeError as exc:
            report["built"] = str(exc)
        ranks.all_built(built=True)  # everyone did: no error
    finally:
        (Path(out) / f"rank{r}.json").write_text(json.dumps(report))
        ranks.close()


def test_ranks_agree_on_two_gloo_processes(tmp_path):
    reports = torchrun_reports(__file__, "ranks_worker", tmp_path, 2, timeout=300)
    assert [(r["rank"], r["world"], r["main"], r["backend"]) for r in reports] == [(0, 2, True, "gloo"),
                                                                               (1, 2, False, "gloo")]
    assert reports[0]["max"] == reports[1]["max"] == [2.0, 5.0, 0.0]
    # peak memory: the maximum over ranks; a row failed on rank 1 is failed on rank 0 too
    assert reports[0]["rows"][0] == [2.5, 3.0, "failed on rank 1 (its error is in that rank's output)"]
    assert reports[1]["rows"][0] == [2.5, 3.0, "boom"]
    assert reports[0]["rows"][1] == reports[1]["rows"][1] == [0.25, None, None]  # None on every rank stays None
    assert reports[0]["built"] == "rank 1 could not build this row (its error is in its output); every rank skipped it"
    assert reports[1]["built"] == "ok"  # the rank that failed keeps its own error


def test_rounds_interleave_the_rows_and_compare_each_with_its_peer_round_by_round(monkeypatch, tmp_path):
    """--rounds 3: every row measured once per round in the order A B C A B C ...; step = the median over the
    rounds with the spread kept; the ratio to the peer taken within each round; a row failed in any round is
    failed; the results do not replace a one-round run's files."""
    from graphstep.bench import run

    order = []
    times = {"eager": [20.0, 21.0, 30.0], "local[attn,mlp]": [5.0, 7.0, 4.0],
             "make_graphed_callables": [6.0, 6.5, 5.0], "te[attn,mlp]": [5.5, 6.0, 4.5]}

    def fake_measure(name, build, *, warmup, iters, profile_iters, device, lockstep, host_top=0):
        k = sum(n == name for n in order)
        order.append(name)
        if name == "te[attn,mlp]" and k == 1:
            return Row(name, error="RuntimeError: lost the GPU")
        return Row(name, step_ms=times[name][k], busy_ms=2.5, peak_allocated_gib=1.0 + k, capture_s=0.1 * (k + 1))

    monkeypatch.setattr(run.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(run, "normalize_device", lambda _: torch.device("cpu"))
    monkeypatch.setattr(run, "matmul_tflops", lambda device: 800.0)
    monkeypatch.setattr(run, "make_workload", lambda cfg, device, n_steps: type("Probe", (), {"model": None})())
    monkeypatch.setattr(run, "flops_per_step", lambda cfg, model: 1e12)
    monkeypatch.setattr(run, "environment", lambda device: {"date": "2026-12-05", "gpu": "Test GPU", "torch": "2.x",
                                                            "cuda": "13.0"})
    monkeypatch.setattr(run, "measure", fake_measure)
    rows = ["eager", "local[attn,mlp]", "make_graphed_callables", "te[attn,mlp]"]
    doc = run.run_bench(get_recipe("small_dense_bench"), rows, recipe="small_dense_bench", rounds=3, world_size=1)
    assert order == rows * 3
    eager, local, peer, te = doc["rows"]
    assert doc["method"]["rounds"] == 3
    assert local["step_ms_rounds"] == [5.0, 7.0, 4.0] and local["step_ms"] == 5.0
    assert local["peer"] == "make_graphed_callables"
    assert local["vs_peer_rounds"] == pytest.approx([5 / 6, 7 / 6.5, 4 / 5]) and local["vs_peer"] == pytest.approx(5 / 6)
    assert local["speedup"] == pytest.approx(21.0 / 5.0)  # medians against medians
    assert local["peak_allocated_gib"] == 3.0 and local["capture_s"] == pytest.approx(0.2)
    assert len(local["step_ms_all"]) == 0 and eager["peer"] is None and peer["vs_peer"] is None
    assert te["error"] == "round 2 of 3: RuntimeError: lost the GPU" and te["step_ms"] is None
    md = markdown_table(doc)
    assert "3 rounds, the rows interleaved" in md and "| vs peer | rounds min-max ms |" in md
    assert "| 0.83x make_graphed_callables (0.80-1.08x, ahead in 2/3) | 4.000-7.000 |" in md
    from rich.console import Console

    console = Console(width=300, record=True)
    console.print(table(doc))
    text = console.export_text()
    assert "4.000-7.000" in text and "ahead in 2/3" in text
    header = next(line for line in text.splitlines() if "┃ row" in line)
    assert header.count("┃") == 17  # 16 columns: the failed row adds none
    path = write_results(doc, tmp_path)
    assert path.name == "small_dense_bench_Test-GPU_2026-12-05_rounds3.json"
    with pytest.raises(ValueError, match="rounds >= 1"):
        run.run_bench(get_recipe("small_dense_bench"), rows, recipe="small_dense_bench", rounds=0, world_size=1)


def test_bench_rounds_must_be_a_whole_number_of_one_or_more(capsys):
    from graphstep.cli import main

    with pytest.raises(SystemExit) as info:
        main(["bench", "--recipe", "small_dense_bench", "--rounds", "0"])
    assert info.value.code == 2 and "'0' is not a number of rounds" in capsys.readouterr().err


# --- the packed-row attention benchmark (bench/packed_attention.py) ------------------------------------------


def test_packed_attention_candidates_attend_within_each_document_as_the_model_does():
    """On the CPU: the flattened offsets the varlen candidate gets describe the same documents as the model's
    mask (a per-document causal loop over them equals ``sdpa_mask``), and flex attention equals it too."""
    from graphstep.bench import packed_attention as pa

    shape = pa.Shape("tiny", 2, 64, 4, 2, 16, 5, 30)
    cu = pa.offsets(shape, torch.Generator().manual_seed(0))
    assert cu[:, 0].eq(0).all() and cu[:, -2:].eq(64).all() and (cu.diff(dim=1) >= 0).all()
    cands = pa.candidates(shape, cu, torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 64, 16), torch.randn(2, 2, 64, 16), torch.randn(2, 2, 64, 16)
    ref = cands["sdpa_mask"](q, k, v)
    flat = pa.flat_offsets(cu, 64)
    qf = q.transpose(1, 2).reshape(128, 4, 16)
    kf, vf = (t.transpose(1, 2).reshape(128, 2, 16).repeat_interleave(2, 1) for t in (k, v))
    out = torch.zeros_like(qf)
    for a, b in zip(flat[:-1].tolist(), flat[1:].tolist()):
        if b > a:
            out[a:b] = torch.nn.functional.scaled_dot_product_attention(
                *(t[a:b].transpose(0, 1) for t in (qf, kf, vf)), is_causal=True).transpose(0, 1)
    torch.testing.assert_close(out.view(2, 64, 4, 16).transpose(1, 2), ref)
    assert not torch.allclose(cands["sdpa_causal"](q, k, v), ref)  # the boundaries matter in this data
    if not isinstance(cands["flex"], str):
        torch.testing.assert_close(cands["flex"](q, k, v), ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
def test_packed_attention_without_a_gpu_says_so(tmp_path, capsys):
    from graphstep.bench.packed_attention import main

    assert main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().out and not list(tmp_path.iterdir())


def test_host_breakdown_clocks_count_the_outermost_call_once():
    """benchmarks/host_breakdown.py's clocks: a wrapped call inside another of the same part (a layer replay inside a
    replay, the launch inside both) is time the outer one already counts."""
    import importlib.util
    import time

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "host_breakdown.py"
    spec = importlib.util.spec_from_file_location("host_breakdown", script)
    hb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hb)

    class Work:
        def inner(self):
            time.sleep(0.002)

        def outer(self):
            time.sleep(0.002)
            self.inner()

    clocks = hb.Clocks()
    clocks.wrap(Work, "inner", "part")
    clocks.wrap(Work, "outer", "part")
    Work().outer()
    Work().inner()
    assert clocks.calls["part"] == 2  # the outer call and the lone inner one; the nested inner call is not counted
    assert 0.006 <= clocks.spent["part"] < 0.05
    clocks.reset()
    assert not clocks.spent and not clocks.calls
