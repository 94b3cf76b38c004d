"""The plain value checks of a config: rule ``V`` and the numbered value rules ``V1``-``V13``.

``V`` (unnumbered) covers types, fixed choices, minimums and shapes;
``V1``-``V13`` each guard one thing that training would refuse late (after
building the model and reading the data) or, worse, silently train wrong:
negative rates and coefficients, probabilities outside their range, a zero
save interval, a malformed split, a vocabulary smaller than the tokenizer's,
an odd attention head width, a Hugging Face directory that is not there, a
corpus too small to split, a global batch that does not split into whole
micro-batches over the data-parallel ranks. Each check takes the normalised
config, returns violations naming the field, its value and the
fix, and never raises (``_checked`` turns a crash into a violation).
validation/__init__.py runs them after the R rules; docs/rules.md lists them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from graphstep.config import Config, ConfigError, iter_fields, set_value

from .parallel_rules import data_parallel_size
from .report import Violation, as_int as _int, as_num as _num, as_str as _str, checked as _checked, fmt as _fmt
from .report import get as _get, names as _names, violation as _v


# --------------------------------------------------------------------------
# plain value checks (rule "V")

# Fields whose type the R rules already judge (a wrong type there is R1/R2, not V); fields with a
# fixed set of values are judged by _choice_violations alone (any other value, of any type, is wrong).
_GRAPH_TYPED = {"model.cuda_graph_impl", "model.cuda_graph_scope", "model.cuda_graph_modules"}

_CHOICES: dict[str, tuple[str | None, ...]] = {
    "model.cuda_graph_backend": ("auto", "cuda", "replay"),
    "model.cuda_graph_on_failure": ("raise", "eager"),
    "model.params_dtype": ("auto", "bf16", "fp32"),
    "model.recompute_granularity": (None, "full", "selective"),
    "model.moe_router_score_function": ("softmax", "sigmoid"),
    "model.moe_router_load_balancing_type": ("aux_loss", "none"),
    "model.normalization": ("RMSNorm",),
    "model.position_embedding_type": ("rope",),
    "scheduler.lr_decay_style": ("cosine", "linear", "constant"),
    "optimizer.optimizer": ("adam",),
    "data.dataset": ("corpus", "mock", "indexed", "sft"),
    "train.device": ("auto", "cuda", "cpu"),
}

_MINIMUM: dict[str, int] = {
    "model.cuda_graph_warmup_steps": 0, "model.num_layers": 1, "model.ffn_hidden_size": 1, "model.hidden_size": 1,
    "model.seq_length": 1,
    "model.vocab_size": 1, "model.num_attention_heads": 1, "model.num_query_groups": 1, "model.num_moe_experts": 1,
    "model.moe_router_topk": 1, "model.moe_layer_freq": 1, "train.micro_batch_size": 1, "train.global_batch_size": 1,
    "train.train_iters": 0, "logger.log_interval": 1,
}


def _type_violations(cfg: Config) -> list[Violation]:
    """Values of the wrong type (set by attribute assignment), judged by the same check as overrides."""
    scratch, out = Config(), []
    for section, name, value, default, _help, _unsupported in iter_fields(cfg):
        key = f"{section}.{name}"
        if key in _GRAPH_TYPED or key in _CHOICES or (type(value) is type(default) and not isinstance(value, list)):
            continue  # same plain type as the default: nothing to check (set_value is slow, ~0.2 ms a field)
        try:
            set_value(scratch, key, value)
        except ConfigError as exc:
            out.append(_v("V", [key], f"{exc}.", f"set {key} to a value of that type."))
        except Exception as exc:  # an annotation the type check does not know
            out.append(_v("V", [key], f"{key}={_fmt(value)} cannot be checked ({exc}).", f"set {key} to its default."))
    return out


def _choice_violations(cfg: Config) -> list[Violation]:
    out, defaults = [], Config()
    for key, allowed in _CHOICES.items():
        value, listed = _get(cfg, key), ", ".join(map(_fmt, allowed))
        if not any(value is a or (isinstance(value, str) and value == a) for a in allowed):
            out.append(_v("V", [key], f"{key}={_fmt(value)} is not one of {listed}.",
                          f"set {key}={_fmt(_get(defaults, key))} (the default; allowed: {listed})."))
    for module in _names(cfg.model.recompute_modules) or []:
        if _str(module) not in ("core_attn", "mlp", "moe"):
            out.append(_v("V", ["model.recompute_modules"], f"{_fmt(module)} in model.recompute_modules is not "
                          "one of core_attn, mlp, moe.", f"remove {_fmt(module)} from model.recompute_modules."))
    return out


def _range_violations(cfg: Config) -> list[Violation]:
    out = []
    for key, low in _MINIMUM.items():
        value = _int(_get(cfg, key))
        if value is not None and value < low:
            out.append(_v("V", [key], f"{key}={value} is below {low}.", f"set {key} to {low} or more."))
    return out


def _divisible(out: list[Violation], fields: list[str], a: Any, b: Any, what: str, fix: str) -> None:
    a, b = _int(a), _int(b)
    if a is not None and b is not None and b > 0 and a % b:
        out.append(_v("V", fields, f"{what} ({a} is not a multiple of {b}).", fix))


def _shape_violations(cfg: Config) -> list[Violation]:
    m, out = cfg.model, []
    if m.kv_channels is None:
        _divisible(out, ["model.hidden_size", "model.num_attention_heads"], m.hidden_size, m.num_attention_heads,
                   "model.hidden_size must split evenly over model.num_attention_heads",
                   "change model.num_attention_heads to a divisor of model.hidden_size, or set model.kv_channels.")
    if m.num_query_groups is not None:
        _divisible(out, ["model.num_attention_heads", "model.num_query_groups"], m.num_attention_heads,
                   m.num_query_groups, "model.num_attention_heads must be a multiple of model.num_query_groups",
                   "set model.num_query_groups to a divisor of model.num_attention_heads.")
    experts, topk = _int(m.num_moe_experts), _int(m.moe_router_topk)
    if experts is not None and topk is not None and topk > experts:
        out.append(_v("V", ["model.moe_router_topk", "model.num_moe_experts"], f"model.moe_router_topk={topk} "
                      f"is more than model.num_moe_experts={experts}.",
                      f"set model.moe_router_topk={experts} or less."))
    return out + _pattern_violations(cfg)


def _pattern_violations(cfg: Config) -> list[Violation]:
    m, out = cfg.model, []
    pattern, layers, key = _str(m.hybrid_override_pattern), _int(m.num_layers), "model.hybrid_override_pattern"
    if m.hybrid_override_pattern is not None and pattern is None:
        return [_v("V", [key], f"{key}={_fmt(m.hybrid_override_pattern)} is not a string.",
                   f"write {key} as a string such as M*-E, one character per layer.")]
    if pattern is None:
        return out
    bad = sorted(set(pattern) - set("M*-E"))
    if bad:
        out.append(_v("V", [key], f"{key}={_fmt(pattern)} has characters {''.join(bad)!r} outside M * - E.",
                      f"write {key} with M (Mamba), * (attention), - (MLP) and E (MoE) only."))
    if layers is not None and len(pattern) != layers:
        out.append(_v("V", [key, "model.num_layers"], f"{key}={_fmt(pattern)} describes {len(pattern)} layers but "
                      f"model.num_layers={layers}.",
                      f"set model.num_layers={len(pattern)}, or write one character per layer."))
    if "E" in pattern and m.num_moe_experts is None:
        out.append(_v("V", [key, "model.num_moe_experts"], f"{key}={_fmt(pattern)} has E (MoE) layers but "
                      "model.num_moe_experts=null.",
                      "set model.num_moe_experts (e.g. 8), or remove E from the pattern."))
    return out


# --------------------------------------------------------------------------
# numbered value rules V1-V13

# rule -> (fields, lowest allowed, highest allowed (exclusive) or None, why)
_BOUNDS: dict[str, tuple[tuple[str, ...], float, float | None, str]] = {
    "V1": (("optimizer.lr", "optimizer.min_lr"), 0, None, "a negative learning rate climbs the loss"),
    "V2": (("optimizer.clip_grad",), 0, None, "the gradient norm is clipped to this bound (0 = off)"),
    "V3": (("optimizer.adam_beta1", "optimizer.adam_beta2"), 0, 1, "Adam's moving averages need a decay rate in "
           "[0, 1)"),
    "V4": (("optimizer.weight_decay",), 0, None, "a negative weight decay grows the weights"),
    "V5": (("model.attention_dropout", "model.hidden_dropout"), 0, 1, "a dropout probability lies in [0, 1)"),
    "V6": (("train.eval_iters", "scheduler.lr_warmup_iters", "model.init_method_std", "rng.seed"), 0, None,
           "it counts iterations, scales the initial weights or seeds the data order"),
    "V7": (("checkpoint.save_interval", "train.eval_interval", "scheduler.lr_decay_iters"), 1, None,
           "it is an interval of iterations"),
    "V12": (("data.corpus_max_bytes",), 65536, None, "the embedded corpus needs room for whole source files "
            "in each split"),
}


def _bound_violations(cfg: Config) -> list[Violation]:
    out = []
    for rule, (keys, low, high, why) in _BOUNDS.items():
        for key in keys:
            value = _num(_get(cfg, key))
            if value is None or (value >= low and (high is None or value < high)):
                continue  # null (where allowed) and wrong types are judged elsewhere (V)
            allowed = f"in [{low}, {high})" if high is not None else f"{low} or more"
            problem = f"below {low}" if value < low else f"not below {high}"
            fix = f"set {key}={_fmt(_get(Config(), key))} (its default) or another value {allowed}"
            if key == "checkpoint.save_interval":
                fix = f"set {key} to 1 or more, or null to save only at the end"
            out.append(_v(rule, [key], f"{key}={_fmt(_get(cfg, key))} is {problem}: {why}.", fix + "."))
    return out


def _head_violations(cfg: Config) -> list[Violation]:
    """V10: the attention head width (kv_channels, or hidden_size / heads) is even and positive: RoPE rotates pairs."""
    m = cfg.model
    kv, hidden, heads = _int(m.kv_channels), _int(m.hidden_size), _int(m.num_attention_heads)
    if m.kv_channels is not None:
        width, key = kv, "model.kv_channels"
    elif hidden is not None and heads and hidden % heads == 0:
        width, key = hidden // heads, "model.hidden_size"
    else:
        return []  # not an int, or not divisible: V reports it
    if width is None or (width >= 2 and width % 2 == 0):
        return []
    shown = f"model.kv_channels={width}" if key == "model.kv_channels" else (
        f"model.hidden_size={hidden} / model.num_attention_heads={heads} = {width}")
    fields = [key] if key == "model.kv_channels" else [key, "model.num_attention_heads"]
    return [_v("V10", fields, f"the attention head width {shown} is not a positive even number: RoPE rotates pairs "
               "of channels.", f"set {key} so that each head has an even width of 2 or more (e.g. "
               "model.kv_channels=16).")]


def _split_violations(cfg: Config) -> list[Violation]:
    """V8: data.split is up to three non-negative weights with a positive sum (train,valid,test)."""
    split, key = _get(cfg, "data.split"), "data.split"
    text = _str(split)
    try:
        weights = [float(p) for p in (text or "").replace("/", ",").split(",") if p.strip()]
        ok = text is not None and 0 < len(weights) <= 3 and min(weights) >= 0 and sum(weights) > 0
        ok = ok and all(w == w and w != float("inf") for w in weights)
    except ValueError:
        ok = False
    if ok:
        return []
    return [_v("V8", [key], f"{key}={_fmt(split)} is not up to three non-negative weights with a positive sum "
               "(train,valid,test).", f"set {key} to comma-separated weights such as 98,2,0.")]


def _tokenizer_vocab(name: str) -> int:
    if name == "byte":
        return 256
    from graphstep.data.tokenizer import build_tokenizer  # data/ knows tokenizers; imported only when one is named

    return int(build_tokenizer(name).vocab_size)


def _vocab_violations(cfg: Config) -> list[Violation]:
    """V9: model.vocab_size holds every id the tokenizer makes (not checked for mock data or model.hf_path)."""
    vocab, name = _int(cfg.model.vocab_size), _str(cfg.data.tokenizer)
    if cfg.data.dataset not in ("corpus", "indexed", "sft") or cfg.model.hf_path is not None or vocab is None:
        return []
    if name is None:
        return []  # a wrong type: V reports it
    try:
        needed = _tokenizer_vocab(name)
    except ConfigError as exc:
        return [_v("V9", ["data.tokenizer"], f"{exc}.", "set data.tokenizer=byte or the path of a tokenizer.json.")]
    if vocab >= needed:
        return []
    return [_v("V9", ["model.vocab_size", "data.tokenizer"], f"model.vocab_size={vocab} is smaller than the "
               f"vocabulary of data.tokenizer={_fmt(name)} ({needed} ids): token ids past {vocab - 1} have no "
               "embedding row.", f"set model.vocab_size={needed} (or more).")]


def _hf_path_violations(cfg: Config) -> list[Violation]:
    """V11: model.hf_path names a directory holding config.json."""
    path, key = _str(cfg.model.hf_path), "model.hf_path"
    if path is None:
        return []
    if not os.path.isdir(path):
        why = "is a file, not a directory" if os.path.exists(path) else "does not exist"
    elif not (Path(path) / "config.json").is_file():
        why = "has no config.json"
    else:
        return []
    return [_v("V11", [key], f"{key}={_fmt(path)} {why}.", f"set {key} to a local Hugging Face model directory "
               "(config.json + model.safetensors), or null.")]


def _batch_violations(cfg: Config, world_size: int) -> list[Violation]:
    """V13: the global batch splits into whole micro-batches on every data-parallel rank (data/loader.py)."""
    t, ranks = cfg.train, data_parallel_size(cfg, world_size)
    gbs, mbs = _int(t.global_batch_size), _int(t.micro_batch_size)
    if gbs is None or mbs is None or mbs < 1 or gbs < 1 or gbs % (mbs * ranks) == 0:
        return []  # wrong types and values below 1: V reports them
    return [_v("V13", ["train.global_batch_size", "train.micro_batch_size"], f"train.global_batch_size={gbs} is not "
               f"a multiple of train.micro_batch_size={mbs} x {ranks} data-parallel rank(s) = {mbs * ranks}: each "
               "rank runs a whole number of micro-batches per iteration.",
               f"set train.global_batch_size={mbs * ranks} or another multiple of {mbs * ranks}.")]


_NUMBERED: tuple[Callable[[Config], list[Violation]], ...] = (
    _bound_violations, _split_violations, _vocab_violations, _head_violations, _hf_path_violations,
)


def value_violations(cfg: Config, world_size: int) -> list[Violation]:
    out = []
    for check in (_type_violations, _choice_violations, _range_violations):
        out += _checked("V", check, cfg)
    out += _checked("V", _shape_violations, cfg)
    numbered = [v for check in _NUMBERED for v in _checked("V", check, cfg)]
    numbered += _checked("V13", lambda c: _batch_violations(c, world_size), cfg)
    return out + sorted(numbered, key=lambda v: int(v.rule[1:]) if v.rule[1:].isdigit() else 0)
