"""The command line: config show/validate, overrides, perf flags, train."""

from __future__ import annotations

import json

import pytest
import yaml

from graphstep.cli import main
from graphstep.config import Config, ConfigError, apply_overrides
from graphstep.config_files import load_yaml, save_yaml
from graphstep.doctor import capture_error_hook
from graphstep.recipes import RECIPES, get_recipe
from helpers.launch import ROOT


def test_validate_names_r4_and_exits_2(capsys):
    code = main(["config", "validate", "--recipe", "llama3_tiny", "model.cuda_graph_impl=transformer_engine",
                 "model.cuda_graph_scope=[full_iteration]"])
    out = capsys.readouterr().out
    assert code == 2
    assert "R4" in out and "model.cuda_graph_impl" in out


def test_validate_lists_three_violations_at_once(capsys):
    code = main(["config", "validate", "model.cuda_graph_impl=local", "model.cuda_graph_scope=[attn,full_iteration]",
                 "model.use_te_rng_tracker=false", "rng.te_rng_tracker=false", "data.reset_position_ids=true"])
    out = capsys.readouterr().out
    assert code == 2
    for rule in ("R4", "R5", "R18"):
        assert rule in out


def test_validate_clean_recipe_exits_0(capsys):
    assert main(["config", "validate", "--recipe", "llama3_tiny"]) == 0
    assert "no rule violated" in capsys.readouterr().out


BRIDGE_LAYOUT = {"llama3_70b"}  # Bridge's TP x PP x VPP x CP layout: 32 ranks, validated at that world size below


@pytest.mark.parametrize("name", sorted(set(RECIPES) - BRIDGE_LAYOUT))
def test_every_recipe_validates(name):
    from graphstep.validation import validate_config

    assert validate_config(get_recipe(name)) == []


def test_the_70b_recipe_passes_at_its_world_size_and_names_it_below():
    """Bridge's TP4 x PP4 x VPP5 x CP2: virtual stages with tensor parallel (R28) and context parallel with stages
    (R30) pass on 32 ranks; on 16 the rules say how many ranks the layout takes."""
    from graphstep.validation import validate_config

    assert validate_config(get_recipe("llama3_70b"), env={}, world_size=32) == []
    found = [v for v in validate_config(get_recipe("llama3_70b"), env={}, world_size=16) if v.rule == "R30"]
    assert len(found) == 1 and "4 pipeline-stage x 2 context-parallel x 4 tensor-parallel ranks do not divide the " \
        "world size 16" in found[0].message and found[0].fix == "launch a multiple of 32 processes."


def _validate_out(capsys, monkeypatch, *argv: str) -> tuple[int, str]:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main(["config", "validate", *argv])
    return code, capsys.readouterr().out


def test_validate_70b_accepts_bridges_layout_and_says_what_it_needs(capsys, monkeypatch):
    import torch

    from graphstep.cuda_graph.devices import GiB
    from graphstep.parallel.dims import ParallelDims
    from graphstep.training.memory import HEADROOM, estimate_memory
    from graphstep.validation import validate_config

    code, out = _validate_out(capsys, monkeypatch, "--recipe", "llama3_70b", "--gpu-memory", "80")
    assert code == 0 and "no rule violated" in out  # virtual stages x tensor parallel x context parallel pass
    assert "validated at world size 32, the fewest ranks the layout takes" in out
    assert "32 GPUs (tp 4 x pp 4 x cp 2 x dp 1, 5 virtual stages per pipeline rank)" in out
    cfg = get_recipe("llama3_70b")
    layout = ParallelDims.from_config(cfg, 32)
    assert (layout.tp, layout.pp, layout.cp, layout.dp, layout.sequence_parallel) == (4, 4, 2, 1, True)
    est = estimate_memory(cfg, torch.device("cuda"), layout)
    assert est.total > HEADROOM * 80 * GiB and est.stage == 0 and est.in_flight == 4 + 3 / 5  # Megatron's 4 (1 + 3/20)
    assert f"about {est.total / GiB:.1f} GiB of 80.0 GiB per GPU (does not fit" in out
    assert "nearest layout the rules accept" not in out
    assert "as 4 data-parallel (FSDP2 optim_grads_params) x 8 tensor-parallel" in out  # the smallest that fits
    # the GPU memory the layout needs as it is, and Bridge's distributed optimizer keeping it on the same 32 GPUs
    assert f"as it is, it needs GPUs of at least {est.total / HEADROOM / GiB:.1f} GiB" in out
    line = next(ln for ln in out.splitlines() if "keeping the layout with ddp.use_distributed_optimizer=true" in ln)
    sharded = apply_overrides(get_recipe("llama3_70b"), ["ddp.use_distributed_optimizer=true"])
    kept = ParallelDims.from_config(sharded, 32)
    assert (kept.tp, kept.pp, kept.cp, kept.dp, kept.fsdp) == (4, 4, 2, 1, "optim_grads")
    assert validate_config(sharded, env={}, world_size=32) == []
    total = estimate_memory(sharded, torch.device("cuda"), kept).total
    assert total <= HEADROOM * 80 * GiB and line.endswith(f"about {total / GiB:.1f} GiB per rank as "
                                                         f"{kept.describe()}: on the same 32 GPUs")


def test_validate_names_the_nearest_accepted_layout(capsys, monkeypatch):
    """Bridge's 70B layout with ring attention (``cp_comm_type=p2p``, refused by R30): the nearest layout the rules
    accept turns the fewest layout features off -- context parallel, its ranks data-parallel -- with its estimate."""
    from graphstep.validation import validate_config

    code, out = _validate_out(capsys, monkeypatch, "--recipe", "llama3_70b", "model.cp_comm_type=p2p",
                              "--gpu-memory", "80")
    assert code == 2 and "R30" in out and "ring attention" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("nearest layout the rules accept"))
    assert "(without context parallel (its ranks data-parallel))" in line and "virtual stages" not in line
    overrides = line.split(": add ")[1].split(": ")[0].split()
    assert overrides == ["model.context_parallel_size=1"]
    near = apply_overrides(get_recipe("llama3_70b"), ["model.cp_comm_type=p2p", *overrides])
    assert [v.rule for v in validate_config(near, env={}, world_size=32) if v.rule.startswith("R")] == []
    assert "4 pipeline-stage x 2 data-parallel x 4 tensor-parallel + sequence-parallel ranks" in line
    after = out.splitlines()[out.splitlines().index(line) + 1]
    assert after.startswith("  memory per rank: about ") and "of 80.0 GiB per GPU" in after


def test_validate_world_size_and_gpu_memory_options(capsys, monkeypatch):
    code, out = _validate_out(capsys, monkeypatch, "--recipe", "llama3_70b", "--world-size", "64", "--gpu-memory",
                              "141")
    assert code == 0 and "validated at world size" not in out
    assert "64 GPUs (tp 4 x pp 4 x cp 2 x dp 2, 5 virtual stages per pipeline rank)" in out
    assert "of 141.0 GiB per GPU (fits" in out
    code, out = _validate_out(capsys, monkeypatch, "--recipe", "llama3_tiny", "--gpu-memory", "80")
    assert code == 0 and "1 GPU (tp 1 x pp 1 x cp 1 x dp 1)" in out and "(fits, 95% usable)" in out


def test_config_show_prints_resolved_yaml(capsys):
    assert main(["config", "show", "model.cuda_graph_impl=local", "model.cuda_graph_scope=[full_iteration]"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert data["model"]["cuda_graph_impl"] == "full_iteration"  # the legacy form, migrated


def test_perf_flags_turn_on_the_tracker(capsys):
    code = main(["config", "show", "--recipe", "llama3_tiny", "--cuda_graph_impl", "local",
                 "--cuda_graph_scope", "attn,mlp"])
    data = yaml.safe_load(capsys.readouterr().out)
    assert code == 0
    assert data["model"]["use_te_rng_tracker"] is True and data["rng"]["te_rng_tracker"] is True
    assert data["model"]["cuda_graph_impl"] == "local" and data["model"]["cuda_graph_modules"] == ["attn", "mlp"]
    from graphstep.validation import apply_perf_flags

    cfg = Config()  # tracker off by default; the flags turn both fields on
    apply_perf_flags(cfg, "local", "attn,mlp")
    assert cfg.model.use_te_rng_tracker and cfg.rng.te_rng_tracker


def test_unknown_key_and_wrong_type_name_the_key():
    with pytest.raises(ConfigError, match=r"'model.cuda_graph_implx'.*unknown key"):
        apply_overrides(Config(), ["model.cuda_graph_implx=local"])
    with pytest.raises(ConfigError, match=r"'train.train_iters': expected int, got 'many'"):
        apply_overrides(Config(), ["train.train_iters=many"])
    with pytest.raises(ConfigError, match=r"'model.cuda_graph_warmup_steps': expected int, got 1.5"):
        apply_overrides(Config(), ["model.cuda_graph_warmup_steps=1.5"])
    with pytest.raises(ConfigError, match="unknown section"):
        apply_overrides(Config(), ["modle.num_layers=2"])


def test_cli_reports_config_errors_with_exit_2(capsys):
    assert main(["train", "train.nope=1"]) == 2
    assert "train.nope" in capsys.readouterr().err


def test_yaml_round_trip(tmp_path):
    cfg = get_recipe("llama3_tiny")
    apply_overrides(cfg, ["model.cuda_graph_modules=[attn,mlp]", "model.cuda_graph_impl=local", "train.train_iters=7"])
    save_yaml(cfg, tmp_path / "c.yaml")
    again = load_yaml(tmp_path / "c.yaml")
    assert again == cfg
    (tmp_path / "bad.yaml").write_text("model:\n  hidden: 3\n")
    with pytest.raises(ConfigError, match="bad.yaml.*model.hidden"):
        load_yaml(tmp_path / "bad.yaml")


@pytest.mark.slow
def test_train_command_writes_metrics(tmp_path):
    metrics = tmp_path / "m.jsonl"
    code = main(["train", "train.train_iters=4", "model.num_layers=1", "model.seq_length=32", "train.eval_iters=0",
                 "logger.progress_bar=false", "data.corpus_max_bytes=200000", f"logger.metrics_path={metrics}"])
    assert code == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert all(isinstance(r["loss"], float) for r in rows)


def test_docs_config_reference_is_current():

    from graphstep.config_files import markdown_reference

    path = ROOT / "docs" / "config.md"
    assert path.read_text() == markdown_reference(), "regenerate: python -m graphstep.config_files > docs/config.md"


def test_overrides_before_and_after_options(monkeypatch):
    import graphstep.training.loop as loop

    seen = {}

    class Result:
        stopped_by_signal = False

    def fake_train(cfg, *, hooks):
        seen["cfg"], seen["hooks"] = cfg, hooks
        return Result()

    monkeypatch.setattr(loop, "train", fake_train)
    assert main(["train", "train.train_iters=20", "--recipe", "qwen3_moe_tiny", "model.cuda_graph_impl=local",
                 "--config", "/dev/null", "train.train_iters=21"]) == 0
    cfg = seen["cfg"]
    assert seen["hooks"].on_capture_error is capture_error_hook  # graphstep train: the doctor names a failed capture
    assert cfg.model.num_moe_experts == get_recipe("qwen3_moe_tiny").model.num_moe_experts
    assert cfg.model.cuda_graph_impl == "local" and cfg.train.train_iters == 21  # applied in the order written


def test_stray_option_is_still_refused():
    with pytest.raises(SystemExit) as exc:
        main(["config", "show", "model.num_layers=3", "--recipe", "llama3_tiny", "--nope"])
    assert exc.value.code == 2


def test_config_fields_lists_every_field_with_its_help(capsys):
    from graphstep.config import iter_fields

    assert main(["config", "fields"]) == 0
    out = capsys.readouterr().out
    for section, name, _value, _default, help_text, _unsupported in iter_fields():
        line = next(line for line in out.splitlines() if line.strip().startswith(f"{section}.{name} ("))
        assert help_text.split(" Not implemented")[0][:40] in line
    assert main(["config", "fields", "rng"]) == 0
    out = capsys.readouterr().out
    assert "rng.seed (int, default 1234): Base seed" in out and "\n  model." not in out


def test_config_show_help_lists_the_fields(capsys):
    with pytest.raises(SystemExit):
        main(["config", "show", "--help"])
    out = capsys.readouterr().out
    assert "optimizer.adam_beta2 (float, default 0.95): Adam beta2." in out


def test_yaml_error_names_line_and_column(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  num_layers: 2\n  hidden_size: [64\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:4:1: invalid YAML"):
        load_yaml(path)
