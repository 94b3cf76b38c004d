"""``graphstep bench --recipe R [overrides] [--rows a,b] [--iters N] [--out DIR]``.

Needs a CUDA GPU (every row is timed with CUDA events); without one the
command stops with exit code 2 before building anything.
"""

from __future__ import annotations

import argparse
import json

from ..cli import _config_args, register, resolve_config


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .run import default_rows, run_bench, split_rows, table, write_results

    cfg = resolve_config(args)
    if args.tensorboard_dir:  # before a long run, not after it
        from ..observability.writers import _require

        _require("tensorboard", "tensorboard", "graphstep bench --tensorboard-dir")
    _need_gpu()
    rows = split_rows(args.rows) if args.rows else default_rows(cfg)
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(f"{args.recipe}: starting", total=len(rows))

        def progress(done: int, name: str) -> None:
            bar.update(task, completed=done, description=f"{args.recipe}: {escape(name)}")

        doc = run_bench(cfg, rows, recipe=args.recipe, iters=args.iters, warmup=args.warmup, progress=progress)
        bar.update(task, completed=len(rows), description=f"{args.recipe}: done")
    path = write_results(doc, args.out)
    if args.tensorboard_dir:
        from .tensorboard import write_tensorboard

        print(f"tensorboard: {write_tensorboard(doc, args.tensorboard_dir)}")
    Console(width=max(160, Console().width)).print(table(doc))
    print(f"results: {path}")
    if args.json:
        print(json.dumps(doc))
    return 0


def _need_gpu() -> None:
    import torch

    from ..config import ConfigError

    if not torch.cuda.is_available():
        raise ConfigError("no CUDA GPU is visible: graphstep bench times CUDA graphs on a GPU and has no CPU rows; "
                          "run it on a GPU machine, or dry-run the capture here with `graphstep train "
                          "model.cuda_graph_backend=replay` or `graphstep doctor --recipe NAME`")


@register("bench")
def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure eager, graphstep's graph settings and peers on one GPU")
    _config_args(p)
    p.add_argument("--rows", help="comma list of rows (default: every applicable row)")
    p.add_argument("--iters", type=int, default=50, help="timed iterations per row")
    p.add_argument("--warmup", type=int, default=8, help="untimed iterations per row (capture included)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON results")
    p.add_argument("--json", action="store_true", help="also print the result document")
    p.add_argument("--tensorboard-dir", help="also write the rows as TensorBoard scalars (a run folder under it)")
    p.set_defaults(fn=cmd_bench)
