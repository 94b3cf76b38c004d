"""FP8 delayed scaling on 2 data-parallel gloo processes under torchrun, on the CPU replay backend: the replicas
max-reduce their amaxes at the end of every step (one all-reduce, inside the graph), so every rank holds the same
histories and scales although each casts its own data; the graphed runs equal eager bit for bit on every rank."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from helpers.launch import exact_list, param_digest, report_runs, torchrun_reports

pytestmark = pytest.mark.slow

COMMON = ["train.train_iters=6", "logger.log_interval=1", "model.params_dtype=bf16",
          "mixed_precision=bf16_with_fp8_delayed_scaling_mixed", "mixed_precision.fp8_amax_history_len=3"]
RUNS = {
    "eager": ["model.cuda_graph_impl=none"],
    "full_iteration": ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"],
    "attn_mlp": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"],
}


def _scaling_digest(model) -> str:
    from graphstep.converters.fp8_delayed import delayed_modules

    h = hashlib.sha256()
    for m in delayed_modules(model):
        for t in (m.fp8_amax_history, m.fp8_scale):
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def fp8_worker(out: str, device: str, runs: str) -> None:
    """The torchrun worker: each run of ``runs`` (JSON: name -> overrides)."""
    from helpers.runs import tiny_config
    from graphstep.converters.fp8_delayed import delayed_modules
    from graphstep.training.loop import train

    def run(overrides: list[str]) -> dict:
        result = train(tiny_config(*COMMON, f"train.device={device}", *overrides), keep_model=True)
        return {"losses": [r["loss"] for r in result.rows], "states": [str(r["state"]) for r in result.rows],
                "params": param_digest(result.model), "scaling": _scaling_digest(result.model),
                "fp8_layers": len(delayed_modules(result.model))}

    report_runs(Path(out), device, json.loads(runs), run)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return torchrun_reports(__file__, "fp8_worker", tmp_path_factory.mktemp("fp8_dp"), 2, "cpu",
                            json.dumps(RUNS), timeout=400)


@pytest.mark.parametrize("name", ["full_iteration", "attn_mlp"])
def test_graphed_delayed_fp8_on_two_ranks_equals_eager_bit_for_bit(reports, name):
    for report in reports:
        assert exact_list(report[name]["losses"]) == exact_list(report["eager"]["losses"])
        assert report[name]["params"] == report["eager"]["params"]
        assert report[name]["scaling"] == report["eager"]["scaling"]
        assert "replayed" in report[name]["states"][-1].lower()


@pytest.mark.parametrize("name", list(RUNS))
def test_replicas_share_their_amax_histories_and_scales(reports, name):
    r0, r1 = reports[0][name], reports[1][name]
    assert r0["fp8_layers"] == r1["fp8_layers"] > 0
    assert r0["losses"] == r1["losses"] and r0["params"] == r1["params"]
    assert r0["scaling"] == r1["scaling"]  # each rank cast its own data; the max-reduction made them agree
