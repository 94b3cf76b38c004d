"""Normalisation: the one canonical form of a config, applied once, before any rule.

:func:`normalize_cuda_graph_config` rewrites the config *in place* (spec section 1,
"Migrations"): the deprecated flags ``enable_cuda_graph`` /
``external_cuda_graph`` become ``cuda_graph_impl``; the legacy
``cuda_graph_scope`` (list, comma string or ``full``) moves into
``cuda_graph_impl`` / ``cuda_graph_modules`` and is set to None (the
full-iteration graph is always stored as ``cuda_graph_impl=full_iteration``
with ``cuda_graph_modules=[]``); ``none`` clears the coverage; the two RNG
tracker flags are made equal (either on turns both on, as in Megatron
Bridge); ``sequence_parallel`` is turned off with one tensor-parallel rank (as
Bridge does); ``local`` captures ``moe_router`` and ``moe_preprocess``
together; and Megatron Bridge's fields that act through graphstep's own
(:func:`_bridge_fields`: a precision preset, comm_overlap's ddp overrides,
the tokenizer, a dataset blend, vocabulary padding, DoRA's alpha default). It never raises and is idempotent: anything it cannot migrate
without losing information (conflicting or malformed values) is left as it
is, for validation to report. It remembers which coverage field the user
wrote (``coverage_field``) so that messages name it after the migration.

:func:`apply_perf_flags` maps the perf-harness flags onto the config before
any of this.
"""

from __future__ import annotations

import warnings
from typing import Any

from graphstep.config import Config, explicit_keys
from graphstep.cuda_graph.settings import GraphImpl

from .report import as_str, copy_config, fmt, names, only, strs

_COVERAGE_KEY = "_coverage_field"


def coverage_field(cfg: Config) -> str:
    """The coverage field the user wrote: ``model.cuda_graph_scope`` (legacy) or ``model.cuda_graph_modules``."""
    if cfg.model.cuda_graph_scope is not None:
        return "model.cuda_graph_scope"
    return cfg.__dict__.get(_COVERAGE_KEY, "model.cuda_graph_modules")


def _sync_trackers(cfg: Config) -> list[str]:
    """Make the two RNG tracker flags equal as Megatron Bridge does: either one on turns both on.

    (Bridge's ConfigContainer: ``if rng.te_rng_tracker or model.use_te_rng_tracker`` both become true, whoever
    set which; to turn the tracker off, set both to false.)
    """
    model_on, rng_on = cfg.model.use_te_rng_tracker is True, cfg.rng.te_rng_tracker is True
    if model_on == rng_on:
        return []
    chosen, other = (("model.use_te_rng_tracker", "rng.te_rng_tracker") if model_on
                     else ("rng.te_rng_tracker", "model.use_te_rng_tracker"))
    cfg.model.use_te_rng_tracker = cfg.rng.te_rng_tracker = True
    return [f"{other} set to true to match {chosen}=true (one switch: the graph-safe RNG tracker; either on turns "
            "both on, as in Megatron Bridge)"]


def _sequence_parallel(cfg: Config) -> list[str]:
    """``sequence_parallel=true`` with one tensor-parallel rank is set to false, as Megatron Bridge does."""
    m = cfg.model
    if m.sequence_parallel is True and m.tensor_model_parallel_size == 1:
        m.sequence_parallel = False
        return ["model.sequence_parallel set to false: model.tensor_model_parallel_size=1 has no sequence to shard "
                "(as Megatron Bridge does)"]
    return []


def _migrate_deprecated_flags(model: Any) -> list[str]:
    """enable_cuda_graph -> local, external_cuda_graph -> transformer_engine (only with impl none; else R3)."""
    enable, external = model.enable_cuda_graph is True, model.external_cuda_graph is True
    if enable == external or as_str(model.cuda_graph_impl) != "none":
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


def _scope_replaces_recipe_modules(cfg: Config) -> list[str]:
    """A ``cuda_graph_scope`` you set replaces the coverage a recipe set in ``cuda_graph_modules``.

    Megatron Bridge's recipes write the legacy scope field; graphstep's recipes write modules. Pasted onto
    a graphstep recipe, the scope you wrote is the coverage (as the perf flag's is); both fields set by you
    stay a conflict (R2).
    """
    m, explicit = cfg.model, explicit_keys(cfg)
    if m.cuda_graph_scope is None or "model.cuda_graph_scope" not in explicit or "model.cuda_graph_modules" in explicit:
        return []
    if isinstance(m.cuda_graph_modules, list) and not m.cuda_graph_modules:
        return []
    m.cuda_graph_modules = []
    return ["model.cuda_graph_modules of the recipe replaced by the model.cuda_graph_scope you set"]


def _migrate_coverage(model: Any) -> list[str]:
    """Fold cuda_graph_scope into cuda_graph_impl/cuda_graph_modules; leave conflicts and garbage alone."""
    impl, scope_raw = as_str(model.cuda_graph_impl), model.cuda_graph_scope
    if isinstance(model.cuda_graph_impl, GraphImpl):
        model.cuda_graph_impl = impl
    if impl == "none":
        return _clear_coverage(model)
    scope, modules = (None if scope_raw is None else names(scope_raw)), names(model.cuda_graph_modules)
    if (scope_raw is not None and scope is None) or modules is None or (scope is not None and modules):
        return []  # malformed, or both fields set: R2 reports it
    listed = scope if scope is not None else modules
    if only(listed, "full"):
        listed = []
    if only(listed, "full_iteration") and impl in ("local", "full_iteration"):
        listed, model.cuda_graph_impl = [], "full_iteration"
    model.cuda_graph_scope, model.cuda_graph_modules = None, listed
    if scope is None and model.cuda_graph_impl == impl:
        return []
    which, given = ("scope", scope_raw) if scope is not None else ("modules", modules)
    return [f"model.cuda_graph_{which}={fmt(given)} with model.cuda_graph_impl={fmt(impl)} stored as "
            f"model.cuda_graph_impl={model.cuda_graph_impl}, model.cuda_graph_modules={fmt(listed)}"]


def _pair_router_preprocess(model: Any) -> list[str]:
    """``local`` captures moe_router and moe_preprocess together, as Megatron Core does."""
    modules = model.cuda_graph_modules
    if as_str(model.cuda_graph_impl) != "local" or model.cuda_graph_scope is not None or not isinstance(modules, list):
        return []
    listed = strs(modules)
    if ("moe_router" in listed) == ("moe_preprocess" in listed):
        return []
    if "moe_router" in listed:
        added, at = "moe_preprocess", listed.index("moe_router") + 1
    else:
        added, at = "moe_router", listed.index("moe_preprocess")
    model.cuda_graph_modules = modules[:at] + [added] + modules[at:]
    return [f"model.cuda_graph_modules: {added} added (local captures moe_router and moe_preprocess together)"]


_BF16 = ("bf16", "bfloat16", "torch.bfloat16")
_FP32 = ("fp32", "float32", "torch.float32")


def _lower(value: Any) -> str | None:
    text = as_str(value)
    return text.lower() if text is not None else None


# What Megatron Bridge's FP8 current-scaling and delayed-scaling presets set, beyond bf16 (its mixed_precision presets)
FP8_CURRENT_SCALING = {"fp8": "hybrid", "fp8_recipe": "tensorwise", "first_last_layers_bf16": True,
                       "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 1, "fp8_param_gather": True}
FP8_CURRENT_SCALING_PRESET = "bf16_with_fp8_current_scaling_mixed"
FP8_DELAYED_SCALING = {"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_margin": 0, "fp8_amax_history_len": 1024,
                       "fp8_amax_compute_algo": "max", "fp8_param_gather": True}
FP8_DELAYED_SCALING_PRESET = "bf16_with_fp8_delayed_scaling_mixed"
FP8_PRESETS = {FP8_CURRENT_SCALING_PRESET: FP8_CURRENT_SCALING, FP8_DELAYED_SCALING_PRESET: FP8_DELAYED_SCALING}


def _precision(cfg: Config, explicit: frozenset[str]) -> list[str]:
    """Bridge's mixed_precision onto model.params_dtype and ddp.grad_reduce_in_fp32 (a value you set wins); its FP8
    current- and delayed-scaling presets onto the FP8 fields; model.fp8 (Megatron Core's spelling) onto mixed_precision.fp8."""
    mp, notes = cfg.mixed_precision, []
    preset = _lower(mp.preset)
    preset = preset.replace("-", "_") if preset is not None else None
    if preset in FP8_PRESETS:
        for name, value in FP8_PRESETS[preset].items():
            if f"mixed_precision.{name}" not in explicit and getattr(mp, name) != value:
                setattr(mp, name, value)
                notes.append(f"mixed_precision.{name}={fmt(value)} from mixed_precision={preset}")
    if mp.fp8 is None and cfg.model.fp8 is not None:
        mp.fp8 = cfg.model.fp8
        notes.append(f"mixed_precision.fp8={fmt(mp.fp8)} from model.fp8")
    dtype = _lower(mp.params_dtype)
    want = ("bf16" if dtype in _BF16 else "fp32" if dtype in _FP32 else None)
    if want is None and (mp.bf16 is True or preset in ("bf16_mixed", *FP8_PRESETS)):
        want = "bf16"
    if want is None and mp.fp32 is True:
        want = "fp32"
    if want is not None and "model.params_dtype" not in explicit and cfg.model.params_dtype != want:
        cfg.model.params_dtype = want
        notes.append(f"model.params_dtype={want} from mixed_precision")
    if mp.grad_reduce_in_fp32 is False and "ddp.grad_reduce_in_fp32" not in explicit \
            and cfg.ddp.grad_reduce_in_fp32 is not False:
        cfg.ddp.grad_reduce_in_fp32 = False
        notes.append("ddp.grad_reduce_in_fp32=false from mixed_precision.grad_reduce_in_fp32")
    return notes


def _comm_overlap(cfg: Config) -> list[str]:
    """comm_overlap's overlap_grad_reduce, overlap_param_gather and bucket_size, when set, are the ddp values."""
    notes = []
    for name in ("overlap_grad_reduce", "overlap_param_gather", "bucket_size"):
        value = getattr(cfg.comm_overlap, name)
        if value is not None and getattr(cfg.ddp, name) != value:
            setattr(cfg.ddp, name, value)
            notes.append(f"ddp.{name}={fmt(value)} from comm_overlap.{name}")
    return notes


def _tokenizer(cfg: Config) -> list[str]:
    t = cfg.tokenizer
    if as_str(t.tokenizer_type) == "HuggingFaceTokenizer" and as_str(t.tokenizer_model) and cfg.data.tokenizer == "byte":
        cfg.data.tokenizer = t.tokenizer_model
        return [f"data.tokenizer={t.tokenizer_model} from tokenizer.tokenizer_model"]
    return []


def _blend(cfg: Config) -> list[str]:
    """Bridge's ``blend: [[prefixes], [weights] or null]`` as data.data_path (a weighted blend) on indexed data."""
    blend = cfg.data.blend
    if not isinstance(blend, (list, tuple)) or not blend or not isinstance(blend[0], (list, tuple)):
        return []  # null, or malformed: R38 reports it
    prefixes = list(blend[0])
    weights = list(blend[1]) if len(blend) > 1 and isinstance(blend[1], (list, tuple)) else None
    if weights is not None and len(weights) != len(prefixes):
        return []
    path = (" ".join(f"{w} {p}" for w, p in zip(weights, prefixes)) if weights else
            (prefixes[0] if len(prefixes) == 1 else prefixes))
    cfg.data.data_path, cfg.data.dataset, cfg.data.blend = path, "indexed", None
    return [f"data.data_path={fmt(path)}, data.dataset=indexed from data.blend"]


def _pad_vocab(cfg: Config) -> list[str]:
    m = cfg.model
    if m.should_pad_vocab is not True or not isinstance(m.vocab_size, int):
        return []
    tp = m.tensor_model_parallel_size if isinstance(m.tensor_model_parallel_size, int) else 1
    multiple = (m.make_vocab_size_divisible_by if isinstance(m.make_vocab_size_divisible_by, int) else 1) * max(1, tp)
    if multiple < 1:
        return []
    padded = -(-m.vocab_size // multiple) * multiple
    if padded == m.vocab_size:
        return []
    note = f"model.vocab_size {m.vocab_size} padded to {padded} (model.should_pad_vocab, a multiple of {multiple})"
    m.vocab_size = padded
    return [note]


def _weight_decay(cfg: Config) -> list[str]:
    """Megatron's constant weight-decay schedule: equal scheduler.start_weight_decay and end_weight_decay are the
    weight decay (Megatron's scheduler writes that value into every parameter group, over optimizer.weight_decay)."""
    s = cfg.scheduler
    start, end = s.start_weight_decay, s.end_weight_decay
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (start, end))
    if not numbers or start != end or as_str(s.weight_decay_incr_style) != "constant" \
            or cfg.optimizer.weight_decay == start:
        return []  # unset, or a schedule (R18 refuses it)
    cfg.optimizer.weight_decay = float(start)
    return [f"optimizer.weight_decay={fmt(float(start))} from scheduler.start_weight_decay/end_weight_decay"]


# Bridge's DoRA dataclass has its own alpha default (64; LoRA's is 32)
DORA_ALPHA = 64


def _dora_alpha(cfg: Config, explicit: frozenset[str]) -> list[str]:
    """peft=dora without an alpha of the user's: Bridge's DoRA default, 64."""
    p = cfg.peft
    if as_str(p.scheme) != "dora" or "peft.alpha" in explicit or p.alpha != 32:
        return []
    p.alpha = DORA_ALPHA
    return [f"peft.alpha={DORA_ALPHA} (Bridge's DoRA default) from peft=dora"]


def _bridge_fields(cfg: Config) -> list[str]:
    """Megatron Bridge's fields that act through graphstep's own ones (docs/config.md: "acts")."""
    explicit = explicit_keys(cfg)
    return (_precision(cfg, explicit) + _comm_overlap(cfg) + _tokenizer(cfg) + _blend(cfg) + _pad_vocab(cfg)
            + _weight_decay(cfg) + _dora_alpha(cfg, explicit))


def _normalize(cfg: Config, *, warn: bool) -> list[str]:
    # Order matters: the deprecated flags decide the impl, the impl decides how the scope migrates,
    # and the router/preprocess pairing needs the migrated modules.
    if cfg.model.cuda_graph_scope is not None:
        cfg.__dict__[_COVERAGE_KEY] = "model.cuda_graph_scope"
    notes = _bridge_fields(cfg) + _sync_trackers(cfg) + _sequence_parallel(cfg) + _scope_replaces_recipe_modules(cfg)
    deprecated = _migrate_deprecated_flags(cfg.model)
    notes += deprecated + _migrate_coverage(cfg.model) + _pair_router_preprocess(cfg.model)
    if warn:
        for note in deprecated:
            warnings.warn(note, DeprecationWarning, stacklevel=3)
    return notes


def normalize_cuda_graph_config(cfg: Config) -> list[str]:
    """Apply the spec's migrations in place; return notes (deprecations warned as DeprecationWarning)."""
    return _normalize(cfg, warn=True)


def normalized_copy(cfg: Config) -> Config:
    """A normalised copy; ``cfg`` itself is left as it is (no warnings: the caller's normalise gives them)."""
    work = copy_config(cfg)
    _normalize(work, warn=False)
    return work


def apply_perf_flags(cfg: Config, impl: str | None, scope: str | None) -> None:
    """The perf-harness flags ``--cuda_graph_impl X --cuda_graph_scope a,b``, applied as Bridge's harness does.

    The scope flag replaces the coverage (``cuda_graph_modules`` is reset so a recipe's modules cannot
    conflict with it). Whenever graphs end up on, both RNG tracker flags are turned on; when they end up
    off (``--cuda_graph_impl none``, or a recipe without graphs), both are turned off; with the
    full-iteration graph the host-side loss check is turned off (Bridge's harness does all three).
    """
    if impl is not None:
        cfg.model.cuda_graph_impl = impl
    if scope is not None:
        cfg.model.cuda_graph_scope = [part.strip() for part in str(scope).split(",") if part.strip()]
        cfg.model.cuda_graph_modules = []
    resolved = as_str(normalized_copy(cfg).model.cuda_graph_impl)
    if resolved in ("local", "transformer_engine", "full_iteration", "none"):
        cfg.model.use_te_rng_tracker = cfg.rng.te_rng_tracker = resolved != "none"
    if resolved == "full_iteration":
        cfg.rerun_state_machine.check_for_nan_in_loss = False
