"""LoRA (peft=lora; DoRA, peft=dora, too) on 2 data-parallel gloo processes under torchrun, on the CPU replay backend: the graphed runs
equal eager bit for bit on every rank, the ranks agree, and the frozen base weights never move. Adapter dropout
is on: every data-parallel rank draws from the same tracker streams, as in test_distributed.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.launch import exact_list, param_digest, report_runs, torchrun_reports

pytestmark = pytest.mark.slow

# iteration 1 eager, the graphs captured at 2 and replayed at 3 and 4
COMMON = ["train.train_iters=4", "model.cuda_graph_warmup_steps=1", "logger.log_interval=1", "peft=lora", "peft.dim=8",
          "peft.alpha=16", "peft.dropout=0.1"]
RUNS = {
    "eager": ["model.cuda_graph_impl=none"],
    "full_iteration": ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"],
    "attn_mlp": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"],
    "dora_eager": ["peft=dora", "model.cuda_graph_impl=none"],
    "dora_full_iteration": ["peft=dora", "model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"],
}


def _frozen_digest(model) -> str:
    import torch

    frozen = torch.nn.ParameterList([p for n, p in model.named_parameters() if ".lora_" not in n])
    return param_digest(frozen)


def lora_worker(out: str, device: str, runs: str) -> None:
    """The torchrun worker: each run of ``runs`` (JSON: name -> overrides); the weights as built, then trained."""
    import torch

    from helpers.runs import tiny_config
    from graphstep.training.build import RunOptions, build_run
    from graphstep.training.loop import train

    def run(overrides: list[str]) -> dict:
        cfg = tiny_config(*COMMON, f"train.device={device}", *overrides)
        built = build_run(cfg, RunOptions(torch.device(device)))
        start = _frozen_digest(built.model)
        built.close()
        result = train(tiny_config(*COMMON, f"train.device={device}", *overrides), keep_model=True)
        return {"losses": [r["loss"] for r in result.rows], "states": [str(r["state"]) for r in result.rows],
                "params": param_digest(result.model), "frozen_start": start,
                "frozen_end": _frozen_digest(result.model)}

    report_runs(Path(out), device, json.loads(runs), run)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return torchrun_reports(__file__, "lora_worker", tmp_path_factory.mktemp("lora_dp"), 2, "cpu",
                            json.dumps(RUNS), timeout=240)


@pytest.mark.parametrize("name", ["full_iteration", "attn_mlp", "dora_full_iteration"])
def test_graphed_lora_on_two_ranks_equals_eager_bit_for_bit(reports, name):
    ref = "dora_eager" if name.startswith("dora_") else "eager"
    for report in reports:
        assert exact_list(report[name]["losses"]) == exact_list(report[ref]["losses"])
        assert report[name]["params"] == report[ref]["params"]
        assert "replayed" in report[name]["states"][-1].lower()


@pytest.mark.parametrize("name", list(RUNS))
def test_ranks_agree_and_the_base_weights_never_move(reports, name):
    r0, r1 = reports[0][name], reports[1][name]
    assert r0["losses"] == r1["losses"] and r0["params"] == r1["params"]
    for report in reports:
        assert report[name]["frozen_end"] == report[name]["frozen_start"]
