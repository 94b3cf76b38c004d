"""Rules R1-R24 (R20 in test_compile.py) and the V checks, the migrations, and resolution of the graph settings.

Every rule has a case that breaks it (checked for the rule id, a distinctive
part of the message and of the fix) and a close variant that is clean. Configs
are built the way users build them: from the graph-friendly baseline
(tracker on, host-side NaN checks off) plus Bridge-style dotted overrides.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphstep.config import Config, ConfigError, apply_overrides, iter_fields
from helpers.runs import graph_config
from graphstep.validation import graph_rules
from graphstep.cuda_graph import settings as cg
from graphstep.cuda_graph.settings import CudaGraphSettings, GraphImpl
from graphstep.validation import (
    ConfigValidationError,
    Violation,
    apply_perf_flags,
    format_violations,
    normalize_cuda_graph_config,
    resolve_cuda_graph_settings,
    validate_config,
)

MULTI_GPU_EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6,expandable_segments:True",
                        "WORLD_SIZE": "2"}


def make(*overrides: str) -> Config:
    """The graph-friendly baseline plus overrides (conftest.graph_config)."""
    return graph_config(*overrides)


def check(cfg: Config, env: dict[str, str] | None = None, **kwargs) -> list[Violation]:
    kwargs.setdefault("device_capability", (9, 0))
    return validate_config(cfg, env=env or {}, **kwargs)


def rules(violations: list[Violation]) -> set[str]:
    return {v.rule for v in violations}


@dataclass
class Case:
    rule: str
    bad: tuple[str, ...]
    message: str
    fix: str
    good: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    good_env: dict[str, str] | None = None  # None: the same env as the bad case


EXPERTS = ("model.num_moe_experts=4",)
CASES = {
    "R1": Case("R1", ("model.cuda_graph_impl=locl",), "model.cuda_graph_impl=locl is not one of",
               "model.cuda_graph_impl=local", ("model.cuda_graph_impl=local",)),
    "R2-unknown": Case("R2", ("model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,atn]"),
                       "atn in model.cuda_graph_modules is not a scope name", "did you mean attn",
                       ("model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn]")),
    "R2-both-fields": Case("R2", ("model.cuda_graph_impl=local", "model.cuda_graph_scope=[attn]",
                                  "model.cuda_graph_modules=[mlp]"), "are both set", "model.cuda_graph_scope=null",
                           ("model.cuda_graph_impl=local", "model.cuda_graph_scope=[attn]")),
    "R2-full-combined": Case("R2", ("model.cuda_graph_impl=local", "model.cuda_graph_scope=[full,attn]"),
                             "combines full (the whole layer)", "model.cuda_graph_scope=[]",
                             ("model.cuda_graph_impl=local", "model.cuda_graph_scope=full")),
    "R3": Case("R3", ("model.cuda_graph_impl=local", "model.enable_cuda_graph=true"),
               "deprecated model.enable_cuda_graph=true is combined with model.cuda_graph_impl=local",
               "model.enable_cuda_graph=false", ("model.cuda_graph_impl=local",)),
    "R3-both-flags": Case("R3", ("model.enable_cuda_graph=true", "model.external_cuda_graph=true"),
                          "are both set", "model.cuda_graph_impl=transformer_engine",
                          ("model.enable_cuda_graph=true",)),
    "R4-mixed": Case("R4", ("model.cuda_graph_impl=local", "model.cuda_graph_scope=[full_iteration,attn]"),
                     "combines full_iteration with other scopes", "model.cuda_graph_impl=full_iteration",
                     ("model.cuda_graph_impl=local", "model.cuda_graph_scope=[full_iteration]")),
    "R4-te": Case("R4", ("model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=[full_iteration]"),
                  "transformer_engine graphs are per layer", "model.cuda_graph_impl=full_iteration",
                  ("model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=[attn]")),
    "R4-modules": Case("R4", ("model.cuda_graph_impl=full_iteration", "model.cuda_graph_modules=[attn]"),
                       "full_iteration captures the whole iteration", "model.cuda_graph_modules=[]",
                       ("model.cuda_graph_impl=full_iteration",)),
    "R5": Case("R5", ("model.cuda_graph_impl=local", "model.use_te_rng_tracker=false"),
               "graph-safe RNG tracker is off", "model.use_te_rng_tracker=true", ("model.cuda_graph_impl=local",)),
    "R6": Case("R6", ("model.cuda_graph_impl=full_iteration", "rerun_state_machine.check_for_nan_in_loss=true"),
               "Megatron's host-side check inside the step", "train.check_for_nan_on_device=true",
               ("model.cuda_graph_impl=full_iteration", "ddp.check_for_nan_in_grad=true")),
    "R7": Case("R7", ("model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[moe,moe_router]")
               + EXPERTS,
               "the router would be captured twice", "moe_router with moe_preprocess",
               ("model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[moe]") + EXPERTS),
    "R8": Case("R8", ("model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[attn,moe_preprocess]")
               + EXPERTS, "moe_preprocess without moe_router", "add moe_router",
               ("model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[attn,moe_router,moe_preprocess]")
               + EXPERTS),
    "R9": Case("R9", ("model.cuda_graph_impl=local", "model.cuda_graph_modules=[moe_router]"),
               "no experts (model.num_moe_experts=null)", "remove moe_router, moe_preprocess",
               ("model.cuda_graph_impl=local", "model.cuda_graph_modules=[moe_router]") + EXPERTS),
    "R9-hybrid": Case("R9", ("model.cuda_graph_impl=local", "model.cuda_graph_modules=[moe]", "model.num_layers=4",
                             "model.hybrid_override_pattern=M*-M") + EXPERTS, "has no E layer", "remove moe",
                      ("model.cuda_graph_impl=local", "model.cuda_graph_modules=[moe]", "model.num_layers=4",
                       "model.hybrid_override_pattern=M*-E") + EXPERTS),
    "R10": Case("R10", ("model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]") + EXPERTS,
                "no layer has a dense MLP", "remove mlp",
                ("model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]", "model.moe_layer_freq=2")
                + EXPERTS),
    "R10-hybrid": Case("R10", ("model.cuda_graph_impl=local", "model.cuda_graph_modules=[mlp]", "model.num_layers=4",
                               "model.hybrid_override_pattern=M*E*") + EXPERTS, "has no - (dense MLP) layer",
                       "remove mlp", ("model.cuda_graph_impl=local", "model.cuda_graph_modules=[mlp]",
                                      "model.num_layers=4", "model.hybrid_override_pattern=M*-E") + EXPERTS),
    "R11": Case("R11", ("model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[moe]",
                        "model.moe_sync_free=false") + EXPERTS, "dropless routing with model.moe_sync_free=false",
                "model.moe_sync_free=true", ("model.cuda_graph_impl=transformer_engine",
                                             "model.cuda_graph_modules=[moe]") + EXPERTS),
    "R11-whole-layer": Case("R11", ("model.cuda_graph_impl=local", "model.moe_sync_free=false") + EXPERTS,
                            "(the whole layer) includes the MoE block", "model.moe_sync_free=true",
                            ("model.cuda_graph_impl=local", "model.moe_sync_free=false",
                             "model.cuda_graph_modules=[attn]") + EXPERTS),
    "R11-full-iteration": Case("R11", ("model.cuda_graph_impl=full_iteration", "model.moe_sync_free=false") + EXPERTS,
                               "model.cuda_graph_impl=full_iteration captures the MoE block, but dropless routing "
                               "with model.moe_sync_free=false", "model.moe_sync_free=true",
                               ("model.cuda_graph_impl=full_iteration", "model.moe_sync_free=true") + EXPERTS),
    "R12": Case("R12", ("model.cuda_graph_impl=transformer_engine",
                        "model.cuda_graph_modules=[moe_router,moe_preprocess]",
                        "model.moe_sync_free=false") + EXPERTS, "copies token counts to the host",
                "model.moe_sync_free=true",
                ("model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[moe_router,moe_preprocess]",
                 "model.moe_sync_free=false", "model.moe_expert_capacity_factor=1.25") + EXPERTS),
    "R12-local": Case("R12", ("model.cuda_graph_impl=local", "model.cuda_graph_modules=[moe_router]",
                              "model.moe_sync_free=false") + EXPERTS, "(local captures it with moe_router)",
                      "remove moe_preprocess and moe_router", ("model.cuda_graph_impl=local",
                                                               "model.cuda_graph_modules=[moe_router]") + EXPERTS),
    "R13": Case("R13", ("model.cuda_graph_impl=local", "model.cuda_graph_modules=[mamba]"),
                "has no Mamba layer (model.hybrid_override_pattern=null)", "[attn,mamba]",
                ("model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mamba]")),
    "R15-full": Case("R15", ("model.cuda_graph_impl=local", "model.recompute_granularity=full"),
                     "model.recompute_granularity=full", "model.cuda_graph_impl=full_iteration",
                     ("model.cuda_graph_impl=full_iteration", "model.recompute_granularity=full")),
    "R15-attn-dropout": Case("R15", ("model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn]",
                                     "model.recompute_granularity=selective", "model.attention_dropout=0.1"),
                             "recompute of core_attn inside the graphed attn scope", "model.attention_dropout=0.0",
                             ("model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn]",
                              "model.recompute_granularity=selective", "model.attention_dropout=0.0")),
    "R15-mlp-dropout": Case("R15", ("model.cuda_graph_impl=local", "model.recompute_granularity=selective",
                                    "model.recompute_modules=[mlp]", "model.hidden_dropout=0.1"),
                            "recompute of mlp inside the graphed mlp scope", "remove mlp from model.recompute_modules",
                            ("model.cuda_graph_impl=local", "model.recompute_granularity=selective",
                             "model.recompute_modules=[mlp]", "model.hidden_dropout=0.0")),
    "R16": Case("R16", ("model.cuda_graph_impl=transformer_engine",), "expandable_segments:True",
                "export NCCL_GRAPH_REGISTER=0", ("model.cuda_graph_impl=transformer_engine",), MULTI_GPU_EXPANDABLE,
                {**MULTI_GPU_EXPANDABLE, "NCCL_GRAPH_REGISTER": "0"}),
    "R17": Case("R17", ("model.cuda_graph_impl=full_iteration", "model.variable_seq_lengths=true"),
                "no data.seq_length_buckets", "set data.seq_length_buckets",
                ("model.cuda_graph_impl=full_iteration", "model.variable_seq_lengths=true",
                 "data.seq_length_buckets=[64,128]")),
    "R17-layers": Case("R17", ("model.cuda_graph_impl=local", "model.variable_seq_lengths=true"),
                       "no data.seq_length_buckets", "with model.cuda_graph_impl=full_iteration (one graph per bucket",
                       ("model.cuda_graph_impl=full_iteration", "model.variable_seq_lengths=true",
                        "data.seq_length_buckets=[64,128]")),
    "R18": Case("R18", ("data.reset_position_ids=true",), "graphstep does not implement data.reset_position_ids "
                "(set to true)", "data.reset_position_ids=false (its default)", ()),
    "V-warmup": Case("V", ("model.cuda_graph_warmup_steps=-1",), "model.cuda_graph_warmup_steps=-1 is below 0",
                     "model.cuda_graph_warmup_steps to 0 or more", ("model.cuda_graph_warmup_steps=0",)),
    "V-backend": Case("V", ("model.cuda_graph_backend=gpu",), "model.cuda_graph_backend=gpu is not one of",
                      "model.cuda_graph_backend=auto", ("model.cuda_graph_backend=replay",)),
    "R21": Case("R21", ("model.cuda_graph_impl=local", "data.seq_length_buckets=[64,128]"),
                "data.seq_length_buckets=[64, 128] with per-layer graphs (model.cuda_graph_impl=local) is not "
                "implemented", "set model.cuda_graph_impl=full_iteration (one graph per bucket)",
                ("model.cuda_graph_impl=full_iteration", "data.seq_length_buckets=[64,128]")),
    "R22": Case("R22", ("ddp.grad_reduce_in_fp32=false",), "ddp.grad_reduce_in_fp32=false with 2 data-parallel "
                "ranks is not implemented", "set ddp.grad_reduce_in_fp32=true", (), {"WORLD_SIZE": "2"},
                {"WORLD_SIZE": "1"}),
    "R23": Case("R23", ("model.moe_token_dispatcher_type=deepep",), "model.moe_token_dispatcher_type=deepep is not "
                "implemented", "set model.moe_token_dispatcher_type=allgather",
                ("model.moe_token_dispatcher_type=flex",)),
    "R23-garbage": Case("R23", ("model.moe_token_dispatcher_type=anything",), "=anything is not implemented",
                        "alltoall or flex", ("model.moe_token_dispatcher_type=allgather",)),
    "R24": Case("R24", ("train.skip_step_on_nan=true", "train.check_for_nan_on_device=false"),
                "train.skip_step_on_nan=true needs the device-side flag it skips on",
                "set train.check_for_nan_on_device=true", ("train.skip_step_on_nan=true",)),
    "R25-world": Case("R25", ("model.tensor_model_parallel_size=2",), "model.tensor_model_parallel_size=2 does not "
                      "divide the world size 3", "launch a multiple of 2 processes", ("model.tensor_model_parallel_size=1",),
                      {"WORLD_SIZE": "3"}, {"WORLD_SIZE": "2"}),
    "R25-heads": Case("R25", ("model.tensor_model_parallel_size=2", "model.num_attention_heads=3",
                              "model.hidden_size=96"), "model.num_attention_heads=3 does not divide over "
                      "model.tensor_model_parallel_size=2 ranks", "set model.tensor_model_parallel_size to a divisor "
                      "of 3", ("model.tensor_model_parallel_size=2", "model.num_attention_heads=4"), {"WORLD_SIZE": "2"}),
    # a hybrid model under tensor parallel: each rank runs half of the Mamba heads and whole groups of B and C
    "R25-mamba": Case("R25", ("model.tensor_model_parallel_size=2", "model.hybrid_override_pattern=M*",
                              "model.num_layers=2", "model.mamba_num_groups=1"), "model.mamba_num_groups=1 does not "
                      "divide over model.tensor_model_parallel_size=2 ranks", "set model.mamba_num_groups so that it "
                      "divides by 2", ("model.tensor_model_parallel_size=2", "model.hybrid_override_pattern=M*",
                                       "model.num_layers=2", "model.mamba_num_groups=2"), {"WORLD_SIZE": "2"}),
    "R26": Case("R26", ("ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim"),
                "ddp.data_parallel_sharding_strategy=optim is not implemented: optim (ZeRO-1) keeps gradients whole",
                "set ddp.data_parallel_sharding_strategy=optim_grads (ZeRO-2)",
                ("ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads")),
    "R26-gather": Case("R26", ("ddp.overlap_param_gather=true",), "ddp.overlap_param_gather=true overlaps the "
                       "all-gather of sharded parameters", "set ddp.use_distributed_optimizer=true",
                       ("ddp.overlap_param_gather=true", "ddp.use_distributed_optimizer=true")),
    "R27-layers": Case("R27", ("ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params",
                               "model.cuda_graph_impl=local", "model.use_te_rng_tracker=true"),
                       "FSDP2 (ddp.use_megatron_fsdp=true, ddp.data_parallel_sharding_strategy=optim_grads_params) with "
                       "per-layer graphs (model.cuda_graph_impl=local) would not save the parameter memory ZeRO-3 is "
                       "for", "set ddp.data_parallel_sharding_strategy=optim_grads (ZeRO-2",
                       ("ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads",
                        "model.cuda_graph_impl=local", "model.use_te_rng_tracker=true")),
    "R27-moe": Case("R27", ("ddp.use_distributed_optimizer=true", "model.num_moe_experts=4"),
                    "FSDP2 (ddp.use_distributed_optimizer=true) with model.num_moe_experts=4 (an MoE model) and "
                    "model.expert_model_parallel_size=1 is not implemented", "set model.expert_model_parallel_size=2 "
                    "or more", ("ddp.use_distributed_optimizer=true", "model.num_moe_experts=4",
                                "model.expert_model_parallel_size=2"), {"WORLD_SIZE": "2"}),
    "R27-moe-both": Case("R27", ("model.tensor_model_parallel_size=2", "ddp.use_distributed_optimizer=true",
                                 "model.num_moe_experts=4"),
                         "model.tensor_model_parallel_size=2 and FSDP2 (ddp.use_distributed_optimizer=true) with "
                         "model.num_moe_experts=4 (an MoE model) is not implemented", "train MoE models with tensor "
                         "parallel over replicated data parallel", ("model.tensor_model_parallel_size=2",
                                                                    "model.num_moe_experts=4"), {"WORLD_SIZE": "4"}),
    "R27-warmup": Case("R27", ("model.tensor_model_parallel_size=2", "model.cuda_graph_impl=full_iteration",
                               "model.use_te_rng_tracker=true", "model.cuda_graph_warmup_steps=0"),
                       "model.cuda_graph_warmup_steps=0 (the first iteration would be captured",
                       "set model.cuda_graph_warmup_steps=1 or more", ("model.tensor_model_parallel_size=2",
                       "model.cuda_graph_impl=full_iteration", "model.use_te_rng_tracker=true",
                       "model.cuda_graph_warmup_steps=1"), {"WORLD_SIZE": "2"}),
    "V-pattern": Case("V", ("model.hybrid_override_pattern=M*-",), "describes 3 layers but model.num_layers=2",
                      "model.num_layers=3", ("model.hybrid_override_pattern=M*",)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rule_reports_problem_and_fix(name: str) -> None:
    case = CASES[name]
    found = [v for v in check(make(*case.bad), case.env) if v.rule == case.rule]
    assert found, f"{name}: expected a {case.rule} violation"
    assert any(case.message in v.message for v in found), [v.message for v in found]
    assert any(case.fix in v.fix for v in found), [v.fix for v in found]
    assert all(v.fields and v.fix for v in found)
    good_env = case.env if case.good_env is None else case.good_env
    assert check(make(*case.good), good_env) == [], f"{name}: the clean variant should have no violation"


def test_every_rule_has_a_case() -> None:
    assert {c.rule for c in CASES.values()} >= {f"R{i}" for i in range(1, 28)} - {"R14", "R19", "R20"} | {"V"}


SHARDED_LAYOUTS = {
    "tp2_sp": ("model.tensor_model_parallel_size=2", "model.sequence_parallel=true"),
    "zero3": ("ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"),
    "zero2": ("ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads"),
    "dist_opt": ("ddp.use_distributed_optimizer=true",),
    "dp2_tp2_zero3": ("model.tensor_model_parallel_size=2", "ddp.use_megatron_fsdp=true",
                      "ddp.data_parallel_sharding_strategy=optim_grads_params"),
}
RECOMPUTES = {
    "selective": ("model.recompute_granularity=selective", "model.recompute_modules=[core_attn,mlp]",
                  "model.attention_dropout=0.0", "model.hidden_dropout=0.0"),
    "full": ("model.recompute_granularity=full", "model.recompute_method=block", "model.recompute_num_layers=1",
             "model.attention_dropout=0.0", "model.hidden_dropout=0.0"),
}


@pytest.mark.parametrize("impl", ["none", "full_iteration"])
@pytest.mark.parametrize("recompute", list(RECOMPUTES))
@pytest.mark.parametrize("layout", list(SHARDED_LAYOUTS))
def test_r27_takes_recompute_with_tensor_parallel_and_fsdp2(layout, recompute, impl) -> None:
    """Activation recompute, selective and full, eager and inside the full-iteration graph, over tensor (+ sequence)
    parallel and FSDP2 ZeRO-2/ZeRO-3 (tests/distributed/test_parallel.py runs them)."""
    cfg = make(*SHARDED_LAYOUTS[layout], *RECOMPUTES[recompute], f"model.cuda_graph_impl={impl}",
               "train.global_batch_size=32")
    assert check(cfg, {"WORLD_SIZE": "4"}) == []


def test_recompute_over_sharded_layouts_keeps_the_dropout_rules() -> None:
    """R27 takes recompute; R35 (eager) and R15 (graphed) still refuse dropout inside a recomputed region, and
    R15 full recompute with per-layer graphs, as on one process."""
    tp = SHARDED_LAYOUTS["tp2_sp"]
    full = ("model.recompute_granularity=full", "model.attention_dropout=0.1")
    assert rules(check(make(*tp, *full), {"WORLD_SIZE": "2"})) == {"R35"}
    selective = ("model.recompute_granularity=selective", "model.recompute_modules=[core_attn]",
                 "model.attention_dropout=0.1")
    assert rules(check(make(*tp, *selective, "model.cuda_graph_impl=full_iteration"), {"WORLD_SIZE": "2"})) == {"R15"}
    zero2 = SHARDED_LAYOUTS["zero2"]
    assert rules(check(make(*zero2, *RECOMPUTES["full"], "model.cuda_graph_impl=local",
                            "model.cuda_graph_modules=[attn,mlp]"), {"WORLD_SIZE": "2"})) == {"R15"}
    assert check(make(*zero2, *RECOMPUTES["selective"], "model.cuda_graph_impl=local",
                      "model.cuda_graph_modules=[attn,mlp]"), {"WORLD_SIZE": "2"}) == []


def test_violation_str_names_rule_fields_and_fix() -> None:
    (v,) = check(make("model.cuda_graph_impl=local", "model.use_te_rng_tracker=false"))
    assert str(v).startswith("R5 [model.use_te_rng_tracker, rng.te_rng_tracker, model.cuda_graph_impl]: ")
    assert " Fix: set model.use_te_rng_tracker=true" in str(v)


# --- R16: the device-capability and world-size parts ------------------------------


@pytest.mark.parametrize("capability, device, expected", [
    ((9, 0), "auto", True), ((10, 0), "auto", False), (None, "cuda", True), (None, "auto", False),
])
def test_r16_local_depends_on_capability(monkeypatch, capability, device, expected) -> None:
    monkeypatch.setattr(graph_rules, "_capability", lambda v: v.capability)  # no GPU probing in this test
    cfg = make("model.cuda_graph_impl=local", f"train.device={device}")
    found = rules(validate_config(cfg, env=MULTI_GPU_EXPANDABLE, device_capability=capability))
    assert ("R16" in found) is expected


def test_r16_needs_captured_collectives_and_registration() -> None:
    cfg = make("model.cuda_graph_impl=transformer_engine")
    assert "R16" in rules(check(cfg, MULTI_GPU_EXPANDABLE))
    assert "R16" not in rules(check(cfg, MULTI_GPU_EXPANDABLE, world_size=1))
    assert "R16" not in rules(check(cfg, {**MULTI_GPU_EXPANDABLE, "NCCL_GRAPH_REGISTER": "0"}))
    segments_off = {**MULTI_GPU_EXPANDABLE, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    assert "R16" not in rules(check(cfg, segments_off))


# --- R18 and V -----------------------------------------------------------------


def _non_default(default, section: str, name: str):
    """A value of the field's type other than its default."""
    from graphstep.config import _matches, field_type

    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    for candidate in ("e4m3", 0.5, 7, [7], {"a": 1}):
        ok, value = _matches(candidate, field_type(section, name))
        if ok and value != default:
            return value
    raise AssertionError((section, name))


@pytest.mark.parametrize("key", [f"{s}.{n}" for s, n, *_r, unsup in iter_fields() if unsup])
def test_r18_every_unsupported_field(key: str) -> None:
    section, name = key.split(".")
    cfg = make()
    setattr(getattr(cfg, section), name, _non_default(getattr(getattr(Config(), section), name), section, name))
    (v,) = check(cfg)
    assert v.rule == "R18" and v.fields == (key,) and f"graphstep does not implement {key}" in v.message


def test_value_checks_types_world_size_and_heads() -> None:
    cfg = make()
    cfg.model.num_layers = "two"
    assert any(v.rule == "V" and "expected int" in v.message for v in check(cfg))
    (batch,) = [v for v in check(make("train.global_batch_size=8"), world_size=4) if v.rule == "V13"]
    assert "x 4 data-parallel rank(s) = 16" in batch.message and "train.global_batch_size=16" in batch.fix
    assert "V" in rules(check(make("model.num_attention_heads=3")))
    assert "V" in rules(check(make("model.num_query_groups=3")))
    assert "V" in rules(check(make("model.num_moe_experts=1")))  # moe_router_topk=2 > 1 expert
    assert [v for v in validate_config(make("model.cuda_graph_backend=gpu"), env={}) if v.rule.startswith("R")] == []


# --- migrations ------------------------------------------------------------------


def resolved(*overrides: str) -> CudaGraphSettings:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return resolve_cuda_graph_settings(make(*overrides), env={}, device_capability=(9, 0))


def test_both_spellings_of_full_iteration_are_the_same() -> None:
    legacy = resolved("model.cuda_graph_impl=local", "model.cuda_graph_scope=[full_iteration]")
    comma = resolved("model.cuda_graph_impl=local", "model.cuda_graph_scope=full_iteration")
    current = resolved("model.cuda_graph_impl=full_iteration")
    assert legacy == comma == current
    assert current.impl is GraphImpl.FULL_ITERATION and current.modules == () and current.full_iteration


def test_legacy_scope_moves_into_impl_and_modules() -> None:
    cfg = make("model.cuda_graph_impl=local", "model.cuda_graph_scope=[full_iteration]")
    normalize_cuda_graph_config(cfg)
    assert (cfg.model.cuda_graph_impl, cfg.model.cuda_graph_modules, cfg.model.cuda_graph_scope) == (
        "full_iteration", [], None)


def test_comma_string_scope_keeps_every_name() -> None:
    s = resolved("model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=attn,mlp")
    assert s.modules == ("attn", "mlp") and s.per_layer and s.enabled


@pytest.mark.parametrize("override", ["model.cuda_graph_scope=full", "model.cuda_graph_scope=[full]",
                                      "model.cuda_graph_scope=[]", "model.cuda_graph_modules=[full]"])
def test_full_means_whole_layer(override: str) -> None:
    s = resolved("model.cuda_graph_impl=local", override)
    assert s.impl is GraphImpl.LOCAL and s.modules == ()


def test_modules_full_string_means_whole_layer() -> None:
    cfg = make("model.cuda_graph_impl=local")
    cfg.model.cuda_graph_modules = "full"  # the override parser only takes lists for this field (see config.py)
    assert resolve_cuda_graph_settings(cfg, env={}).modules == () and cfg.model.cuda_graph_modules == []


@pytest.mark.parametrize("scope", ["[attn,mlp]", "[full_iteration]"])
def test_none_clears_and_does_not_promote(scope: str) -> None:
    cfg = make("model.cuda_graph_impl=none", f"model.cuda_graph_scope={scope}")
    normalize_cuda_graph_config(cfg)
    assert (cfg.model.cuda_graph_impl, cfg.model.cuda_graph_scope, cfg.model.cuda_graph_modules) == ("none", None, [])
    assert not resolved("model.cuda_graph_impl=none", f"model.cuda_graph_scope={scope}").enabled


@pytest.mark.parametrize("flag, impl", [("enable_cuda_graph", "local"), ("external_cuda_graph", "transformer_engine")])
def test_deprecated_flags_migrate_with_warning(flag: str, impl: str) -> None:
    cfg = make(f"model.{flag}=true")
    with pytest.warns(DeprecationWarning, match=f"model.{flag} is deprecated: use model.cuda_graph_impl={impl}"):
        notes = normalize_cuda_graph_config(cfg)
    assert f"model.{flag} is deprecated: use model.cuda_graph_impl={impl}" in notes
    assert cfg.model.cuda_graph_impl == impl and getattr(cfg.model, flag) is False


def test_deprecated_flag_with_legacy_full_iteration_scope() -> None:
    assert resolved("model.enable_cuda_graph=true", "model.cuda_graph_scope=[full_iteration]").full_iteration


@pytest.mark.parametrize("key", ["model.use_te_rng_tracker", "rng.te_rng_tracker"])
def test_either_tracker_flag_turns_on_both(key: str) -> None:
    cfg = Config()
    apply_overrides(cfg, [f"{key}=true"])
    normalize_cuda_graph_config(cfg)
    assert cfg.model.use_te_rng_tracker is True and cfg.rng.te_rng_tracker is True


@pytest.mark.parametrize("asked, expected", [("[attn,moe_router]", ("attn", "moe_router", "moe_preprocess")),
                                             ("[moe_preprocess]", ("moe_router", "moe_preprocess"))])
def test_local_pairs_router_and_preprocess(asked: str, expected: tuple[str, ...]) -> None:
    assert resolved("model.cuda_graph_impl=local", f"model.cuda_graph_modules={asked}", *EXPERTS).modules == expected
    te = make("model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[moe_router]", *EXPERTS)
    normalize_cuda_graph_config(te)
    assert te.model.cuda_graph_modules == ["moe_router"]


IDEMPOTENCE = [
    ("model.cuda_graph_impl=local", "model.cuda_graph_scope=[full_iteration]"),
    ("model.enable_cuda_graph=true", "model.cuda_graph_scope=attn,moe_router"),
    ("model.cuda_graph_impl=local", "model.cuda_graph_scope=[attn]", "model.cuda_graph_modules=[mlp]"),
    ("model.external_cuda_graph=true", "model.cuda_graph_impl=local"),
    ("model.cuda_graph_impl=none", "model.cuda_graph_scope=full", "rng.te_rng_tracker=true"),
]


@pytest.mark.parametrize("overrides", IDEMPOTENCE)
def test_normalize_is_idempotent(overrides: tuple[str, ...]) -> None:
    once, twice = make(*overrides), make(*overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        normalize_cuda_graph_config(once)
        normalize_cuda_graph_config(twice)
        assert normalize_cuda_graph_config(twice) == []
    assert once.to_dict() == twice.to_dict()


def test_validate_leaves_the_callers_config_alone() -> None:
    cfg = make("model.enable_cuda_graph=true", "model.cuda_graph_scope=attn,mlp")
    before = cfg.to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # validate itself does not warn
        check(cfg)
    assert cfg.to_dict() == before


def test_perf_flags_set_impl_scope_and_both_trackers() -> None:
    cfg = Config()
    cfg.model.cuda_graph_modules = ["mlp"]  # a recipe's coverage: the flag replaces it
    apply_perf_flags(cfg, "transformer_engine", "attn,moe_router")
    assert cfg.model.cuda_graph_scope == ["attn", "moe_router"] and cfg.model.cuda_graph_modules == []
    assert cfg.model.use_te_rng_tracker is True and cfg.rng.te_rng_tracker is True
    off = Config()
    apply_perf_flags(off, "none", None)
    assert off.model.use_te_rng_tracker is False and off.rng.te_rng_tracker is False
    full = Config()
    apply_perf_flags(full, "local", "full_iteration")
    assert full.model.cuda_graph_scope == ["full_iteration"] and full.rng.te_rng_tracker is True


# --- reporting everything at once ---------------------------------------------------


def test_all_violations_are_reported_together() -> None:
    cfg = make("model.cuda_graph_impl=full_iteration", "model.cuda_graph_modules=[attn]",
               "model.use_te_rng_tracker=false", "rerun_state_machine.check_for_nan_in_loss=true")
    found = check(cfg)
    assert rules(found) >= {"R4", "R5", "R6"}
    text = format_violations(found)
    assert text.splitlines()[0] == f"{len(found)} configuration violations:"
    assert all(str(v) in text for v in found)


def test_resolve_raises_with_every_rule_id() -> None:
    cfg = make("model.cuda_graph_impl=full_iteration", "model.cuda_graph_modules=[attn]",
               "model.use_te_rng_tracker=false", "rerun_state_machine.check_for_nan_in_loss=true", "data.reset_position_ids=true")
    with pytest.raises(ConfigValidationError) as info:
        resolve_cuda_graph_settings(cfg, env={})
    assert isinstance(info.value, ConfigError)
    assert {"R4", "R5", "R6", "R18"} <= rules(info.value.violations)
    assert all(f"{rule} [" in str(info.value) for rule in ("R4", "R5", "R6", "R18"))


def test_resolve_returns_settings_for_a_clean_config() -> None:
    cfg = make("model.cuda_graph_impl=local", "model.cuda_graph_scope=[attn,mlp]",
               "optimizer.optimizer_cuda_graph=true", "model.cuda_graph_warmup_steps=5")
    s = resolve_cuda_graph_settings(cfg, env={})
    assert s == CudaGraphSettings(impl=GraphImpl.LOCAL, modules=("attn", "mlp"), warmup_steps=5,
                                  use_single_mempool=True, retain_backward_graph=False, optimizer_graph=True,
                                  backend="auto", on_failure="raise")
    assert cfg.model.cuda_graph_scope is None and cfg.model.cuda_graph_modules == ["attn", "mlp"]


# --- nothing raises, whatever the values --------------------------------------------

GARBAGE = st.one_of(st.integers(-3, 3), st.none(), st.text(max_size=6), st.booleans(), st.floats(allow_nan=True))
NAMES = st.sampled_from(cg.SCOPE_NAMES + ("full", "full_iteration", "atn", "", " attn"))
SCOPE = st.one_of(st.none(), NAMES, st.lists(NAMES, max_size=4), st.lists(NAMES, max_size=3).map(",".join),
                  st.lists(GARBAGE, max_size=2), GARBAGE)
ENV = st.fixed_dictionaries({}, optional={
    "PYTORCH_CUDA_ALLOC_CONF": st.sampled_from(["", "expandable_segments:True", "a:1, expandable_segments : true",
                                                "expandable_segments", ":::"]),
    "NCCL_GRAPH_REGISTER": st.sampled_from(["0", "1", ""]),
    "WORLD_SIZE": st.sampled_from(["1", "2", "8", "x", ""]),
})
GRAPH_FIELDS = st.fixed_dictionaries({
    "model.cuda_graph_impl": st.one_of(st.sampled_from(["none", "local", "transformer_engine", "full_iteration",
                                                        "Local", "full"]), st.sampled_from(list(GraphImpl)), GARBAGE),
    "model.cuda_graph_scope": SCOPE,
    "model.cuda_graph_modules": st.one_of(st.lists(NAMES, max_size=4), SCOPE),
    "model.enable_cuda_graph": st.one_of(st.booleans(), GARBAGE),
    "model.external_cuda_graph": st.booleans(),
    "model.use_te_rng_tracker": st.booleans(),
    "rng.te_rng_tracker": st.one_of(st.booleans(), GARBAGE),
    "rerun_state_machine.check_for_nan_in_loss": st.booleans(),
    "ddp.check_for_nan_in_grad": st.booleans(),
    "model.num_moe_experts": st.one_of(st.none(), st.integers(0, 8)),
    "model.moe_layer_freq": st.integers(1, 2),
    "model.moe_expert_capacity_factor": st.one_of(st.none(), st.sampled_from([1.0, 1.5])),
    "model.moe_pad_expert_input_to_capacity": st.booleans(),
    "model.moe_sync_free": st.booleans(),
    "model.hybrid_override_pattern": st.one_of(st.none(), st.text("M*-EX", max_size=4)),
    "model.recompute_granularity": st.sampled_from([None, "full", "selective", "bogus"]),
    "model.recompute_modules": st.lists(st.sampled_from(["core_attn", "mlp", "moe", "x"]), max_size=3),
    "model.attention_dropout": st.sampled_from([0.0, 0.1]),
    "model.hidden_dropout": st.sampled_from([0.0, 0.1]),
    "model.cpu_offloading": st.booleans(),
    "model.variable_seq_lengths": st.booleans(),
    "train.device": st.sampled_from(["auto", "cuda", "cpu"]),
})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=GRAPH_FIELDS, env=ENV, capability=st.sampled_from([None, (8, 0), (9, 0), (10, 0)]),
       world_size=st.sampled_from([None, 1, 2]))
def test_random_graph_fields_never_raise(values, env, capability, world_size) -> None:
    cfg = Config()
    for key, value in values.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    kwargs = dict(env=env, device_capability=capability, world_size=world_size)
    found = validate_config(cfg, **kwargs)
    assert all(isinstance(v, Violation) and v.rule and v.message and v.fix for v in found)
    assert not [v for v in found if "could not check" in v.message], found
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            settings_ = resolve_cuda_graph_settings(cfg, **kwargs)
        except ConfigValidationError as exc:
            assert exc.violations and str(exc)
        else:
            assert not found and isinstance(settings_, CudaGraphSettings)
            assert settings_.modules == () or settings_.per_layer
        before = cfg.to_dict()
        normalize_cuda_graph_config(cfg)  # idempotent after resolve's own normalisation
        assert cfg.to_dict() == before


# --------------------------------------------------------------------------
# the numbered value rules V1-V12 and R19 (the two tracker flags)

VALUE_CASES = {
    "V1-lr": ("V1", ("optimizer.lr=-0.001",), "optimizer.lr=-0.001 is below 0", ("optimizer.lr=0.0",)),
    "V1-min_lr": ("V1", ("optimizer.min_lr=-1",), "optimizer.min_lr=-1.0 is below 0", ("optimizer.min_lr=0",)),
    "V2": ("V2", ("optimizer.clip_grad=-1",), "optimizer.clip_grad=-1.0 is below 0", ("optimizer.clip_grad=0",)),
    "V3-beta1": ("V3", ("optimizer.adam_beta1=1.0",), "optimizer.adam_beta1=1.0 is not below 1",
                 ("optimizer.adam_beta1=0.0",)),
    "V3-beta2": ("V3", ("optimizer.adam_beta2=-0.1",), "optimizer.adam_beta2=-0.1 is below 0",
                 ("optimizer.adam_beta2=0.999",)),
    "V4": ("V4", ("optimizer.weight_decay=-0.1",), "optimizer.weight_decay=-0.1 is below 0",
           ("optimizer.weight_decay=0",)),
    "V5-attention": ("V5", ("model.attention_dropout=1.0",), "model.attention_dropout=1.0 is not below 1",
                     ("model.attention_dropout=0.9",)),
    "V5-hidden": ("V5", ("model.hidden_dropout=-0.1",), "model.hidden_dropout=-0.1 is below 0",
                  ("model.hidden_dropout=0.1",)),
    "V6-eval_iters": ("V6", ("train.eval_iters=-1",), "train.eval_iters=-1 is below 0", ("train.eval_iters=0",)),
    "V6-warmup": ("V6", ("scheduler.lr_warmup_iters=-5",), "scheduler.lr_warmup_iters=-5 is below 0",
                  ("scheduler.lr_warmup_iters=0",)),
    "V6-init_std": ("V6", ("model.init_method_std=-0.02",), "model.init_method_std=-0.02 is below 0",
                    ("model.init_method_std=0.01",)),
    "V7-save_interval": ("V7", ("checkpoint.save_interval=0",), "checkpoint.save_interval=0 is below 1",
                         ("checkpoint.save_interval=null",)),
    "V7-eval_interval": ("V7", ("train.eval_interval=0",), "train.eval_interval=0 is below 1",
                         ("train.eval_interval=null",)),
    "V12": ("V12", ("data.corpus_max_bytes=-1",), "data.corpus_max_bytes=-1 is below 65536",
            ("data.corpus_max_bytes=65536",)),
    "V8": ("V8", ("data.split=98,,x",), "data.split='98,,x' is not up to three non-negative weights",
           ("data.split=98,2",)),
    "V8-four": ("V8", ("data.split=1,1,1,1",), "is not up to three non-negative weights", ("data.split=1,1,1",)),
    "V9": ("V9", ("model.vocab_size=255",), "model.vocab_size=255 is smaller than the vocabulary of "
           "data.tokenizer=byte (256 ids)", ("model.vocab_size=256",)),
    "V10": ("V10", ("model.kv_channels=0",), "model.kv_channels=0 is not a positive even number",
            ("model.kv_channels=16",)),
    "V10-odd": ("V10", ("model.kv_channels=3",), "model.kv_channels=3 is not a positive even number",
                ("model.kv_channels=2",)),
    "V10-derived": ("V10", ("model.hidden_size=12",), "model.hidden_size=12 / model.num_attention_heads=4 = 3 is not",
                    ("model.hidden_size=16",)),
    "V11": ("V11", ("model.hf_path=/nonexistent/hf-model",), "model.hf_path=/nonexistent/hf-model does not exist",
            ("model.hf_path=null",)),
    "V13": ("V13", ("train.global_batch_size=10",), "train.global_batch_size=10 is not a multiple of "
            "train.micro_batch_size=4 x 1 data-parallel rank(s) = 4", ("train.global_batch_size=12",)),
}


@pytest.mark.parametrize("name", sorted(VALUE_CASES))
def test_numbered_value_rule_reports_problem_and_fix(name: str) -> None:
    rule, bad, message, good = VALUE_CASES[name]
    found = [v for v in check(make(*bad)) if v.rule == rule]
    assert len(found) == 1, format_violations(check(make(*bad)))
    assert message in found[0].message and found[0].fix
    assert bad[0].split("=")[0] in found[0].fields
    assert rule not in rules(check(make(*good)))


def test_every_numbered_value_rule_has_a_case() -> None:
    assert {case[0] for case in VALUE_CASES.values()} == {f"V{i}" for i in range(1, 14)}


def test_v11_directory_without_config_json(tmp_path) -> None:
    (found,) = [v for v in check(make(f"model.hf_path={tmp_path}")) if v.rule == "V11"]
    assert "has no config.json" in found.message
    (tmp_path / "config.json").write_text("{}")
    assert "V11" not in rules(check(make(f"model.hf_path={tmp_path}")))


def test_v9_skips_mock_data_and_names_an_unreadable_tokenizer(tmp_path) -> None:
    assert "V9" not in rules(check(make("model.vocab_size=8", "data.dataset=mock")))
    (found,) = [v for v in check(make(f"data.tokenizer={tmp_path}/none.json")) if v.rule == "V9"]
    assert "data.tokenizer" in found.fields and "no such file" in found.message


def test_numbered_rules_stop_training_before_it_starts() -> None:
    with pytest.raises(ConfigValidationError, match=r"V1 \[optimizer.lr\]"):
        resolve_cuda_graph_settings(make("optimizer.lr=-1"), env={})


def test_either_tracker_flag_on_turns_both_on_as_in_bridge() -> None:
    from graphstep.recipes import get_recipe

    cfg = get_recipe("llama3_tiny")  # the recipe turns both flags on
    apply_overrides(cfg, ["model.use_te_rng_tracker=false"])  # rng.te_rng_tracker is still on: both on
    assert "R5" not in rules(check(cfg)) and "R19" not in rules(check(cfg))
    normalize_cuda_graph_config(cfg)
    assert cfg.model.use_te_rng_tracker is True and cfg.rng.te_rng_tracker is True
    cfg = make("model.use_te_rng_tracker=false", "rng.te_rng_tracker=true", "model.cuda_graph_impl=local")
    assert not check(cfg)  # Bridge accepts it (R19 is retired)
    cfg = get_recipe("llama3_tiny")
    apply_overrides(cfg, ["model.use_te_rng_tracker=false", "rng.te_rng_tracker=false"])  # both off: R5 with graphs
    assert "R5" in rules(check(cfg))


def test_sequence_parallel_with_one_tensor_parallel_rank_is_turned_off_as_in_bridge() -> None:
    cfg = make("model.sequence_parallel=true")
    assert not check(cfg)
    notes = normalize_cuda_graph_config(cfg)
    assert cfg.model.sequence_parallel is False and any("sequence_parallel set to false" in n for n in notes)


# --------------------------------------------------------------------------
# validate passes => training does not fail on that field


def _numeric_fields() -> list[tuple[str, type]]:
    import typing

    from graphstep.config import field_type

    out = []
    for section, name, _value, _default, _help, unsupported in iter_fields():
        hint = field_type(section, name)
        if typing.get_origin(hint) in (list, dict, tuple):
            continue  # list[int] is a list, not a number
        args = typing.get_args(hint) or (hint,)
        if unsupported or bool in args:
            continue
        kind = int if int in args else float if float in args else None
        if kind is not None:
            out.append((f"{section}.{name}", kind))
    return out


NUMERIC_FIELDS = _numeric_fields()
EDGE_VALUES = {int: [-1, 0, 1, 2, 3], float: [-0.5, 0.0, 0.5, 1.0, 1.5]}


@pytest.mark.slow
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(NUMERIC_FIELDS).flatmap(
    lambda f: st.tuples(st.just(f[0]), st.sampled_from(EDGE_VALUES[f[1]]))))
def test_a_valid_numeric_field_trains(key_value) -> None:
    """Any numeric field at an edge value: if validate passes, a 2-iteration CPU train runs through."""
    from helpers.runs import tiny_config

    from graphstep.training.loop import train

    key, value = key_value
    cfg = tiny_config("model.cuda_graph_warmup_steps=1", f"{key}={value}", "train.train_iters=2", "train.eval_iters=0",
                      "checkpoint.save=null")  # warm-up 1: the graph is captured in the 2 iterations (V19)
    if check(cfg):
        return  # refused up front: the property only speaks of configs validate accepts
    result = train(cfg)
    assert len(result.rows) == 2, key_value


def test_numeric_fields_cover_the_value_rules() -> None:
    keys = {key for key, _kind in NUMERIC_FIELDS}
    assert {"optimizer.lr", "optimizer.adam_beta2", "model.hidden_dropout", "checkpoint.save_interval",
            "data.corpus_max_bytes", "model.kv_channels", "scheduler.lr_warmup_iters"} <= keys


# --- what training used to refuse late: `graphstep config validate` reports it --------------

LATE_CHECKS = {
    "R21": ["model.cuda_graph_impl=local", "data.seq_length_buckets=[32,64]"],
    "R22": ["ddp.grad_reduce_in_fp32=false"],
    "V7": ["checkpoint.save_interval=0"],
    "V13": ["train.global_batch_size=12"],  # micro-batch 2 x 4 ranks = 8
    "R23": ["model.moe_token_dispatcher_type=anything"],
    "R24": ["train.skip_step_on_nan=true", "train.check_for_nan_on_device=false"],
    "V23": ["model.num_moe_experts=4", "model.moe_pad_expert_input_to_capacity=true"],  # models/moe.py refused it
    "V24": ["model.hybrid_override_pattern=M*", "model.num_layers=2", "model.mamba_head_dim=7"],  # models/mamba.py
}


@pytest.mark.parametrize("rule", sorted(LATE_CHECKS))
def test_config_validate_reports_what_training_refused_late(rule, monkeypatch, capsys) -> None:
    from graphstep.cli import main

    monkeypatch.setenv("WORLD_SIZE", "4")
    base = ["train.micro_batch_size=2", "train.global_batch_size=8"]
    assert main(["config", "validate", *base]) == 0
    capsys.readouterr()
    assert main(["config", "validate", *base, *LATE_CHECKS[rule]]) == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith(rule + " ")]
    assert len(lines) == 1 and "Fix: set " in lines[0], lines
    with pytest.raises(ConfigValidationError, match=rf"{rule} \["):  # the trainer's first step: before any build
        resolve_cuda_graph_settings(apply_overrides(Config(), base + LATE_CHECKS[rule]), env={"WORLD_SIZE": "4"})


def test_a_run_normalises_and_validates_once(monkeypatch) -> None:
    """loop.train resolves once and hands the settings to build_run: one normalisation, one validation, no copy."""
    from helpers.runs import tiny_config

    import graphstep.validation as validation
    from graphstep.validation import migrations as normalize_mod
    from graphstep.training.loop import train

    calls = {"normalize": 0, "validate": 0, "copy": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(normalize_mod, "_normalize", counted("normalize", normalize_mod._normalize))
    monkeypatch.setattr(normalize_mod, "copy_config", counted("copy", normalize_mod.copy_config))
    monkeypatch.setattr(validation, "validate_config", counted("validate", validation.validate_config))
    cfg = tiny_config("model.cuda_graph_impl=full_iteration", "model.use_te_rng_tracker=true",
                      "rerun_state_machine.check_for_nan_in_loss=false", "ddp.check_for_nan_in_grad=false",
                      "model.cuda_graph_warmup_steps=1", "train.train_iters=3", "checkpoint.save=null")
    result = train(cfg)
    assert len(result.rows) == 3
    assert calls == {"normalize": 1, "validate": 1, "copy": 0}
