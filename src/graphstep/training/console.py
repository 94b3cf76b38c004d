"""What the trainer prints: a progress bar, one line per logging step, a final table."""

from __future__ import annotations

import logging
import sys
from typing import Any

from rich.console import Console as RichConsole
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

log = logging.getLogger("graphstep")


def setup_logging(level: int = logging.INFO) -> None:
    """``graphstep`` log records to stderr, one line each, prefixed with the logger name."""
    logger = logging.getLogger("graphstep")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[graphstep] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)


class Console:
    """Progress bar (on a terminal only) and log lines that do not tear it."""

    def __init__(self, *, enabled: bool, total: int) -> None:
        self.rich = RichConsole(stderr=True)
        self.progress = (
            Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                     console=self.rich, transient=True)
            if enabled else None
        )
        self.total = total
        self.task = None

    def __enter__(self) -> "Console":
        if self.progress is not None:
            self.progress.start()
            self.task = self.progress.add_task("train", total=self.total)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.stop()

    def advance(self) -> None:
        if self.progress is not None:
            self.progress.advance(self.task)

    def line(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text, highlight=False, markup=False)
        else:
            log.info(text)

    def summary(self, result: Any, memory: str, metrics_path: str | None) -> None:
        rows = result.rows
        table = Table(title="graphstep train", show_header=False)
        table.add_column("what")
        table.add_column("value")
        table.add_row("iterations", str(result.iterations) + (" (stopped by signal)" if result.stopped_by_signal else ""))
        table.add_row("graphs", result.describe)
        if rows:
            table.add_row("loss first -> last", f"{rows[0]['loss']} -> {rows[-1]['loss']}")
            steady = [r["step_ms"] for r in rows if r.get("state") != "captured"][-max(1, len(rows) // 2):]
            if steady:
                table.add_row("step time (second half)", f"{sorted(steady)[len(steady) // 2]:.1f} ms")
        if result.eval_losses:
            table.add_row("eval loss", ", ".join(f"{i}: {v:.4f}" for i, v in result.eval_losses))
        if result.graphs:
            table.add_row("captures", f"{result.graphs} graph(s), {result.capture_seconds:.2f} s")
        if result.nonfinite_iterations:
            table.add_row("non-finite iterations", ", ".join(map(str, result.nonfinite_iterations)))
        table.add_row("peak memory", memory)
        if metrics_path:
            table.add_row("metrics", metrics_path)
        self.rich.print(table)
