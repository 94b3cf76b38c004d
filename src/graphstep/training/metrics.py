"""Per-iteration metrics without a host sync per iteration.

Every iteration copies its scalars (loss, grad norm, LR, the non-finite flag,
MoE statistics) into one row of a small device buffer -- a device-to-device
copy, no sync. On logging steps the buffer is read once (the only host sync
of the interval) and one JSON object per iteration is written to the metrics
file, the loss as the exact float32 value (``repr`` of the Python float), so
two runs can be compared for bit-equality.

A resumed run (``resume_after=N``) keeps the file's rows of iterations 1..N
and appends from N+1, so the file stays the run's whole history, each
iteration once: rows past N (written by the run that was killed after its
last checkpoint) and a line torn by the kill are dropped first, through a
temporary file and ``os.replace`` so that a kill during the rewrite leaves
the old file or the new one. A fresh run (``resume_after=0``) starts the
file anew.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("graphstep")


class MetricsRecorder:
    """A device-side history of per-iteration scalars, flushed on logging steps."""

    def __init__(self, keys: list[str], device: torch.device, capacity: int, path: str | None,
                 *, resume_after: int = 0) -> None:
        self.keys = list(keys)
        self.capacity = max(1, capacity)
        self.device = device
        self.buffer = torch.zeros(self.capacity, len(self.keys), dtype=torch.float32, device=device)
        self.pending: list[dict[str, Any]] = []
        self.path = Path(path) if path else None
        self._fh = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_after > 0 and self.path.exists():
                keep_history(self.path, resume_after)
                self._fh = open(self.path, "a")
            else:
                self._fh = open(self.path, "w")

    def record(self, iteration: int, state: str, values: dict[str, torch.Tensor], **host: Any) -> None:
        """Queue iteration ``iteration``'s device scalars (no sync)."""
        if len(self.pending) >= self.capacity:
            self.flush()
        row = len(self.pending)
        with torch.no_grad():
            stacked = torch.stack([values[k].detach().reshape(()).float() for k in self.keys])
            self.buffer[row].copy_(stacked, non_blocking=True)
        self.pending.append({"iteration": iteration, "state": state, "time": time.time(), **host})

    def flush(self) -> list[dict[str, Any]]:
        """Read the queued rows (one host sync) and write them; returns them."""
        if not self.pending:
            return []
        values = self.buffer[: len(self.pending)].tolist()  # the sync of this logging interval
        rows = []
        for meta, vals in zip(self.pending, values):
            row = {"iteration": meta["iteration"]}
            row.update({k: _exact(v) for k, v in zip(self.keys, vals)})
            row.update({k: v for k, v in meta.items() if k != "iteration"})
            rows.append(row)
            if self._fh is not None:
                self._fh.write(json.dumps(row) + "\n")
        if self._fh is not None:
            self._fh.flush()
        self.pending.clear()
        return rows

    def close(self) -> None:
        self.flush()
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _exact(v: float) -> float | str:
    # JSON has no NaN/Inf: write them as strings so the file stays valid.
    if math.isfinite(v):
        return v
    return str(v)


def keep_history(path: Path, last: int) -> None:
    """Rewrite ``path`` atomically with its rows of iterations <= ``last``, each once."""
    kept: dict[int, str] = {}
    dropped = torn = 0
    with open(path) as fh:
        for line in fh:
            try:
                it = int(json.loads(line)["iteration"])
            except (ValueError, KeyError, TypeError):
                torn += bool(line.strip())  # a line cut short by a kill
                continue
            if it <= last:
                kept[it] = line if line.endswith("\n") else line + "\n"
            else:
                dropped += 1
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.writelines(kept[i] for i in sorted(kept))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    if dropped or torn:
        log.info("%s: resuming after iteration %d, dropped %d row(s) written after it%s", path, last, dropped,
                 f" and {torn} torn line(s)" if torn else "")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]
