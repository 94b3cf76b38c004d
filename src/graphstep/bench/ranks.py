"""``graphstep bench`` under torchrun: one process per GPU, every row measured by all of them in lockstep.

``torchrun --nproc_per_node N -m graphstep bench ...`` starts N processes;
torchrun's ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` are all this module
reads (:func:`world_size_from_env`, :func:`rank_from_env`). The bench joins
the process group once, the way the trainer does (:meth:`Ranks.join`: the
trainer's ``init_data_parallel``, so NCCL on ``cuda:LOCAL_RANK``, created
eagerly and warmed up, and a gloo group for host-side agreement); each
row's layout is then joined over that group by ``make_workload``
(bench/harness.py), again through ``init_data_parallel``.

Every rank runs every row with the same warm-up and iteration counts, so
their collectives match. Per row the ranks agree twice, on the host (the
gloo group, never the GPU stream, so no measured step waits on it):

* after building (:meth:`Ranks.all_built`): a rank that could not build the
  row -- failing before the build's own collectives (the row's groups and
  mesh, the warm-up all-reduce, the parameter broadcast), e.g. a config the
  model refuses -- must not leave the others waiting in the row's first step;
* after measuring (:meth:`Ranks.reduce_row`): peak memory becomes the
  maximum over the ranks -- one all-reduce (:func:`max_over_ranks`), which
  also carries whether the row failed on any rank.

Times are rank 0's own measurement; only rank 0 reports and writes results.
A rank that fails while the others are inside one of the row's collectives
(inside the build after its first collective, or mid-step) cannot be
covered by either agreement: the
others wait in that collective (captured NCCL work is not timed out by the
watchdog) until torchrun's job is stopped.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from ..config import Config, ConfigError
from ..training.distributed import DataParallel, init_data_parallel
from ..validation import resolve_cuda_graph_settings
from .harness import Row


def _env_int(env: Mapping[str, str] | None, name: str, default: int) -> int:
    env = os.environ if env is None else env
    text = env.get(name, str(default))
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a whole number (torchrun sets it; unset it to bench one "
                          "process on one GPU)") from None
    if value < 0 or (name == "WORLD_SIZE" and value < 1):
        raise ConfigError(f"{name}={value} is not a valid {name} (torchrun sets it; unset it to bench one process "
                          "on one GPU)")
    return value


def world_size_from_env(env: Mapping[str, str] | None = None) -> int:
    """The processes torchrun started (``WORLD_SIZE``); 1 without torchrun."""
    return _env_int(env, "WORLD_SIZE", 1)


def rank_from_env(env: Mapping[str, str] | None = None) -> int:
    """This process's rank (``RANK``); 0 without torchrun."""
    return _env_int(env, "RANK", 0)


def max_over_ranks(values: Sequence[float], group: Any = None) -> list[float]:
    """The element-wise maximum of ``values`` over the ranks of ``group``: one all-reduce of a CPU tensor
    (``group`` must be a gloo group, or None for a gloo default group). Without a process group: ``values``."""
    if not (dist.is_available() and dist.is_initialized()):
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


@dataclass
class Ranks:
    """The bench's place among torchrun's processes: the process group it joined (closed by :meth:`close`)."""

    dp: DataParallel

    @classmethod
    def join(cls, cfg: Config, world_size: int) -> "Ranks":
        """Join torchrun's process group as the trainer does; ``cfg`` (valid at ``world_size`` ranks) gives the
        device and backend. Sets this process's device to ``cuda:LOCAL_RANK``."""
        settings = resolve_cuda_graph_settings(cfg, world_size=world_size)
        dp = init_data_parallel(cfg, settings)
        if dp.world_size != world_size:
            dp.close()
            raise RuntimeError(f"the process group has {dp.world_size} ranks, WORLD_SIZE says {world_size}")
        return cls(dp)

    @property
    def rank(self) -> int:
        return self.dp.rank

    @property
    def world_size(self) -> int:
        return self.dp.world_size

    @property
    def is_main(self) -> bool:
        return self.dp.is_main

    @property
    def group(self) -> Any:
        """The host-side (gloo) group: the control group next to NCCL, or the default group on gloo."""
        return self.dp.control

    def all_built(self, built: bool) -> None:
        """Every rank says whether it built the row (one host all-reduce). On a rank that built it while
        another did not, raises: that rank skips the row instead of waiting in a collective no one joins."""
        failed = max_over_ranks([0.0 if built else float(self.rank + 1)], self.group)[0]
        if built and failed:
            raise RuntimeError(f"rank {int(failed) - 1} could not build this row (its error is in its output); "
                               "every rank skipped it")

    def reduce_row(self, row: Row) -> None:
        """Peak allocated and reserved memory become the maximum over the ranks, and a row that failed on
        another rank is marked failed here, in one all-reduce; a rank other than 0 prints its own failure
        (rank 0 reports the row)."""
        mine = [_or_minus_one(row.peak_allocated_gib), _or_minus_one(row.peak_reserved_gib),
                float(self.rank + 1) if row.error else 0.0]
        allocated, reserved, failed = max_over_ranks(mine, self.group)
        row.peak_allocated_gib = allocated if allocated >= 0 else None
        row.peak_reserved_gib = reserved if reserved >= 0 else None
        if row.error and not self.is_main:
            print(f"rank {self.rank}: bench row {row.name} failed: {row.error}", file=sys.stderr, flush=True)
        if failed and not row.error:
            row.error = f"failed on rank {int(failed) - 1} (its error is in that rank's output)"

    def close(self) -> None:
        """Destroy the bench's process group: after every row was freed (none may hold a captured collective)."""
        self.dp.close()


def _or_minus_one(value: float | None) -> float:
    return -1.0 if value is None else float(value)
