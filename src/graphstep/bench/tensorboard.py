"""``graphstep bench --tensorboard-dir DIR``: a bench run's rows as TensorBoard scalars.

Each bench run becomes one TensorBoard run folder, ``DIR/<recipe>_<gpu>_<date>``
(``<N>x<gpu>`` for a run over N ranks; ``_2``, ``_3``, ... when it exists), so runs of other days, GPUs or commits
sit side by side. Every row's numbers are scalars tagged ``<metric>/<row>``
(``step_ms/full_iteration``, ``peak_allocated_gib/local[attn,mlp]``) at step 0,
and the run's Markdown table is attached as text. Rows that failed are
skipped. Needs the ``tensorboard`` package (``pip install 'graphstep[tensorboard]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..observability.writers import _require

METRICS = ("step_ms", "busy_ms", "host_ms", "speedup", "floor_ratio", "peak_allocated_gib", "memory_vs_eager",
           "capture_s", "kernels", "host_syncs", "tokens_per_s", "tflops", "mfu")


def run_folder(doc: dict[str, Any], root: str | Path) -> Path:
    from .run import result_stem

    stem = result_stem(doc)
    path, n = Path(root) / stem, 1
    while path.exists():
        n += 1
        path = Path(root) / f"{stem}_{n}"
    return path


def write_tensorboard(doc: dict[str, Any], root: str | Path) -> Path:
    """Write the rows of ``doc`` (``run_bench``'s result) as one TensorBoard run under ``root``; returns its folder."""
    _require("tensorboard", "tensorboard", "graphstep bench --tensorboard-dir")
    from torch.utils.tensorboard import SummaryWriter

    from .run import markdown_table

    folder = run_folder(doc, root)
    writer = SummaryWriter(log_dir=str(folder))
    try:
        for row in doc["rows"]:
            if row.get("error"):
                continue
            for metric in METRICS:
                value = row.get(metric)
                if isinstance(value, (int, float)):
                    writer.add_scalar(f"{metric}/{row['name']}", float(value), 0)
        writer.add_text("table", markdown_table(doc), 0)
    finally:
        writer.close()
    return folder
