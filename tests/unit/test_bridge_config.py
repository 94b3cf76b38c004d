"""Megatron Bridge configurations: numbers and nulls as Bridge reads them, its sections and fields, its rules."""

from __future__ import annotations

import pytest

from graphstep.config import Config, ConfigError, apply_overrides, parse_value
from graphstep.config_files import load_yaml


# --------------------------------------------------------------------------
# numbers and null, as OmegaConf (Bridge) reads them


@pytest.mark.parametrize("text, value", [("1e-4", 1e-4), ("5e-6", 5e-6), ("-1e3", -1000.0), ("+1E+3", 1000.0),
                                         ("1.5e3", 1500.0), (".5e-2", 0.005), ("0.1", 0.1)])
def test_exponent_numbers_are_floats_in_overrides(text, value):
    assert parse_value(text) == value and isinstance(parse_value(text), float)
    cfg = apply_overrides(Config(), [f"optimizer.lr={text}"])
    assert cfg.optimizer.lr == value


@pytest.mark.parametrize("text", ["1e", "e5", "1e-", "abc", "98,2,0"])
def test_non_numbers_stay_strings(text):
    assert parse_value(text) == text


def test_exponent_numbers_are_floats_in_yaml(tmp_path):
    path = tmp_path / "bridge.yaml"
    path.write_text("optimizer:\n  lr: 1e-4\n  min_lr: 5e-6\n  adam_eps: 1e-8\nmodel:\n  init_method_std: 2e-2\n")
    cfg = load_yaml(path)
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.optimizer.adam_eps) == (1e-4, 5e-6, 1e-8)
    assert cfg.model.init_method_std == 0.02


def test_recompute_modules_null_is_megatron_cores_default():
    cfg = apply_overrides(Config(), ["model.recompute_modules=[mlp]", "model.recompute_modules=null"])
    assert cfg.model.recompute_modules == ["core_attn"]


def test_null_where_megatron_does_not_allow_it_is_still_a_type_error():
    with pytest.raises(ConfigError, match="model.num_layers"):
        apply_overrides(Config(), ["model.num_layers=null"])


# --------------------------------------------------------------------------
# Bridge's sections and names


from graphstep.cli import main  # noqa: E402
from graphstep.config import field_kind  # noqa: E402
from graphstep.validation import (  # noqa: E402
    normalize_cuda_graph_config, resolve_cuda_graph_settings, validate_config,
)


def _rules(cfg: Config) -> dict[str, list[tuple[str, ...]]]:
    out: dict[str, list[tuple[str, ...]]] = {}
    for v in validate_config(cfg, env={}, device_capability=(9, 0)):
        out.setdefault(v.rule, []).append(v.fields)
    return out


def test_dataset_is_the_data_section_and_validation_holds_the_eval_fields(tmp_path):
    cfg = apply_overrides(Config(), ["dataset.split=90,10,0", "validation.eval_interval=5", "validation.eval_iters=2"])
    assert (cfg.data.split, cfg.train.eval_interval, cfg.train.eval_iters) == ("90,10,0", 5, 2)
    path = tmp_path / "b.yaml"
    path.write_text("dataset:\n  seq_length: 128\nvalidation:\n  eval_iters: 3\n")
    cfg = load_yaml(path)
    assert cfg.data.seq_length == 128 and cfg.train.eval_iters == 3


def test_an_unknown_validation_field_names_the_two_graphstep_takes():
    with pytest.raises(ConfigError, match="validation.eval_interval and validation.eval_iters"):
        apply_overrides(Config(), ["validation.full_validation=true"])


@pytest.mark.parametrize("text", ["bf16_mixed", "bf16-mixed"])
def test_mixed_precision_preset_as_one_value(text):
    cfg = apply_overrides(Config(), [f"mixed_precision={text}"])
    assert cfg.mixed_precision.preset == "bf16_mixed"
    normalize_cuda_graph_config(cfg)
    assert cfg.model.params_dtype == "bf16" and not _rules(cfg)


def test_mixed_precision_leaves_a_params_dtype_you_set():
    cfg = apply_overrides(Config(), ["model.params_dtype=fp32", "mixed_precision=bf16_mixed"])
    normalize_cuda_graph_config(cfg)
    assert cfg.model.params_dtype == "fp32"


def test_mixed_precision_in_yaml_as_a_name_or_a_mapping(tmp_path):
    (tmp_path / "a.yaml").write_text("mixed_precision: bf16_mixed\npeft: null\n")
    assert load_yaml(tmp_path / "a.yaml").mixed_precision.preset == "bf16_mixed"
    (tmp_path / "b.yaml").write_text("mixed_precision:\n  bf16: true\n  fp8: null\n")
    assert load_yaml(tmp_path / "b.yaml").mixed_precision.bf16 is True


@pytest.mark.parametrize("preset, why", [("bf16_with_mxfp8_mixed", "Blackwell"), ("bf16_with_nvfp4_mixed", "Blackwell"),
                                         ("bf16-with-fp8-subchannel-scaling-mixed", "blockwise")])
def test_fp8_presets_graphstep_lacks_are_r32(preset, why):
    cfg = apply_overrides(Config(), [f"mixed_precision={preset}"])
    (v,) = validate_config(cfg, env={})
    assert v.rule == "R32" and why in v.message
    assert "mixed_precision=bf16_with_fp8_current_scaling_mixed" in v.fix


def test_the_fp8_current_scaling_preset_and_fields_act_and_unknown_values_are_r32():
    # the FP8 runs themselves: tests/integration/test_fp8.py
    assert not _rules(apply_overrides(Config(), ["mixed_precision=bf16_with_fp8_current_scaling_mixed"]))
    assert not _rules(apply_overrides(Config(), ["mixed_precision=bf16-with-fp8-delayed-scaling-mixed"]))
    assert not _rules(apply_overrides(Config(), ["mixed_precision.fp8=hybrid"]))
    assert _rules(apply_overrides(Config(), ["mixed_precision.fp8=e5m2"]))["R32"] == [("mixed_precision.fp8",)]
    assert "R32" in _rules(apply_overrides(Config(), ["mixed_precision=bf17_mixed"]))
    assert _rules(apply_overrides(Config(), ["mixed_precision=fp16_mixed"])).keys() == {"R18"}


def test_peft_null_lora_and_dora_pass_and_lora_fields_without_a_scheme_are_r33(tmp_path):
    assert not _rules(apply_overrides(Config(), ["peft=null"]))
    assert not _rules(apply_overrides(Config(), ["peft=lora", "peft.dim=8", "peft.alpha=16"]))
    assert not _rules(apply_overrides(Config(), ["peft=dora"]))
    assert _rules(apply_overrides(Config(), ["peft=qlora"]))["R33"] == [("peft.scheme",)]
    (tmp_path / "ft.yaml").write_text("peft:\n  dim: 8\n  alpha: 16\ncheckpoint:\n  pretrained_checkpoint: /ckpt\n")
    found = _rules(load_yaml(tmp_path / "ft.yaml"))
    assert sorted(found["R33"]) == [("peft.alpha",), ("peft.dim",)]  # pretrained_checkpoint acts


@pytest.mark.parametrize("override, rule", [
    ("optimizer.exp_avg_dtype=torch.bfloat16", "R34"), ("optimizer.main_params_dtype=fp16", "R34"),
    ("model.cpu_offloading=true", "R36"),
    ("model.fine_grained_activation_offloading=true", "R36"), ("model.offload_modules=[expert_fc1]", "R36"),
    ("model.mtp_num_layers=1", "R37"), ("scheduler.max_lr=1e-4", "R39"), ("scheduler.min_lr=1e-5", "R39"),
    ("checkpoint.ckpt_format=torch", "R18"), ("train.exit_duration_in_mins=230", "R18"),
    ("model.moe_router_force_load_balancing=true", "R18"), ("model.moe_router_padding_for_fp8=true", "R32"),
])
def test_refused_values(override, rule):
    key = override.split("=")[0]
    assert _rules(apply_overrides(Config(), [override])) == {rule: [(key,)]}


@pytest.mark.parametrize("override", [
    "optimizer.exp_avg_dtype=torch.float32", "optimizer.main_grads_dtype=fp32", "optimizer.main_params_dtype=null",
    "model.recompute_method=null", "model.offload_modules=[]", "model.offload_modules=null",
    "checkpoint.ckpt_format=torch_dist", "checkpoint.ckpt_format=fsdp_dtensor", "model.moe_router_dtype=fp32",
    "optimizer.use_precision_aware_optimizer=true", "checkpoint.async_save=true", "train.manual_gc=true",
    "train.manual_gc_interval=100", "train.manual_gc_eval=100", "comm_overlap.tp_comm_overlap=true",
    "dist.distributed_timeout_minutes=30", "tokenizer.tokenizer_type=NullTokenizer", "model.should_pad_vocab=true",
])
def test_what_graphstep_does_is_accepted(override):
    assert not _rules(apply_overrides(Config(), [override]))


def test_r38_bridge_dataset_and_tokenizer_agree_with_graphstep():
    assert _rules(apply_overrides(Config(), ["dataset.seq_length=64"]))["R38"] == [("data.seq_length",
                                                                                    "model.seq_length")]
    assert not _rules(apply_overrides(Config(), ["dataset.seq_length=128"]))
    assert "R38" in _rules(apply_overrides(Config(), ["tokenizer.tokenizer_type=SentencePieceTokenizer"]))
    assert "R38" in _rules(apply_overrides(Config(), ["tokenizer.tokenizer_type=HuggingFaceTokenizer"]))
    assert "R38" in _rules(apply_overrides(Config(), ["tokenizer.tokenizer_type=NullTokenizer",
                                                      "tokenizer.vocab_size=300"]))
    assert "R38" in _rules(apply_overrides(Config(), ["train.manual_gc_interval=-1"]))
    assert "R38" in _rules(apply_overrides(Config(), ["rng.seed=5678", "dataset.random_seed=1234"]))
    assert not _rules(apply_overrides(Config(), ["rng.seed=5678"]))  # Bridge's default random_seed is not yours
    assert "R38" in _rules(apply_overrides(Config(), ["dataset.blend=[a,b]"]))


def test_a_blend_becomes_indexed_data():
    cfg = apply_overrides(Config(), ["dataset.blend=[[/d/a],null]"])
    normalize_cuda_graph_config(cfg)
    assert (cfg.data.dataset, cfg.data.data_path) == ("indexed", "/d/a")


def test_vocabulary_padding_as_megatron_pads_it():
    cfg = apply_overrides(Config(), ["model.should_pad_vocab=true", "model.vocab_size=50257",
                                     "model.tensor_model_parallel_size=2"])
    normalize_cuda_graph_config(cfg)
    assert cfg.model.vocab_size == 50432  # a multiple of 128 x 2
    normalize_cuda_graph_config(cfg)
    assert cfg.model.vocab_size == 50432


def test_config_fields_marks_noops_and_refusals(capsys):
    assert main(["config", "fields", "model"]) == 0
    out = capsys.readouterr().out
    assert "model.apply_rope_fusion (bool, default false): Fused RoPE kernel. [no-op: " in out
    assert "model.cpu_offloading (bool, default false): " in out and "[other values: R36]" in out
    assert field_kind("train", "manual_gc") == ("acts", "")


# --------------------------------------------------------------------------
# train.manual_gc


def test_manual_gc_policy(monkeypatch):
    import gc

    from graphstep.training.manual_gc import ManualGC

    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation))
    train = apply_overrides(Config(), ["train.manual_gc=true", "train.manual_gc_interval=3",
                                       "train.manual_gc_eval=100"]).train
    assert gc.isenabled()
    with ManualGC(train) as policy:
        assert not gc.isenabled() and calls == [2]
        for it in range(1, 8):
            policy.after_iteration(it)
        assert calls == [2, 2, 2]  # at the start, after iterations 3 and 6
        policy.before_eval()
        policy.after_eval()
        assert calls == [2, 2, 2, 2, 0]
    assert gc.isenabled()
    calls.clear()
    with ManualGC(Config().train) as policy:  # off: nothing collected by hand, the collector stays on
        policy.after_iteration(100)
        policy.before_eval()
        assert gc.isenabled() and calls == []


def test_training_runs_with_the_collector_off_and_collects_between_steps(monkeypatch, tmp_path):
    import gc

    from helpers.runs import tiny_config
    from graphstep.training import loop

    seen = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: seen.append((generation, gc.isenabled())) or real(generation))
    states = []
    monkeypatch.setattr(loop, "_host_nan_check", lambda *a: states.append(gc.isenabled()))
    cfg = tiny_config("train.train_iters=4", "train.manual_gc=true", "train.manual_gc_interval=2",
                      "train.eval_iters=1", "train.eval_interval=null", "rerun_state_machine.check_for_nan_in_loss=true",
                      "model.cuda_graph_impl=none",
                      tmp_path=tmp_path)
    result = loop.train(cfg)
    assert result.iterations == 4
    assert gc.isenabled()  # restored after the run
    assert states == [False] * 4  # every step ran with the automatic collector off
    assert [g for g, _ in seen] == [2, 2, 2, 2, 0]  # start, iterations 2 and 4, around the final evaluation


# --------------------------------------------------------------------------
# the CUDA-graph rules where Megatron Bridge / Megatron Core decide otherwise


from graphstep.validation import apply_perf_flags  # noqa: E402

GRAPHS = ["model.use_te_rng_tracker=true", "rerun_state_machine.check_for_nan_in_loss=false",
          "ddp.check_for_nan_in_grad=false"]
EXPERTS = ["model.num_moe_experts=4", "model.moe_router_topk=1"]


def _graph_rules(*overrides: str) -> dict[str, list[tuple[str, ...]]]:
    return _rules(apply_overrides(Config(), GRAPHS + list(overrides)))


def test_grad_nan_check_passes_with_full_iteration_and_the_loss_check_does_not():
    assert not _graph_rules("model.cuda_graph_impl=full_iteration", "ddp.check_for_nan_in_grad=true")
    assert "R6" in _graph_rules("model.cuda_graph_impl=full_iteration", "rerun_state_machine.check_for_nan_in_loss=true")


def test_the_grad_nan_check_runs_after_the_replay_never_inside_a_capture(monkeypatch, tmp_path):
    from helpers.runs import tiny_config
    from graphstep.cuda_graph.replay import active_recorder
    from graphstep.training import loop

    real, calls = loop._host_nan_check, []

    def probe(cfg, it, loss, grad_norm):
        calls.append((it, active_recorder() is not None))  # the replay backend's capture is recording
        real(cfg, it, loss, grad_norm)

    monkeypatch.setattr(loop, "_host_nan_check", probe)
    cfg = tiny_config("train.train_iters=5", "model.cuda_graph_impl=full_iteration", "model.cuda_graph_warmup_steps=1",
                      "ddp.check_for_nan_in_grad=true", "model.cuda_graph_backend=replay", tmp_path=tmp_path)
    result = loop.train(cfg)
    assert result.graphs >= 1  # the step was captured and replayed
    assert calls == [(it, False) for it in range(1, 6)]


def test_the_grad_nan_check_stops_a_full_iteration_run_on_a_nonfinite_gradient(tmp_path):
    from helpers.runs import tiny_config
    from graphstep.training import loop

    cfg = tiny_config("train.train_iters=6", "model.cuda_graph_impl=full_iteration", "model.cuda_graph_warmup_steps=1",
                      "ddp.check_for_nan_in_grad=true", "model.cuda_graph_backend=replay", "optimizer.lr=1e30",
                      "optimizer.clip_grad=0", "scheduler.lr_warmup_iters=0", tmp_path=tmp_path)
    with pytest.raises(FloatingPointError, match="ddp.check_for_nan_in_grad"):
        loop.train(cfg)


@pytest.mark.parametrize("module, dropout", [("core_attn", "attention_dropout"), ("mlp", "hidden_dropout")])
def test_full_iteration_refuses_recompute_of_dropout_regions_as_megatron_core(module, dropout):
    found = _graph_rules("model.cuda_graph_impl=full_iteration", "model.recompute_granularity=selective",
                         f"model.recompute_modules=[{module}]", f"model.{dropout}=0.1")
    assert found == {"R15": [("model.recompute_modules", f"model.{dropout}", "model.cuda_graph_impl")]}
    assert not _graph_rules("model.cuda_graph_impl=full_iteration", "model.recompute_granularity=selective",
                            f"model.recompute_modules=[{module}]")
    eager = _graph_rules("model.recompute_granularity=selective", f"model.recompute_modules=[{module}]",
                         f"model.{dropout}=0.1")
    # Ungraphed: the MLP's dropout lies outside its recomputed region; attention's inside it (R35, as eager redraws)
    assert eager == ({"R35": [("model.recompute_modules", "model.attention_dropout")]} if module == "core_attn" else {})


def test_moe_recompute_is_refused():
    found = _graph_rules("model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[moe_router,"
                         "moe_preprocess]", "model.recompute_granularity=selective", "model.recompute_modules=[moe]",
                         *EXPERTS)
    assert "R35" in found


def test_moe_router_scope_with_one_expert_is_refused():
    found = _graph_rules("model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[attn,moe_router,"
                         "moe_preprocess]", "model.num_moe_experts=1", "model.moe_router_topk=1")
    assert list(found) == ["R9"]
    assert not _graph_rules("model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[attn,moe_router,"
                            "moe_preprocess]", *EXPERTS)


def test_alltoall_with_capacity_and_no_padding_under_moe_preprocess_is_refused():
    scoped = ["model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[attn,moe_router,moe_preprocess]",
              "model.moe_token_dispatcher_type=alltoall", "model.moe_expert_capacity_factor=1.0", *EXPERTS]
    assert list(_graph_rules(*scoped)) == ["R12"]
    assert not _graph_rules(*scoped, "model.moe_pad_expert_input_to_capacity=true")


def test_allgather_with_variable_seq_lengths_is_refused():
    found = _graph_rules("model.variable_seq_lengths=true", *EXPERTS)
    assert found == {"R23": [("model.moe_token_dispatcher_type", "model.variable_seq_lengths")]}
    assert not _graph_rules("model.variable_seq_lengths=true", "model.moe_token_dispatcher_type=alltoall", *EXPERTS)
    assert not _graph_rules("model.variable_seq_lengths=true")  # dense: no dispatcher


def test_mamba_scope_without_mamba_layers_is_allowed_beside_other_scopes():
    assert not _graph_rules("model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mamba]")
    assert list(_graph_rules("model.cuda_graph_impl=local", "model.cuda_graph_modules=[mamba]")) == ["R13"]


def test_extensions_are_said_once_in_the_log(caplog):
    import logging

    cfg = apply_overrides(Config(), GRAPHS + ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,moe]",
                                              *EXPERTS])
    with caplog.at_level(logging.INFO, logger="graphstep"):
        resolve_cuda_graph_settings(cfg, env={})
    text = [r.getMessage() for r in caplog.records]
    assert sum("a graphstep extension -- Megatron Bridge takes local for full_iteration only" in t for t in text) == 1
    assert sum("graphed dropless: a graphstep extension" in t for t in text) == 1


def test_perf_flags_as_bridges_harness():
    cfg = Config()  # Megatron's defaults: both host-side NaN checks on
    apply_perf_flags(cfg, "local", "full_iteration")
    assert cfg.rerun_state_machine.check_for_nan_in_loss is False and cfg.ddp.check_for_nan_in_grad is True
    assert cfg.model.use_te_rng_tracker is True and cfg.rng.te_rng_tracker is True
    assert not validate_config(cfg, env={})
    off = apply_overrides(Config(), ["model.use_te_rng_tracker=true", "rng.te_rng_tracker=true"])
    apply_perf_flags(off, "none", None)
    assert off.model.use_te_rng_tracker is False and off.rng.te_rng_tracker is False


def test_perf_flags_on_the_command_line(capsys):
    from graphstep.recipes import get_recipe

    assert get_recipe("llama3_8b").rerun_state_machine.check_for_nan_in_loss is False  # graph_ready
    assert main(["config", "validate", "--recipe", "llama3_8b", "rerun_state_machine.check_for_nan_in_loss=true",
                 "ddp.check_for_nan_in_grad=true", "--cuda_graph_impl", "local", "--cuda_graph_scope",
                 "full_iteration"]) == 2  # an override after the flags is yours: R6
    capsys.readouterr()
    assert main(["config", "validate", "--recipe", "llama3_8b", "--config", "/dev/null", "--cuda_graph_impl", "local",
                 "--cuda_graph_scope", "full_iteration"]) == 0
    assert main(["config", "show", "--recipe", "llama3_8b", "--cuda_graph_impl", "none"]) == 0
    out = capsys.readouterr().out
    assert "use_te_rng_tracker: false" in out and "te_rng_tracker: false" in out


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_the_grad_nan_check_runs_after_the_replay_on_cuda(monkeypatch, tmp_path):
    """The CPU test above on a GPU: the full-iteration CUDA graph, and the host check never inside its capture."""
    import torch

    from helpers.runs import tiny_config
    from graphstep.training import loop

    real, calls = loop._host_nan_check, []

    def probe(cfg, it, loss, grad_norm):
        calls.append((it, torch.cuda.is_current_stream_capturing()))
        real(cfg, it, loss, grad_norm)

    monkeypatch.setattr(loop, "_host_nan_check", probe)
    cfg = tiny_config("train.train_iters=5", "model.cuda_graph_impl=full_iteration", "model.cuda_graph_warmup_steps=1",
                      "ddp.check_for_nan_in_grad=true", "train.device=cuda", "model.cuda_graph_backend=cuda",
                      tmp_path=tmp_path)
    result = loop.train(cfg)
    assert result.graphs >= 1
    assert calls == [(it, False) for it in range(1, 6)]


# --------------------------------------------------------------------------
# the rest of Bridge's recipe fields: env_vars, mapping entries, R40, the constant weight decay


def test_env_vars_as_a_mapping_or_one_name_and_in_yaml(tmp_path):
    cfg = apply_overrides(Config(), ["env_vars={NCCL_GRAPH_REGISTER: 0, PYTORCH_CUDA_ALLOC_CONF: 'expandable_segments:True'}",
                                     "env_vars.TORCH_NCCL_HIGH_PRIORITY=1"])
    assert cfg.env_vars == {"NCCL_GRAPH_REGISTER": 0, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                            "TORCH_NCCL_HIGH_PRIORITY": 1}
    assert apply_overrides(cfg, ["env_vars=null"]).env_vars == {}
    (tmp_path / "e.yaml").write_text("env_vars:\n  CUDA_DEVICE_MAX_CONNECTIONS: 1\n  NVTE_FUSED_ATTN: true\n")
    assert load_yaml(tmp_path / "e.yaml").env_vars == {"CUDA_DEVICE_MAX_CONNECTIONS": 1, "NVTE_FUSED_ATTN": True}
    with pytest.raises(ConfigError, match="env_vars.X=.*string, number or bool"):
        apply_overrides(Config(), ["env_vars.X=[1,2]"])
    with pytest.raises(ConfigError, match="expected a mapping of environment variable names"):
        apply_overrides(Config(), ["env_vars=5"])


def test_the_rules_read_env_vars_beneath_the_environment():
    graphs = GRAPHS + ["model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[attn]"]
    cfg = apply_overrides(Config(), graphs + ["env_vars.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"])
    found = validate_config(cfg, env={}, device_capability=(9, 0), world_size=2)
    assert {v.rule for v in found} == {"R16"}  # the allocator setting env_vars asks for breaks R16 ...
    ok = apply_overrides(cfg, ["env_vars.NCCL_GRAPH_REGISTER=0"])
    assert not validate_config(ok, env={}, device_capability=(9, 0), world_size=2)  # ... unless it sets the fix too
    yours = {"PYTORCH_CUDA_ALLOC_CONF": "backend:native"}  # a variable the environment sets wins
    assert not validate_config(cfg, env=yours, device_capability=(9, 0), world_size=2)


def test_env_vars_are_set_at_the_start_where_the_environment_does_not(monkeypatch):
    import os

    from graphstep.validation import apply_env_vars

    monkeypatch.setenv("GS_TEST_MINE", "kept")
    monkeypatch.delenv("GS_TEST_NEW", raising=False)
    monkeypatch.delenv("GS_TEST_FLAG", raising=False)
    cfg = apply_overrides(Config(), ["env_vars={GS_TEST_MINE: 1, GS_TEST_NEW: 32, GS_TEST_FLAG: true}"])
    assert apply_env_vars(cfg) == ["GS_TEST_NEW=32", "GS_TEST_FLAG=1"]
    assert (os.environ["GS_TEST_MINE"], os.environ["GS_TEST_NEW"], os.environ["GS_TEST_FLAG"]) == ("kept", "32", "1")


def test_a_mapping_field_takes_one_entry_and_packing_needs_sft_data():
    cfg = apply_overrides(Config(), ["dataset.offline_packing_specs.packed_sequence_size=128",
                                     "dataset.offline_packing_specs.pad_seq_to_mult=1"])
    assert cfg.data.offline_packing_specs == {"packed_sequence_size": 128, "pad_seq_to_mult": 1}
    assert _rules(cfg) == {"R41": [("data.packed_sequences", "data.dataset")]}  # packing is on: SFT data only
    with pytest.raises(ConfigError, match="keys have the form section.field"):
        apply_overrides(Config(), ["model.num_layers.x=1"])


@pytest.mark.parametrize("override, fields", [
    ("model.multi_latent_attention=true", ("model.multi_latent_attention",)),
    ("model.position_embedding_type=yarn", ("model.position_embedding_type",)),
    ("scheduler.lr_decay_style=WSD", ("scheduler.lr_decay_style",)),
    ("model.recompute_modules=[mla_up_proj,mlp]", ("model.recompute_modules",)),
    ("model.recompute_modules=[moe_act,layernorm]", ("model.recompute_modules",)),
])
def test_r40_megatron_model_features_graphstep_lacks(override, fields):
    found = validate_config(apply_overrides(Config(), [override]), env={})
    assert {v.rule for v in found} == {"R40"} and all(v.fields == fields for v in found)
    assert all("not implemented" in v.message for v in found)


def test_values_neither_megatron_nor_graphstep_know_stay_rule_v():
    assert _rules(apply_overrides(Config(), ["model.position_embedding_type=ropee"])) == {
        "V": [("model.position_embedding_type",)]}
    assert _rules(apply_overrides(Config(), ["model.recompute_modules=[core_atn]"])) == {
        "V": [("model.recompute_modules",)]}


def test_megatrons_constant_weight_decay_schedule_is_the_weight_decay():
    cfg = apply_overrides(Config(), ["optimizer.weight_decay=0.1", "scheduler.start_weight_decay=0.033",
                                     "scheduler.end_weight_decay=0.033", "scheduler.weight_decay_incr_style=constant"])
    assert not _rules(cfg)
    normalize_cuda_graph_config(cfg)
    assert cfg.optimizer.weight_decay == 0.033
    assert _rules(apply_overrides(Config(), ["scheduler.start_weight_decay=0.0"]))["R18"]  # a schedule 0.0 -> 0.1
    assert _rules(apply_overrides(Config(), ["scheduler.start_weight_decay=0.0", "scheduler.end_weight_decay=0.1"]))


# Settings the way Bridge's performance recipes for a Qwen3 MoE set them (written for graphstep): every one is
# accepted on qwen3_30b_a3b, and the kernel hints among them are named once as no-ops.
PERF_MOE = [
    "mixed_precision=bf16_mixed", "mixed_precision.grad_reduce_in_fp32=true", "model.rotary_base=1000000.0",
    "comm_overlap.overlap_param_gather_with_optimizer_step=null", "dataset.data_sharding=true",
    "optimizer.bf16=true", "optimizer.fp16=false", "scheduler.lr_wsd_decay_style=minus_sqrt",
    "scheduler.lr_wsd_decay_iters=null", "scheduler.start_weight_decay=0.033", "scheduler.end_weight_decay=0.033",
    "scheduler.weight_decay_incr_style=constant", "model.moe_paged_stash_buffer_size_factor_cuda=1.2",
    "model.moe_paged_stash_buffer_size_factor_cpu=1.0", "ddp.fsdp_all_gather_in_start_param_sync=false",
    "model.moe_grouped_gemm=true", "model.moe_permute_fusion=true", "model.moe_router_fusion=true",
    "model.apply_rope_fusion=true", "model.cross_entropy_fusion_impl=te", "model.yarn_mscale=1.0",
    "peft=null", "peft.lora_dtype=null", "peft.a2a_experimental=false", "dataset.do_validation=true",
    "env_vars={TORCH_NCCL_HIGH_PRIORITY: 1, CUDA_DEVICE_MAX_CONNECTIONS: 32, NCCL_GRAPH_REGISTER: 0}",
]


def test_a_perf_recipes_settings_validate_on_qwen3_30b_a3b():
    from graphstep.recipes import get_recipe
    from graphstep.validation import noop_notes

    cfg = apply_overrides(get_recipe("qwen3_30b_a3b"), PERF_MOE)
    assert not validate_config(cfg, env={}, device_capability=(9, 0), world_size=1)
    notes = " ".join(noop_notes(cfg))
    for key in ("optimizer.bf16=true", "data.data_sharding=true",
                "scheduler.lr_wsd_decay_style=minus_sqrt", "model.moe_grouped_gemm=true"):
        assert key in notes
    normalize_cuda_graph_config(cfg)
    assert (cfg.model.rotary_base, cfg.optimizer.weight_decay) == (1000000.0, 0.033)
