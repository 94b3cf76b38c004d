"""The plain value checks of a config: rule ``V`` and the numbered value rules ``V1``-``V24``.

``V`` (unnumbered) covers types, fixed choices, minimums and shapes;
``V1``-``V13`` each guard one thing that training would refuse late (after
building the model and reading the data) or, worse, silently train wrong:
negative rates and coefficients, probabilities outside their range, a zero
save interval, a malformed split, a vocabulary smaller than the tokenizer's,
an odd attention head width, a Hugging Face directory that is not there, a
corpus too small to split, a global batch that does not split into whole
micro-batches over the data-parallel ranks. ``V14``-``V22`` guard settings
that a run would otherwise ignore without a word, or refuse only once it has
started: a data path the dataset does not read, a sharding strategy without
FSDP2, a profiling window or ranks outside the run, fine-tuning with nothing
to load, a graph warm-up as long as the run, W&B fields without a project, a
missing optional package, sequence-length buckets the model cannot hold.
``V23``-``V24`` judge the fields the MoE and Mamba blocks read, which the
model would otherwise refuse only when it is built.
Each check takes the normalised config, returns violations naming the field,
its value and the fix, and never raises (``_checked`` turns a crash into a
violation).
validation/__init__.py runs them after the R rules; docs/rules.md lists them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable

from graphstep.config import Config, ConfigError, iter_fields, set_value

from .parallel_rules import data_parallel_size
from .run_rules import MEGATRON_ONLY_RECOMPUTE, MEGATRON_ONLY_VALUES
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
    "model.recompute_method": (None, "uniform", "block"),
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
    "train.train_iters": 0, "logger.log_interval": 1, "logger.tensorboard_log_interval": 1, "ddp.bucket_size": 1,
    "model.recompute_num_layers": 1, "model.mamba_chunk_size": 1,
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
        if isinstance(value, str) and value in MEGATRON_ONLY_VALUES.get(key, {}):
            continue  # a Megatron Core value graphstep lacks: R40 says so
        if not any(value is a or (isinstance(value, str) and value == a) for a in allowed):
            out.append(_v("V", [key], f"{key}={_fmt(value)} is not one of {listed}.",
                          f"set {key}={_fmt(_get(defaults, key))} (the default; allowed: {listed})."))
    for module in _names(cfg.model.recompute_modules) or []:
        if _str(module) not in ("core_attn", "mlp", "moe") and _str(module) not in MEGATRON_ONLY_RECOMPUTE:
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
# numbered value rules V1-V24

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


# --------------------------------------------------------------------------
# V14-V22: settings a run would ignore without a word, or refuse only once started


def _unset(value: Any) -> bool:
    return value is None or value == "" or value == []


def _data_path_violations(cfg: Config) -> list[Violation]:
    """V14: data.data_path is read by data.dataset=indexed and sft only (data/sources.py)."""
    d = cfg.data
    if _unset(d.data_path) or _str(d.dataset) not in ("corpus", "mock"):
        return []  # an unknown dataset is V's
    paths = [d.data_path] if isinstance(d.data_path, str) else d.data_path if isinstance(d.data_path, list) else []
    reader = ("data.dataset=sft (a prompt/response jsonl file)" if any(str(p).endswith(".jsonl") for p in paths)
              else "data.dataset=indexed (a Megatron .bin/.idx prefix, a list or a blend)")
    what = "the embedded corpus" if d.dataset == "corpus" else "random tokens"
    return [_v("V14", ["data.data_path", "data.dataset"], f"data.data_path={_fmt(d.data_path)} is set but "
               f"data.dataset={d.dataset} does not read it: the run would train on {what}.",
               f"set {reader}, or data.data_path=null.")]


def sharding_note(cfg: Config) -> str | None:
    """What ddp.data_parallel_sharding_strategy does without ddp.use_megatron_fsdp=true: nothing, as in Megatron
    (Megatron Bridge's pretraining recipes set optim_grads_params without Megatron FSDP). A log line, not a rule."""
    d = cfg.ddp
    strategy = _str(d.data_parallel_sharding_strategy)
    if d.use_megatron_fsdp is True or strategy not in ("optim_grads", "optim_grads_params"):
        return None  # no_shard is the default; any other value is R26's
    zero2 = d.use_distributed_optimizer is True or cfg.optimizer.use_distributed_optimizer is True
    now = ("the distributed optimizer shards as optim_grads (ZeRO-2)" if zero2 else
           "the data-parallel ranks hold whole replicas (no sharding)")
    return (f"ddp.data_parallel_sharding_strategy={strategy} takes effect only with ddp.use_megatron_fsdp=true, "
            f"which is false: as in Megatron, {now}")


_PROFILERS = ("profiling.use_pytorch_profiler", "profiling.use_nsys_profiler", "profiling.record_memory_history")


def _profiler_on(cfg: Config) -> str | None:
    """The first profiling switch that is on: each acts on the window and ranks (observability/profiler.py)."""
    return next((key for key in _PROFILERS if _get(cfg, key) is True), None)


def _window_violations(cfg: Config) -> list[Violation]:
    """V16: the profiling window is 1 <= profile_step_start <= profile_step_end <= train.train_iters."""
    on, pr = _profiler_on(cfg), cfg.profiling
    start, end, iters = _int(pr.profile_step_start), _int(pr.profile_step_end), _int(cfg.train.train_iters)
    if on is None or start is None or end is None or iters is None:
        return []  # profiling off, or a wrong type: V reports it
    window = ["profiling.profile_step_start", "profiling.profile_step_end"]
    shown = f"profiling.profile_step_start={start}, profiling.profile_step_end={end}"
    if not 1 <= start <= end:
        return [_v("V16", window, f"{shown} with {on}=true: the profiled iterations run from start to end, "
                   "both included, counted from 1, so no iteration is profiled.",
                   f"set 1 <= profiling.profile_step_start <= profiling.profile_step_end (e.g. "
                   f"profiling.profile_step_start={max(1, min(start, end))} "
                   f"profiling.profile_step_end={max(1, start, end)}).")]
    if end <= iters:
        return []
    missing = f"iteration {end}" if iters + 1 == end else f"iterations {iters + 1}-{end}"
    lost = ("none of them runs: nothing is profiled" if start > iters else
            f"{missing} never run(s): the profile stops short")
    fix = (f"set train.train_iters={end} or more, or profiling.profile_step_end={iters} or less (and "
           f"profiling.profile_step_start <= it)" if iters >= 1 else f"set train.train_iters={end} or more, or {on}=false")
    return [_v("V16", window + ["train.train_iters"], f"{shown} with {on}=true, but train.train_iters={iters}: "
               f"{lost}.", fix + ".")]


def _rank_violations(cfg: Config, world_size: int) -> list[Violation]:
    """V17: every rank of profiling.profile_ranks is one of the run's ranks (0 .. world size - 1)."""
    on, ranks, key = _profiler_on(cfg), cfg.profiling.profile_ranks, "profiling.profile_ranks"
    if on is None or not isinstance(ranks, list) or any(_int(r) is None for r in ranks):
        return []  # profiling off, or a wrong type: V reports it
    world = max(world_size, 1)
    if not ranks:
        return [_v("V17", [key], f"{key}=[] with {on}=true names no rank: nothing is profiled.",
                   f"set {key}=[0] (or the global ranks to profile).")]
    outside = [r for r in ranks if not 0 <= r < world]
    if not outside:
        return []
    none = " (no rank profiles)" if len(outside) == len(ranks) else ""
    return [_v("V17", [key], f"{key}={_fmt(ranks)} with {on}=true names rank(s) {_fmt(outside)}, but the run has "
               f"{world} rank(s), 0..{world - 1} (torchrun's WORLD_SIZE): those never profile{none}.",
               f"set {key} to ranks in 0..{world - 1} (e.g. [0]), or launch more ranks.")]


def _finetune_violations(cfg: Config) -> list[Violation]:
    """V18: checkpoint.finetune=true needs weights to load: checkpoint.load (or model.hf_path's)."""
    c = cfg.checkpoint
    if c.finetune is not True or not _unset(c.load) or not _unset(cfg.model.hf_path):
        return []
    return [_v("V18", ["checkpoint.finetune", "checkpoint.load"], "checkpoint.finetune=true loads the weights of "
               f"checkpoint.load, but checkpoint.load={_fmt(c.load)} (and no model.hf_path): nothing is loaded, the "
               "run starts from random weights.", "set checkpoint.load=<checkpoint directory> (or "
               "model.hf_path=<Hugging Face directory>), or checkpoint.finetune=false.")]


def _warmup_violations(cfg: Config) -> list[Violation]:
    """V19: with graphs on, the run is longer than the eager warm-up, or no graph is ever captured."""
    m, impl = cfg.model, _str(cfg.model.cuda_graph_impl)
    warmup, iters = _int(m.cuda_graph_warmup_steps), _int(cfg.train.train_iters)
    if impl not in ("local", "transformer_engine", "full_iteration") or warmup is None or iters is None:
        return []  # graphs off, or values that R1 and V report
    # per-layer graphs learn the call order on one eager iteration at least (training/graphs.py)
    eager = warmup if impl == "full_iteration" else max(1, warmup)
    if iters > eager:
        return []
    why = "" if eager == warmup else " (per-layer graphs always run one eager iteration first)"
    fixes = [f"train.train_iters={eager + 1} or more"]
    if iters >= 2 or (iters == 1 and impl == "full_iteration"):
        fixes.append(f"model.cuda_graph_warmup_steps={iters - 1}" + (" or less" if iters >= 2 else ""))
    return [_v("V19", ["model.cuda_graph_warmup_steps", "train.train_iters", "model.cuda_graph_impl"],
               f"model.cuda_graph_impl={impl} captures after model.cuda_graph_warmup_steps={warmup} eager "
               f"iteration(s){why}, but train.train_iters={iters}: no graph is ever captured, the whole run is "
               "eager.", f"set {', or '.join(fixes)}, or model.cuda_graph_impl=none.")]


def _wandb_violations(cfg: Config) -> list[Violation]:
    """V20: the W&B run's fields (name, directory) need logger.wandb_project, which turns W&B on."""
    lg = cfg.logger
    if not _unset(lg.wandb_project):
        return []
    given = [key for key in ("logger.wandb_save_dir", "logger.wandb_exp_name") if not _unset(_get(cfg, key))]
    if not given:
        return []
    shown = ", ".join(f"{key}={_fmt(_get(cfg, key))}" for key in given)
    return [_v("V20", given + ["logger.wandb_project"], f"{shown} {'is' if len(given) == 1 else 'are'} ignored: "
               f"W&B is off without a project (logger.wandb_project={_fmt(lg.wandb_project)}), nothing is written.",
               "set logger.wandb_project=<project> (W&B runs offline unless WANDB_MODE is set), or "
               f"{' and '.join(f'{key}=null' for key in given)}.")]


def _installed(module: str) -> bool:
    """Whether ``import module`` can find it, without importing it (the writers import it when the run starts)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# field -> (the module it imports, the graphstep extra that installs it); torch.utils.tensorboard imports tensorboard
_EXTRAS = {"logger.tensorboard_dir": ("tensorboard", "tensorboard"), "logger.wandb_project": ("wandb", "wandb"),
           "mixed_precision.fp8": ("torchao", "fp8")}


def _extra_violations(cfg: Config) -> list[Violation]:
    """V21: a field that needs an optional package (observability/writers.py) has it installed."""
    out = []
    for key, (module, extra) in _EXTRAS.items():
        value = _get(cfg, key)
        if key == "mixed_precision.fp8" and _get(cfg, "mixed_precision.fp8_recipe") == "delayed":
            continue  # delayed scaling is graphstep's own FP8 linear (converters/fp8_delayed.py): no torchao
        if isinstance(value, str) and value and not _installed(module):
            out.append(_v("V21", [key], f"{key}={_fmt(value)} needs the {module} package, which is not installed.",
                          f"pip install 'graphstep[{extra}]', or set {key}=null."))
    return out


def _bucket_violations(cfg: Config) -> list[Violation]:
    """V22: data.seq_length_buckets are widths in 1..model.seq_length; fixed-length data needs model.seq_length."""
    buckets, seq, key = cfg.data.seq_length_buckets, _int(cfg.model.seq_length), "data.seq_length_buckets"
    if buckets is None or not isinstance(buckets, list) or seq is None or any(_int(b) is None for b in buckets):
        return []  # no buckets, or a wrong type: V reports it
    if not buckets:
        return [_v("V22", [key], f"{key}=[] holds no bucket.", f"set {key}=null (no buckets), or bucket widths "
                   f"such as [{max(1, seq // 2)},{seq}].")]
    outside = sorted({b for b in buckets if not 1 <= b <= seq})
    if outside:
        raise_seq = f", or set model.seq_length={max(outside)}" if max(outside) > seq else ""
        return [_v("V22", [key, "model.seq_length"], f"{key}={_fmt(buckets)} has bucket(s) {_fmt(outside)} outside "
                   f"1..model.seq_length={seq}: a bucket is a padded width, at most the longest sequence the model's "
                   "position tables hold.", f"drop {_fmt(outside)} from {key}{raise_seq}.")]
    dataset = _str(cfg.data.dataset)
    if dataset in ("corpus", "mock", "indexed") and max(buckets) < seq:
        return [_v("V22", [key, "model.seq_length", "data.dataset"], f"data.dataset={dataset} samples are all "
                   f"model.seq_length={seq} tokens, longer than the largest bucket {max(buckets)} of "
                   f"{key}={_fmt(buckets)}.", f"add the bucket {seq} to {key}, or set {key}=null.")]
    return []


# --------------------------------------------------------------------------
# V23-V24: the fields the model's blocks read, judged before the model is built


def _has_blocks(cfg: Config, symbol: str) -> bool:
    """Whether the model has layers of the pattern ``symbol`` (E: MoE, M: Mamba), as models/hybrid.py builds it."""
    m, pattern = cfg.model, _str(cfg.model.hybrid_override_pattern)
    if pattern is not None:
        return symbol in pattern
    return symbol == "E" and _int(m.num_moe_experts) is not None and _int(m.num_moe_experts) > 0


def _moe_violations(cfg: Config) -> list[Violation]:
    """V23: the router and capacity fields an MoE layer reads go together (models/moe.py refuses them otherwise)."""
    m, out = cfg.model, []
    if not _has_blocks(cfg, "E"):
        return []
    score = _str(m.moe_router_score_function)
    if m.moe_router_enable_expert_bias is True and score == "softmax":  # any other value is V's
        out.append(_v("V23", ["model.moe_router_enable_expert_bias", "model.moe_router_score_function"],
                      f"model.moe_router_enable_expert_bias=true with model.moe_router_score_function={score}: the "
                      "expert bias of aux-loss-free balancing is added to sigmoid scores (as in Megatron Core).",
                      "set model.moe_router_score_function=sigmoid, or model.moe_router_enable_expert_bias=false."))
    factor = _num(m.moe_expert_capacity_factor)
    if m.moe_pad_expert_input_to_capacity is True and m.moe_expert_capacity_factor is None:
        out.append(_v("V23", ["model.moe_pad_expert_input_to_capacity", "model.moe_expert_capacity_factor"],
                      "model.moe_pad_expert_input_to_capacity=true with model.moe_expert_capacity_factor=null: "
                      "there is no capacity to pad to (null is dropless).",
                      "set model.moe_expert_capacity_factor=1.0 (drop-and-pad), or "
                      "model.moe_pad_expert_input_to_capacity=false."))
    if factor is not None and factor <= 0:
        out.append(_v("V23", ["model.moe_expert_capacity_factor"], f"model.moe_expert_capacity_factor={_fmt(factor)} "
                      "is not above 0: every expert would drop every token.",
                      "set model.moe_expert_capacity_factor=1.0 (or more), or null for dropless."))
    return out


def _mamba_violations(cfg: Config) -> list[Violation]:
    """V24: the Mamba layers' heads tile their inner width, the groups their heads (models/mamba.py)."""
    from graphstep.models.mamba import EXPAND  # the width the Mamba block expands to

    m, out = cfg.model, []
    hidden, head_dim, groups = _int(m.hidden_size), _int(m.mamba_head_dim), _int(m.mamba_num_groups)
    if not _has_blocks(cfg, "M") or hidden is None or head_dim is None or groups is None:
        return []  # no Mamba layers, or a wrong type: V reports it
    inner = EXPAND * hidden
    if head_dim < 1 or inner % head_dim:
        out.append(_v("V24", ["model.mamba_head_dim", "model.hidden_size"], f"model.mamba_head_dim={head_dim} does not "
                      f"divide the Mamba inner width {EXPAND} x model.hidden_size={hidden} = {inner}.",
                      f"set model.mamba_head_dim to a divisor of {inner}{'' if inner % 16 else ' (e.g. 16)'}."))
    elif groups < 1 or (inner // head_dim) % groups:
        out.append(_v("V24", ["model.mamba_num_groups", "model.mamba_head_dim"], f"model.mamba_num_groups={groups} "
                      f"does not divide the {inner // head_dim} Mamba heads ({inner} / model.mamba_head_dim="
                      f"{head_dim}).", f"set model.mamba_num_groups to a divisor of {inner // head_dim} (e.g. 1)."))
    return out


_NUMBERED: tuple[Callable[[Config], list[Violation]], ...] = (
    _bound_violations, _split_violations, _vocab_violations, _head_violations, _hf_path_violations,
    _data_path_violations, _window_violations, _finetune_violations, _warmup_violations,
    _wandb_violations, _extra_violations, _bucket_violations, _moe_violations, _mamba_violations,
)


def value_violations(cfg: Config, world_size: int) -> list[Violation]:
    out = []
    for check in (_type_violations, _choice_violations, _range_violations):
        out += _checked("V", check, cfg)
    out += _checked("V", _shape_violations, cfg)
    numbered = [v for check in _NUMBERED for v in _checked("V", check, cfg)]
    numbered += _checked("V13", lambda c: _batch_violations(c, world_size), cfg)
    numbered += _checked("V17", lambda c: _rank_violations(c, world_size), cfg)
    return out + sorted(numbered, key=lambda v: int(v.rule[1:]) if v.rule[1:].isdigit() else 0)
