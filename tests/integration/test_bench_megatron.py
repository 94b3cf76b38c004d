"""The ``megatron_full_cuda_graph`` bench row without a GPU: finding and importing the megatron-core wheel."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from graphstep.bench import megatron_peer
from graphstep.bench.run import DENSE_ROWS, _builder
from graphstep.recipes import get_recipe


def test_row_is_registered_and_lazy():
    assert DENSE_ROWS[-1] == "megatron_full_cuda_graph"
    build = _builder("megatron_full_cuda_graph", get_recipe("llama3_tiny"), torch.device("cpu"))
    assert callable(build)


def test_missing_wheel_is_a_one_line_runtime_error_naming_the_path(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere" / "megatron_core-0.0.0-py3-none-any.whl"
    monkeypatch.setenv(megatron_peer.WHEEL_ENV, str(missing))
    build = _builder("megatron_full_cuda_graph", get_recipe("llama3_tiny"), torch.device("cpu"))
    with pytest.raises(RuntimeError) as info:
        build()
    message = str(info.value)
    assert message.startswith("megatron-core wheel not found: ") and str(missing) in message
    assert "\n" not in message


def test_empty_vendor_dir_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.delenv(megatron_peer.WHEEL_ENV, raising=False)
    monkeypatch.setattr(megatron_peer, "vendor_dirs", lambda: [tmp_path / "vendor"])
    with pytest.raises(RuntimeError, match="no megatron_core-.*whl in .*vendor"):
        megatron_peer.find_wheel()


def test_newest_wheel_wins(tmp_path, monkeypatch):
    vendor = tmp_path / "vendor"
    vendor.mkdir()
    for name in ("megatron_core-0.9.0-py3-none-any.whl", "megatron_core-0.16.1-cp39-cp39-linux_x86_64.whl",
                 "megatron_core-0.15.3-py3-none-any.whl"):
        (vendor / name).write_bytes(b"")
    monkeypatch.delenv(megatron_peer.WHEEL_ENV, raising=False)
    monkeypatch.setattr(megatron_peer, "vendor_dirs", lambda: [vendor])
    assert megatron_peer.find_wheel().name.startswith("megatron_core-0.16.1")


def _vendored_wheel():
    try:
        return megatron_peer.find_wheel()
    except RuntimeError:
        return None


@pytest.mark.slow
def test_vendored_wheel_imports_and_refuses_the_cpu():
    """In a fresh interpreter (megatron stays out of this one): the wheel imports, and the row needs CUDA."""
    if _vendored_wheel() is None:
        pytest.skip(f"no megatron-core wheel (${megatron_peer.WHEEL_ENV} or vendor/; scripts/fetch-megatron-core)")
    code = textwrap.dedent("""
        import sys, torch
        from graphstep.bench.megatron_peer import load_megatron, megatron_full_graph
        from graphstep.recipes import get_recipe
        mc = load_megatron()
        print("version", mc.version)
        wanted = ("megatron.core.full_cuda_graph", "megatron.core.models.gpt.gpt_model")
        print("imported", *(m in sys.modules for m in wanted))
        try:
            megatron_full_graph(get_recipe("llama3_tiny"), torch.device("cpu"))
        except RuntimeError as exc:
            print("refused", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("version 0.") for line in lines), out.stdout
    assert "imported True True" in lines, out.stdout
    assert any(line.startswith("refused megatron-core needs a CUDA device") for line in lines), out.stdout
