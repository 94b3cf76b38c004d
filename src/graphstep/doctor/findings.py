"""What the doctor reports: :class:`Finding` (one problem, where, why, the fix) and :class:`Report`.

Every category has a severity:

* ``capture`` -- the step cannot be captured as written: CUDA refuses the
  operation while a stream is capturing (``operation not permitted when
  stream is capturing``), or the optimizer refuses to be captured;
* ``replay`` -- capture succeeds but replays silently compute something else
  than the eager step (Python state frozen at its captured value, an input
  read from a stale address, a cache freed under the graph).

Exit codes of ``graphstep doctor`` (:attr:`Report.exit_code`): 0 nothing
found, 1 a finding breaks capture, 2 the config breaks a rule (the step was
not run), 3 only replay-corrupting findings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..cuda_graph.frames import SourceLine

CAPTURE, REPLAY = "capture", "replay"


@dataclass(frozen=True)
class Category:
    name: str
    title: str
    severity: str
    why: str
    fix: str


CATEGORIES: dict[str, Category] = {c.name: c for c in (
    Category(
        "host_sync", "host sync", CAPTURE,
        "it reads a device value on the host: the CPU waits for the GPU (a synchronisation), which is not "
        "allowed while a stream is capturing, and a replay could not redo the host side anyway",
        "keep the value on the device (torch.where, clamp, a device-side flag) and read it after the step, "
        "outside the graph, on logging steps only",
    ),
    Category(
        "dynamic_shape", "data-dependent shape", CAPTURE,
        "its output shape depends on tensor values, so the host must read the data to allocate the result "
        "(a sync), and a graph replays one fixed shape",
        "use a fixed-shape formulation: torch.where / masked_fill / multiply by the mask instead of selecting, "
        "repeat_interleave(..., output_size=N), scatter_add_/index_add_ into a preallocated buffer instead of "
        "bincount, a padded top-k instead of nonzero/unique",
    ),
    Category(
        "h2d_copy", "host-to-device copy of pageable memory", CAPTURE,
        "copying pageable host memory to the device inside the step is a synchronous cudaMemcpy: illegal while "
        "capturing, and a replay would copy from a host address the step no longer owns",
        "create the tensor on the device once, outside the step (or with device=... from device values), and "
        "update it in place; pass batches as arguments of the graphed step, which copies them into static buffers",
    ),
    Category(
        "optimizer", "optimizer not capturable", CAPTURE,
        "this torch.optim optimizer keeps its step counter on the host (capturable=False) and reads it with "
        ".item(); torch refuses to capture it",
        "construct it with capturable=True (state and step on the device) or fused=True",
    ),
    Category(
        "grad_scaler", "GradScaler with dynamic scaling", CAPTURE,
        "GradScaler.step reads found_inf on the host (.item()) to decide whether to step, and update() changes "
        "the scale between iterations: host decisions a replay cannot redo",
        "train in bf16 without a scaler, or give a fused optimizer (fused=True) the scale and found_inf on the "
        "device, or keep scaler.step/update outside the captured region",
    ),
    Category(
        "autocast_cache", "autocast with its cache enabled", REPLAY,
        "autocast caches the casted weights outside the graph; casts made during warm-up or capture are freed "
        "or re-made behind the graph's back, so a replay can read a freed or stale cast",
        "use torch.autocast(..., cache_enabled=False) around captured work",
    ),
    Category(
        "rng", "RNG outside the graph-safe tracker", CAPTURE,
        "the graph only advances generators registered with it: getting or setting a CUDA RNG state while "
        "capturing is refused, and an unregistered generator would replay the same random numbers every step",
        "draw from the default generator or the RNG tracker's streams (tracker.fork()); register extra "
        "generators with the graph (GraphedStep(generators=...)); never copy RNG states inside the step",
    ),
    Category(
        "python_state", "Python state changed inside the step", REPLAY,
        "a replay re-runs only the device work: this Python value changes on every eager step but stays frozen "
        "at its captured value once the step is replayed",
        "keep the value on the device (a tensor updated in place, e.g. self.steps_t.add_(1)) or update it "
        "outside the captured step",
    ),
    Category(
        "new_input", "input allocated anew each step", REPLAY,
        "the step reads a tensor that is neither an argument, nor a parameter or buffer, nor made by the step, "
        "and it is a different tensor on each call: the graph keeps reading the address it saw at capture",
        "allocate one static buffer and copy_ each new value into it, or pass the tensor as an argument of the "
        "graphed step (GraphedStep copies arguments into its static inputs)",
    ),
    Category(
        "error", "the step raised", CAPTURE,
        "the step raised an exception while the doctor ran it, so it cannot be captured as it is",
        "fix the error (run the step once eagerly to see it)",
    ),
    Category(
        "config", "configuration rule", CAPTURE,
        "the configuration breaks a CUDA-graph rule; graphstep train refuses to start",
        "change the fields the rule names",
    ),
)}


@dataclass
class Finding:
    """One problem: its category, the op, the user's line, why it breaks capture or replay, and the fix."""

    category: str
    op: str
    where: SourceLine | None = None
    why: str = ""
    fix: str = ""
    detail: str = ""
    count: int = 1

    def __post_init__(self) -> None:
        cat = CATEGORIES[self.category]
        self.why = self.why or cat.why
        self.fix = self.fix or cat.fix

    @property
    def severity(self) -> str:
        return CATEGORIES[self.category].severity

    @property
    def location(self) -> str:
        return f"{self.where.filename}:{self.where.lineno}" if self.where is not None else "(no user line)"

    def key(self) -> tuple[Any, ...]:
        w = self.where
        return self.category, self.op, (w.filename, w.lineno) if w is not None else None

    def format(self) -> str:
        times = f" (x{self.count})" if self.count > 1 else ""
        head = f"[{self.category}] {self.op}{times} at {self.location}"
        lines = [head]
        if self.where is not None:
            lines.append(f"    in {self.where.function}: {self.where.line.strip()}")
        if self.detail:
            lines.append(f"  what: {self.detail}")
        lines += [f"  why:  {self.why}", f"  fix:  {self.fix}"]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        w = self.where
        return {
            "category": self.category, "title": CATEGORIES[self.category].title, "severity": self.severity,
            "op": self.op, "file": w.filename if w else None, "line": w.lineno if w else None,
            "function": w.function if w else None, "code": w.line.strip() if w else None,
            "detail": self.detail, "why": self.why, "fix": self.fix, "count": self.count,
        }


@dataclass
class Report:
    """Everything one doctor run found (``findings``) plus what it did (``notes``)."""

    target: str
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, finding: Finding) -> None:
        for old in self.findings:
            if old.key() == finding.key():
                old.count += finding.count
                return
        self.findings.append(finding)

    def extend(self, findings: list[Finding]) -> None:
        for f in findings:
            self.add(f)

    def of(self, category: str) -> list[Finding]:
        return [f for f in self.findings if f.category == category]

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def capture_would_fail(self) -> bool:
        return any(f.severity == CAPTURE for f in self.findings)

    @property
    def exit_code(self) -> int:
        if self.of("config"):
            return 2
        if self.capture_would_fail:
            return 1
        return 3 if self.findings else 0

    def summary(self) -> str:
        if self.ok:
            return "no finding: nothing in the step breaks capture or replay"
        breaks = sum(f.severity == CAPTURE for f in self.findings)
        replay = len(self.findings) - breaks
        noun = "finding" if len(self.findings) == 1 else "findings"
        return f"{len(self.findings)} {noun}: {breaks} break capture, {replay} corrupt replay"

    def format(self) -> str:
        lines = [f"graphstep doctor: {self.target}"]
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(self.summary())
        for f in self.findings:
            lines += ["", f.format()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target, "ok": self.ok, "capture_would_fail": self.capture_would_fail,
            "exit_code": self.exit_code, "summary": self.summary(), "notes": list(self.notes),
            "findings": [f.to_dict() for f in self.findings],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)
