"""TensorBoard and W&B writers fed with the trainer's metrics rows.

The trainer reads its per-iteration scalars from the device once per
``logger.log_interval`` (training/metrics.py) and hands the rows here:
:meth:`MetricWriters.write_rows` writes the values the JSONL file has, at the
same iterations (every ``logger.tensorboard_log_interval``-th row), so the
writers add no host sync. Tags follow Megatron's where Megatron has one
(``lm loss``, ``learning-rate``, ``grad-norm``); any other numeric column of
a row (MoE aux/z-loss and load imbalance, TFLOP/s or MFU when a row has them)
is written under its own name. ``log_timers_to_tensorboard`` adds step time
and tokens/s, ``log_memory_to_tensorboard`` the peak memory, and every
capture is written as an event (iteration, graphs, seconds, memory added).

Both packages are optional extras: validation refuses a field that needs one
that is not installed (rule V21, before the run is built); the writers import
it when the run starts (a package that is found but does not import is a
one-line :class:`MissingExtraError`, exit 2). W&B runs offline (``WANDB_MODE=offline``)
unless ``WANDB_MODE`` is set, so it needs no network and no login.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import resource
from pathlib import Path
from typing import Any, Iterator

import torch

from ..config import Config, ConfigError
from ..errors import MissingExtraError
from ..cuda_graph.devices import GiB

log = logging.getLogger("graphstep")


# Megatron's TensorBoard tags for the columns it logs too; other columns keep their name.
TAGS = {"loss": "lm loss", "lr": "learning-rate", "grad_norm": "grad-norm"}
NOT_SCALARS = ("iteration", "time", "state", "step_ms")


def _require(module: str, extra: str, setting: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(
            f"{setting} needs the {extra} package, which is not installed: pip install 'graphstep[{extra}]' "
            f"(or unset {setting.split('=')[0]})") from None


class MetricWriters:
    """TensorBoard and W&B for one rank (the main one); every method is a no-op without either."""

    def __init__(self, cfg: Config, *, enabled: bool, tokens_per_iteration: int, device: torch.device,
                 flops_per_iteration: float | None = None, peak_tflops: float | None = None) -> None:
        lg = cfg.logger
        self.device = device
        self.interval = lg.tensorboard_log_interval
        self.timers, self.memory = lg.log_timers_to_tensorboard, lg.log_memory_to_tensorboard
        self.tokens = tokens_per_iteration
        self.flops, self.peak = flops_per_iteration, peak_tflops  # this rank's model FLOPs; its peak, if known
        self.nonfinite = 0
        self.captures = 0  # capture reports written so far
        self.tb = self.wandb = None
        if enabled and lg.tensorboard_dir:
            tensorboard = _require("torch.utils.tensorboard", "tensorboard", f"logger.tensorboard_dir={lg.tensorboard_dir}")
            with _output_dir("logger.tensorboard_dir", lg.tensorboard_dir):
                self.tb = tensorboard.SummaryWriter(log_dir=lg.tensorboard_dir)
        if enabled and lg.wandb_project:
            self.wandb = _open_wandb(cfg)

    @property
    def enabled(self) -> bool:
        return self.tb is not None or self.wandb is not None

    def write_rows(self, rows: list[dict[str, Any]]) -> None:
        """Write every ``tensorboard_log_interval``-th row, and the peak memory at the last row's iteration."""
        if not self.enabled:
            return
        for row in rows:
            self.nonfinite += bool(row.get("nonfinite"))
            if row["iteration"] % self.interval == 0:
                self._write(row["iteration"], self._scalars(row))
        if self.memory and rows:
            self._write(rows[-1]["iteration"], peak_memory_gib(self.device))

    def _scalars(self, row: dict[str, Any]) -> dict[str, float]:
        scalars = {TAGS.get(k, k): _number(v) for k, v in row.items() if k not in NOT_SCALARS}
        scalars = {k: v for k, v in scalars.items() if v is not None}
        if "nonfinite" in row:
            scalars["nonfinite-iterations"] = float(self.nonfinite)  # so far, skipped with train.skip_step_on_nan
        if self.timers and "step_ms" in row:
            scalars["step-time-ms"] = row["step_ms"]
            scalars["tokens-per-sec"] = self.tokens / (row["step_ms"] / 1e3) if row["step_ms"] > 0 else 0.0
            if self.flops and row["step_ms"] > 0:
                tflops = self.flops / (row["step_ms"] / 1e3) / 1e12
                scalars["throughput-tflops-per-gpu"] = tflops
                if self.peak:
                    scalars["mfu"] = tflops / self.peak
        return scalars

    def capture(self, iteration: int, reports: list[Any]) -> None:
        """The captures among ``reports`` (the run's, in order) not written yet: how many, which, time, memory."""
        reports, self.captures = reports[self.captures:], len(reports)
        if not self.enabled or not reports:
            return
        self._write(iteration, {
            "graphs/captured": float(len(reports)),
            "graphs/capture-seconds": sum(r.seconds for r in reports),
            "graphs/capture-allocated-gib": sum(r.allocated_delta for r in reports) / GiB,
            "graphs/capture-reserved-gib": sum(r.reserved_delta for r in reports) / GiB,
        })
        names = ", ".join(r.name for r in reports)
        if self.tb is not None:
            self.tb.add_text("graphs/captures", f"iteration {iteration}: {names}", iteration)
        if self.wandb is not None:
            self.wandb.summary["graphs"] = names

    def _write(self, step: int, scalars: dict[str, float]) -> None:
        if self.tb is not None:
            for tag, value in scalars.items():
                self.tb.add_scalar(tag, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            # rows are logged with an explicit step, which W&B holds open until a later step comes: commit the last
            # one here rather than leave it to finish()
            self.wandb.log({}, commit=True)
            self.wandb.finish()
            self.wandb = None


def peak_memory_gib(device: torch.device) -> dict[str, float]:
    """Peak allocated and reserved device memory (the process's peak RSS on the CPU), in GiB."""
    if device.type == "cuda":
        return {"memory/max-allocated-gib": torch.cuda.max_memory_allocated(device) / GiB,
                "memory/max-reserved-gib": torch.cuda.max_memory_reserved(device) / GiB}
    return {"memory/max-rss-gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB}


def _number(value: Any) -> float | None:
    """A row's value as a float (NaN/Inf are written as strings in the JSONL file); None for text."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            v = float(value)
        except ValueError:
            return None
        return v if not math.isfinite(v) else None
    return None


@contextlib.contextmanager
def _output_dir(field: str, path: str) -> Iterator[None]:
    """A folder that cannot be created as a one-line ``ConfigError``; the trainer's preflight
    (training/rundir.py) finds it before the run is built, this is for a folder lost since."""
    try:
        yield
    except OSError as exc:
        raise ConfigError(f"{field}={path}: cannot create or write this folder ({exc.strerror or exc}); "
                          f"choose another path for {field}") from None


def _open_wandb(cfg: Config) -> Any:
    lg = cfg.logger
    wandb = _require("wandb", "wandb", f"logger.wandb_project={lg.wandb_project}")
    os.environ.setdefault("WANDB_MODE", "offline")  # no network, no login; the user's WANDB_MODE wins
    if lg.wandb_save_dir:
        with _output_dir("logger.wandb_save_dir", lg.wandb_save_dir):
            Path(lg.wandb_save_dir).mkdir(parents=True, exist_ok=True)
    run = wandb.init(project=lg.wandb_project, name=lg.wandb_exp_name, dir=lg.wandb_save_dir,
                     config=cfg.to_dict(), reinit="finish_previous")
    log.info("W&B run %s (%s mode) in %s", run.name, os.environ["WANDB_MODE"], run.dir)
    return run
