"""``graphstep train | export | config show | config validate | config fields``, and the subcommands that bench/,
doctor/ and data/ add (``add_bench``, ``add_doctor``, ``add_preprocess``).

Every command resolves a config the same way: the recipe (``--recipe``,
default ``llama3_tiny``), then a YAML file (``--config``), then the
perf-harness flags (``--cuda_graph_impl``, ``--cuda_graph_scope``), then the
dotted overrides in the order written (``model.cuda_graph_impl=local``).
Overrides may stand before, between and after the options, as with Hydra.

This module is the top of the package (nothing imports it) and the boundary
where a user's mistake becomes one line. Every error graphstep raises on purpose is a :class:`~graphstep.errors.GraphstepError`
whose class attribute ``exit_code`` says how the command ends (graphstep/errors.py
lists the tree): 2 for input the user fixes (a config, a data file, a
checkpoint, a script: :class:`~graphstep.errors.InputError` and below), printed
as ``graphstep <command>: <what, where, fix>`` without a traceback (``-v``
shows it); 1 for a failure of the run itself (a capture that fails), raised
with its traceback like any other exception. A command's own findings exit 1
too (``graphstep doctor``: a line breaks capture), a run stopped by a signal 130.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .config import ConfigError
from .config_files import add_config_args, config_from_args, dump_yaml
from .errors import GraphstepError

log = logging.getLogger("graphstep")


def cmd_train(args: argparse.Namespace) -> int:
    from .doctor import capture_error_hook
    from .training.loop import RunHooks, train

    cfg = config_from_args(args)
    result = train(cfg, hooks=RunHooks(on_capture_error=capture_error_hook))  # the doctor names a failed capture's line
    return 130 if result.stopped_by_signal else 0


def cmd_export(args: argparse.Namespace) -> int:
    from .training.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.format, args.out, base=args.base)
    print(f"exported {args.checkpoint} as --format {args.format} to {out}")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    from .validation import normalize_cuda_graph_config

    cfg = config_from_args(args)
    for note in normalize_cuda_graph_config(cfg):
        log.warning(note)
    sys.stdout.write(dump_yaml(cfg))
    return 0


def cmd_config_validate(args: argparse.Namespace) -> int:
    import os

    from .training.memory import LAYOUT_RULES
    from .validation import accepted_notes, format_violations, validate_config
    from .validation.migrations import normalized_copy

    cfg = config_from_args(args)
    world, chosen = _validate_world_size(args, cfg, os.environ)
    violations = validate_config(cfg, world_size=world)
    if violations:
        print(format_violations(violations))
    else:
        print(f"config OK ({args.recipe}{' + overrides' if args.overrides else ''}): no rule violated")
        for note in accepted_notes(normalized_copy(cfg)):  # what a run would log once: no-ops, extensions
            print(f"  note: {note}")
    if chosen:
        print(f"validated at world size {world}, the fewest ranks the layout takes (--world-size or WORLD_SIZE to "
              "choose another)")
    if not violations or any(v.rule in LAYOUT_RULES for v in violations):  # other rules: fix those first
        for line in _layout_lines(cfg, world, args.gpu_memory):
            print(line)
    return 2 if violations else 0


def _validate_world_size(args: argparse.Namespace, cfg, env) -> tuple[int, bool]:
    """``(world size, chosen here)``: --world-size, else WORLD_SIZE, else the fewest ranks the layout takes."""
    from .training.memory import layout_world_size

    if args.world_size is not None:
        return args.world_size, False
    if env.get("WORLD_SIZE"):
        return max(1, int(env["WORLD_SIZE"])) if env["WORLD_SIZE"].isdigit() else 1, False
    world = layout_world_size(cfg) if _positive_sizes(cfg) else 1
    return world, world > 1


def _positive_sizes(cfg) -> bool:
    m = cfg.model
    sizes = (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size,
             m.expert_model_parallel_size)
    return all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes)


def _layout_lines(cfg, world: int, gpu_memory: float | None) -> list[str]:
    """What the layout needs (training/memory.py: ``layout_report``) against ``gpu_memory`` GiB per GPU: this
    machine's GPU, else an H100's 80 GiB. Nothing for a config whose layout sizes the rules refuse."""
    import torch

    from .cuda_graph.devices import GiB
    from .training.memory import H100_GIB, layout_report

    if not _positive_sizes(cfg):
        return []
    if gpu_memory is None:
        if torch.cuda.is_available():
            gpu_memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GiB
        else:
            gpu_memory = H100_GIB
    return layout_report(cfg, world, gpu_memory * GiB)


def field_reference(section: str | None = None) -> str:
    """Every config field (or one section's) with its type, default and help: ``graphstep config fields``."""
    from .config import SECTIONS, _describe, field_kind, field_type, iter_fields

    if section is not None and section not in SECTIONS:
        raise ConfigError(f"unknown section {section!r}; sections: {', '.join(SECTIONS)}")
    lines, current = [], None
    for sec, name, _value, default, help_text, unsupported in iter_fields():
        if section is not None and sec != section:
            continue
        if sec != current:
            current = sec
            lines.append(f"{'' if not lines else chr(10)}{sec}:")
        kind, detail = field_kind(sec, name)
        note = (" [not implemented: only the default]" if unsupported
                else f" [no-op: {detail}]" if kind == "noop" else f" [other values: {detail}]" if kind == "refused"
                else "")
        help_text = help_text.replace(" Not implemented by graphstep: only the default is accepted.", "")
        lines.append(f"  {sec}.{name} ({_describe(field_type(sec, name))}, default {dump_value(default)}): "
                     f"{help_text}{note}")
    return "\n".join(lines) + "\n"


def dump_value(value: object) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def cmd_config_fields(args: argparse.Namespace) -> int:
    sys.stdout.write(field_reference(args.section))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphstep", description="Capture LLM training steps into CUDA graphs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a recipe (default: llama3_tiny on the embedded corpus)")
    add_config_args(p)
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("export", help="write a run's trained model as a Hugging Face model (--format hf, adapters "
                       "merged) or its LoRA/DoRA adapters in HF peft's format (--format peft)")
    p.add_argument("checkpoint", help="a run's checkpoint.save folder (its newest intact checkpoint) or one "
                   "iter_NNNNNNN folder in it")
    p.add_argument("--format", required=True, choices=("hf", "peft"),
                   help="hf: config.json + model.safetensors, adapters merged; peft: adapter_config.json + "
                   "adapter_model.safetensors (a LoRA/DoRA run only)")
    p.add_argument("--out", required=True, help="a new or empty folder to write into")
    p.add_argument("--base", help="where an adapter-only checkpoint's base weights are now (the graphstep "
                   "checkpoint or Hugging Face folder its meta.base names, moved)")
    p.set_defaults(fn=cmd_export)

    pc = sub.add_parser("config", help="show or validate a resolved config")
    csub = pc.add_subparsers(dest="config_command", required=True)
    p = csub.add_parser("show", help="print the resolved config as YAML", epilog="fields:\n" + field_reference(),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.set_defaults(fn=cmd_config_show)
    p = csub.add_parser("validate", help="check every CUDA-graph rule; exit 2 listing all violations; then what "
                        "the layout needs: GPUs and memory per rank")
    add_config_args(p)
    p.add_argument("--world-size", type=int, help="ranks to validate the layout on (default: WORLD_SIZE, else the "
                   "fewest the layout takes)")
    p.add_argument("--gpu-memory", type=float, metavar="GiB", help="memory per GPU to judge the per-rank estimate "
                   "against (default: this machine's GPU, else 80, an H100's)")
    p.set_defaults(fn=cmd_config_validate)
    p = csub.add_parser("fields", help="list every config field with its type, default and meaning")
    p.add_argument("section", nargs="?", help="only this section (model, train, optimizer, ...)")
    p.set_defaults(fn=cmd_config_fields)

    # the subcommands of the packages below the CLI: each package adds its own parser (the CLI is the top;
    # nothing imports it)
    from .bench.cli import add_bench
    from .data.cli import add_preprocess
    from .doctor.cli import add_doctor

    for add in (add_bench, add_doctor, add_preprocess):
        add(sub)
    return parser


def _late_overrides(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> None:
    """Overrides written after an option (``train a=1 --recipe r b=2``) join the others, in order."""
    if not extra:
        return
    stray = [e for e in extra if e.startswith("-") or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides = list(args.overrides) + extra


def one_line(exc: BaseException) -> str:
    """A user error's message on one line (a list of rule violations keeps one line per violation)."""
    from .validation import ConfigValidationError

    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, ConfigValidationError):
        return text
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def main(argv: list[str] | None = None) -> int:
    from .training.console import setup_logging

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    _late_overrides(parser, args, extra)
    setup_logging(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return args.fn(args)
    except GraphstepError as exc:
        if args.verbose or exc.exit_code == 1:  # a failure of the run itself (errors.py): with its traceback
            raise
        command = " ".join(c for c in (args.command, getattr(args, "config_command", None)) if c)
        print(f"graphstep {command}: {one_line(exc)}", file=sys.stderr)
        return exc.exit_code
