"""Every config field acts or is refused: none is accepted and silently ignored.

A field *acts* when code outside the config and validation modules reads it:
an attribute access ``.<name>`` (or ``getattr(x, "<name>")``) somewhere in
src/graphstep other than config.py, config_sections.py, config_bridge_sections.py, config_files.py and validation/. The
search is by name, not by section (``cfg.model.seq_length`` and
``m.seq_length`` read the same way), so a field whose name is also some other
attribute could pass by coincidence; the exceptions below are listed with
what stands in for the read, and each exception is checked in turn:

* fields the resolved ``CudaGraphSettings`` carries are read through it;
* the deprecated flags are migrated into ``model.cuda_graph_impl``;
* fields graphstep implements one way only are refused by a rule for any
  other value (R18 for the ``unsupported`` fields, R32-R39 for the ``refused``
  ones -- each checked to break its rule; the others named here);
* Megatron Bridge's fields that act through graphstep's own ones are mapped
  onto them by the normalisation (``MAPPED``, each mapping checked);
* the no-op fields (``noop``: performance hints of Transformer Engine /
  Megatron kernels) are accepted whatever their value and named in the one
  log line of the run (each checked: accepted, reported, reported once).
"""

from __future__ import annotations

import ast

import pytest

import logging

from graphstep.config import Config, _matches, apply_overrides, field_kind, field_type, iter_fields, refused_values
from graphstep.validation import (
    noop_notes, normalize_cuda_graph_config, resolve_cuda_graph_settings, validate_config,
)
from helpers.launch import ROOT

PACKAGE = ROOT / "src" / "graphstep"
CONFIG_CODE = ("config.py", "config_sections.py", "config_bridge_sections.py", "config_files.py", "validation/")

# field -> the CudaGraphSettings attribute that carries it to the trainer
THROUGH_SETTINGS = {
    "model.cuda_graph_use_single_mempool": "use_single_mempool",
    "model.cuda_graph_retain_backward_graph": "retain_backward_graph",
    "model.cuda_graph_backend": "backend",
    "model.cuda_graph_on_failure": "on_failure",
    "optimizer.optimizer_cuda_graph": "optimizer_graph",
}

# deprecated flag -> the override normalisation turns it into
MIGRATED = {
    "model.enable_cuda_graph": ("model.cuda_graph_impl", "local"),
    "model.external_cuda_graph": ("model.cuda_graph_impl", "transformer_engine"),
}

# field implemented one way only -> (rule that refuses the others, overrides that break it)
REFUSED_OTHERWISE = {
    "model.normalization": ("V", ["model.normalization=LayerNorm"]),
    "model.position_embedding_type": ("R40", ["model.position_embedding_type=learned_absolute"]),
    "compile.components": ("R20", ["compile.components=[loss]"]),
    "model.pipeline_dtype": ("R28", ["model.pipeline_dtype=fp32", "model.params_dtype=bf16",
                                     "model.pipeline_model_parallel_size=2"]),
    # FP8 all-gather under FSDP2: torchao's tensorwise scaling with whole-step graphs only
    "mixed_precision.fp8_param_gather": ("R32", ["mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=rowwise",
                                                 "ddp.use_megatron_fsdp=true", "mixed_precision.fp8_param_gather=true"]),
    "model.fp8_param_gather": ("R32", ["mixed_precision.fp8=hybrid", "ddp.use_distributed_optimizer=true",
                                       "model.fp8_param_gather=true", "model.cuda_graph_impl=local",
                                       "model.cuda_graph_modules=[attn,mlp]"]),
    "model.expert_tensor_parallel_size": ("R31", ["model.expert_tensor_parallel_size=2"]),
    # a declaration about the data (the data source decides the widths): refused with graphs and no buckets
    "model.variable_seq_lengths": ("R17", ["model.variable_seq_lengths=true", "model.cuda_graph_impl=full_iteration",
                                           "model.use_te_rng_tracker=true",
                                           "rerun_state_machine.check_for_nan_in_loss=false",
                                           "ddp.check_for_nan_in_grad=false"]),
    # Megatron Bridge's fields that must agree with graphstep's own (R38) or stay constant (R18)
    "data.seq_length": ("R38", ["dataset.seq_length=64"]),
    "data.random_seed": ("R38", ["dataset.random_seed=7"]),
    "data.seed": ("R38", ["dataset.seed=7"]),
    "tokenizer.vocab_size": ("R38", ["tokenizer.tokenizer_type=NullTokenizer", "tokenizer.vocab_size=1000"]),
    "scheduler.start_weight_decay": ("R18", ["scheduler.start_weight_decay=0.0"]),
    "scheduler.end_weight_decay": ("R18", ["scheduler.end_weight_decay=0.0"]),
}

# Bridge field -> (overrides, the graphstep field normalisation sets, the value it gets)
MAPPED = {
    "model.should_pad_vocab": (["model.should_pad_vocab=true", "model.vocab_size=250"], "model.vocab_size", 256),
    "model.make_vocab_size_divisible_by": (["model.should_pad_vocab=true", "model.vocab_size=250",
                                           "model.make_vocab_size_divisible_by=100"], "model.vocab_size", 300),
    "data.blend": (["dataset.blend=[[a,b],[0.3,0.7]]"], "data.data_path", "0.3 a 0.7 b"),
    "tokenizer.tokenizer_type": (["tokenizer.tokenizer_type=HuggingFaceTokenizer", "tokenizer.tokenizer_model=/t"],
                                 "data.tokenizer", "/t"),
    "tokenizer.tokenizer_model": (["tokenizer.tokenizer_type=HuggingFaceTokenizer", "tokenizer.tokenizer_model=/t"],
                                  "data.tokenizer", "/t"),
    "mixed_precision.preset": (["mixed_precision=bf16_mixed"], "model.params_dtype", "bf16"),
    "mixed_precision.bf16": (["mixed_precision.bf16=true"], "model.params_dtype", "bf16"),
    "mixed_precision.fp32": (["mixed_precision.fp32=true"], "model.params_dtype", "fp32"),
    "mixed_precision.params_dtype": (["mixed_precision.params_dtype=torch.bfloat16"], "model.params_dtype", "bf16"),
    "mixed_precision.grad_reduce_in_fp32": (["mixed_precision.grad_reduce_in_fp32=false"],
                                            "ddp.grad_reduce_in_fp32", False),
    "comm_overlap.overlap_grad_reduce": (["comm_overlap.overlap_grad_reduce=true"], "ddp.overlap_grad_reduce", True),
    "comm_overlap.overlap_param_gather": (["comm_overlap.overlap_param_gather=true"], "ddp.overlap_param_gather",
                                          True),
    "comm_overlap.bucket_size": (["comm_overlap.bucket_size=1000"], "ddp.bucket_size", 1000),
    "scheduler.end_weight_decay": (["scheduler.start_weight_decay=0.03", "scheduler.end_weight_decay=0.03"],
                                   "optimizer.weight_decay", 0.03),
}


def attributes_read() -> set[str]:
    """Every attribute name read (``x.name``, ``getattr(x, "name")``) outside the config and validation code."""
    found: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(CONFIG_CODE):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute):
                found.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
                found.add(str(node.args[1].value))
    return found


def _changed(value, section=None, name=None):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if section is not None:
        return _value_of_type(section, name, value)
    return "e4m3" if value is None else value


def _value_of_type(section, name, default):
    """A value of the field's type that differs from ``default``."""
    hint = field_type(section, name)
    for candidate in (not default if isinstance(default, bool) else True, 7, 0.5, "e4m3", ["x"], [7], {"a": 1}):
        ok, coerced = _matches(candidate, hint)
        if ok and coerced != default:
            return coerced
    raise AssertionError((section, name, hint))


def test_the_scanner_sees_attributes_and_getattr(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("def f(cfg):\n    return cfg.model.num_layers + getattr(cfg.data, 'split')\n")
    (tmp_path / "validation").mkdir()
    (tmp_path / "validation" / "b.py").write_text("x = cfg.train.device\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path)
    assert attributes_read() >= {"model", "num_layers", "data", "split"}
    assert "device" not in attributes_read()


def test_every_field_is_read_outside_config_and_validation():
    read = attributes_read()
    excepted = set(THROUGH_SETTINGS) | set(MIGRATED) | set(REFUSED_OTHERWISE) | set(MAPPED)
    unread = [f"{section}.{name}" for section, name, _v, _d, _h, _u in iter_fields()
              if field_kind(section, name)[0] == "acts" and name not in read and f"{section}.{name}" not in excepted]
    assert not unread, (f"fields nobody reads: {unread}; make them act, or refuse the values graphstep does not "
                        "implement with a rule (and list them in REFUSED_OTHERWISE)")


def test_the_exceptions_are_not_read_directly():
    """An exception that code reads directly after all is stale: remove it from its list."""
    read = attributes_read()
    # a name that several sections share (dataset.seq_length, model.seq_length) is read for the other one
    names = [n for _s, n, _v, _d, _h, _u in iter_fields()]
    shared = {n for n in names if names.count(n) > 1}
    stale = [key for key in (*THROUGH_SETTINGS, *MIGRATED, *REFUSED_OTHERWISE, *MAPPED)
             if key.split(".")[1] in read and key.split(".")[1] not in shared]
    assert not stale, f"read directly now: remove from the exception lists: {stale}"


def test_settings_fields_are_read_by_the_trainer():
    read = attributes_read()
    assert not [attr for attr in THROUGH_SETTINGS.values() if attr not in read]


@pytest.mark.parametrize("key", sorted(MIGRATED))
def test_deprecated_flags_are_migrated(key):
    target, value = MIGRATED[key]
    cfg = apply_overrides(Config(), [f"{key}=true"])
    with pytest.warns(DeprecationWarning):
        normalize_cuda_graph_config(cfg)
    section, name = target.split(".")
    assert getattr(getattr(cfg, section), name) == value


@pytest.mark.parametrize("key", sorted(REFUSED_OTHERWISE))
def test_fields_implemented_one_way_refuse_the_others(key):
    rule, overrides = REFUSED_OTHERWISE[key]
    found = [v for v in validate_config(apply_overrides(Config(), overrides), env={}, device_capability=(9, 0))
             if v.rule == rule and key in v.fields]
    assert found, f"{key}: {overrides} should break {rule}"


def test_unsupported_fields_are_refused_when_changed():
    fields = [(s, n, d) for s, n, _v, d, _h, unsupported in iter_fields() if unsupported]
    assert fields
    for section, name, default in fields:
        cfg = Config()
        setattr(getattr(cfg, section), name, _changed(default, section, name))
        found = [v for v in validate_config(cfg, env={}) if v.rule == "R18"]
        assert [v.fields for v in found] == [(f"{section}.{name}",)], (section, name)


@pytest.mark.parametrize("key", sorted(MAPPED))
def test_bridge_fields_act_through_graphsteps_own(key):
    overrides, target, value = MAPPED[key]
    cfg = apply_overrides(Config(), overrides)
    normalize_cuda_graph_config(cfg)
    section, name = target.split(".")
    assert getattr(getattr(cfg, section), name) == value


def _refused_fields():
    return [(s, n, d) for s, n, _v, d, _h, _u in iter_fields() if refused_values(s, n) is not None]


def test_refused_fields_break_their_rule_when_changed():
    fields = _refused_fields()
    assert len(fields) > 30
    for section, name, default in fields:
        rule, _accepted = refused_values(section, name)
        value = _value_of_type(section, name, default)
        cfg = Config()
        setattr(getattr(cfg, section), name, value)
        found = [v for v in validate_config(cfg, env={}) if v.rule == rule and f"{section}.{name}" in v.fields]
        assert found, (section, name, value, rule)
        setattr(getattr(cfg, section), name, default)
        assert not [v for v in validate_config(cfg, env={}) if f"{section}.{name}" in v.fields], (section, name)


def _noop_fields():
    return [(s, n, d) for s, n, _v, d, _h, _u in iter_fields() if field_kind(s, n)[0] == "noop"]


def test_noop_fields_are_accepted_and_reported():
    fields = _noop_fields()
    assert {"model.apply_rope_fusion", "model.bias_activation_fusion", "model.cross_entropy_loss_fusion",
            "model.cross_entropy_fusion_impl", "model.moe_permute_fusion", "model.moe_grouped_gemm",
            "model.transformer_impl", "model.attention_backend",
            "model.gradient_accumulation_fusion"} <= {f"{s}.{n}" for s, n, _d in fields}
    for section, name, default in fields:
        value = _value_of_type(section, name, default)
        cfg = Config()
        setattr(getattr(cfg, section), name, value)
        assert not [v for v in validate_config(cfg, env={}) if f"{section}.{name}" in v.fields], (section, name)
        notes = noop_notes(cfg)
        assert len(notes) == 1 and notes[0].startswith(f"{section}.{name}=") and field_kind(section, name)[1] in notes[0]
        assert noop_notes(Config()) == []


def test_noop_fields_set_at_their_default_are_reported_too():
    cfg = apply_overrides(Config(), ["model.apply_rope_fusion=false"])  # the user's own choice, even the default
    assert noop_notes(cfg) == ["model.apply_rope_fusion=false (graphstep: applies RoPE with plain tensor ops "
                               "(captured in the graphs))"]


def test_a_run_reports_its_noop_fields_in_one_log_line(caplog):
    cfg = apply_overrides(Config(), ["model.apply_rope_fusion=true", "model.transformer_impl=local",
                                     "comm_overlap.tp_comm_overlap=true"])
    with caplog.at_level(logging.INFO, logger="graphstep"):
        resolve_cuda_graph_settings(cfg, env={})
    lines = [r.getMessage() for r in caplog.records if "no-op" in r.getMessage()]
    assert len(lines) == 1
    for key in ("model.apply_rope_fusion=true", "model.transformer_impl=local", "comm_overlap.tp_comm_overlap=true"):
        assert key in lines[0]
