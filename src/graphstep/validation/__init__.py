"""Validation of a whole config: normalise once, check every rule at once, resolve the graph settings.

Three steps, always in this order (``resolve_cuda_graph_settings`` runs all three), one
function each:

1. :func:`normalize_cuda_graph_config` rewrites the config *in place* into its one canonical
   form (migrations.py: the legacy and deprecated CUDA-graph fields, the RNG
   tracker flags). :func:`apply_perf_flags` maps the perf-harness flags
   onto the config before it.
2. :func:`validate_config` checks every numbered rule -- R1-R17 (graph_rules.py),
   R18-R24 and R32-R41 (run_rules.py), R25-R31 (parallel_rules.py) -- and every value rule, ``V`` and V1-V24
   (values.py), and returns all violations at once, each with its rule id,
   the fields it names and the fix. It never raises, whatever the values: a
   rule that cannot even be evaluated reports itself. Given a config that is
   not normalised yet, it judges a normalised copy and leaves the config as
   it is (``graphstep config validate``).
3. :func:`resolve_cuda_graph_settings` normalises ``cfg`` in place, validates it (no copy),
   raises :class:`ConfigValidationError` listing every violation, or returns
   the frozen :class:`~graphstep.cuda_graph.settings.CudaGraphSettings` the
   trainer reads. Strings become enums here, at the config edge, and nowhere
   else. The trainer, the doctor and the bench resolve once per run and pass
   the settings on (``build_run(cfg, RunOptions(device, settings=...))``).

The mechanism (graphstep.cuda_graph) knows only the resolved settings; the
trainer's checks made once a run has started are rules here too, so a
validated config never reaches them. docs/rules.md describes every rule with
an example override and its fix.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

from graphstep.config import Config
from graphstep.cuda_graph.settings import CudaGraphSettings, GraphImpl

from .graph_rules import GRAPH_RULES, make_view
from .migrations import apply_perf_flags, normalize_cuda_graph_config, normalized_copy
from .report import ConfigValidationError, Violation, checked, format_violations, get
from .parallel_rules import PARALLEL_RULES
from .run_rules import REPLAY_COMPILE_REASON, RUN_RULES, noop_notes
from .values import sharding_note, value_violations

log = logging.getLogger("graphstep")

__all__ = [
    "ConfigValidationError", "Violation", "REPLAY_COMPILE_REASON", "apply_env_vars", "apply_perf_flags", "format_violations",
    "accepted_notes", "normalize_cuda_graph_config", "noop_notes", "resolve_cuda_graph_settings", "settings_from",
    "validate_config",
]


def _world_size(env: Mapping[str, str]) -> int:
    try:
        return int(env.get("WORLD_SIZE", "1"))
    except (TypeError, ValueError):
        return 1


def _rule_violations(cfg: Config, env: Mapping[str, str], capability: tuple[int, int] | None,
                     world: int) -> list[Violation]:
    view = make_view(cfg, env, capability, world)
    return [v for rule, check in GRAPH_RULES + RUN_RULES + PARALLEL_RULES for v in checked(rule, check, view)]


def validate_config(cfg: Config, *, env: Mapping[str, str] | None = None, device_capability: tuple[int, int] | None = None,
             world_size: int | None = None, normalized: bool = False) -> list[Violation]:
    """Every rule (R1-R41, V, V1-V24) on the normalised ``cfg``; all violations, never an exception.

    ``normalized=True``: ``cfg`` was normalised in place already (``resolve_cuda_graph_settings``); otherwise a normalised
    copy is judged. ``env`` (default ``os.environ``) gives ``WORLD_SIZE`` unless ``world_size`` is given.
    """
    env = with_env_vars(cfg, os.environ if env is None else env)
    world = world_size if world_size is not None else _world_size(env)
    work = cfg if normalized else normalized_copy(cfg)
    return _rule_violations(work, env, device_capability, world) + value_violations(work, world)


def env_var_text(value: object) -> str:
    """An env_vars value as the environment holds it: true/false as 1/0, numbers and strings as written."""
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


def with_env_vars(cfg: Config, env: Mapping[str, str]) -> Mapping[str, str]:
    """``env`` with ``cfg.env_vars`` beneath it: a variable the environment sets wins, as at the run's start."""
    if not cfg.env_vars:
        return env
    return {**{name: env_var_text(v) for name, v in cfg.env_vars.items()}, **env}


def apply_env_vars(cfg: Config) -> list[str]:
    """Bridge's env_vars into ``os.environ`` where it does not set them already; the names set, for the log.

    Called first thing at the start of a run, before anything reads the environment (CUDA's allocator,
    NCCL, the rules that read PYTORCH_CUDA_ALLOC_CONF / NCCL_GRAPH_REGISTER).
    """
    applied = []
    for name, value in cfg.env_vars.items():
        if name not in os.environ:
            os.environ[name] = env_var_text(value)
            applied.append(f"{name}={os.environ[name]}")
    return applied


def settings_from(cfg: Config) -> CudaGraphSettings:
    """The resolved graph settings of a normalised, valid config."""
    m = cfg.model
    impl = GraphImpl(m.cuda_graph_impl)
    per_layer = impl in (GraphImpl.LOCAL, GraphImpl.TRANSFORMER_ENGINE)
    return CudaGraphSettings(
        impl=impl,
        modules=tuple(m.cuda_graph_modules) if per_layer else (),
        warmup_steps=m.cuda_graph_warmup_steps,
        use_single_mempool=m.cuda_graph_use_single_mempool,
        retain_backward_graph=m.cuda_graph_retain_backward_graph,
        optimizer_graph=cfg.optimizer.optimizer_cuda_graph,
        backend=m.cuda_graph_backend,
        on_failure=m.cuda_graph_on_failure,
    )


def resolve_cuda_graph_settings(cfg: Config, *, env: Mapping[str, str] | None = None, device_capability: tuple[int, int] | None = None,
            world_size: int | None = None) -> CudaGraphSettings:
    """Normalise ``cfg`` in place, validate it once, and return its settings (ConfigValidationError lists all)."""
    normalize_cuda_graph_config(cfg)  # records the coverage field the user wrote, so messages still name it
    violations = validate_config(cfg, env=env, device_capability=device_capability, world_size=world_size,
                                 normalized=True)
    if violations:
        raise ConfigValidationError(violations)
    for line in accepted_notes(cfg):  # once per run: this is called once per run
        log.info("%s", line)
    return settings_from(cfg)


def accepted_notes(cfg: Config) -> list[str]:
    """What a valid, normalised config asks for that graphstep accepts but Megatron Bridge does differently:
    the no-op fields in one line, and one line per deliberate extension (docs/rules.md)."""
    notes, out = noop_notes(cfg), []
    if notes:
        out.append(f"accepted as no-ops (performance hints of Transformer Engine / Megatron Core kernels, no effect "
                   f"on the numbers): {'; '.join(notes)}")
    sharding = sharding_note(cfg)
    if sharding is not None:
        out.append(sharding)
    if cfg.mixed_precision.fp8 is not None:
        d = cfg.ddp
        sharded = d.use_megatron_fsdp is True or d.use_distributed_optimizer is True \
            or cfg.optimizer.use_distributed_optimizer is True
        for key in ("mixed_precision.fp8_param_gather", "model.fp8_param_gather"):
            if get(cfg, key) is True and sharded:  # R32 accepts it with FSDP2 for torchao's tensorwise scaling
                out.append(f"{key}=true: FSDP2 all-gathers the decoder layers' FP8 weights in FP8 (torchao), their "
                           "scales computed once per step in the optimizer step")
            elif get(cfg, key) is True:
                out.append(f"{key}=true: nothing to gather in FP8, the data-parallel ranks hold whole replicas")
    m = cfg.model
    if m.moe_token_dispatcher_type == "flex" and m.num_moe_experts is not None:
        out.append("model.moe_token_dispatcher_type=flex: runs as alltoall -- each token sent to the ranks holding "
                   "its experts with torch's all-to-all, not DeepEP or HybridEP kernels (moe_flex_dispatcher_backend)")
    modules = [str(x) for x in m.cuda_graph_modules] if isinstance(m.cuda_graph_modules, list) else []
    if m.cuda_graph_impl == "local":
        out.append(f"model.cuda_graph_impl=local with per-layer scopes ({modules or 'the whole layer'}): a graphstep "
                   "extension -- Megatron Bridge takes local for full_iteration only (per-layer graphs there are "
                   "transformer_engine); graphstep captures Megatron Core's per-layer local path")
    moe_graphed = "moe" in modules or (m.cuda_graph_impl in ("local", "transformer_engine") and not modules) \
        or m.cuda_graph_impl == "full_iteration"
    if moe_graphed and m.num_moe_experts is not None and m.moe_expert_capacity_factor is None \
            and (m.hybrid_override_pattern is None or "E" in str(m.hybrid_override_pattern)):
        out.append("the MoE block is graphed dropless: a graphstep extension -- Megatron Core graphs the moe scope "
                   "only with drop-and-pad; graphstep's sync-free dropless MoE keeps its group sizes on the device")
    return out
