"""Violations and the small value helpers every rule shares.

A :class:`Violation` is one broken rule: its id (``R5``, ``V7``), the fields
it names, what is wrong and what to change. :class:`ConfigValidationError`
carries all of them at once; :func:`format_violations` is the report
``graphstep config validate`` prints. The helpers below read a config value
the way a rule needs it and never raise on garbage: a value of the wrong type
reads as None and is judged by the type check (rule ``V``) instead.
"""

from __future__ import annotations

import copy
import enum
import re
from dataclasses import dataclass
from typing import Any, Callable

from graphstep.config import Config, ConfigError


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


def violation(rule: str, fields: tuple[str, ...] | list[str], message: str, fix: str) -> Violation:
    return Violation(rule, tuple(fields), message, fix)


def checked(rule: str, check: Callable[[Any], list[Violation]], view: Any) -> list[Violation]:
    """Run one rule; a value so malformed that the rule cannot run is itself reported, never raised."""
    try:
        return check(view)
    except Exception as exc:
        return [violation(rule, [], f"could not check this rule ({type(exc).__name__}: {exc}).",
                          "correct the types of the fields this rule reads (see the V violations).")]


# --------------------------------------------------------------------------
# value helpers that never raise on garbage values


def fmt(value: Any) -> str:
    """A value the way an override would spell it (null, true, [a, b], 'odd string')."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return fmt(value.value)
    if isinstance(value, str):
        return value if re.fullmatch(r"[\w.:/*+\-]+", value) else repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    try:
        text = repr(value)
    except Exception:  # a garbage object whose repr fails
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def as_str(value: Any) -> str | None:
    """``value`` as a plain string, or None when it is not one."""
    if isinstance(value, enum.Enum):
        value = value.value
    return value if isinstance(value, str) else None


def as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def as_num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def names(value: Any) -> list[Any] | None:
    """A scope/modules value as a list (comma strings split); None when it is neither list nor string."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (list, tuple)):
        return list(value)
    return None


def only(items: list[Any], name: str) -> bool:
    return len(items) == 1 and as_str(items[0]) == name


def strs(items: list[Any] | None) -> list[str]:
    return [n for n in (items or []) if isinstance(n, str)]


def get(cfg: Config, dotted: str) -> Any:
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


def copy_config(cfg: Config) -> Config:
    """A copy to normalise; falls back to copying each section when a value cannot be deep-copied."""
    try:
        return copy.deepcopy(cfg)
    except Exception:
        sections = {name: copy.copy(getattr(cfg, name)) for name in cfg.__dataclass_fields__}
        out = type(cfg)(**sections)
        out.__dict__.update({k: v for k, v in cfg.__dict__.items() if k.startswith("_")})
        return out
