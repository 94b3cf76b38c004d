"""FP8 on 2 gloo processes under torchrun, on the CPU replay backend, in one launch:

* delayed scaling on data-parallel replicas: the replicas max-reduce their amaxes at the end of every step (one
  all-reduce, inside the graph), so every rank holds the same histories and scales although each casts its own
  data; the graphed runs equal eager bit for bit on every rank;
* delayed scaling on FSDP2 (the weights gathered in bf16), ZeRO-3 and ZeRO-2: graphed equals eager, the ranks
  hold the same histories;
* current scaling (torchao) on FSDP2 -- ZeRO-3 (use_megatron_fsdp) and ZeRO-2 (the distributed optimizer): with
  fp8_param_gather the weights are all-gathered in FP8 (torchao's WeightWithDynamicFloat8CastTensor) with scales
  that graphstep computes inside the optimizer step (converters/fp8.py FsdpWeightScales) into tensors the
  graphs keep reading; full_iteration with the optimizer graph equals the same layout eager bit for bit, the
  scales are the whole weights' (fp8_max / amax), and a resumed run continues exactly.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from helpers.launch import exact_list, report_runs, torchrun_reports

pytestmark = pytest.mark.slow

# iteration 1 eager, the graphs captured at 2 and replayed at 3 and 4
COMMON = ["train.train_iters=4", "model.cuda_graph_warmup_steps=1", "logger.log_interval=1", "model.params_dtype=bf16"]
DELAYED = ["mixed_precision=bf16_with_fp8_delayed_scaling_mixed", "mixed_precision.fp8_amax_history_len=3"]
EAGER = ["model.cuda_graph_impl=none"]
FULL = ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"]
ZERO3 = ["mixed_precision.fp8=hybrid", "ddp.use_megatron_fsdp=true",
         "ddp.data_parallel_sharding_strategy=optim_grads_params"]
ZERO2 = ["mixed_precision.fp8=hybrid", "ddp.use_distributed_optimizer=true"]
GATHER = ["mixed_precision.fp8_param_gather=true"]
CKPT = "{out}/ckpt"  # the worker's folder: the graphed ZeRO-3 FP8-gather run saves at 2 and 4, resumed at 2
RUNS = {
    "eager": [*DELAYED, *EAGER],
    "full_iteration": [*DELAYED, *FULL],
    "attn_mlp": [*DELAYED, "model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"],
    "zero3_fp8_gather_eager": [*ZERO3, *GATHER, *EAGER],
    "zero3_fp8_gather_full": [*ZERO3, *GATHER, *FULL, f"checkpoint.save={CKPT}", "checkpoint.save_interval=2"],
    "zero3_bf16_gather_eager": [*ZERO3, *EAGER],
    "zero3_bf16_gather_full": [*ZERO3, *FULL],
    "zero2_fp8_gather_full": [*ZERO2, *GATHER, *FULL],
    "zero3_delayed_eager": [*DELAYED, *ZERO3[1:], "mixed_precision.fp8_param_gather=false", *EAGER],
    "zero3_delayed_full": [*DELAYED, *ZERO3[1:], "mixed_precision.fp8_param_gather=false", *FULL],
    "zero2_delayed_full": [*DELAYED, *ZERO2[1:], "mixed_precision.fp8_param_gather=false", *FULL],
    "zero3_resume": [*ZERO3, *GATHER, *FULL, f"checkpoint.load={CKPT}/iter_0000002"],
}
DELAYED_RUNS = ("eager", "full_iteration", "attn_mlp", "zero3_delayed_full", "zero2_delayed_full")
FSDP_PAIRS = [("zero3_fp8_gather_eager", "zero3_fp8_gather_full"),
              ("zero3_bf16_gather_eager", "zero3_bf16_gather_full"),
              ("zero3_fp8_gather_eager", "zero2_fp8_gather_full"),  # ZeRO-2 holds ZeRO-3's shards
              ("zero3_delayed_eager", "zero3_delayed_full"),
              ("zero3_delayed_eager", "zero2_delayed_full")]


def _scaling_digest(model) -> str:
    from graphstep.converters.fp8_delayed import delayed_modules

    h = hashlib.sha256()
    for m in delayed_modules(model):
        for t in (m.fp8_amax_history, m.fp8_scale):
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _shards_digest(model) -> str:
    """The parameters as this rank holds them (a DTensor's local shard; torchao's FP8-gathered wrapper unwrapped
    by an op it does not keep wrapped)."""
    from graphstep.engines_compat import dtensor_local

    h = hashlib.sha256()
    for p in model.parameters():
        local = dtensor_local(p) if hasattr(p, "to_local") else p
        h.update((local.detach() * 1).float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _fp8_gather_state(model) -> dict:
    """How many weights all-gather in FP8; whether each reads its scale from graphstep's persistent tensor, and
    whether that scale is the whole weight's fp8_max / amax (torchao's arithmetic)."""
    import torch

    from graphstep.engines_compat import dtensor_local, fsdp_float8_scale, fsdp_float8_weight

    gathered, right = 0, True
    for p in model.parameters():
        if not hasattr(p, "to_local") or not fsdp_float8_weight(dtensor_local(p)):
            continue
        gathered += 1
        scale = fsdp_float8_scale(dtensor_local(p))
        amax = p.full_tensor().abs().max().to(torch.float64)  # the whole weight (an all-gather)
        expect = (448.0 / torch.clamp(amax, min=1e-12)).to(torch.float32)
        right = right and scale is not None and torch.equal(scale, expect)
    return {"fp8_gathered": gathered, "scales_right": right}


def fp8_worker(out: str, device: str, runs: str) -> None:
    """The torchrun worker: each run of ``runs`` (JSON: name -> overrides)."""
    from helpers.runs import tiny_config
    from graphstep.converters.fp8_delayed import delayed_modules
    from graphstep.training.loop import train

    def run(overrides: list[str]) -> dict:
        overrides = [o.replace("{out}", str(out)) for o in overrides]
        result = train(tiny_config(*COMMON, f"train.device={device}", *overrides), keep_model=True)
        return {"iterations": [r["iteration"] for r in result.rows], "losses": [r["loss"] for r in result.rows],
                "states": [str(r["state"]) for r in result.rows], "params": _shards_digest(result.model),
                "scaling": _scaling_digest(result.model), "fp8_layers": len(delayed_modules(result.model)),
                **_fp8_gather_state(result.model)}

    report_runs(Path(out), device, json.loads(runs), run)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return torchrun_reports(__file__, "fp8_worker", tmp_path_factory.mktemp("fp8_dp"), 2, "cpu",
                            json.dumps(RUNS), timeout=600)


@pytest.mark.parametrize("name", ["full_iteration", "attn_mlp"])
def test_graphed_delayed_fp8_on_two_ranks_equals_eager_bit_for_bit(reports, name):
    for report in reports:
        assert exact_list(report[name]["losses"]) == exact_list(report["eager"]["losses"])
        assert report[name]["params"] == report["eager"]["params"]
        assert report[name]["scaling"] == report["eager"]["scaling"]
        assert "replayed" in report[name]["states"][-1].lower()


@pytest.mark.parametrize("name", list(DELAYED_RUNS))
def test_replicas_share_their_amax_histories_and_scales(reports, name):
    r0, r1 = reports[0][name], reports[1][name]
    assert r0["fp8_layers"] == r1["fp8_layers"] > 0
    assert r0["losses"] == r1["losses"]
    if not name.startswith("zero"):  # replicas hold the same weights (FSDP2 ranks hold their own shards)
        assert r0["params"] == r1["params"]
    assert r0["scaling"] == r1["scaling"]  # each rank cast its own data; the max-reduction made them agree


@pytest.mark.parametrize("eager_run,graphed_run", FSDP_PAIRS)
def test_fp8_on_fsdp2_graphed_equals_the_same_layout_eager(reports, eager_run, graphed_run):
    for report in reports:
        eager, graphed = report[eager_run], report[graphed_run]
        assert exact_list(graphed["losses"]) == exact_list(eager["losses"])
        assert graphed["params"] == eager["params"] and graphed["scaling"] == eager["scaling"]
        assert "replayed" in graphed["states"][-1].lower()
    assert reports[0][graphed_run]["losses"] == reports[1][graphed_run]["losses"]


def test_fp8_param_gather_all_gathers_fp8_weights_with_the_whole_weights_scales(reports):
    for report in reports:
        for name in ("zero3_fp8_gather_eager", "zero3_fp8_gather_full", "zero2_fp8_gather_full"):
            # 2 decoder layers x 4 linear layers in FP8, each scale rewritten in the optimizer step, in the graph
            assert report[name]["fp8_gathered"] == 8 and report[name]["scales_right"], name
        assert report["zero3_bf16_gather_full"]["fp8_gathered"] == 0
        # the FP8 all-gather changes the numbers (the weights reach the matmul cast from the fp32 shards)
        assert report["zero3_fp8_gather_full"]["losses"] != report["zero3_bf16_gather_full"]["losses"]
        # ZeRO-2 and ZeRO-3 gather the same weights the same way
        assert report["zero2_fp8_gather_full"]["losses"] == report["zero3_fp8_gather_full"]["losses"]


def test_fp8_on_fsdp2_resumes_exactly(reports):
    for report in reports:
        whole, resumed = report["zero3_fp8_gather_full"], report["zero3_resume"]
        assert resumed["iterations"] == [3, 4]
        assert exact_list(resumed["losses"]) == exact_list(whole["losses"][2:])
        assert resumed["params"] == whole["params"] and resumed["scales_right"]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2 or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs 2 CUDA GPUs with FP8 tensor cores")
def test_the_same_on_two_gpus(tmp_path):
    gpu_reports = torchrun_reports(__file__, "fp8_worker", tmp_path, 2, "cuda", json.dumps(RUNS), timeout=600)
    for name in ("full_iteration", "attn_mlp"):
        test_graphed_delayed_fp8_on_two_ranks_equals_eager_bit_for_bit(gpu_reports, name)
    for name in DELAYED_RUNS:
        test_replicas_share_their_amax_histories_and_scales(gpu_reports, name)
    for eager_run, graphed_run in FSDP_PAIRS:
        test_fp8_on_fsdp2_graphed_equals_the_same_layout_eager(gpu_reports, eager_run, graphed_run)
    test_fp8_param_gather_all_gathers_fp8_weights_with_the_whole_weights_scales(gpu_reports)
    test_fp8_on_fsdp2_resumes_exactly(gpu_reports)
