"""Every everyday mistake is one line naming the culprit and the fix, exit code 2, no traceback.

Each case runs ``graphstep ...`` as a user would -- ``graphstep.cli.main`` in this
process, which ``test_python_m_graphstep_ends_as_in_process`` shows ends as
``python -m graphstep`` does -- and checks the exit code, that the error is
exactly one ``graphstep <command>:`` line naming the file or field, and that no
Python traceback reaches the user.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from helpers.cli import QUICK_TRAIN, assert_one_line_error, run_cli


@pytest.mark.slow  # a Python process per command: about 4 s each on an idle core
@pytest.mark.parametrize("args", [
    ("config", "validate", "--config", "bad.yaml"),  # a YAML error
    ("config", "validate", "optimizer.lr=-0.1"),  # rule violations on stdout
    ("config", "show", "--no-such-option"),  # argparse's usage error
    ("train", "data.dataset=sft", "data.data_path=sft.jsonl", "train.train_iters=1", "model.cuda_graph_impl=none"),
])
def test_python_m_graphstep_ends_as_in_process(tmp_path, args):
    (tmp_path / "bad.yaml").write_bytes(b"model:\n  num_layers: [1\n")
    (tmp_path / "sft.jsonl").write_bytes(b"\x89PNG\r\n")
    child = run_cli(*args, cwd=tmp_path, in_process=False)
    here = run_cli(*args, cwd=tmp_path)
    assert child.returncode == here.returncode == 2, child.stderr[-3000:] + here.stderr[-3000:]
    assert child.stdout == here.stdout
    assert [line for line in child.stderr.splitlines() if line.startswith(("graphstep", "usage"))] == \
        [line for line in here.stderr.splitlines() if line.startswith(("graphstep", "usage"))]

# --------------------------------------------------------------------------
# 1. --config files


@pytest.mark.parametrize("name, content, needles", [
    ("bad.yaml", b"model:\n  num_layers: [1\n", ("bad.yaml:3:1", "invalid YAML", "line 2")),
    ("tab.yaml", b"model:\n\tnum_layers: 2\n", ("tab.yaml:2:1", "replace the tab by spaces")),
    ("latin.yaml", b"model:\n  num_layers: 2 # caf\xe9\n", ("latin.yaml:2", "byte 0xe9 is not UTF-8")),
    ("list.yaml", b"- model\n", ("list.yaml", "a config is a mapping of sections")),
])
def test_malformed_config_file(tmp_path, name, content, needles):
    (tmp_path / name).write_bytes(content)
    assert_one_line_error(run_cli("config", "validate", "--config", str(tmp_path / name), cwd=tmp_path), *needles)


def test_missing_config_file_and_directory(tmp_path):
    assert_one_line_error(run_cli("train", "--config", "nope.yaml", cwd=tmp_path), "nope.yaml: no such file")
    (tmp_path / "conf").mkdir()
    assert_one_line_error(run_cli("config", "show", "--config", "conf", cwd=tmp_path), "conf: is a directory")


# --------------------------------------------------------------------------
# 2. data


@pytest.fixture
def indexed_prefix(tmp_path) -> str:
    from graphstep.data.cli import preprocess
    from graphstep.data.tokenizer import ByteTokenizer

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(40)))
    (prefix,) = preprocess([docs], str(tmp_path / "ds"), ByteTokenizer(), "byte")
    return prefix


def _train_indexed(prefix: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_cli("train", "data.dataset=indexed", f"data.data_path={prefix}", *QUICK_TRAIN, cwd=cwd)


@pytest.mark.parametrize("damage, needles", [
    ("truncate_idx", (".idx",)),
    ("garbage_idx", (".idx", "not a Megatron index")),
    ("empty_idx", (".idx", "in a file of 0 bytes")),
    ("truncate_bin", (".bin",)),
    ("empty_bin", (".bin",)),
    ("missing_idx", (".idx: no such file", ".bin is there")),
])
def test_damaged_indexed_dataset(tmp_path, indexed_prefix, damage, needles):
    idx, binary = Path(indexed_prefix + ".idx"), Path(indexed_prefix + ".bin")
    if damage == "truncate_idx":
        idx.write_bytes(idx.read_bytes()[:40])
    elif damage == "garbage_idx":
        idx.write_bytes(os.urandom(64))
    elif damage == "empty_idx":
        idx.write_bytes(b"")
    elif damage == "truncate_bin":
        binary.write_bytes(binary.read_bytes()[:101])
    elif damage == "empty_bin":
        binary.write_bytes(b"")
    else:
        idx.unlink()
    assert_one_line_error(_train_indexed(indexed_prefix, tmp_path), *needles)


def test_nonexistent_data_path(tmp_path):
    assert_one_line_error(_train_indexed(str(tmp_path / "nowhere"), tmp_path), "nowhere.idx: no such file",
                          "data.data_path takes the prefix")


@pytest.mark.parametrize("content, needles", [
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", ("sft.jsonl:1", "not UTF-8")),
    (b'{"prompt": "a", "response": "b"}\n\x00\x01\x02\x03', ("sft.jsonl:2", "binary file, not jsonl")),
])
def test_binary_sft_file(tmp_path, content, needles):
    (tmp_path / "sft.jsonl").write_bytes(content)
    proc = run_cli("train", "data.dataset=sft", "data.data_path=sft.jsonl", *QUICK_TRAIN, cwd=tmp_path)
    assert_one_line_error(proc, *needles)


@pytest.mark.parametrize("name, content", [("empty.txt", ""), ("blank.jsonl", "\n\n"),
                                           ("nokey.jsonl", '{"text": ""}\n')])
def test_preprocess_of_empty_input(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    proc = run_cli("preprocess", "--input", name, "--output-prefix", "out/ds", cwd=tmp_path)
    assert_one_line_error(proc, name, "no document with text")
    assert not list((tmp_path / "out").glob("*")), "no partial dataset is left behind"


# --------------------------------------------------------------------------
# 3. Hugging Face directories

LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "vocab_size": 256}


@pytest.mark.parametrize("case, needles", [
    ("no_config", ("model.hf_path=", "no config.json")),
    ("bad_json", ("config.json:1:2", "invalid JSON")),
    ("garbage_weights", ("model.safetensors", "not a readable safetensors file")),
    ("model_type", ("model_type='gpt2'", "graphstep loads llama")),
    ("missing_keys", ("config.json", "num_attention_heads", "missing")),
])
def test_broken_hugging_face_directory(tmp_path, case, needles):
    hf = tmp_path / "hf"
    hf.mkdir()
    config = {"no_config": None, "bad_json": "{bad", "garbage_weights": json.dumps(LLAMA),
              "model_type": json.dumps(LLAMA | {"model_type": "gpt2"}),
              "missing_keys": json.dumps({"model_type": "llama"})}[case]
    if config is not None:
        (hf / "config.json").write_text(config)
    (hf / "model.safetensors").write_bytes(b"garbage, not a safetensors file")
    assert_one_line_error(run_cli("train", f"model.hf_path={hf}", *QUICK_TRAIN, cwd=tmp_path), *needles)


def test_validate_checks_that_hf_path_exists(tmp_path):
    proc = run_cli("config", "validate", f"model.hf_path={tmp_path / 'missing'}", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr
    assert "V11 [model.hf_path]" in proc.stdout and "does not exist" in proc.stdout


# --------------------------------------------------------------------------
# 4. bench and doctor


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_bench_without_a_gpu(tmp_path):
    assert_one_line_error(run_cli("bench", "--recipe", "small_dense_bench", cwd=tmp_path), "no CUDA GPU",
                          "model.cuda_graph_backend=replay")


@pytest.mark.parametrize("source, target, needles", [
    ("import torch\ndef step(:\n    pass\n", "script.py:step", ("script.py:2", "SyntaxError")),
    ("import torch\nimport no_such_module_graphstep\n", "script.py:step",
     ("script.py:2", "ModuleNotFoundError", "no_such_module_graphstep")),
    ("def step():\n    return 1\n", "script.py:nostep", ("script.py", "no function 'nostep'")),
    ("def step():\n    return 1\n", "script.py", ("script.py", "name the step function")),
    ("def step():\n    return 1\n", "missing.py:step", ("missing.py: no such file",)),
])
def test_doctor_cannot_judge_the_script(tmp_path, source, target, needles):
    (tmp_path / "script.py").write_text(source)
    assert_one_line_error(run_cli("doctor", target, cwd=tmp_path), *needles)


# --------------------------------------------------------------------------
# 5-7. values, tracker flags, lists


def test_validate_refuses_negative_lr(tmp_path):
    proc = run_cli("config", "validate", "optimizer.lr=-0.1", "optimizer.adam_beta1=1", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "V1 [optimizer.lr]" in proc.stdout and "V3 [optimizer.adam_beta1]" in proc.stdout


def test_training_refuses_what_validate_refuses(tmp_path):
    proc = run_cli("train", "optimizer.lr=-0.1", *QUICK_TRAIN, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr
    assert "V1 [optimizer.lr]" in proc.stderr


def test_tracker_flags_as_in_bridge(tmp_path):
    import yaml

    # Bridge: either flag on turns both on; off takes both
    proc = run_cli("config", "show", "model.cuda_graph_impl=none", "model.use_te_rng_tracker=false",
                   "rng.te_rng_tracker=false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = yaml.safe_load(proc.stdout)
    assert data["model"]["use_te_rng_tracker"] is False and data["rng"]["te_rng_tracker"] is False
    proc = run_cli("config", "validate", "model.use_te_rng_tracker=false", "rng.te_rng_tracker=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout


def test_empty_list_item_is_reported(tmp_path):
    proc = run_cli("config", "validate", "model.cuda_graph_impl=local", "model.cuda_graph_scope=[attn,,mlp]",
                   cwd=tmp_path)
    line = assert_one_line_error(proc, "model.cuda_graph_scope=[attn,,mlp]", "item 2 of the list is empty")
    assert "'[attn'" not in proc.stdout + line and "R4" not in proc.stdout + line


def test_unknown_option_is_a_usage_error(tmp_path):
    proc = run_cli("config", "show", "--recipe", "llama3_tiny", "--no-such-option", cwd=tmp_path)
    assert proc.returncode == 2 and "unrecognized arguments: --no-such-option" in proc.stderr
    assert "Traceback" not in proc.stderr
