"""The peer rows ``megatron_full_cuda_graph`` and ``torchtitan_cuda_graph`` without a GPU: finding and importing
their wheels."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from graphstep.bench import megatron_peer, torchtitan_peer, wheels
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
    monkeypatch.setattr(wheels, "vendor_dirs", lambda: [tmp_path / "vendor"])
    with pytest.raises(RuntimeError, match="no megatron_core-.*whl in .*vendor"):
        megatron_peer.find_wheel()


def test_newest_wheel_wins(tmp_path, monkeypatch):
    vendor = tmp_path / "vendor"
    vendor.mkdir()
    for name in ("megatron_core-0.9.0-py3-none-any.whl", "megatron_core-0.16.1-cp39-cp39-linux_x86_64.whl",
                 "megatron_core-0.15.3-py3-none-any.whl"):
        (vendor / name).write_bytes(b"")
    monkeypatch.delenv(megatron_peer.WHEEL_ENV, raising=False)
    monkeypatch.setattr(wheels, "vendor_dirs", lambda: [vendor])
    assert megatron_peer.find_wheel().name.startswith("megatron_core-0.16.1")


def _vendored_wheel():
    """The newest vendored megatron-core wheel built for this interpreter (0.17 and newer are CPython 3.12+)."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    found = [w for d in wheels.vendor_dirs() if d.is_dir() for w in d.glob(f"megatron_core-*-{tag}-*.whl")]
    return max(found, key=wheels._version_key) if found else None


@pytest.mark.slow
def test_vendored_wheel_imports_and_refuses_the_cpu():
    """In a fresh interpreter (megatron stays out of this one): the wheel imports, and the row needs CUDA."""
    wheel = _vendored_wheel()
    if wheel is None:
        pytest.skip("no megatron-core wheel for this Python in vendor/ (scripts/fetch-megatron-core)")
    version = wheels.wheel_version(wheel)
    code = textwrap.dedent(f"""
        import sys, torch
        from graphstep.bench.megatron_peer import load_megatron, megatron_full_graph
        from graphstep.recipes import get_recipe
        mc = load_megatron({version!r})
        print("version", mc.version)
        wanted = ("megatron.core.full_cuda_graph", "megatron.core.models.gpt.gpt_model")
        print("imported", *(m in sys.modules for m in wanted))
        try:
            megatron_full_graph(get_recipe("llama3_tiny"), torch.device("cpu"), {version!r})
        except RuntimeError as exc:
            print("refused", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert f"version {version}" in lines, out.stdout
    assert "imported True True" in lines, out.stdout
    assert any(line.startswith("refused megatron-core needs a CUDA device") for line in lines), out.stdout


def test_a_versioned_row_takes_that_versions_wheel(tmp_path, monkeypatch):
    vendor = tmp_path / "vendor"
    vendor.mkdir()
    for name in ("megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl",
                 "megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl"):
        (vendor / name).write_bytes(b"")
    monkeypatch.setenv(megatron_peer.WHEEL_ENV, str(vendor / "megatron_core-0.19.2-x.whl"))  # a version wins
    monkeypatch.setattr(wheels, "vendor_dirs", lambda: [vendor])
    assert megatron_peer.find_wheel("0.16.1").name.startswith("megatron_core-0.16.1-")
    with pytest.raises(RuntimeError, match=r"no megatron_core-0\.18\.0-\*\.whl in .*fetch-megatron-core"):
        megatron_peer.find_wheel("0.18.0")
    build = _builder("megatron_full_cuda_graph@0.18.0", get_recipe("llama3_tiny"), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="megatron-core wheel not found"):
        build()


def test_torchtitan_row_without_its_wheel_is_a_one_line_error(tmp_path, monkeypatch):
    assert "torchtitan_cuda_graph" in DENSE_ROWS
    monkeypatch.delenv(torchtitan_peer.WHEEL_ENV, raising=False)
    monkeypatch.setattr(wheels, "vendor_dirs", lambda: [tmp_path / "vendor"])
    build = _builder("torchtitan_cuda_graph", get_recipe("llama3_tiny"), torch.device("cpu"))
    with pytest.raises(RuntimeError) as info:
        build()
    message = str(info.value)
    assert message.startswith("torchtitan wheel not found: no torchtitan-*.whl in ") and "\n" not in message
    assert "scripts/fetch-torchtitan" in message


def test_the_table_says_what_each_peer_captures():
    from graphstep.bench.run import markdown_table

    row = dict(error=None, step_ms=1.0, busy_ms=0.5, host_ms=0.5, kernels=3, host_syncs=0, speedup=None,
               floor_ratio=None, peak_allocated_gib=1.0, memory_vs_eager=None, capture_s=None, mfu=None,
               vs_peer=None)
    doc = {"recipe": "r", "environment": {"gpu": "G", "torch": "t", "cuda": "c", "date": "d"},
           "bf16_matmul_tflops": 1.0,
           "rows": [dict(row, name="full_iteration", note=""),
                    dict(row, name="megatron_full_cuda_graph@0.19.2", note="ran on its capture stream"),
                    dict(row, name="torchtitan_cuda_graph", note="")]}
    text = markdown_table(doc)
    assert "- megatron_full_cuda_graph@0.19.2: forward+backward of every micro-batch in one graph" in text
    assert "- torchtitan_cuda_graph: per micro-batch" in text
    assert "- megatron_full_cuda_graph@0.19.2: ran on its capture stream" in text
    assert "- full_iteration:" not in text


def _vendored_torchtitan():
    try:
        return wheels.find_wheel("torchtitan", torchtitan_peer.WHEEL_ENV, torchtitan_peer.FETCH)
    except RuntimeError:
        return None


@pytest.mark.slow
def test_vendored_torchtitan_wrapper_imports_alone_and_refuses_the_cpu():
    """In a fresh interpreter: torchtitan's cudagraph module imports from the wheel without the rest of
    torchtitan.distributed, and the row needs CUDA."""
    if _vendored_torchtitan() is None:
        pytest.skip(f"no torchtitan wheel (${torchtitan_peer.WHEEL_ENV} or vendor/; scripts/fetch-torchtitan)")
    code = textwrap.dedent("""
        import sys, torch
        from graphstep.bench.torchtitan_peer import load_cudagraph, torchtitan_graph, version
        from graphstep.recipes import get_recipe
        module = load_cudagraph()
        print("version", version(), callable(module.wrap_with_cuda_graph))
        print("parallel_dims", "torchtitan.distributed.parallel_dims" in sys.modules)
        try:
            torchtitan_graph(get_recipe("llama3_tiny"), torch.device("cpu"))
        except RuntimeError as exc:
            print("refused", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "version 0.3.0 True" in lines, out.stdout
    assert "parallel_dims False" in lines, out.stdout
    assert any(line.startswith("refused torchtitan_cuda_graph needs a CUDA device") for line in lines), out.stdout
