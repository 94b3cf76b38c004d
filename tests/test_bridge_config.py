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
