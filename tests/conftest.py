"""pytest's fixtures for every test: a scratch working directory, no graph left alive, a one-rank group.

What the tests share besides fixtures (tiny configs, the same-run assertion) is in ``helpers/``."""

from __future__ import annotations

import os

# Inductor compiles in the test's own process: with its default on 2 cores (2 compile threads) it starts a pool of
# compile processes (each importing torch) and a thread pool that lives on in the pytest worker after the test.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest
import torch

from helpers import aten_cpu_matmuls

# Under pytest-xdist (scripts/test) each worker takes one core; alone, the tests take up to two.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))
aten_cpu_matmuls()  # oneDNN's FP8 matmul is slow on some CPUs (helpers/__init__.py)


@pytest.fixture(autouse=True, scope="session")
def _outside_the_checkout(tmp_path_factory):
    """Every test (and every process it starts) runs in a scratch folder, not in the checkout: what a run
    writes by default relative to the working directory (``runs/metrics.jsonl``, W&B's ``wandb/``, the
    profiler's ``profile/``) never lands in the repository, where a ``scripts/train`` of the same clone may
    hold the lock of ``runs/``. Session-scoped, so module fixtures that train run there too."""
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(old)


@pytest.fixture(autouse=True)
def _fresh_backends():
    """Each test starts and ends without graphs alive."""
    from graphstep.cuda_graph.registry import close_all_backends

    yield
    close_all_backends()


@pytest.fixture
def one_rank_group(request):
    """A one-rank process group (gloo, or NCCL for a test parametrized with ``device="cuda"``) for the test."""
    import torch.distributed as dist

    import graphstep

    device = request.node.callspec.params.get("device", "cpu") if hasattr(request.node, "callspec") else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield device
    graphstep.close_all()
    dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    """The costliest test files first, so that under xdist (``--dist loadfile --no-loadscope-reorder``,
    scripts/test) no long torchrun launch is left to start when the other worker has run out of files: files with
    4- or 8-rank launches, then the other multi-rank files, then by their number of tests marked ``slow``, then by
    their number of tests. Within a file the order stays."""
    files: dict = {}
    for item in items:
        files.setdefault(item.path, []).append(item)

    def cost(path) -> tuple:
        marks = [{m.name for m in item.iter_markers()} for item in files[path]]
        return (not any(m & {"ranks4", "ranks8"} for m in marks), "distributed" not in path.parts,
                -sum("slow" in m for m in marks), -len(marks))

    items[:] = [item for path in sorted(files, key=cost) for item in files[path]]
