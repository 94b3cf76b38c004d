"""graphstep bench without a GPU: row names, derived columns, the table, the chart and the recipes' rows."""

from __future__ import annotations

import pytest
import torch

from graphstep.bench.harness import Row, finish
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


def test_split_rows_keeps_commas_inside_brackets():
    assert split_rows("eager,local[attn,mlp],te[],compile[reduce-overhead]") == [
        "eager", "local[attn,mlp]", "te[]", "compile[reduce-overhead]"]


def test_row_overrides():
    assert "model.cuda_graph_impl=transformer_engine" in row_overrides("te[attn,mlp]")
    assert "model.cuda_graph_modules=[attn,mlp]" in row_overrides("te[attn,mlp]")
    assert "model.cuda_graph_modules=[]" in row_overrides("local[]")
    assert "optimizer.optimizer_cuda_graph=true" in row_overrides("full_iteration+optimizer")
    assert "model.cuda_graph_impl=full_iteration" in row_overrides("compile+full_iteration")
    assert row_overrides("manual_graph") is None and row_overrides("compile[reduce-overhead]") is None


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
            Row("full_iteration", step_ms=3.3, busy_ms=3.0, kernels=900, peak_allocated_gib=1.05, capture_s=0.2),
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
    assert "| full_iteration | 3.300 | 3.000 | 0.300 | 900 | - | 6.06x | 1.10x |" in md
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
