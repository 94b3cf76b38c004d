"""Bad inputs found at run time: one line naming the field or file and the fix, exit code 2, nothing lost.

Output folders TensorBoard and W&B cannot write (found by the trainer's preflight, before the run is
built), ``train.device=cuda`` under torchrun without a GPU, ``scripts/gpu-check`` without a GPU, checkpoints
that do not fit the run (another model, nothing left to train, a file), ``export_hf`` over existing
files, ``graphstep doctor --full-size`` of a model the host cannot hold -- and the tests themselves,
which must not write into the checkout. The command-line cases run ``python -m graphstep`` as a user would
(tests/integration/test_user_errors.py's helpers); the others call the functions.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.runs import tiny_config
from graphstep.config import ConfigError, ModelConfig
from graphstep.training.checkpoint import CheckpointError
from helpers.cli import QUICK_TRAIN, SRC, assert_one_line_error, run_cli
from helpers.launch import subprocess_env, torchrun
from helpers.launch import ROOT

TINY_SHAPE = ["model.hidden_size=64", "model.ffn_hidden_size=128", "model.seq_length=32", "train.micro_batch_size=2",
              "train.global_batch_size=4", "train.device=cpu", "model.cuda_graph_impl=none"]  # eager: short runs (V19)


def _graphstep_frames(output: str) -> list[str]:
    """Traceback frames inside graphstep's own code (a launcher's traceback, e.g. torchrun's, is not ours)."""
    return [line for line in output.splitlines() if line.strip().startswith("File ") and str(SRC / "graphstep") in line]


# --------------------------------------------------------------------------
# 1. TensorBoard and W&B folders: the preflight of training/rundir.py


@pytest.mark.parametrize("field", ["logger.tensorboard_dir", "logger.wandb_save_dir"])
def test_preflight_checks_the_tensorboard_and_wandb_folders(tmp_path, field):
    from graphstep.training.rundir import RunSetupError, check_outputs_writable

    (tmp_path / "afile").write_text("x")
    cases = {"/proc/graphstep-test": "cannot be created there", str(tmp_path / "afile"): "afile is a file",
             str(tmp_path / "afile" / "below"): "afile is a file"}
    for path, why in cases.items():
        cfg = tiny_config(f"{field}={path}", "logger.wandb_project=p")
        with pytest.raises(RunSetupError) as err:
            check_outputs_writable(cfg)
        message = str(err.value)
        assert message.startswith(f"{field}={path}: ") and why in message, message
        assert f"choose another path for {field}" in message and "\n" not in message
    ok = tiny_config(f"{field}={tmp_path / 'new' / 'folder'}", "logger.wandb_project=p")
    check_outputs_writable(ok)  # created, probed, left empty
    assert list((tmp_path / "new" / "folder").iterdir()) == []
    check_outputs_writable(ok, metrics=False)  # other ranks write neither


def test_wandb_folder_is_not_checked_without_a_project(tmp_path):
    from graphstep.training.rundir import check_outputs_writable

    check_outputs_writable(tiny_config("logger.wandb_save_dir=/proc/graphstep-test"))  # nothing will write there


@pytest.mark.slow
def test_unwritable_tensorboard_dir_is_one_line_before_the_run(tmp_path):
    (tmp_path / "afile").write_text("x")
    proc = run_cli("train", *QUICK_TRAIN, "logger.tensorboard_dir=/proc/tb", cwd=tmp_path)
    assert_one_line_error(proc, "logger.tensorboard_dir=/proc/tb", "choose another path for logger.tensorboard_dir")
    proc = run_cli("train", *QUICK_TRAIN, "logger.tensorboard_dir=afile", cwd=tmp_path)
    assert_one_line_error(proc, "logger.tensorboard_dir=afile", "afile is a file, not a directory")
    assert "replay backend" not in proc.stderr  # refused before the run was built (its graphs set up)


@pytest.mark.slow
def test_unwritable_wandb_save_dir_is_one_line_before_the_run(tmp_path):
    pytest.importorskip("wandb", reason="the wandb package is not installed")
    proc = run_cli("train", *QUICK_TRAIN, "logger.wandb_project=p", "logger.wandb_save_dir=/proc/wb", cwd=tmp_path)
    assert_one_line_error(proc, "logger.wandb_save_dir=/proc/wb", "choose another path for logger.wandb_save_dir")


# --------------------------------------------------------------------------
# 2. train.device=cuda under torchrun on a machine without a GPU


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_device_under_torchrun_without_a_gpu_is_one_line_per_rank(tmp_path):
    cmd = torchrun(2, "-m", "graphstep", "train", "train.device=cuda", *QUICK_TRAIN)
    proc = subprocess.run(cmd, env=subprocess_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert not _graphstep_frames(output), output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("graphstep train:")]
    assert 1 <= len(lines) <= 2 and len(set(lines)) == 1, output[-3000:]  # every rank that got there says the same
    assert lines[0] == ("graphstep train: train.device=cuda but this machine has no CUDA device; "
                        "use train.device=cpu or auto")
    assert re.search(r"exitcode\s*: 2\b", output), output[-3000:]  # torchrun's summary: the worker exited 2


# --------------------------------------------------------------------------
# 3. scripts/gpu-check on a machine without a GPU


def _can_run_scripts() -> bool:
    """scripts/bootstrap.sh reuses this Python when it has these modules (else it would build a .venv)."""
    return all(importlib.util.find_spec(m) for m in ("torch", "numpy", "yaml", "rich", "pytest", "hypothesis"))


def _gpu_check(out: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    clean.update(GRAPHSTEP_PYTHON=sys.executable, OUT=str(out), **env)
    clean.pop("GRAPHSTEP_FORCE_VENV", None)
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check")], env=clean, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.skipif(not _can_run_scripts(), reason="scripts/bootstrap.sh would build a virtual environment")
def test_gpu_check_without_a_gpu_says_so_and_fails(tmp_path):
    proc = _gpu_check(tmp_path / "out")
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2, output[-3000:]
    assert "Traceback" not in output and len(output.splitlines()) == 1, output[-3000:]
    assert output.startswith("scripts/gpu-check: no CUDA device is visible") and "a machine with a GPU" in output
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written


@pytest.mark.cuda
@pytest.mark.skipif(not _can_run_scripts(), reason="scripts/bootstrap.sh would build a virtual environment")
def test_gpu_check_on_a_gpu_goes_on_past_the_device_check(tmp_path):
    """On a GPU the script runs as before (here without its tests and benchmarks, FP8 ones included: they are what
    runs this)."""
    proc = _gpu_check(tmp_path / "out", GPU_CHECK_TESTS="0", GPU_CHECK_BENCH="", GPU_CHECK_FP8="0")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "no CUDA device" not in output and "gpu-check summary" in output
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert torch.cuda.get_device_name(0) in summary


# --------------------------------------------------------------------------
# 4. checkpoints that do not fit the run


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """A 4-layer checkpoint saved at iteration 2 (and its config)."""
    from graphstep.training.loop import train

    root = tmp_path_factory.mktemp("ck4") / "ck"
    train(tiny_config(*TINY_SHAPE, "model.num_layers=4", "train.train_iters=2", f"checkpoint.save={root}"))
    return root


def _load(root: Path, *overrides: str, iters: int = 4):
    from graphstep.training.loop import train

    return train(tiny_config(*TINY_SHAPE, f"train.train_iters={iters}", f"checkpoint.load={root}", *overrides))


@pytest.mark.parametrize("finetune", [False, True])
def test_checkpoint_of_another_depth_is_refused_naming_the_field(four_layers, finetune):
    with pytest.raises(CheckpointError) as err:
        _load(four_layers, "model.num_layers=2", f"checkpoint.finetune={str(finetune).lower()}")
    message = str(err.value)
    assert "iter_0000002" in message and "saved for another model" in message and "\n" not in message
    assert "model.num_layers=4 (this run: 2)" in message and "set model.num_layers=4" in message


def test_checkpoint_of_another_width_is_refused_naming_the_field(four_layers):
    with pytest.raises(CheckpointError, match=r"model\.ffn_hidden_size=128 \(this run: 96\)"):
        _load(four_layers, "model.num_layers=4", "model.ffn_hidden_size=96")


def test_without_its_config_the_refusal_names_the_tensors(four_layers):
    """Called as a library without configs: the names and shapes that differ."""
    from graphstep.models import build_model
    from graphstep.training.checkpoint import check_model_matches
    from graphstep.training.distributed import DataParallel

    path = four_layers / "iter_0000002"
    two = build_model(tiny_config(*TINY_SHAPE, "model.num_layers=2").model, torch.device("cpu"))
    with pytest.raises(CheckpointError, match=r"it holds layers\.2\.\S+, layers\.2\.\S+, layers\.2\.\S+ and \d+ more "
                                              r"that this model lacks"):
        check_model_matches(path, two, DataParallel())
    wide = build_model(tiny_config(*TINY_SHAPE, "model.num_layers=4", "model.ffn_hidden_size=96").model,
                       torch.device("cpu"))
    with pytest.raises(CheckpointError, match=r"layers\.0\.\S+ is \[\d+, \d+\] there, \[\d+, \d+\] here"):
        check_model_matches(path, wide, DataParallel())
    same = build_model(tiny_config(*TINY_SHAPE, "model.num_layers=4").model, torch.device("cpu"))
    check_model_matches(path, same, DataParallel())  # the model that saved it


@pytest.mark.parametrize("iters", [1, 2])
def test_resume_with_nothing_left_to_train_is_refused(four_layers, iters):
    with pytest.raises(CheckpointError) as err:
        _load(four_layers, "model.num_layers=4", iters=iters)
    message = str(err.value)
    assert f"iter_0000002 is at iteration 2 and train.train_iters={iters}" in message
    assert "raise train.train_iters above 2" in message
    resumed = _load(four_layers, "model.num_layers=4", iters=3)  # one iteration left: trained
    assert [r["iteration"] for r in resumed.rows] == [3]


def test_finetune_from_a_later_iteration_is_not_a_resume(four_layers):
    result = _load(four_layers, "model.num_layers=4", "checkpoint.finetune=true", iters=1)
    assert [r["iteration"] for r in result.rows] == [1]


def test_checkpoint_load_naming_a_file_is_refused(four_layers, tmp_path):
    from graphstep.training.checkpoint import choose_checkpoint

    (tmp_path / "model.pt").write_bytes(b"x")
    cases = {
        tmp_path / "model.pt": "name a checkpoint.save folder",
        four_layers / "latest_checkpointed_iteration.txt": f"set checkpoint.load={four_layers}",
        four_layers / "iter_0000002" / ".metadata": f"set checkpoint.load={four_layers / 'iter_0000002'}",
    }
    for path, fix in cases.items():
        with pytest.raises(CheckpointError) as err:
            choose_checkpoint(path)
        assert str(err.value).startswith(f"checkpoint.load={path} is a file, not a checkpoint folder; ")
        assert fix in str(err.value)
    with pytest.raises(CheckpointError, match=r"iter_0000009: no such checkpoint folder; intact checkpoints in .*"
                                              r"iter_0000002"):
        choose_checkpoint(four_layers / "iter_0000009")  # a typo in the iteration
    assert choose_checkpoint(tmp_path / "not-yet") is None  # a save folder of a first run: starts from scratch


@pytest.mark.slow
def test_checkpoint_mistakes_are_one_line_on_the_command_line(four_layers, tmp_path):
    common = [*QUICK_TRAIN, *TINY_SHAPE]
    proc = run_cli("train", *common, "model.num_layers=2", "train.train_iters=4", f"checkpoint.load={four_layers}",
                   cwd=tmp_path)
    assert_one_line_error(proc, "model.num_layers=4 (this run: 2)", "set model.num_layers=4")
    proc = run_cli("train", *common, "model.num_layers=4", "train.train_iters=1", f"checkpoint.load={four_layers}",
                   cwd=tmp_path)
    assert_one_line_error(proc, "iteration 2", "raise train.train_iters above 2")
    proc = run_cli("train", *common, "model.num_layers=4", "train.train_iters=4",
                   f"checkpoint.load={four_layers / 'latest_checkpointed_iteration.txt'}", cwd=tmp_path)
    assert_one_line_error(proc, "is a file, not a checkpoint folder", f"set checkpoint.load={four_layers}")


@pytest.mark.cuda
def test_checkpoint_of_another_depth_is_refused_on_cuda(four_layers):
    with pytest.raises(CheckpointError, match=r"model\.num_layers=4 \(this run: 2\)"):
        _load(four_layers, "model.num_layers=2", "train.device=cuda")


# --------------------------------------------------------------------------
# 5. export_hf: nothing lost


def _tiny_model():
    from graphstep.models import build_model

    cfg = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2, vocab_size=64)
    return build_model(cfg, torch.device("cpu")), cfg


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_export_refuses_a_non_empty_folder_and_overwrites_only_when_asked(tmp_path, umask_022):
    from graphstep.models.hf import HFExportError, export_hf, load_hf

    model, cfg = _tiny_model()
    out = export_hf(model, cfg, tmp_path / "hf")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"config.json", "model.safetensors"}
    with torch.no_grad():
        model.embedding.weight.add_(1.0)
    with pytest.raises(HFExportError) as err:
        export_hf(model, cfg, out)
    assert isinstance(err.value, ConfigError) and "\n" not in str(err.value)
    assert "not empty (config.json, model.safetensors)" in str(err.value) and "overwrite=True" in str(err.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("mine")
    with pytest.raises(HFExportError, match="not empty"):
        export_hf(model, cfg, tmp_path / "notes")
    assert os.listdir(tmp_path / "notes") == ["README.md"]

    export_hf(model, cfg, out, overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]  # no temporary file left
    _, state = load_hf(out)
    assert torch.equal(state["embedding.weight"], model.embedding.weight)


def test_export_refuses_a_file_and_a_sharded_folder(tmp_path):
    from graphstep.models.hf import HFExportError, export_hf

    model, cfg = _tiny_model()
    (tmp_path / "f").write_text("x")
    with pytest.raises(HFExportError, match="is a file"):
        export_hf(model, cfg, tmp_path / "f")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(HFExportError, match="sharded checkpoint"):
        export_hf(model, cfg, sharded, overwrite=True)
    assert os.listdir(sharded) == ["model.safetensors.index.json"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)], ids=["umask022", "umask027"])
def test_exported_files_have_the_ordinary_mode(tmp_path, umask, mode):
    from graphstep.models.hf import export_hf

    model, cfg = _tiny_model()
    old = os.umask(umask)
    try:
        out = export_hf(model, cfg, tmp_path / "hf")
    finally:
        os.umask(old)
    for name in ("config.json", "model.safetensors"):
        assert (out / name).stat().st_mode & 0o777 == mode, name


def test_a_failed_overwrite_leaves_the_old_files(tmp_path, monkeypatch):
    import safetensors.torch

    from graphstep.models.hf import export_hf

    model, cfg = _tiny_model()
    out = export_hf(model, cfg, tmp_path / "hf")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def dies_midway(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", dies_midway)
    with pytest.raises(OSError, match="No space left"):
        export_hf(model, cfg, out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # old files whole, no temporary left


# --------------------------------------------------------------------------
# 6. graphstep doctor --full-size: the memory check before building


def test_doctor_refuses_a_full_size_model_the_host_cannot_hold_before_building(monkeypatch):
    from graphstep.cuda_graph.devices import GiB
    from graphstep.doctor import recipe
    from graphstep.recipes import get_recipe
    from graphstep.training import build
    from graphstep.training.rundir import RunSetupError

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.delenv("GRAPHSTEP_SKIP_MEMORY_CHECK", raising=False)
    monkeypatch.setattr(recipe, "available_memory", lambda device: 16 * GiB)
    monkeypatch.setattr(build, "build_run", no_build)
    with pytest.raises(RunSetupError) as err:
        recipe.check_recipe(get_recipe("llama3_8b"), name="llama3_8b", full_size=True)
    message = str(err.value)
    assert "--recipe llama3_8b as judged needs about" in message and "16.0 GiB are available" in message
    assert "8.03B parameters" in message and "drop --full-size" in message and "\n" not in message


@pytest.mark.slow
@pytest.mark.skipif(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") > 250 * 2**30,
                    reason="this machine could hold llama3_8b")
def test_doctor_full_size_llama3_8b_is_one_line_on_a_small_machine(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(SRC))
    env.pop("GRAPHSTEP_SKIP_MEMORY_CHECK", None)
    proc = subprocess.run([sys.executable, "-m", "graphstep", "doctor", "--recipe", "llama3_8b", "--full-size"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc, "GiB of host RAM", "drop --full-size")


# --------------------------------------------------------------------------
# 7. the tests themselves write nothing into the checkout


def test_tests_run_outside_the_checkout():
    """conftest.py moves every test (and what it starts) into a scratch folder: a run's default outputs
    (runs/metrics.jsonl) stay out of the repository, where a scripts/train of the same clone locks runs/."""
    assert not Path.cwd().resolve().is_relative_to(ROOT), Path.cwd()


def test_no_test_starts_a_process_in_the_checkout():
    offenders = [f"{path.name}:{n}" for path in sorted((ROOT / "tests").rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"\bcwd=(ROOT|HERE)\b", line)]
    assert offenders == []
