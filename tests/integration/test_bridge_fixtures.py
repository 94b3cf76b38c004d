"""Megatron Bridge-style configurations (tests/fixtures/bridge/) validate on graphstep's recipes, and the tiny ones train.

The files are graphstep's own, written in the shape of Bridge's recipes (dotted
overrides a line, as its recipe functions set their fields) and of its
tutorial YAML files (its section and field names).
"""

from __future__ import annotations


import pytest

from graphstep.cli import build_parser, main
from graphstep.config_files import config_from_args
from graphstep.training.loop import train
from graphstep.validation import validate_config
from helpers.launch import TESTS

FIXTURES = TESTS / "fixtures" / "bridge"
# the 70B layout: tp4 x pp4 (x 5 virtual stages) x cp2, one data-parallel replica; Qwen3-30B-A3B's: ep16 over 16
# FSDP2 ranks
WORLD = {"llama3_70b": "32", "qwen3_30b_a3b": "16"}


def overrides(recipe: str) -> list[str]:
    lines = (FIXTURES / f"{recipe}.overrides").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def config(*argv: str):
    args = build_parser().parse_args(["config", "validate", *argv])
    return config_from_args(args)


@pytest.mark.parametrize("recipe", ["llama3_8b", "llama3_70b", "qwen3_30b_a3b", "gpt_oss_20b", "nemotron_h_tiny"])
def test_bridge_recipe_settings_validate_unchanged(recipe, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", WORLD.get(recipe, "1"))
    assert len(overrides(recipe)) > 40
    assert main(["config", "validate", "--recipe", recipe, *overrides(recipe)]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "no rule violated" in out
    assert "note: accepted as no-ops" in out and "model.apply_rope_fusion=true (graphstep: " in out


def test_the_70b_recipe_has_llama3_70bs_shape():
    m = config("--recipe", "llama3_70b").model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups,
            m.vocab_size, m.seq_length) == (80, 8192, 28672, 64, 8, 128256, 8192)


def test_bridges_70b_layout_as_written_validates_and_fits_80_gib(monkeypatch, capsys):
    """Bridge's own layout for Llama 3 70B (TP4 x PP4 x VPP5 x CP2, the distributed optimizer), not one graphstep
    chose: accepted, and with its optimizer state sharded over the context-parallel ranks it fits 80 GiB GPUs."""
    monkeypatch.setenv("WORLD_SIZE", "32")
    cfg = config("--recipe", "llama3_70b", *overrides("llama3_70b"))
    m = cfg.model
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size,
            m.context_parallel_size, m.sequence_parallel) == (4, 4, 5, 2, True)
    assert cfg.ddp.use_distributed_optimizer is True and cfg.ddp.overlap_grad_reduce is True
    assert validate_config(cfg) == []
    assert main(["config", "validate", "--recipe", "llama3_70b", *overrides("llama3_70b"), "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "4 pipeline-stage x 1 data-parallel (FSDP2 optim_grads) x 2 context-parallel x 4 tensor-parallel" in out
    assert "per GPU (fits" in out, out


def test_bridges_tensor_by_pipeline_70b_layout_validates(monkeypatch):
    """Bridge's 70B layout without context parallel and virtual stages, on 16 ranks."""
    monkeypatch.setenv("WORLD_SIZE", "16")
    cfg = config("--recipe", "llama3_70b", *overrides("llama3_70b"), "model.context_parallel_size=1",
                 "model.virtual_pipeline_model_parallel_size=null")
    assert (cfg.model.tensor_model_parallel_size, cfg.model.pipeline_model_parallel_size) == (4, 4)
    assert validate_config(cfg) == []


def test_bridges_qwen3_30b_a3b_layout_as_written_validates_and_fits_80_gib(monkeypatch, capsys):
    """Bridge's own 16-GPU layout for Qwen3-30B-A3B, as its recipe writes it: 16 expert-parallel ranks, the flex
    dispatcher (run as alltoall), the distributed optimizer (FSDP2 ZeRO-2) with both overlap flags, and Transformer
    Engine graphs of the router and preprocess stages -- accepted, and it fits 80 GiB GPUs."""
    monkeypatch.setenv("WORLD_SIZE", "16")
    cfg = config("--recipe", "qwen3_30b_a3b", *overrides("qwen3_30b_a3b"))
    m, d = cfg.model, cfg.ddp
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size,
            m.expert_model_parallel_size, m.moe_token_dispatcher_type) == (1, 1, 1, 16, "flex")
    assert (d.use_distributed_optimizer, d.overlap_grad_reduce, d.overlap_param_gather) == (True, True, True)
    assert (m.cuda_graph_impl, list(m.cuda_graph_scope), cfg.train.global_batch_size) == \
        ("transformer_engine", ["moe_router", "moe_preprocess"], 1024)
    assert validate_config(cfg) == []
    assert main(["config", "validate", "--recipe", "qwen3_30b_a3b", *overrides("qwen3_30b_a3b"),
                 "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "16 data-parallel (FSDP2 optim_grads) (16 expert-parallel) ranks" in out, out
    assert "flex: runs as alltoall" in out and "per GPU (fits" in out, out


def test_the_pretrain_yaml_validates(capsys):
    assert main(["config", "validate", "--recipe", "llama32_1b", "--config",
                 str(FIXTURES / "llama32_1b_pretrain.yaml")]) == 0, capsys.readouterr()
    cfg = config("--recipe", "llama32_1b", "--config", str(FIXTURES / "llama32_1b_pretrain.yaml"))
    assert (cfg.optimizer.lr, cfg.data.seq_length, cfg.model.seq_length) == (3e-4, 2048, 2048)


def test_the_finetune_yaml_reads_and_its_peft_fields_need_a_scheme():
    cfg = config("--recipe", "llama32_1b", "--config", str(FIXTURES / "llama32_1b_finetune.yaml"))
    found = validate_config(cfg, env={})
    assert {v.rule for v in found} == {"R33"}
    assert sorted(v.fields for v in found) == [("peft.alpha",), ("peft.dim",)]  # Bridge's recipe sets peft=lora
    cfg = config("--recipe", "llama32_1b", "--config", str(FIXTURES / "llama32_1b_finetune.yaml"), "peft=lora")
    assert not validate_config(cfg, env={})
    assert (cfg.peft.dim, cfg.peft.alpha, cfg.checkpoint.pretrained_checkpoint) == (16, 32, "./checkpoints/llama32_1b")


def test_the_tiny_bridge_yaml_trains(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config("--recipe", "llama3_tiny", "--config", str(FIXTURES / "tiny_pretrain.yaml"),
                 "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=176")
    assert not validate_config(cfg, env={})
    result = train(cfg)
    assert result.iterations == 4 and len(result.eval_losses) == 2
    assert all(row["loss"] == row["loss"] for row in result.rows)  # finite numbers


def test_the_tiny_hybrid_with_bridge_settings_trains(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config("--recipe", "nemotron_h_tiny", *overrides("nemotron_h_tiny"), "model.cuda_graph_backend=replay")
    result = train(cfg)
    assert result.iterations == 4 and result.graphs >= 1
