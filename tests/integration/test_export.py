"""``graphstep export`` (training/export.py): a run's checkpoint rebuilt and written as a merged Hugging Face model
(``--format hf``) or a LoRA/DoRA run's adapters in HF peft's format (``--format peft``); transformers and peft load
them with the trained model's logits; every failure is one line."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.cli import assert_one_line_error, run_cli
from helpers.runs import eager, tiny_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")  # the test extra installs both

PEFT = ["peft.dim=8", "peft.alpha=16", "peft.dropout=0.1", "model.attention_dropout=0.0", "model.hidden_dropout=0.0"]
TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))


def _train(*overrides: str):
    from graphstep.training.loop import train

    return train(eager(tiny_config(*overrides)), keep_model=True).model.eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(TOKENS)
    return getattr(out, "logits", out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A pretrained base run, and a LoRA run over it (adapter-only checkpoints at iterations 2 and 4)."""
    root = tmp_path_factory.mktemp("export")
    base = _train("train.train_iters=2", f"checkpoint.save={root / 'base'}")
    lora = _train("train.train_iters=4", "checkpoint.save_interval=2", f"checkpoint.save={root / 'lora'}",
                  "peft=lora", *PEFT, f"checkpoint.pretrained_checkpoint={root / 'base'}")
    return root, base, lora


def test_export_writes_a_peft_adapter_that_loads_over_the_exported_base_with_the_trained_logits(runs, tmp_path):
    root, base, lora = runs
    for args in ((root / "base", "hf", "base_hf"), (root / "lora", "peft", "adapter")):
        proc = run_cli("export", str(args[0]), "--format", args[1], "--out", str(tmp_path / args[2]), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"to {tmp_path / args[2]}" in proc.stdout
    want = _logits(lora)
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base_hf").eval()
    plain = _logits(hf_base)
    torch.testing.assert_close(plain, _logits(base), atol=1e-4, rtol=0)  # the full checkpoint, as trained
    adapted = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    torch.testing.assert_close(_logits(adapted), want, atol=1e-4, rtol=0)
    assert (plain - want).abs().max() > 1e-2  # the trained adapters are what makes them equal
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (8, 16, 0.1)


def test_export_hf_merges_the_adapters_of_the_iteration_folder_named(runs, tmp_path):
    root, _, lora = runs
    for name in ("iter_0000002", "iter_0000004"):
        assert run_cli("export", str(root / "lora" / name), "--format", "hf", "--out", str(tmp_path / name),
                       cwd=tmp_path).returncode == 0
    early, late = (_logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / n).eval())
                   for n in ("iter_0000002", "iter_0000004"))
    torch.testing.assert_close(late, _logits(lora), atol=1e-4, rtol=0)  # the last one: the trained model
    assert (early - late).abs().max() > 1e-3
    assert not any("lora" in k for k in transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "iter_0000004").state_dict())


def test_dora_over_a_seeded_base_exports_merged_with_the_trained_logits(tmp_path):
    dora = _train("train.train_iters=2", f"checkpoint.save={tmp_path / 'dora'}", "peft=dora", *PEFT)
    assert run_cli("export", str(tmp_path / "dora"), "--format", "hf", "--out", str(tmp_path / "hf"),
                   cwd=tmp_path).returncode == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(_logits(merged), _logits(dora), atol=1e-4, rtol=0)


def test_a_lora_run_over_a_hugging_face_base_exports_an_adapter_naming_it(runs, tmp_path):
    root, base, _ = runs
    assert run_cli("export", str(root / "base"), "--format", "hf", "--out", str(tmp_path / "hf"),
                   cwd=tmp_path).returncode == 0
    lora = _train("train.train_iters=2", f"checkpoint.save={tmp_path / 'run'}", "peft=lora", *PEFT,
                  "peft.target_modules=[linear_qkv,linear_fc2]", f"model.hf_path={tmp_path / 'hf'}")
    assert run_cli("export", str(tmp_path / "run"), "--format", "peft", "--out", str(tmp_path / "adapter"),
                   cwd=tmp_path).returncode == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "hf")
    assert config["target_modules"] == ["down_proj", "k_proj", "q_proj", "v_proj"]
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    adapted = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    torch.testing.assert_close(_logits(adapted), _logits(lora), atol=1e-4, rtol=0)
    assert (_logits(base) - _logits(lora)).abs().max() > 1e-2


def test_export_failures_are_one_line_errors(runs, tmp_path):
    import shutil

    root, _, lora = runs
    shutil.copytree(root / "lora" / "iter_0000002", tmp_path / "noconf" / "iter_0000002")
    (tmp_path / "noconf" / "iter_0000002" / "config.yaml").unlink()
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    cases = {
        (str(tmp_path / "empty"), "--format", "hf", "--out", str(tmp_path / "a")): "holds no complete graphstep",
        (str(tmp_path / "noconf"), "--format", "hf", "--out", str(tmp_path / "a")): "no config.yaml beside",
        (str(root / "lora" / "iter_0000009"), "--format", "hf", "--out", str(tmp_path / "a")): "no such checkpoint",
        (str(root / "lora"), "--format", "hf", "--out", str(tmp_path / "full")): "is not empty",
        (str(root / "base"), "--format", "peft", "--out", str(tmp_path / "a")): "without LoRA/DoRA adapters",
        (str(root / "base"), "--format", "hf", "--out", str(tmp_path / "a"), "--base", str(root)): "drop --base",
    }
    for args, words in cases.items():
        assert_one_line_error(run_cli("export", *args, cwd=tmp_path), "graphstep export", words)
    assert not (tmp_path / "a").exists()
    moved = tmp_path / "moved_base"
    (root / "base").rename(moved)  # the base the adapters were trained over is gone from where meta.base says
    try:
        line = assert_one_line_error(run_cli("export", str(root / "lora"), "--format", "peft", "--out",
                                             str(tmp_path / "a"), cwd=tmp_path), "pass --base DIR")
        assert f"checkpoint.pretrained_checkpoint={root / 'base'}" in line
        assert_one_line_error(run_cli("export", str(root / "lora"), "--format", "hf", "--out", str(tmp_path / "a"),
                                      "--base", str(tmp_path / "nowhere"), cwd=tmp_path), "(--base) is not there")
        proc = run_cli("export", str(root / "lora"), "--format", "hf", "--out", str(tmp_path / "b"), "--base",
                       str(moved), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        moved.rename(root / "base")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").eval()
    torch.testing.assert_close(_logits(merged), _logits(lora), atol=1e-4, rtol=0)
