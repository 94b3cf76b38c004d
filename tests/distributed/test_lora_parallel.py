"""LoRA and DoRA over tensor parallel and FSDP2 on 4 gloo ranks under torchrun, on the CPU replay backend.

One launch; each rank runs every layout of ``LAYOUTS`` in turn: LoRA over 2 tensor-parallel (sequence-parallel) x 2
replicated data-parallel ranks, LoRA over FSDP2 ZeRO-3 (and ZeRO-2, where per-layer graphs run: R27 refuses them
with ZeRO-3) on 4 ranks, and DoRA over 2 tensor-parallel x 2 data-parallel ranks -- each eagerly, with the
full-iteration and optimizer graphs, and with per-layer ``local[attn,mlp]`` graphs, adapter dropout on (after
the adapter in the first layout: a partial sum under a rowwise base, before it in the others). The graphed
runs equal the eager run bit for bit (losses, every rank's adapters and shards), the frozen base weights are
where they started, bit for bit, and take no gradient. With every dropout off, the tensor-parallel runs compute
what the same global batch computes on 4 replicas, to float tolerance: the losses and the adapters, gathered into
their natural (checkpoint) layout -- the fused projections' ``lora_B`` rows and DoRA's magnitudes included.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from helpers.launch import exact_list, report_runs, torchrun_reports
from helpers.reports import graphed_states

pytestmark = [pytest.mark.slow, pytest.mark.ranks4]

ITERS = 3  # eager, captured, replayed
COMMON = [f"train.train_iters={ITERS}", "logger.log_interval=1", "model.cuda_graph_warmup_steps=1",
          "model.use_te_rng_tracker=true", "peft.dim=8", "peft.alpha=16"]
# global batches of micro-batches of 2: 16 samples on the 4 FSDP2 ranks, 8 on 2 tensor-parallel x 2 data-parallel
# ranks -- 2 micro-batches per rank in every layout (gradient accumulation); the 4 replicas the tensor-parallel runs
# are compared with take the same 8 samples, 1 micro-batch each
BATCH_4, BATCH_2 = ["train.global_batch_size=16"], ["train.global_batch_size=8"]
DROPOUT = ["peft.dropout=0.1"]
NO_DROPOUT = ["model.attention_dropout=0.0", "model.hidden_dropout=0.0", "peft.dropout=0.0"]
MODES = {
    "eager": ["model.cuda_graph_impl=none"],
    "full_iteration": ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"],
    "attn_mlp": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"],
}
TP2 = ["model.tensor_model_parallel_size=2"]
ZERO3 = ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"]
ZERO2 = ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads"]
LAYOUTS = {  # layout -> (overrides, the modes it runs)
    # adapter dropout on the adapter's output here (post), on its input (pre) in the other layouts
    "lora_tp2_sp_dp2": (["peft=lora", *TP2, *BATCH_2, "model.sequence_parallel=true", "peft.dropout_position=post"],
                        list(MODES)),
    "lora_fsdp_zero3": (["peft=lora", *ZERO3, *BATCH_4], ["eager", "full_iteration"]),
    "lora_fsdp_zero2": (["peft=lora", *ZERO2, *BATCH_4], ["eager", "attn_mlp"]),
    "dora_tp2_dp2": (["peft=dora", *TP2, *BATCH_2], list(MODES)),
}
# dropout off: tensor parallel against 4 data-parallel replicas
COMPARED = {"lora_tp2_sp_dp2": "lora_dp4", "dora_tp2_dp2": "dora_dp4"}
REPLICAS = {"lora_dp4": ["peft=lora", *BATCH_2], "dora_dp4": ["peft=dora", *BATCH_2]}


def _digest(tensors) -> str:
    from graphstep.parallel.dims import local_tensor

    h = hashlib.sha256()
    for t in tensors:
        h.update(local_tensor(t).detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _adapter(name: str) -> bool:
    return ".lora_" in name


def _frozen_digest(model) -> str:
    return _digest(p for n, p in model.named_parameters() if not _adapter(n))


def _natural_adapters(model) -> dict[str, list[float]]:
    """The adapters as a checkpoint holds them: gathered, the fused projections' rows in q, k, v (gate, up) order."""
    from graphstep.training.checkpoint import LayoutEntries

    out = {}
    for key, t in LayoutEntries().model(model).items():
        whole = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[key] = whole.detach().float().flatten().tolist()
    return out


def _placements(model) -> dict[str, str]:
    """Layer 0's adapter placements over the tensor-parallel ranks."""
    return {n: str(getattr(p, "placements", None)) for n, p in model.named_parameters()
            if n.startswith("layers.0.") and _adapter(n)}


def lora_parallel_worker(out: str, device: str) -> None:
    """The torchrun worker: for each layout, the frozen weights as built, then each mode's run; then the
    dropout-free runs compared across layouts."""
    from helpers.runs import tiny_config
    from graphstep.training.build import RunOptions, build_run
    from graphstep.training.distributed import init_data_parallel
    from graphstep.training.loop import train
    from graphstep.validation import resolve_cuda_graph_settings

    def config(overrides: list[str]):
        return tiny_config(*COMMON, f"train.device={device}", *overrides)

    def built_frozen(overrides: list[str]) -> str:
        cfg = config([*overrides, *MODES["eager"]])
        settings = resolve_cuda_graph_settings(cfg, world_size=torch.distributed.get_world_size())
        dp = init_data_parallel(cfg, settings)  # the caller's group: left as it is
        run = build_run(cfg, RunOptions(torch.device(device), settings=settings, dp=dp))
        digest = _frozen_digest(run.model)
        run.close()
        return digest

    def run(spec: dict) -> dict:
        if spec["kind"] == "built":
            return {"frozen": built_frozen(spec["overrides"])}
        result = train(config(spec["overrides"]), keep_model=True)
        model = result.model
        report = {"losses": [r["loss"] for r in result.rows], "states": [str(r["state"]) for r in result.rows],
                  "shard": _digest(model.parameters()),
                  "adapters": _digest(p for n, p in model.named_parameters() if _adapter(n)),
                  "frozen": _frozen_digest(model), "placements": _placements(model),
                  "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
                  "frozen_grads": [n for n, p in model.named_parameters() if not p.requires_grad
                                   and (p.grad is not None or hasattr(p, "main_grad"))]}
        if spec["kind"] == "nodrop":
            report["natural"] = _natural_adapters(model)
        return report

    runs: dict[str, dict] = {}
    for layout, (overrides, modes) in LAYOUTS.items():
        runs[f"{layout}/built"] = {"kind": "built", "overrides": overrides}
        for mode in modes:
            runs[f"{layout}/{mode}"] = {"kind": "train", "overrides": [*overrides, *DROPOUT, *MODES[mode]]}
    for name, overrides in {**{k: LAYOUTS[k][0] for k in COMPARED}, **REPLICAS}.items():
        runs[f"{name}/nodrop"] = {"kind": "nodrop", "overrides": [*overrides, *NO_DROPOUT, *MODES["eager"]]}
    report_runs(Path(out), device, runs, run)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return torchrun_reports(__file__, "lora_parallel_worker", tmp_path_factory.mktemp("lora_parallel"), 4, "cpu",
                            timeout=600)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_graphed_adapters_over_sharded_layouts_equal_eager_bit_for_bit(reports, layout):
    for report in reports:
        eager = report[f"{layout}/eager"]
        assert len(eager["losses"]) == ITERS and set(eager["states"]) == {"eager"}
        for mode in LAYOUTS[layout][1]:
            run = report[f"{layout}/{mode}"]
            assert exact_list(run["losses"]) == exact_list(eager["losses"]), mode
            assert run["adapters"] == eager["adapters"] and run["shard"] == eager["shard"], mode
            if mode != "eager":
                assert run["states"] == graphed_states(ITERS), mode
    losses = [r[f"{layout}/eager"]["losses"] for r in reports]
    assert all(lo == losses[0] for lo in losses)  # every rank logs the global loss


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_base_weights_never_move_and_only_adapters_train(reports, layout):
    for report in reports:
        for mode in LAYOUTS[layout][1]:
            run = report[f"{layout}/{mode}"]
            assert run["frozen"] == report[f"{layout}/built"]["frozen"], mode
            assert run["trainable"] and all(_adapter(n) for n in run["trainable"]), run["trainable"]
            assert run["frozen_grads"] == [], mode  # no gradient, no gradient buffer: nothing reduce-scattered
    per_layer = 3 if layout.startswith("dora") else 2  # lora_A, lora_B (+ the magnitude)
    assert len(reports[0][f"{layout}/eager"]["trainable"]) == 2 * 4 * per_layer  # 2 layers x 4 projections


def test_adapters_are_sharded_as_megatron_shards_them(reports):
    """Colwise base (linear_qkv, linear_fc1): lora_A replicated, lora_B and the magnitude by rows; rowwise base
    (linear_proj, linear_fc2): lora_A by input columns, lora_B and the magnitude replicated."""
    placements = reports[0]["dora_tp2_dp2/eager"]["placements"]
    for name, placement in placements.items():
        colwise = ".linear_qkv." in name or ".linear_fc1." in name
        if name.endswith("lora_A.weight"):
            want = "(Replicate(),)" if colwise else "(Shard(dim=1),)"
        else:
            want = "(Shard(dim=0),)" if colwise else "(Replicate(),)"
        assert placement == want, name
    assert len(placements) == 12
    shards = [r["dora_tp2_dp2/eager"]["adapters"] for r in reports]  # ranks 0, 1: the tp ranks of replica 0
    assert shards[0] != shards[1] and shards[0] == shards[2] and shards[1] == shards[3]


@pytest.mark.parametrize("layout", list(COMPARED))
def test_tensor_parallel_adapters_compute_what_replicas_compute(reports, layout):
    """Dropout off, the same global batch: tensor parallel and 4 replicas differ only in the order of sums."""
    tp, dp = reports[0][f"{layout}/nodrop"], reports[0][f"{COMPARED[layout]}/nodrop"]
    torch.testing.assert_close(torch.tensor(tp["losses"], dtype=torch.float64),
                               torch.tensor(dp["losses"], dtype=torch.float64), rtol=2e-5, atol=0)
    assert sorted(tp["natural"]) == sorted(dp["natural"]) and len(tp["natural"]) > 0
    assert all(any(tp["natural"][k]) for k in tp["natural"] if "lora_B" in k)  # trained away from B's zeros
    for key, values in dp["natural"].items():
        torch.testing.assert_close(torch.tensor(tp["natural"][key]), torch.tensor(values), rtol=1e-3, atol=1e-5,
                                   msg=key)
    for report in reports[1:]:  # every rank gathers the same natural adapters
        assert report[f"{layout}/nodrop"]["natural"] == tp["natural"]


@pytest.mark.cuda
def test_adapters_over_sharded_layouts_on_four_gpus_graphed_equal_eager(tmp_path):
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs (the nvidia-h100-x4 machine)")
    reports = torchrun_reports(__file__, "lora_parallel_worker", tmp_path, 4, "cuda", timeout=900)
    for layout, (_, modes) in LAYOUTS.items():
        for report in reports:
            eager = report[f"{layout}/eager"]
            for mode in modes:
                assert report[f"{layout}/{mode}"]["losses"] == eager["losses"], (layout, mode)
                assert report[f"{layout}/{mode}"]["shard"] == eager["shard"], (layout, mode)
                assert report[f"{layout}/{mode}"]["frozen"] == report[f"{layout}/built"]["frozen"], (layout, mode)
