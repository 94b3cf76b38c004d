"""Config files: reading and writing a :class:`~graphstep.config.Config` as YAML, docs/config.md, and the
config arguments every command takes (``--recipe``, ``--config``, the perf-harness flags, overrides).

``read_yaml`` turns every way a file can be unusable -- missing, a
directory, unreadable, not UTF-8, not YAML -- into one :class:`ConfigError`
line naming ``file:line:column`` and the fix; ``load_yaml`` applies the
document on top of a base config through the same checks as overrides.
``markdown_reference`` renders every field with its default and help (a test
keeps docs/config.md equal to it; ``python -m graphstep.config_files >
docs/config.md`` regenerates it). graphstep.config knows nothing of this
module: import these functions from here.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from .config import Config, ConfigError, field_kind, from_dict, iter_fields, load_yaml_text


def read_yaml(path: str | Path) -> Any:
    """The YAML document of ``path``; every way a file can be unreadable is a one-line ConfigError."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{path}: no such file; --config takes the path of a YAML file")
    if p.is_dir():
        raise ConfigError(f"{path}: is a directory; --config takes the path of a YAML file")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror}); check its permissions") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: byte 0x{raw[exc.start]:02x} is not UTF-8; save the file as UTF-8 "
                          "text") from None
    try:
        return load_yaml_text(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = " ".join(str(exc.problem or exc.context or "not valid YAML").split())
        if exc.context and exc.context_mark is not None and exc.context_mark is not mark:
            problem += f", {exc.context} that starts at line {exc.context_mark.line + 1}"
        fix = ("YAML indents with spaces: replace the tab by spaces" if "\\t" in problem
               else "correct the YAML there (a mapping of sections such as `model: {num_layers: 4}`)")
        raise ConfigError(f"{where}: invalid YAML ({problem}); {fix}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML ({' '.join(str(exc).split())})") from None


def load_yaml(path: str | Path, base: Config | None = None) -> Config:
    """A config from a YAML file of sections, on top of ``base``; ConfigError names the file."""
    data = read_yaml(path)
    try:
        return from_dict(data if data is not None else {}, base)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The arguments that name a config: ``--recipe``, ``--config``, the perf-harness flags and overrides."""
    from .recipes import DEFAULT_RECIPE, RECIPES

    p.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"named config ({', '.join(sorted(RECIPES))})")
    p.add_argument("--config", help="YAML file applied on top of the recipe")
    p.add_argument("--cuda_graph_impl", "--cuda-graph-impl", dest="cuda_graph_impl",
                   help="perf-harness flag: sets model.cuda_graph_impl and turns on the graph-safe RNG tracker")
    p.add_argument("--cuda_graph_scope", "--cuda-graph-scope", dest="cuda_graph_scope",
                   help="perf-harness flag: comma list for model.cuda_graph_scope")
    p.add_argument("overrides", nargs="*", help="section.field=value (Bridge/Hydra dotted form)")


def config_from_args(args: argparse.Namespace) -> Config:
    """The config that :func:`add_config_args`' arguments name: the recipe, then the YAML file, then the
    perf-harness flags, then the overrides in order (not validated yet)."""
    from .config import apply_overrides
    from .recipes import get_recipe
    from .validation import apply_perf_flags

    cfg = get_recipe(args.recipe)
    if args.config:
        cfg = load_yaml(args.config, base=cfg)
    if args.cuda_graph_impl is not None or args.cuda_graph_scope is not None:
        apply_perf_flags(cfg, args.cuda_graph_impl, args.cuda_graph_scope)
    return apply_overrides(cfg, list(args.overrides))


def save_yaml(cfg: Config, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        yaml.safe_dump(cfg.to_dict(), fh, sort_keys=False)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def _kind_cell(section: str, name: str) -> str:
    kind, detail = field_kind(section, name)
    if kind == "noop":
        return f"no-op: {detail}"
    if kind == "refused":
        return f"refused by {detail} otherwise" if detail != "R18" else "not implemented (R18 otherwise)"
    return "acts"


def markdown_reference() -> str:
    """docs/config.md: every field with its default, what it does and its help (a test keeps the file equal to this)."""
    out = ["# Configuration reference", "",
           "Generated from `graphstep/config_sections.py` and `config_bridge_sections.py` (`python -m graphstep.config_files > docs/config.md`); a test",
           "keeps it in sync. Section and field names are Megatron Bridge's; Bridge's `dataset.*` is the `data`",
           "section here, `validation.eval_interval`/`validation.eval_iters` are `train.eval_interval`/`eval_iters`,",
           "and `mixed_precision=NAME` / `peft=NAME` (a whole section as one value) set `mixed_precision.preset` /",
           "`peft.scheme`. Numbers read as Bridge's OmegaConf reads them (`1e-4` is a float). Bridge's `env_vars`",
           "(`env_vars={NAME: value}` or `env_vars.NAME=value`; a mapping in YAML) sets each environment variable",
           "when the run starts, where the environment does not set it already (yours win); the rules read it too.",
           "A mapping-valued field takes one entry as `section.field.NAME=value`.", "",
           "The column *does* says what each field does -- the three ways:", "",
           "- **acts**: graphstep does what Megatron Bridge does with it (some through graphstep's own field, named in",
           "  the meaning: `mixed_precision=bf16_mixed` sets `model.params_dtype=bf16`);",
           "- **no-op: ...**: a performance hint of Transformer Engine or Megatron kernels with no effect on the",
           "  numbers; any value is accepted, and a run names the ones you set in one log line with what graphstep",
           "  does instead (the text after *no-op:*);",
           "- **refused by R*n* otherwise** / **not implemented (R18 otherwise)**: graphstep implements the default",
           "  (and the values the meaning lists); any other value asks for a feature graphstep lacks and breaks that",
           "  rule (rules.md), which says why and what to write instead.", ""]
    section = None
    for sec, name, _value, default, help_text, _unsupported in iter_fields():
        if sec != section:
            section = sec
            out += ["", f"## `{sec}`", "", "| field | default | does | meaning |", "|---|---|---|---|"]
        text = help_text.replace(" Not implemented by graphstep: only the default is accepted.", "")
        text = text.replace("|", "\\|")  # a vertical bar in a help text (a layout string) is not a column
        out.append(f"| `{sec}.{name}` | `{yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()}` "
                   f"| {_kind_cell(sec, name)} | {text} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(markdown_reference())
