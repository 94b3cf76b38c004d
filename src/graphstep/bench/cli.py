"""``graphstep bench --recipe R [overrides] [--rows a,b] [--iters N] [--rounds N] [--out DIR]``.

Needs a CUDA GPU (every row is timed with CUDA events); without one the
command stops with exit code 2 before building anything. Under
``torchrun --nproc_per_node N -m graphstep bench ...`` every rank measures
the multi-rank rows in lockstep (bench/ranks.py) and rank 0 alone shows
progress, prints the table and writes the results.
"""

from __future__ import annotations

import argparse
import json

from ..config_files import add_config_args, config_from_args


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .layouts import check_world
    from .ranks import rank_from_env, world_size_from_env
    from .run import REFUSED, default_rows, run_bench, split_rows, table, write_results

    cfg = config_from_args(args)
    if args.tensorboard_dir:  # before a long run, not after it
        from ..observability.writers import _require

        _require("tensorboard", "tensorboard", "graphstep bench --tensorboard-dir")
    world = world_size_from_env()
    rows = split_rows(args.rows) if args.rows else default_rows(cfg, world)
    check_world(rows, world, args.recipe)  # before the GPU check: the refusal says what to launch instead
    _need_gpu()
    if rank_from_env() != 0:  # the other ranks measure in lockstep; rank 0 reports
        run_bench(cfg, rows, recipe=args.recipe, iters=args.iters, warmup=args.warmup, world_size=world,
                  rounds=args.rounds, host_top=args.host_profile)
        return 0
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(f"{args.recipe}: starting", total=len(rows) * args.rounds)

        def progress(done: int, name: str) -> None:
            bar.update(task, completed=done, description=f"{args.recipe}: {escape(name)}")

        doc = run_bench(cfg, rows, recipe=args.recipe, iters=args.iters, warmup=args.warmup, progress=progress,
                        world_size=world, rounds=args.rounds, host_top=args.host_profile)
        bar.update(task, completed=len(rows) * args.rounds, description=f"{args.recipe}: done")
    if doc is None:
        raise RuntimeError("RANK=0 but the process group gave this process another rank: no result document")
    path = write_results(doc, args.out)
    if args.tensorboard_dir:
        from .tensorboard import write_tensorboard

        print(f"tensorboard: {write_tensorboard(doc, args.tensorboard_dir)}")
    Console(width=max(160, Console().width)).print(table(doc))
    for r in doc["rows"]:  # the table shows the start of a refusal; every rule's message and fix in full
        if r["note"] == REFUSED:
            print(f"{r['name']}: {r['error']}")
    print(f"results: {path}")
    if args.json:
        print(json.dumps(doc))
    return 0


def _rounds(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of rounds (a whole number, 1 or more)")
    return n


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of functions (a whole number, 0 or more)")
    return n


def _need_gpu() -> None:
    import torch

    from ..config import ConfigError

    if not torch.cuda.is_available():
        raise ConfigError("no CUDA GPU is visible: graphstep bench times CUDA graphs on a GPU and has no CPU rows; "
                          "run it on a GPU machine, or dry-run the capture here with `graphstep train "
                          "model.cuda_graph_backend=replay` or `graphstep doctor --recipe NAME`")


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure eager, graphstep's graph settings and peers on one GPU "
                       "(multi-rank layouts under torchrun)")
    add_config_args(p)
    p.add_argument("--rows", help="comma list of rows (default: every applicable row)")
    p.add_argument("--iters", type=int, default=50, help="timed iterations per row")
    p.add_argument("--warmup", type=int, default=8, help="untimed iterations per row (capture included)")
    p.add_argument("--rounds", type=_rounds, default=1,
                   help="measure every row this many times, the rows interleaved round by round (A B C A B C): "
                   "step = the median over rounds, the spread shown, each row's ratio to its peer per round")
    p.add_argument("--host-profile", type=_count, default=0, metavar="N",
                   help="also profile each row's host side after its timed steps: its N Python functions "
                   "with the most own time (cProfile) and N torch operators with the most host time (every "
                   "thread), in the JSON and under the table")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON results")
    p.add_argument("--json", action="store_true", help="also print the result document")
    p.add_argument("--tensorboard-dir", help="also write the rows as TensorBoard scalars (a run folder under it)")
    p.set_defaults(fn=cmd_bench)
