"""torchrun's own launcher with the tests' worker function as its entrypoint, its ranks forked:
``python -m helpers.fork_launch NPROC LOG_DIR FILE::FUNCTION [ARG ...]``.

``python -m torch.distributed.run --standalone`` builds a ``LaunchConfig`` and calls
``torch.distributed.launcher.api.elastic_launch(config, <command>)``; this does the
same with ``FUNCTION`` of ``FILE`` as the entrypoint (a c10d rendezvous on a free
local port, one elastic agent, its log directory with each rank's output teed)
and the ``fork`` start method: torch, graphstep and the test module are imported
once, here, and every rank starts from this process instead of importing them
again (about 3 CPU seconds per rank on CI's machine, most of a small launch). The
ranks then run as under the command-line torchrun: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and the rest set by the agent, ``dist.init_process_group("gloo")``
reading them. Nothing here touches CUDA, so the forked ranks may; the tests' GPU
launches still use the command-line torchrun (helpers.launch.torchrun_reports).

The ranks never ask the system resolver for an address: the rendezvous is on
``127.0.0.1`` (the ranks' ``MASTER_ADDR``), and gloo takes the loopback
interface by name (``GLOO_SOCKET_IFNAME=lo``) instead of looking the host name
up. A rank is forked from this process while the agent's threads run, and
once a rank was forked while one of them held glibc's resolver lock: its
``getaddrinfo("localhost")`` waited for that lock forever (a 4-rank launch
stuck at start-up until its timeout, 2026-12-07).
"""

from __future__ import annotations

import gc
import os
import sys
import uuid

# Modules every layout rank imports (graphstep imports some of them lazily, where they are used): torch._dynamo
# alone is about 90 modules (a second of CPU per rank on CI's machine).
PRELOAD = ("graphstep.training.loop", "graphstep.recipes", "helpers.runs", "numpy.random", "torch._dynamo",
           "torch.distributed.pipelining", "torch.nn.attention.flex_attention", "torch._decomp.decompositions_for_rng",
           "torch.distributed._composable.replicate_with_fsdp")


def main(argv: list[str]) -> None:
    if len(argv) < 3 or "::" not in argv[2]:
        raise SystemExit("usage: python -m helpers.fork_launch NPROC LOG_DIR FILE::FUNCTION [ARG ...]")
    nproc, log_dir, target, *args = argv
    import importlib

    for module in PRELOAD:  # what the ranks import, imported once before the fork
        importlib.import_module(module)
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from helpers import aten_cpu_matmuls
    from helpers.worker import load

    aten_cpu_matmuls()  # as in the test process (tests/conftest.py); the forked ranks inherit it
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=int(nproc), run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1", max_restarts=0,
                          start_method="fork",
                          logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks' gloo devices: no host-name lookup (docstring)
    entrypoint = load(target)
    gc.freeze()  # the imported objects out of the collector's reach: its passes in a rank would copy their pages
    elastic_launch(config, entrypoint)(*args)


if __name__ == "__main__":
    main(sys.argv[1:])
