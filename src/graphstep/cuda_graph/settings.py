"""CUDA-graph settings: normalise the old and new config forms, check every rule, resolve one view.

Three steps, always in this order:

1. :func:`normalize_cuda_graph_config` rewrites the config *in place* into its
   one canonical form (spec section 1, "Migrations"): the deprecated flags
   ``enable_cuda_graph`` / ``external_cuda_graph`` become ``cuda_graph_impl``;
   the legacy ``cuda_graph_scope`` (list, comma string or ``full``) moves into
   ``cuda_graph_impl`` / ``cuda_graph_modules`` and is set to None (the
   full-iteration graph is always stored as ``cuda_graph_impl=full_iteration``
   with ``cuda_graph_modules=[]``); ``none`` clears the coverage; the two RNG
   tracker flags are made equal; ``local`` captures ``moe_router`` and
   ``moe_preprocess`` together (a tracker flag the user set wins over a
   recipe's). It never raises and is idempotent: anything it
   cannot migrate without losing information (conflicting or malformed values)
   is left as it is, for validation to report.
2. :func:`validate_cuda_graph_config` checks rules R1-R19 (spec section 2) on a
   normalised *copy* and returns every violation at once, each naming the
   fields, the offending values and the fix. :func:`validate_config` adds the
   plain value checks (rule ``"V"``). Neither raises, whatever the values: a
   rule that cannot even be evaluated reports itself as a violation.
3. :func:`resolve_cuda_graph_settings` normalises, validates, raises
   :class:`ConfigValidationError` listing all violations, or returns the frozen
   :class:`CudaGraphSettings` the trainer reads. Strings become enums here, at
   the config edge, and nowhere else. :func:`apply_perf_flags` maps the
   perf-harness flags onto the config before any of this.

This module holds the types, the normalisation and the perf flags; the rules
(steps 2 and 3) are in rules.py, re-exported here so that callers import
everything from ``graphstep.cuda_graph.settings``.

docs/rules.md describes every rule with an example override and its fix.
"""

from __future__ import annotations

import copy
import enum
import re
import warnings
from dataclasses import dataclass
from typing import Any

from graphstep.config import Config, ConfigError, explicit_keys
from graphstep.cuda_graph.scopes import SCOPES

SCOPE_NAMES: tuple[str, ...] = SCOPES
MOE_SCOPES: tuple[str, ...] = ("moe", "moe_router", "moe_preprocess")


class GraphImpl(str, enum.Enum):
    """Which capture mechanism ``model.cuda_graph_impl`` selects."""

    NONE = "none"
    LOCAL = "local"
    TRANSFORMER_ENGINE = "transformer_engine"
    FULL_ITERATION = "full_iteration"


IMPL_VALUES: tuple[str, ...] = tuple(i.value for i in GraphImpl)
PER_LAYER: tuple[str, ...] = ("local", "transformer_engine")


@dataclass(frozen=True)
class CudaGraphSettings:
    """The canonical, resolved CUDA-graph view the trainer uses."""

    impl: GraphImpl
    modules: tuple[str, ...]  # per-layer scopes; () = whole layer; always () for NONE / FULL_ITERATION
    warmup_steps: int
    use_single_mempool: bool
    retain_backward_graph: bool
    optimizer_graph: bool
    backend: str
    on_failure: str

    @property
    def enabled(self) -> bool:
        return self.impl is not GraphImpl.NONE

    @property
    def full_iteration(self) -> bool:
        return self.impl is GraphImpl.FULL_ITERATION

    @property
    def per_layer(self) -> bool:
        return self.impl in (GraphImpl.LOCAL, GraphImpl.TRANSFORMER_ENGINE)


@dataclass(frozen=True)
class Violation:
    """One broken rule: which, where, what is wrong, and what to change."""

    rule: str
    fields: tuple[str, ...]
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.rule} [{', '.join(self.fields)}]: {self.message} Fix: {self.fix}"


class ConfigValidationError(ConfigError):
    """The configuration breaks one or more rules; ``violations`` lists them all."""

    def __init__(self, violations: list[Violation]):
        self.violations = list(violations)
        super().__init__(format_violations(self.violations))


def format_violations(violations: list[Violation]) -> str:
    """The report `graphstep config validate` prints: one line per violation."""
    if not violations:
        return "configuration OK: no violations"
    noun = "violation" if len(violations) == 1 else "violations"
    return "\n".join([f"{len(violations)} configuration {noun}:"] + [f"  {v}" for v in violations])


# --------------------------------------------------------------------------
# small helpers that never raise on garbage values


def _fmt(value: Any) -> str:
    """A value the way an override would spell it (null, true, [a, b], 'odd string')."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return _fmt(value.value)
    if isinstance(value, str):
        return value if re.fullmatch(r"[\w.:/*+\-]+", value) else repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    try:
        text = repr(value)
    except Exception:  # a garbage object whose repr fails
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def _str(value: Any) -> str | None:
    """``value`` as a plain string, or None when it is not one."""
    if isinstance(value, enum.Enum):
        value = value.value
    return value if isinstance(value, str) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _names(value: Any) -> list[Any] | None:
    """A scope/modules value as a list (comma strings split); None when it is neither list nor string."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (list, tuple)):
        return list(value)
    return None


def _only(names: list[Any], name: str) -> bool:
    return len(names) == 1 and _str(names[0]) == name


def _strs(names: list[Any] | None) -> list[str]:
    return [n for n in (names or []) if isinstance(n, str)]


def _get(cfg: Config, dotted: str) -> Any:
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


def _copy(cfg: Config) -> Config:
    """A copy to normalise; falls back to copying each section when a value cannot be deep-copied."""
    try:
        return copy.deepcopy(cfg)
    except Exception:
        sections = {name: copy.copy(getattr(cfg, name)) for name in cfg.__dataclass_fields__}
        return type(cfg)(**sections)


# --------------------------------------------------------------------------
# 1. normalisation


def _sync_trackers(cfg: Config) -> list[str]:
    """Make the two RNG tracker flags equal (Bridge keeps them so).

    A value the user set (override or YAML: ``explicit_keys``) wins over a recipe's or a default; when
    neither or both were set by the user, either flag on turns both on -- except that two explicit values
    that disagree are left for rule R19 to report.
    """
    model_on, rng_on = cfg.model.use_te_rng_tracker is True, cfg.rng.te_rng_tracker is True
    if model_on == rng_on:
        return []
    explicit = explicit_keys(cfg) & {"model.use_te_rng_tracker", "rng.te_rng_tracker"}
    if len(explicit) == 2:
        return []
    if len(explicit) == 1:
        (chosen,) = explicit
        value = model_on if chosen == "model.use_te_rng_tracker" else rng_on
    else:
        chosen, value = ("model.use_te_rng_tracker" if model_on else "rng.te_rng_tracker"), True
    cfg.model.use_te_rng_tracker = cfg.rng.te_rng_tracker = value
    other = "rng.te_rng_tracker" if chosen == "model.use_te_rng_tracker" else "model.use_te_rng_tracker"
    return [f"{other} set to {_fmt(value)} to match {chosen}={_fmt(value)} (one switch: the graph-safe RNG tracker)"]


def _migrate_deprecated_flags(model: Any) -> list[str]:
    """enable_cuda_graph -> local, external_cuda_graph -> transformer_engine (only with impl none; else R3)."""
    enable, external = model.enable_cuda_graph is True, model.external_cuda_graph is True
    if enable == external or _str(model.cuda_graph_impl) != "none":
        return []
    flag, impl = ("enable_cuda_graph", "local") if enable else ("external_cuda_graph", "transformer_engine")
    setattr(model, flag, False)
    model.cuda_graph_impl = impl
    return [f"model.{flag} is deprecated: use model.cuda_graph_impl={impl}"]


def _clear_coverage(model: Any) -> list[str]:
    """``cuda_graph_impl=none`` clears both coverage fields (a leftover full_iteration is not promoted)."""
    had = model.cuda_graph_scope is not None or not (isinstance(model.cuda_graph_modules, list)
                                                     and not model.cuda_graph_modules)
    model.cuda_graph_scope, model.cuda_graph_modules = None, []
    return ["model.cuda_graph_scope/cuda_graph_modules ignored: model.cuda_graph_impl=none"] if had else []


def _migrate_coverage(model: Any) -> list[str]:
    """Fold cuda_graph_scope into cuda_graph_impl/cuda_graph_modules; leave conflicts and garbage alone."""
    impl, scope_raw = _str(model.cuda_graph_impl), model.cuda_graph_scope
    if isinstance(model.cuda_graph_impl, GraphImpl):
        model.cuda_graph_impl = impl
    if impl == "none":
        return _clear_coverage(model)
    scope, modules = (None if scope_raw is None else _names(scope_raw)), _names(model.cuda_graph_modules)
    if (scope_raw is not None and scope is None) or modules is None or (scope is not None and modules):
        return []  # malformed, or both fields set: R2 reports it
    names = scope if scope is not None else modules
    if _only(names, "full"):
        names = []
    if _only(names, "full_iteration") and impl in ("local", "full_iteration"):
        names, model.cuda_graph_impl = [], "full_iteration"
    model.cuda_graph_scope, model.cuda_graph_modules = None, names
    if scope is None and model.cuda_graph_impl == impl:
        return []
    which, given = ("scope", scope_raw) if scope is not None else ("modules", modules)
    return [f"model.cuda_graph_{which}={_fmt(given)} with model.cuda_graph_impl={_fmt(impl)} stored as "
            f"model.cuda_graph_impl={model.cuda_graph_impl}, model.cuda_graph_modules={_fmt(names)}"]


def _pair_router_preprocess(model: Any) -> list[str]:
    """``local`` captures moe_router and moe_preprocess together, as Megatron Core does."""
    modules = model.cuda_graph_modules
    if _str(model.cuda_graph_impl) != "local" or model.cuda_graph_scope is not None or not isinstance(modules, list):
        return []
    names = _strs(modules)
    if ("moe_router" in names) == ("moe_preprocess" in names):
        return []
    if "moe_router" in names:
        added, at = "moe_preprocess", names.index("moe_router") + 1
    else:
        added, at = "moe_router", names.index("moe_preprocess")
    model.cuda_graph_modules = modules[:at] + [added] + modules[at:]
    return [f"model.cuda_graph_modules: {added} added (local captures moe_router and moe_preprocess together)"]


def _normalize(cfg: Config, *, warn: bool) -> list[str]:
    # Order matters: the deprecated flags decide the impl, the impl decides how the scope migrates,
    # and the router/preprocess pairing needs the migrated modules.
    notes = _sync_trackers(cfg)
    deprecated = _migrate_deprecated_flags(cfg.model)
    notes += deprecated + _migrate_coverage(cfg.model) + _pair_router_preprocess(cfg.model)
    if warn:
        for note in deprecated:
            warnings.warn(note, DeprecationWarning, stacklevel=3)
    return notes


def normalize_cuda_graph_config(cfg: Config) -> list[str]:
    """Apply the spec's migrations in place; return notes (deprecations warned as DeprecationWarning)."""
    return _normalize(cfg, warn=True)


def _normalized_copy(cfg: Config) -> Config:
    """A normalised copy; ``cfg`` itself is left as it is (no warnings: the caller's normalise gives them)."""
    work = _copy(cfg)
    _normalize(work, warn=False)
    return work


def apply_perf_flags(cfg: Config, impl: str | None, scope: str | None) -> None:
    """The perf-harness flags ``--cuda_graph_impl X --cuda_graph_scope a,b``, applied as Bridge's harness does.

    The scope flag replaces the coverage (``cuda_graph_modules`` is reset so a recipe's modules cannot
    conflict with it). Whenever graphs end up on, both RNG tracker flags are turned on.
    """
    if impl is not None:
        cfg.model.cuda_graph_impl = impl
    if scope is not None:
        cfg.model.cuda_graph_scope = [part.strip() for part in str(scope).split(",") if part.strip()]
        cfg.model.cuda_graph_modules = []
    if _str(_normalized_copy(cfg).model.cuda_graph_impl) in ("local", "transformer_engine", "full_iteration"):
        cfg.model.use_te_rng_tracker = True
        cfg.rng.te_rng_tracker = True


_FROM_RULES = ("resolve_cuda_graph_settings", "validate_config", "validate_cuda_graph_config")


def __getattr__(name: str) -> Any:
    """The rules build on the types above and live in rules.py; they are importable from here too."""
    if name in _FROM_RULES:
        from . import rules

        return getattr(rules, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
