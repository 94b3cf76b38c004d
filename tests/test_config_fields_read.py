"""Every config field acts or is refused: none is accepted and silently ignored.

A field *acts* when code outside the config and validation modules reads it:
an attribute access ``.<name>`` (or ``getattr(x, "<name>")``) somewhere in
src/graphstep other than config.py, config_sections.py, config_files.py and validation/. The
search is by name, not by section (``cfg.model.seq_length`` and
``m.seq_length`` read the same way), so a field whose name is also some other
attribute could pass by coincidence; the exceptions below are listed with
what stands in for the read, and each exception is checked in turn:

* fields the resolved ``CudaGraphSettings`` carries are read through it;
* the deprecated flags are migrated into ``model.cuda_graph_impl``;
* fields graphstep implements one way only are refused by a rule for any
  other value (R18 for the ``unsupported`` fields; the others named here).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from graphstep.config import Config, apply_overrides, iter_fields
from graphstep.validation import normalize, validate

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "src" / "graphstep"
CONFIG_CODE = ("config.py", "config_sections.py", "config_files.py", "validation/")

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
    "model.position_embedding_type": ("V", ["model.position_embedding_type=learned_absolute"]),
    "compile.components": ("R20", ["compile.components=[loss]"]),
    "model.virtual_pipeline_model_parallel_size": ("R28", ["model.virtual_pipeline_model_parallel_size=2"]),
    "model.pipeline_dtype": ("R28", ["model.pipeline_dtype=fp32", "model.params_dtype=bf16",
                                     "model.pipeline_model_parallel_size=2"]),
    "model.context_parallel_size": ("R30", ["model.context_parallel_size=2"]),
    "model.expert_tensor_parallel_size": ("R31", ["model.expert_tensor_parallel_size=2"]),
    # a declaration about the data (the data source decides the widths): refused with graphs and no buckets
    "model.variable_seq_lengths": ("R17", ["model.variable_seq_lengths=true", "model.cuda_graph_impl=full_iteration",
                                           "model.use_te_rng_tracker=true",
                                           "rerun_state_machine.check_for_nan_in_loss=false",
                                           "ddp.check_for_nan_in_grad=false"]),
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


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    return "e4m3" if value is None else value


def test_the_scanner_sees_attributes_and_getattr(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("def f(cfg):\n    return cfg.model.num_layers + getattr(cfg.data, 'split')\n")
    (tmp_path / "validation").mkdir()
    (tmp_path / "validation" / "b.py").write_text("x = cfg.train.device\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path)
    assert attributes_read() >= {"model", "num_layers", "data", "split"}
    assert "device" not in attributes_read()


def test_every_field_is_read_outside_config_and_validation():
    read = attributes_read()
    excepted = set(THROUGH_SETTINGS) | set(MIGRATED) | set(REFUSED_OTHERWISE)
    unread = [f"{section}.{name}" for section, name, _v, _d, _h, unsupported in iter_fields()
              if not unsupported and name not in read and f"{section}.{name}" not in excepted]
    assert not unread, (f"fields nobody reads: {unread}; make them act, or refuse the values graphstep does not "
                        "implement with a rule (and list them in REFUSED_OTHERWISE)")


def test_the_exceptions_are_not_read_directly():
    """An exception that code reads directly after all is stale: remove it from its list."""
    read = attributes_read()
    stale = [key for key in (*THROUGH_SETTINGS, *MIGRATED, *REFUSED_OTHERWISE) if key.split(".")[1] in read]
    assert not stale, f"read directly now: remove from the exception lists: {stale}"


def test_settings_fields_are_read_by_the_trainer():
    read = attributes_read()
    assert not [attr for attr in THROUGH_SETTINGS.values() if attr not in read]


@pytest.mark.parametrize("key", sorted(MIGRATED))
def test_deprecated_flags_are_migrated(key):
    target, value = MIGRATED[key]
    cfg = apply_overrides(Config(), [f"{key}=true"])
    with pytest.warns(DeprecationWarning):
        normalize(cfg)
    section, name = target.split(".")
    assert getattr(getattr(cfg, section), name) == value


@pytest.mark.parametrize("key", sorted(REFUSED_OTHERWISE))
def test_fields_implemented_one_way_refuse_the_others(key):
    rule, overrides = REFUSED_OTHERWISE[key]
    found = [v for v in validate(apply_overrides(Config(), overrides), env={}, device_capability=(9, 0))
             if v.rule == rule and key in v.fields]
    assert found, f"{key}: {overrides} should break {rule}"


def test_unsupported_fields_are_refused_when_changed():
    fields = [(s, n, d) for s, n, _v, d, _h, unsupported in iter_fields() if unsupported]
    assert fields
    for section, name, default in fields:
        cfg = Config()
        setattr(getattr(cfg, section), name, _changed(default))
        found = [v for v in validate(cfg, env={}) if v.rule == "R18"]
        assert [v.fields for v in found] == [(f"{section}.{name}",)], (section, name)
