"""The configuration tree: one keyword-only dataclass per section (config_sections.py, config_bridge_sections.py).

Field names, values and defaults follow Megatron Bridge / Megatron Core so a
Bridge user can move an override line over unchanged. Every field carries its
help text in ``metadata["help"]`` (listed by ``graphstep config fields
[section]`` and ``graphstep config show --help``, and in docs/config.md). Fields that exist in Megatron but that graphstep does
not implement are declared with ``unsupported(...)``: they keep Megatron's
default, and any other value is rule R18 of the validation, never silently
ignored.

Overrides use the Bridge/Hydra dotted form (``model.cuda_graph_impl=local``,
lists as ``model.cuda_graph_scope=[attn,mlp]``). Values are parsed as YAML
scalars the way Bridge's OmegaConf reads them (``1e-4`` is a float; YAML files
load the same way: :class:`YamlLoader`), ``null`` is a field's Megatron Core
meaning where it has one (``recompute_modules``), and each value is checked against the field's annotation; an unknown key or a wrong
type raises :class:`ConfigError` naming the key and the expected type. Keys
set this way (overrides, YAML) are remembered as the user's own
(:func:`explicit_keys`): where they disagree with a recipe's value, theirs wins.
A YAML file that cannot be read or parsed is a one-line ConfigError naming
file:line:column.

Every rule (CUDA-graph compatibility, values, what the trainer implements)
is checked by :func:`graphstep.validation.validate_config`, which reports every
violation at once; this module only parses and type-checks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import functools
import re
import types
import typing
from typing import Any, Union

import yaml

from .config_sections import (  # noqa: F401  (the sections, importable from here)
    ConfigError,
    opt,
    unsupported,
    ModelConfig,
    expert_tensor_parallel,
    TrainConfig,
    OptimizerConfig,
    SchedulerConfig,
    DataConfig,
    RNGConfig,
    DDPConfig,
    CompileConfig,
    RerunStateMachineConfig,
    CheckpointConfig,
    LoggerConfig,
    ProfilingConfig,
)
from .config_bridge_sections import (  # noqa: F401
    TokenizerConfig,
    CommOverlapConfig,
    DistConfig,
    MixedPrecisionConfig,
    PeftConfig,
    PRECISION_PRESETS,
)


@dataclass(kw_only=True)
class Config:
    """The whole configuration of a graphstep run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rng: RNGConfig = field(default_factory=RNGConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    rerun_state_machine: RerunStateMachineConfig = field(default_factory=RerunStateMachineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    comm_overlap: CommOverlapConfig = field(default_factory=CommOverlapConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    env_vars: dict[str, Any] = field(default_factory=dict, metadata={"help": (
        "Bridge's env_vars: environment variables (name -> string, number or bool) set when the run starts, each "
        "only where the environment does not set it already (yours win); validation reads them the same way.")})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


# env_vars is no section: one mapping of environment variables (``env_vars.NAME=value``, or a whole mapping)
ENV_VARS = "env_vars"
SECTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Config) if f.name != ENV_VARS)

# Bridge's names where graphstep's differ: a section (``dataset.*`` is ``data.*``) and single keys
# (Bridge moved eval_interval/eval_iters into its validation section; graphstep keeps them in train).
SECTION_ALIASES: dict[str, str] = {"dataset": "data"}
KEY_ALIASES: dict[str, str] = {"validation.eval_interval": "train.eval_interval",
                               "validation.eval_iters": "train.eval_iters"}
# Sections Bridge also takes as one value (``mixed_precision=bf16_mixed``, ``peft=lora``, ``peft=null``):
# the field a scalar goes to. null resets the section to its defaults (Bridge's "none").
SECTION_VALUES: dict[str, str] = {"mixed_precision": "preset", "peft": "scheme", "comm_overlap": ""}
_ALL_SECTIONS = ", ".join(SECTIONS + tuple(SECTION_ALIASES) + ("validation", ENV_VARS))


# --------------------------------------------------------------------------
# YAML scalars as Megatron Bridge (OmegaConf) reads them


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with floats as YAML 1.2 and OmegaConf write them.

    YAML 1.1 (PyYAML) needs a dot in a float, so ``1e-4`` and ``-1e3`` are
    strings there; OmegaConf -- and so Megatron Bridge, its YAML files and its
    ``key=value`` overrides -- reads them as floats. config files and
    overrides both load through this class.
    """


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+
                   |[-+]?\.[0-9][0-9_]*[eE][-+]?[0-9]+)$""", re.X),
    list("-+0123456789."),
)


def load_yaml_text(text: str) -> Any:
    """One YAML document with :class:`YamlLoader` (``1e-4`` is a float, as in Bridge)."""
    return yaml.load(text, Loader=YamlLoader)


# --------------------------------------------------------------------------
# types


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        (arg,) = typing.get_args(tp)
        return f"list[{_describe(arg)}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _matches(value: Any, tp: Any) -> tuple[bool, Any]:
    """Whether ``value`` fits ``tp``; returns the (possibly widened) value."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, v = _matches(value, arg)
            if ok:
                return True, v
        return False, value
    if origin is list:
        (arg,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            return False, value
        out = []
        for item in value:
            ok, v = _matches(item, arg)
            if not ok:
                return False, value
            out.append(v)
        return True, out
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, str(value)  # `data.split=100` parses as a number
        return isinstance(value, str), value
    if tp is Any:
        return True, value
    if tp is dict or typing.get_origin(tp) is dict:
        return isinstance(value, dict), value
    raise TypeError(f"unsupported annotation {tp!r}")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.lru_cache(maxsize=None)
def _field_metadata(cls: type) -> dict[str, Any]:
    return {f.name: f.metadata for f in dataclasses.fields(cls)}


def _metadata(cls: type, name: str) -> Any:
    return _field_metadata(cls).get(name, {})


def field_type(section: str, name: str) -> Any:
    sec_cls = _hints(Config)[section]
    return _hints(sec_cls)[name]


def canonical_key(key: str) -> str:
    """graphstep's name of a Bridge key: ``dataset.seq_length`` -> ``data.seq_length``,
    ``validation.eval_iters`` -> ``train.eval_iters``; other keys unchanged."""
    if key in KEY_ALIASES:
        return KEY_ALIASES[key]
    section, dot, name = key.partition(".")
    return f"{SECTION_ALIASES[section]}.{name}" if dot and section in SECTION_ALIASES else key


def set_section_value(cfg: Config, section: str, value: Any) -> None:
    """A whole section given as one value, as Bridge allows: ``mixed_precision=bf16_mixed``, ``peft=null``."""
    target = SECTION_VALUES[section]
    if value is None:
        setattr(cfg, section, type(getattr(cfg, section))())
        cfg.__dict__.setdefault("_explicit_keys", set()).add(section)
        return
    if not target:
        raise ConfigError(f"{section}={value!r}: {section} takes a mapping of fields or null")
    set_value(cfg, f"{section}.{target}", value.replace("-", "_") if isinstance(value, str) else value)


def _env_value(key: str, value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)):
        return value
    raise ConfigError(f"{key}={value!r}: an environment variable's value is a string, number or bool")


def set_env_vars(cfg: Config, key: str, value: Any) -> None:
    """Bridge's ``env_vars``: ``env_vars={NAME: value, ...}`` (null empties it) or ``env_vars.NAME=value``."""
    if key == ENV_VARS:
        if isinstance(value, str) and value.lstrip().startswith("{"):
            value = load_yaml_text(value)
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"env_vars={value!r}: expected a mapping of environment variable names to values "
                              "(env_vars={NAME: value}), or env_vars.NAME=value")
        cfg.env_vars = {str(name): _env_value(f"env_vars.{name}", v) for name, v in value.items()}
    else:
        name = key.split(".", 1)[1]
        if not name:
            raise ConfigError(f"{key!r}: name the variable: env_vars.NAME=value")
        cfg.env_vars = {**cfg.env_vars, name: _env_value(key, value)}
    cfg.__dict__.setdefault("_explicit_keys", set()).add(key)


def _set_entry(cfg: Config, key: str, value: Any) -> tuple[str, Any]:
    """``section.field.name=value`` on a mapping-valued field (``dataset.offline_packing_specs.pad_seq_to_mult=1``):
    the field's mapping with that entry set."""
    section, name, entry = key.split(".", 2)
    sec = getattr(cfg, section, None) if section in SECTIONS else None
    hint = _hints(type(sec)).get(name) if sec is not None else None
    if hint is None or not _matches({}, hint)[0]:
        raise ConfigError(f"{key!r}: keys have the form section.field (sections: {_ALL_SECTIONS})")
    current = getattr(sec, name)
    return f"{section}.{name}", {**(current if isinstance(current, dict) else {}), entry: value}


def set_value(cfg: Config, key: str, value: Any) -> None:
    """Set ``section.field`` to ``value`` after checking its type (Bridge's aliases accepted)."""
    if key in SECTION_VALUES:
        return set_section_value(cfg, key, value)
    if key == ENV_VARS or key.startswith(ENV_VARS + "."):
        return set_env_vars(cfg, key, value)
    key = canonical_key(key)
    if key.count(".") >= 2:
        key, value = _set_entry(cfg, key, value)
    parts = key.split(".")
    if len(parts) != 2:
        raise ConfigError(f"{key!r}: keys have the form section.field (sections: {_ALL_SECTIONS})")
    section, name = parts
    if section not in SECTIONS:
        known = "validation.eval_interval and validation.eval_iters" if section == "validation" else None
        if known:
            raise ConfigError(f"{key!r}: unknown key in section 'validation' (graphstep takes {known}; "
                              "the other validation fields are not implemented)")
        raise ConfigError(f"{key!r}: unknown section {section!r} (sections: {_ALL_SECTIONS})")
    sec = getattr(cfg, section)
    hints = _hints(type(sec))
    if name not in hints:
        close = [n for n in hints if n.startswith(name[:4])][:5]
        hint = f"; similar: {', '.join(close)}" if close else ""
        raise ConfigError(f"{key!r}: unknown key in section {section!r}{hint}")
    null_means = _metadata(type(sec), name).get("null_means")
    if value is None and null_means is not None:
        value = list(null_means) if isinstance(null_means, list) else null_means  # MCore's meaning of null
    ok, coerced = _matches(value, hints[name])
    if not ok and isinstance(value, str) and value.lstrip().startswith("{"):  # an override's mapping
        try:
            ok, coerced = _matches(load_yaml_text(value), hints[name])
        except yaml.YAMLError:
            pass
    if not ok:
        raise ConfigError(f"{key!r}: expected {_describe(hints[name])}, got {value!r} ({type(value).__name__})")
    setattr(sec, name, coerced)
    cfg.__dict__.setdefault("_explicit_keys", set()).add(key)


def explicit_keys(cfg: Config) -> frozenset[str]:
    """The ``section.field`` keys set through :func:`set_value` (overrides, YAML): the user's own choices.

    A recipe assigns attributes directly, so its values are not explicit; where the user's explicit
    value and a recipe's disagree (the two RNG tracker flags), the explicit one wins.
    """
    return frozenset(cfg.__dict__.get("_explicit_keys", ()))


def parse_value(text: str) -> Any:
    """Parse an override value as YAML (``[a,b]``, ``true``, ``3``, ``1e-3``, ``null``), as OmegaConf does.

    A bracketed list YAML cannot read (``[attn,,mlp]``) is split on its commas;
    an empty item there is a :class:`ConfigError` naming its position.
    """
    try:
        value = load_yaml_text(text) if text.strip() else ""
    except yaml.YAMLError:
        stripped = text.strip()
        return _parse_list(stripped) if stripped.startswith("[") and stripped.endswith("]") else text
    if isinstance(value, (dict, set)):
        return text
    return value


def _parse_list(text: str) -> list[Any]:
    items = [item.strip() for item in text[1:-1].split(",")]
    for position, item in enumerate(items, start=1):
        if not item:
            raise ConfigError(f"{text}: item {position} of the list is empty; write the items separated by "
                              f"single commas, such as [{', '.join(i for i in items if i) or 'a, b'}]")
    return [parse_value(item) if not item.startswith("[") else item for item in items]


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply ``section.field=value`` overrides in order."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected section.field=value")
        key, text = item.split("=", 1)
        key = key.strip().lstrip("+")
        try:
            value = parse_value(text)
        except ConfigError as exc:
            raise ConfigError(f"{key}={exc}") from None
        set_value(cfg, key, value)
    return cfg


def from_dict(data: dict[str, Any], base: Config | None = None) -> Config:
    """Build a config from nested dicts (as YAML gives), on top of ``base``."""
    cfg = base if base is not None else Config()
    if not isinstance(data, dict):
        raise ConfigError(f"a config is a mapping of sections, got {type(data).__name__}")
    for section, values in data.items():
        if section in SECTION_VALUES and not isinstance(values, dict):
            set_section_value(cfg, section, values)
            continue
        if section == ENV_VARS:
            set_env_vars(cfg, ENV_VARS, values)
            continue
        if section not in SECTIONS and section not in SECTION_ALIASES and section != "validation":
            raise ConfigError(f"{section!r}: unknown section (sections: {_ALL_SECTIONS})")
        if not isinstance(values, dict):
            raise ConfigError(f"{section!r}: expected a mapping of fields, got {type(values).__name__}")
        for name, value in values.items():
            set_value(cfg, f"{section}.{name}", value)
    return cfg


def field_kind(section: str, name: str) -> tuple[str, str]:
    """What a field does: ``("acts", "")``, ``("noop", what graphstep does instead)``, or
    ``("refused", rule)`` for a field whose values other than its accepted ones a numbered rule refuses."""
    meta = _metadata(_hints(Config)[section], name)
    if "noop" in meta:
        return "noop", meta["noop"]
    if meta.get("unsupported"):
        return "refused", "R18"
    if "rule" in meta:
        return "refused", meta["rule"]
    return "acts", ""


def refused_values(section: str, name: str) -> tuple[str, tuple[Any, ...]] | None:
    """``(rule, accepted values)`` of a field declared with ``refused(...)``; None for the others."""
    meta = _metadata(_hints(Config)[section], name)
    return (meta["rule"], meta["allowed"]) if "rule" in meta else None


def iter_fields(cfg: Config | None = None):
    """Yield ``(section, name, value, default, help, unsupported)`` for every field."""
    cfg = cfg if cfg is not None else Config()
    defaults = Config()
    for section in SECTIONS:
        sec = getattr(cfg, section)
        for f in dataclasses.fields(sec):
            yield (
                section,
                f.name,
                getattr(sec, f.name),
                getattr(getattr(defaults, section), f.name),
                f.metadata.get("help", ""),
                bool(f.metadata.get("unsupported")),
            )
