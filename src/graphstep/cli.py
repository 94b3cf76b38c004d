"""``graphstep train | config show | config validate`` (and the commands other modules add).

Every command resolves a config the same way: the recipe (``--recipe``,
default ``llama3_tiny``), then a YAML file (``--config``), then the
perf-harness flags (``--cuda_graph_impl``, ``--cuda_graph_scope``), then the
dotted overrides in order (``model.cuda_graph_impl=local``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from .config import Config, ConfigError, apply_overrides, dump_yaml, load_yaml
from .recipes import DEFAULT_RECIPE, RECIPES, get_recipe

log = logging.getLogger("graphstep")


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"named config ({', '.join(sorted(RECIPES))})")
    p.add_argument("--config", help="YAML file applied on top of the recipe")
    p.add_argument("--cuda_graph_impl", "--cuda-graph-impl", dest="cuda_graph_impl",
                   help="perf-harness flag: sets model.cuda_graph_impl and turns on the graph-safe RNG tracker")
    p.add_argument("--cuda_graph_scope", "--cuda-graph-scope", dest="cuda_graph_scope",
                   help="perf-harness flag: comma list for model.cuda_graph_scope")
    p.add_argument("overrides", nargs="*", help="section.field=value (Bridge/Hydra dotted form)")


def resolve_config(args: argparse.Namespace) -> Config:
    from .cuda_graph.settings import apply_perf_flags

    cfg = get_recipe(args.recipe)
    if args.config:
        cfg = load_yaml(args.config, base=cfg)
    if args.cuda_graph_impl is not None or args.cuda_graph_scope is not None:
        apply_perf_flags(cfg, args.cuda_graph_impl, args.cuda_graph_scope)
    return apply_overrides(cfg, list(args.overrides))


def cmd_train(args: argparse.Namespace) -> int:
    from .training.loop import train

    cfg = resolve_config(args)
    result = train(cfg)
    return 130 if result.stopped_by_signal else 0


def cmd_config_show(args: argparse.Namespace) -> int:
    from .cuda_graph.settings import normalize_cuda_graph_config

    cfg = resolve_config(args)
    for note in normalize_cuda_graph_config(cfg):
        log.warning(note)
    sys.stdout.write(dump_yaml(cfg))
    return 0


def cmd_config_validate(args: argparse.Namespace) -> int:
    from .cuda_graph.settings import format_violations, validate_config

    cfg = resolve_config(args)
    violations = validate_config(cfg)
    if violations:
        print(format_violations(violations))
        return 2
    print(f"config OK ({args.recipe}{' + overrides' if args.overrides else ''}): no rule violated")
    return 0


COMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {}


def register(name: str):
    """Decorator for modules that add a subcommand (bench, doctor, preprocess)."""

    def wrap(fn: Callable[[argparse._SubParsersAction], None]):
        COMMANDS[name] = fn
        return fn

    return wrap


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphstep", description="Capture LLM training steps into CUDA graphs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a recipe (default: llama3_tiny on the embedded corpus)")
    _config_args(p)
    p.set_defaults(fn=cmd_train)

    pc = sub.add_parser("config", help="show or validate a resolved config")
    csub = pc.add_subparsers(dest="config_command", required=True)
    p = csub.add_parser("show", help="print the resolved config as YAML")
    _config_args(p)
    p.set_defaults(fn=cmd_config_show)
    p = csub.add_parser("validate", help="check every CUDA-graph rule; exit 2 listing all violations")
    _config_args(p)
    p.set_defaults(fn=cmd_config_validate)

    _load_plugins()
    for add in COMMANDS.values():
        add(sub)
    return parser


def _load_plugins() -> None:
    import importlib

    for mod in ("graphstep.bench.cli", "graphstep.doctor.cli", "graphstep.data.cli"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:
                raise


def main(argv: list[str] | None = None) -> int:
    from .training.console import setup_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"graphstep: config error: {exc}", file=sys.stderr)
        return 2
