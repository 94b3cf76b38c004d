"""The run rules R18-R24 and R32-R41: unimplemented fields, the tracker flags, torch.compile, what training
refused late, and Megatron Bridge's fields whose values ask for what graphstep lacks.

Same shape as graph_rules.py (``_rN(view) -> list[Violation]`` over a
:class:`~graphstep.validation.graph_rules.View`). R21-R24 are the checks the
trainer used to make only once a run had started (per-layer graphs with shape
buckets, ``ddp.grad_reduce_in_fp32``, the token dispatcher, skipping a step on
NaN without the flag it skips on); where the trainer still guards them, the
guard is an ``assert`` naming the rule, which a validated config never trips.

R32-R40 judge the fields config_sections.py (and config_bridge_sections.py) declare with ``refused(default,
help, rule, allowed)``: a value outside ``allowed`` breaks that rule, whose
reason (:data:`REFUSED_REASONS`) says which feature it asks for. The fields
declared with ``noop`` are accepted whatever their value; :func:`noop_notes`
is the one log line that says so (``resolve_cuda_graph_settings`` logs it once per run).

docs/rules.md describes every rule with an example override and its fix.
"""

from __future__ import annotations

from typing import Any

from graphstep.config import PRECISION_PRESETS, explicit_keys, field_kind, iter_fields, refused_values

from graphstep.converters import fp8, fp8_delayed, lora
from graphstep.data import packing

from .graph_rules import View, _impl_f
from .migrations import FP8_CURRENT_SCALING_PRESET, FP8_PRESETS
from .report import Violation, as_num as _num, as_str as _str, fmt as _fmt, names as _names
from .report import violation as _v

_TRACKERS = ("model.use_te_rng_tracker", "rng.te_rng_tracker")


def _r19(v: View) -> list[Violation]:
    """Retired: as in Megatron Bridge, either tracker flag on turns both on (migrations.py), whoever set them."""
    return []


COMPILE_COMPONENTS = ("model", "loss")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
_INDUCTOR_GRAPHS = ("reduce-overhead", "max-autotune")  # Inductor's own CUDA graphs


def _r20(v: View) -> list[Violation]:
    """torch.compile: known components and mode; one owner of the graphs; a backend that can capture it."""
    c, out = v.cfg.compile, []
    names = _names(c.components)
    for name in [n for n in (names if names is not None else [c.components]) if n != "model"]:
        why = ("graphstep's models compute the loss inside their forward (GPTModel.forward), so there is no "
               "separate loss function to compile; compile.components=[model] compiles it with the model"
               if name == "loss" else f"{_fmt(name)} is not a component (components: model)")
        out.append(_v("R20", ["compile.components"], f"compile.components has {_fmt(name)}: {why}.",
                      "set compile.components=[model]."))
    if c.mode not in COMPILE_MODES:
        out.append(_v("R20", ["compile.mode"], f"compile.mode={_fmt(c.mode)} is not an Inductor mode.",
                      "set compile.mode=default (or max-autotune-no-cudagraphs)."))
    if c.backend not in COMPILE_BACKENDS:
        out.append(_v("R20", ["compile.backend"], f"compile.backend={_fmt(c.backend)} is not a backend graphstep "
                      f"runs ({', '.join(COMPILE_BACKENDS)}).", "set compile.backend=inductor."))
    elif c.backend != "inductor" and c.mode != "default":
        out.append(_v("R20", ["compile.backend", "compile.mode"], f"compile.mode={_fmt(c.mode)} is an Inductor "
                      f"mode, and compile.backend={c.backend} is not Inductor.",
                      "set compile.mode=default, or compile.backend=inductor."))
    if c.enable is True and v.on and c.mode in _INDUCTOR_GRAPHS:
        out.append(_v("R20", ["compile.mode", "model.cuda_graph_impl"], f"compile.mode={c.mode} captures Inductor's "
                      f"own CUDA graphs and model.cuda_graph_impl={v.impl} captures graphstep's: two owners of the "
                      "same kernels.", "set compile.mode=default (graphstep's graphs capture the compiled kernels), "
                      "or model.cuda_graph_impl=none to let Inductor own the graphs."))
    if c.enable is True and v.impl == "full_iteration" and _num(v.cfg.model.cuda_graph_warmup_steps) == 0:
        out.append(_v("R20", ["compile.enable", "model.cuda_graph_warmup_steps"], "compile.enable=true with "
                      "model.cuda_graph_warmup_steps=0: the model would be compiled inside the capture.",
                      "set model.cuda_graph_warmup_steps=1 or more (the first eager iteration compiles)."))
    backend, device = _str(v.cfg.model.cuda_graph_backend), _str(v.cfg.train.device)
    if c.enable is True and v.on and (backend == "replay" or (backend == "auto" and device == "cpu")):
        out.append(_v("R20", ["compile.enable", "model.cuda_graph_backend", "train.device"], REPLAY_COMPILE_REASON,
                      "run the graphs on a GPU (model.cuda_graph_backend=cuda), or compile.enable=false for the "
                      "CPU dry run, or model.cuda_graph_impl=none to train compiled without graphs."))
    return out


REPLAY_COMPILE_REASON = (
    "compile.enable=true with graphs on the CPU replay backend: the backend records a capture with a "
    "TorchDispatchMode, under which torch.compile runs the model uncompiled (Dynamo skips frames while a "
    "dispatch mode is active) and Inductor's CPU kernels bypass the dispatcher anyway, so the replayed graph "
    "would compute the uncompiled model while the warm-up ran the compiled one.")


def _differs(value: Any, default: Any) -> bool:
    try:
        return bool(value != default)
    except Exception:
        return True


def _r18(v: View) -> list[Violation]:
    return [_v("R18", [f"{section}.{name}"], f"graphstep does not implement {section}.{name} (set to {_fmt(value)}).",
               f"set {section}.{name}={_fmt(default)} (its default).")
            for section, name, value, default, _help, unsupported in iter_fields(v.cfg)
            if unsupported and _differs(value, default)] + _refused(v, "R18")


def _accepted(value: Any, allowed: tuple[Any, ...]) -> bool:
    for a in allowed:
        if isinstance(a, str) and isinstance(value, str):
            if value.lower() == a.lower():
                return True
        elif type(value) is type(a) and not _differs(value, a):
            return True
    return False


# rule -> (what the refused values ask for, the general fix); the fields are declared with refused(...)
REFUSED_REASONS = {
    "R18": ("graphstep does not implement this value", ""),
    "R32": ("this FP8/FP4 feature is not implemented: graphstep's FP8 is current (tensorwise) or row-wise scaling "
            "of the decoder layers' linear layers on torchao, or delayed scaling on graphstep's own FP8 linear, "
            "with bf16 parameters (no FP8 parameters, attention or FP4)",
            "; for FP8 write mixed_precision=bf16_with_fp8_current_scaling_mixed"),
    "R33": ("not implemented yet: graphstep's LoRA keeps its adapters in the model's dtype (model.params_dtype) "
            "and has no expert all-to-all adapters", ""),
    "R34": ("graphstep's optimizer keeps its master weights, main gradients and Adam moments in fp32 (the "
            "precision-aware optimizer's lower-precision states are not implemented)", ""),
    "R36": ("activation, weight and optimizer offloading to the host are not implemented (inside graphs they would "
            "copy to the host at every replay)", "; to save memory use selective recompute or FSDP2 "
            "(ddp.use_megatron_fsdp=true)"),
    "R37": ("multi-token prediction (MTP) layers are not implemented", ""),
    "R39": ("not a field of Megatron Bridge's SchedulerConfig: Bridge's scheduler never reads it",
            "; set the peak and final rates as optimizer.lr and optimizer.min_lr"),
    "R40": ("this Megatron Core model feature is not implemented by graphstep's models (multi-latent attention: "
            "graphstep's attention is grouped-query)", ""),
}

# R40: values Megatron Core accepts that ask for a feature graphstep does not have -> (why, fix)
MEGATRON_ONLY_VALUES: dict[str, dict[str, tuple[str, str]]] = {
    "model.position_embedding_type": {
        "yarn": ("YaRN RoPE scaling is not implemented (graphstep applies plain RoPE)",
                 "set model.position_embedding_type=rope"),
        "learned_absolute": ("learned absolute position embeddings are not implemented",
                             "set model.position_embedding_type=rope"),
        "mrope": ("multimodal RoPE is not implemented", "set model.position_embedding_type=rope"),
        "none": ("a model without position embeddings is not implemented", "set model.position_embedding_type=rope"),
    },
    "scheduler.lr_decay_style": {
        "WSD": ("the warmup-stable-decay schedule is not implemented",
                "set scheduler.lr_decay_style=cosine (or linear, constant)"),
        "inverse-square-root": ("the inverse-square-root schedule is not implemented",
                                "set scheduler.lr_decay_style=cosine (or linear, constant)"),
    },
}
# recompute modules Megatron Core has and graphstep's models do not (graphstep: core_attn, mlp, moe)
MEGATRON_ONLY_RECOMPUTE = {
    "mla_up_proj": "multi-latent attention's up-projection (graphstep has no MLA)",
    "moe_act": "the experts' activation alone (graphstep recomputes the whole MoE block: moe)",
    "layernorm": "the norms alone (graphstep's norms are recomputed with their layer's core_attn or mlp)",
    "shared_experts": "the shared experts alone (graphstep recomputes the whole MoE block: moe)",
}


def _r40(v: View) -> list[Violation]:
    """Megatron Core model features graphstep's models lack: MLA, YaRN, the WSD schedule, fine recompute modules."""
    out = _refused(v, "R40")
    for key, values in MEGATRON_ONLY_VALUES.items():
        section, name = key.split(".")
        value = getattr(getattr(v.cfg, section), name)
        if isinstance(value, str) and value in values:
            why, fix = values[value]
            out.append(_v("R40", [key], f"{key}={value}: {why}.", f"{fix}."))
    modules = v.cfg.model.recompute_modules
    for module in modules if isinstance(modules, list) else []:
        if isinstance(module, str) and module in MEGATRON_ONLY_RECOMPUTE:
            out.append(_v("R40", ["model.recompute_modules"], f"{module} in model.recompute_modules: recompute of "
                          f"{MEGATRON_ONLY_RECOMPUTE[module]} is not implemented.",
                          f"remove {module} from model.recompute_modules (graphstep recomputes core_attn, mlp, moe)."))
    return out


def _refused(v: View, rule: str) -> list[Violation]:
    """The fields declared ``refused(..., rule)`` whose value is not one of their accepted values."""
    out = []
    reason, fix = REFUSED_REASONS[rule]
    for section, name, value, _default, _help, _unsupported in iter_fields(v.cfg):
        declared = refused_values(section, name)
        if declared is None or declared[0] != rule or _accepted(value, declared[1]):
            continue
        key, accepted = f"{section}.{name}", declared[1]
        choices = " or ".join(f"{key}={_fmt(a)}" for a in accepted[:3])
        out.append(_v(rule, [key], f"{key}={_fmt(value)}: {reason}.", f"set {choices}{fix}."))
    return out


# Megatron Bridge's FP8/FP4 presets graphstep does not implement, by what tells them apart in the name
_PRESET_WHY = (
    ("subchannel", "blockwise (sub-channel) FP8 scaling is not implemented"),
    ("mxfp8", "MXFP8 needs Blackwell tensor cores and is not implemented"),
    ("nvfp4", "NVFP4 needs Blackwell tensor cores and is not implemented"),
    ("current_scaling", "only the general current-scaling preset is implemented (its first and last layers in "
                        "bf16), not this model-specific variant"),
    ("delayed", "only the bf16 delayed-scaling preset is implemented"),
)
_RECIPE_WHY = {
    "blockwise": "blockwise (sub-channel) FP8 scaling is not implemented",
    "mxfp8": "MXFP8 needs Blackwell tensor cores and is not implemented",
}


def _delayed_fields(cfg: Any) -> list[Violation]:
    """fp8_recipe=delayed: its three fields hold values Transformer Engine's DelayedScaling takes; compiled as a
    whole model only (not over FSDP2)."""
    mp, out = cfg.mixed_precision, []
    length, margin = mp.fp8_amax_history_len, mp.fp8_margin
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        out.append(_v("R32", ["mixed_precision.fp8_amax_history_len"], f"mixed_precision.fp8_amax_history_len="
                      f"{_fmt(length)}: the amax history holds a whole number of steps, at least 1.",
                      "set mixed_precision.fp8_amax_history_len=1024 (Bridge's delayed preset) or 1."))
    if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
        out.append(_v("R32", ["mixed_precision.fp8_margin"], f"mixed_precision.fp8_margin={_fmt(margin)}: the "
                      "margin is a whole number of binades (scale = fp8_max / amax / 2**margin), 0 or more.",
                      "set mixed_precision.fp8_margin=0."))
    if _str(mp.fp8_amax_compute_algo) not in fp8_delayed.ALGOS:
        out.append(_v("R32", ["mixed_precision.fp8_amax_compute_algo"], "mixed_precision.fp8_amax_compute_algo="
                      f"{_fmt(mp.fp8_amax_compute_algo)} is not an amax algorithm ({', '.join(fp8_delayed.ALGOS)}).",
                      "set mixed_precision.fp8_amax_compute_algo=max (or most_recent)."))
    fsdp = [key for key in ("ddp.use_megatron_fsdp", "ddp.use_distributed_optimizer",
                            "optimizer.use_distributed_optimizer") if _get_field(cfg, key) is True]
    if cfg.compile.enable is True and fsdp:
        out.append(_v("R32", ["mixed_precision.fp8_recipe", "compile.enable", *fsdp], "mixed_precision.fp8_recipe="
                      f"delayed with compile.enable=true over FSDP2 ({fsdp[0]}=true): FSDP2 has each decoder layer "
                      "compiled apart, which is not tested yet with delayed scaling's history updates (the whole "
                      "model compiled is).", "set compile.enable=false, or drop FSDP2."))
    return out


def _beyond_replicas(cfg: Any) -> list[tuple[str, str]]:
    """The layouts a run asks for beyond data-parallel replicas, as (field, what): model parallelism, FSDP2."""
    m = cfg.model
    out = [(f"model.{key}", f"{what} ({key}={_fmt(getattr(m, key))})") for key, what in (
        ("tensor_model_parallel_size", "tensor parallel"), ("pipeline_model_parallel_size", "pipeline stages"),
        ("expert_model_parallel_size", "expert parallel"), ("context_parallel_size", "context parallel"))
        if isinstance(getattr(m, key), int) and getattr(m, key) > 1]
    if cfg.ddp.use_megatron_fsdp is True:
        out.append(("ddp.use_megatron_fsdp", "FSDP2 (ddp.use_megatron_fsdp=true)"))
    return out


def _r32(v: View) -> list[Violation]:
    """FP8 as graphstep implements it (converters/fp8.py): current or row-wise scaling on torchao, delayed scaling
    on graphstep's own linear (converters/fp8_delayed.py), on data-parallel replicas, and on FSDP2 for current
    (with torchao's FP8 all-gather) and delayed scaling with whole-step graphs; the presets and fields it does
    not implement."""
    out = _refused(v, "R32")
    cfg, mp = v.cfg, v.cfg.mixed_precision
    preset, name = mp.preset, _str(mp.preset)
    if preset is not None:
        name = name.replace("-", "_") if name is not None else None
        if name is None or name not in PRECISION_PRESETS:
            out.append(_v("R32", ["mixed_precision.preset"], f"mixed_precision={_fmt(preset)} is not one of Megatron "
                          f"Bridge's precision presets ({', '.join(PRECISION_PRESETS)}).", "write "
                          "mixed_precision=bf16_mixed (or leave mixed_precision unset)."))
        elif name.startswith("fp16"):
            out.append(_v("R18", ["mixed_precision.preset"], f"mixed_precision={name}: fp16 with loss scaling is not "
                          "implemented by graphstep.", "write mixed_precision=bf16_mixed (or "
                          "bf16_with_fp8_current_scaling_mixed for FP8)."))
        elif name not in ("bf16_mixed", *FP8_PRESETS):
            why = next((why for tag, why in _PRESET_WHY if tag in name), "this precision preset is not implemented")
            out.append(_v("R32", ["mixed_precision.preset"], f"mixed_precision={name}: {why}.",
                          f"write mixed_precision={FP8_CURRENT_SCALING_PRESET} (FP8 current scaling) or "
                          "mixed_precision=bf16_mixed."))
    if mp.fp8 is None:
        return out
    fmt, recipe = _str(mp.fp8), _str(mp.fp8_recipe)
    if fmt not in fp8.FORMATS:
        out.append(_v("R32", ["mixed_precision.fp8"], f"mixed_precision.fp8={_fmt(mp.fp8)} is not an FP8 format "
                      f"graphstep implements ({', '.join(fp8.FORMATS)}).", "set mixed_precision.fp8=hybrid (e4m3 "
                      "forward, e5m2 gradients) or e4m3."))
    if recipe in _RECIPE_WHY:
        out.append(_v("R32", ["mixed_precision.fp8_recipe"], f"mixed_precision.fp8_recipe={recipe}: "
                      f"{_RECIPE_WHY[recipe]}.", "set mixed_precision.fp8_recipe=tensorwise (current scaling)."))
    elif recipe not in fp8.RECIPES:
        out.append(_v("R32", ["mixed_precision.fp8_recipe"], f"mixed_precision.fp8_recipe={_fmt(mp.fp8_recipe)} is "
                      f"not an FP8 scaling graphstep implements ({', '.join(fp8.RECIPES)}).",
                      "set mixed_precision.fp8_recipe=tensorwise (current scaling)."))
    elif recipe in ("rowwise", "rowwise_with_gw_hp") and fmt == "hybrid":
        out.append(_v("R32", ["mixed_precision.fp8_recipe", "mixed_precision.fp8"], f"mixed_precision.fp8_recipe="
                      f"{recipe} with mixed_precision.fp8=hybrid: torchao's row-wise scalings cast the gradients to "
                      "e4m3, not e5m2.", "set mixed_precision.fp8=e4m3, or mixed_precision.fp8_recipe=tensorwise."))
    if recipe == "delayed":
        out += _delayed_fields(cfg)
    d = cfg.ddp
    sharded = d.use_megatron_fsdp is True or d.use_distributed_optimizer is True \
        or cfg.optimizer.use_distributed_optimizer is True
    # FSDP2 with FP8: tensorwise (with fp8_param_gather: torchao's FP8 all-gather) or delayed scaling (the weights
    # gathered in bf16), with whole-step graphs or none
    fsdp_fp8 = recipe in ("tensorwise", "delayed") and not v.per_layer
    fp8_gather = recipe == "tensorwise" and not v.per_layer
    others = [(key, what) for key, what in _beyond_replicas(cfg) if not (key == "ddp.use_megatron_fsdp" and fsdp_fp8)]
    if cfg.compile.enable is True and v.per_layer:
        others.append(("compile.enable", "torch.compile of per-layer graphs (compile.enable=true)"))
    for key, what in others:
        if key == "ddp.use_megatron_fsdp":
            out.append(_v("R32", ["mixed_precision.fp8", "mixed_precision.fp8_recipe", key], f"mixed_precision.fp8="
                          f"{fmt} with {what}: implemented for fp8_recipe=tensorwise or delayed with full_iteration "
                          f"graphs or none, not yet with {'per-layer graphs' if v.per_layer else f'fp8_recipe={recipe}'}.",
                          "set mixed_precision.fp8_recipe=tensorwise (or delayed) and model.cuda_graph_impl="
                          "full_iteration (or none), or drop FSDP2."))
            continue
        out.append(_v("R32", ["mixed_precision.fp8", key], f"mixed_precision.fp8={fmt} with {what} is not "
                      "implemented yet: graphstep's FP8 runs on data-parallel replicas and FSDP2.",
                      f"set mixed_precision.fp8=null (bf16), or drop {what.split(' (')[0]}."))
    for key in ("mixed_precision.fp8_param_gather", "model.fp8_param_gather"):
        if _get_field(cfg, key) is True and sharded and not fp8_gather:
            out.append(_v("R32", [key], f"{key}=true with sharded parameters or optimizer state: the FP8 parameter "
                          "all-gather is implemented for fp8_recipe=tensorwise (torchao's) without per-layer graphs.",
                          f"set {key}=false, or mixed_precision.fp8_recipe=tensorwise and "
                          "model.cuda_graph_impl=full_iteration."))
    if v.capability is not None and tuple(v.capability) < (8, 9):
        major, minor = v.capability
        out.append(_v("R32", ["mixed_precision.fp8"], f"mixed_precision.fp8={fmt} on a GPU of compute capability "
                      f"{major}.{minor}: FP8 matmuls need FP8 tensor cores (8.9 or newer: Ada, Hopper).",
                      "set mixed_precision.fp8=null (bf16) on this GPU."))
    return out


_PEFT_DEFAULTS = {"target_modules": list(lora.TARGETS), "dim": 32, "alpha": 32, "dropout": 0.0,
                  "dropout_position": "pre", "lora_A_init_method": "xavier", "lora_B_init_method": "zero",
                  "adapter_path": None}


def _r33(v: View) -> list[Violation]:
    """LoRA as graphstep implements it (converters/lora.py): Bridge's LoRA fields with valid values, on data-parallel
    replicas of a dense transformer; DoRA, the adapters' own dtype and the rest are refused."""
    out = _refused(v, "R33")
    cfg, p = v.cfg, v.cfg.peft
    if cfg.checkpoint.pretrained_checkpoint and cfg.model.hf_path:
        out.append(_v("R33", ["checkpoint.pretrained_checkpoint", "model.hf_path"], "checkpoint.pretrained_checkpoint "
                      f"={_fmt(cfg.checkpoint.pretrained_checkpoint)} and model.hf_path={_fmt(cfg.model.hf_path)}: two "
                      "sources of the starting weights.", "set one of them (a graphstep checkpoint, or a Hugging "
                      "Face model), and the other to null."))
    scheme = _str(p.scheme)
    if p.scheme is None:
        explicit = explicit_keys(cfg)
        for name, default in _PEFT_DEFAULTS.items():
            value = getattr(p, name)
            if f"peft.{name}" in explicit or _differs(value, default):
                out.append(_v("R33", [f"peft.{name}"], f"peft.{name}={_fmt(value)} without a scheme (peft is null): "
                              "the adapters' fields act only with peft=lora or peft=dora.", f"write peft=lora, or drop peft.{name}."))
        return out
    if scheme not in lora.SCHEMES:
        return out + [_v("R33", ["peft.scheme"], f"peft={_fmt(p.scheme)} is not a PEFT scheme (lora, dora).",
                         "write peft=lora (or peft=dora, peft=null).")]
    targets = p.target_modules
    bad = [t for t in targets if t not in lora.TARGETS] if isinstance(targets, list) else None
    if bad is None or not targets or bad:
        what = f"has {', '.join(map(_fmt, bad))}" if bad else "is empty"
        out.append(_v("R33", ["peft.target_modules"], f"peft.target_modules {what}: graphstep's adapters wrap the "
                      f"decoder layers' linear layers by Bridge's names ({', '.join(lora.TARGETS)}); module paths "
                      "and wildcards are not implemented.", "set peft.target_modules to a list of those names "
                      "(default: all four)."))
    dim, alpha, dropout = _num(p.dim), _num(p.alpha), _num(p.dropout)
    if not isinstance(p.dim, int) or dim is None or dim < 1:
        out.append(_v("R33", ["peft.dim"], f"peft.dim={_fmt(p.dim)}: the adapters' rank is a positive integer.",
                      "set peft.dim=8 (or 16, 32: Bridge's default)."))
    if alpha is None or alpha <= 0:
        out.append(_v("R33", ["peft.alpha"], f"peft.alpha={_fmt(p.alpha)}: the scaling numerator is a positive "
                      "number.", "set peft.alpha=32 (Bridge's default) or twice peft.dim."))
    if dropout is None or not 0.0 <= dropout < 1.0:
        out.append(_v("R33", ["peft.dropout"], f"peft.dropout={_fmt(p.dropout)}: a dropout probability is in "
                      "[0, 1).", "set peft.dropout=0.0 (Bridge's default) or e.g. 0.1."))
    for name, choices in (("dropout_position", lora.DROPOUT_POSITIONS), ("lora_A_init_method", lora.A_INITS),
                          ("lora_B_init_method", lora.B_INITS)):
        value = getattr(p, name)
        if _str(value) not in choices:
            out.append(_v("R33", [f"peft.{name}"], f"peft.{name}={_fmt(value)} is not one of "
                          f"{', '.join(choices)}.", f"set peft.{name}={choices[0]} (Bridge's default)."))
    if scheme == "dora" and _str(p.dropout_position) == "post":
        out.append(_v("R33", ["peft.scheme", "peft.dropout_position"], "peft=dora with peft.dropout_position=post: "
                      "DoRA drops the adapter's input only (Bridge asserts the same; its rescaling corrects the base "
                      "output of the dropped input).", "set peft.dropout_position=pre."))
    return out + _r33_combinations(v, dropout or 0.0)


def _r33_combinations(v: View, dropout: float) -> list[Violation]:
    """What LoRA does not combine with yet: pipeline stages, expert and context parallel, FP8, MoE and hybrid
    models, and adapter dropout inside recomputed regions. Tensor parallel and FSDP2 act
    (parallel/tensor_parallel.py shards the adapters as Megatron does)."""
    m, out = v.cfg.model, []
    others = [(key, what) for key, what in _beyond_replicas(v.cfg)
              if key not in ("model.tensor_model_parallel_size", "ddp.use_megatron_fsdp")]
    if v.cfg.mixed_precision.fp8 is not None:
        others.append(("mixed_precision.fp8", f"FP8 (mixed_precision.fp8={_fmt(v.cfg.mixed_precision.fp8)})"))
    if m.num_moe_experts is not None:
        others.append(("model.num_moe_experts", f"an MoE model (num_moe_experts={_fmt(m.num_moe_experts)})"))
    if m.hybrid_override_pattern:
        others.append(("model.hybrid_override_pattern", "a hybrid Mamba model (hybrid_override_pattern set)"))
    for key, what in others:
        out.append(_v("R33", ["peft.scheme", key], f"peft={_fmt(v.cfg.peft.scheme)} with {what} is not implemented "
                      "yet: graphstep's adapters run on data-parallel replicas, tensor parallel and FSDP2 of a "
                      "dense transformer.",
                      f"drop {what.split(' (')[0]}, or write peft=null."))
    if v.cfg.compile.enable is True and v.per_layer:  # as FP8 (R32): compiled whole-model only, for now
        out.append(_v("R33", ["peft.scheme", "compile.enable", "model.cuda_graph_impl"], f"peft="
                      f"{_fmt(v.cfg.peft.scheme)} with torch.compile of per-layer graphs (compile.enable=true, "
                      f"model.cuda_graph_impl={v.impl}) is not implemented yet: compiled adapters are tested "
                      "whole-model, without graphs and under full_iteration.", "set model.cuda_graph_impl="
                      "full_iteration (or none) to compile the adapters, or compile.enable=false."))
    recomputed = _names(m.recompute_modules) or []
    if dropout > 0 and (m.recompute_granularity == "full" or
                        (m.recompute_granularity == "selective" and "mlp" in recomputed)):
        out.append(_v("R33", ["peft.dropout", "model.recompute_granularity"], f"peft.dropout={dropout:g} inside "
                      "recomputed layers: the recompute would draw other adapter dropout masks than the forward.",
                      "set peft.dropout=0.0, or recompute only core_attn (or nothing)."))
    return out


def _r38(v: View) -> list[Violation]:
    """Bridge's dataset, tokenizer and manual-gc fields agree with what graphstep does."""
    cfg, out = v.cfg, []
    d, t, explicit = cfg.data, cfg.tokenizer, explicit_keys(cfg)
    if d.seq_length is not None and d.seq_length != cfg.model.seq_length:
        out.append(_v("R38", ["data.seq_length", "model.seq_length"], f"dataset.seq_length={_fmt(d.seq_length)} "
                      f"differs from model.seq_length={_fmt(cfg.model.seq_length)}: graphstep's samples are "
                      "model.seq_length tokens (Bridge requires the two equal too).",
                      f"set dataset.seq_length={_fmt(cfg.model.seq_length)} (or null)."))
    for key in ("data.random_seed", "data.seed"):
        value = _get_field(cfg, key)
        if key in explicit and value is not None and value != cfg.rng.seed:
            out.append(_v("R38", [key, "rng.seed"], f"{key.replace('data.', 'dataset.')}={_fmt(value)} differs from "
                          f"rng.seed={_fmt(cfg.rng.seed)}: graphstep derives the sample order from rng.seed.",
                          f"set rng.seed={_fmt(value)} and drop {key.replace('data.', 'dataset.')}."))
    blend = d.blend
    if blend is not None and not (isinstance(blend, list) and blend and isinstance(blend[0], list)
                                  and (len(blend) == 1 or blend[1] is None
                                       or (isinstance(blend[1], list) and len(blend[1]) == len(blend[0])))):
        out.append(_v("R38", ["data.blend"], f"dataset.blend={_fmt(blend)} is not [[prefix, ...], [weight, ...]] "
                      "(or [[prefix, ...], null]).", "write dataset.blend=[[pathA,pathB],[0.7,0.3]], or "
                      "data.data_path='0.7 pathA 0.3 pathB'."))
    kind = _str(t.tokenizer_type)
    if t.tokenizer_type is not None and kind not in ("NullTokenizer", "HuggingFaceTokenizer"):
        out.append(_v("R38", ["tokenizer.tokenizer_type"], f"tokenizer.tokenizer_type={_fmt(t.tokenizer_type)} is "
                      "not implemented: graphstep reads Hugging Face tokenizer.json files and raw token ids.",
                      "set tokenizer.tokenizer_type=HuggingFaceTokenizer with tokenizer.tokenizer_model=PATH, or "
                      "NullTokenizer."))
    if kind == "HuggingFaceTokenizer" and not _str(t.tokenizer_model):
        out.append(_v("R38", ["tokenizer.tokenizer_model"], "tokenizer.tokenizer_type=HuggingFaceTokenizer without "
                      "tokenizer.tokenizer_model.", "set tokenizer.tokenizer_model to the tokenizer's local "
                      "directory or tokenizer.json."))
    if kind == "NullTokenizer" and isinstance(t.vocab_size, int) and isinstance(cfg.model.vocab_size, int) \
            and t.vocab_size > cfg.model.vocab_size:
        out.append(_v("R38", ["tokenizer.vocab_size", "model.vocab_size"], f"tokenizer.vocab_size={t.vocab_size} "
                      f"ids do not fit model.vocab_size={cfg.model.vocab_size}.",
                      f"set model.vocab_size={t.vocab_size} or more (model.should_pad_vocab=true pads it)."))
    gc_interval = cfg.train.manual_gc_interval
    if isinstance(gc_interval, int) and gc_interval < 0:
        out.append(_v("R38", ["train.manual_gc_interval"], f"train.manual_gc_interval={gc_interval} is negative.",
                      "set train.manual_gc_interval=0 (collect only at the start) or a positive interval."))
    s = cfg.scheduler
    for key, value in (("scheduler.start_weight_decay", s.start_weight_decay),
                       ("scheduler.end_weight_decay", s.end_weight_decay)):
        if value is not None and _differs(value, cfg.optimizer.weight_decay):
            out.append(_v("R18", [key, "optimizer.weight_decay"], f"{key}={_fmt(value)} differs from "
                          f"optimizer.weight_decay={_fmt(cfg.optimizer.weight_decay)}: graphstep does not implement "
                          "a weight-decay schedule (its weight decay is constant).",
                          f"set {key}=null or optimizer.weight_decay={_fmt(value)} (constant)."))
    return out


def _packing_switch(cfg: Any) -> str:
    """The field that turned packing on, as the user wrote it (for the messages)."""
    if cfg.data.packed_sequences is True:
        return "data.packed_sequences=true"
    if cfg.data.enable_offline_packing is True:
        return "dataset.enable_offline_packing=true"
    return f"packed_sequence_size={_fmt(packing.spec_fields(cfg).get('packed_sequence_size'))}"


def _r41_specs(cfg: Any) -> list[Violation]:
    """Bridge's packing specs: known fields with valid values; the offline-packed files are refused."""
    out, seq = [], cfg.model.seq_length
    for key in packing.SPEC_SECTIONS:
        specs, bridge = getattr(cfg.data, key.split(".")[1]), key.replace("data.", "dataset.")
        if specs is None:
            continue
        if not isinstance(specs, dict):
            out.append(_v("R41", [key], f"{bridge}={_fmt(specs)} is not a mapping of Bridge's PackedSequenceSpecs "
                          "fields.", f"set {bridge}.packed_sequence_size=N (and the other fields one by one)."))
            continue
        for name in [n for n in specs if n not in packing.SPEC_FIELDS]:
            out.append(_v("R41", [key], f"{bridge} has {_fmt(name)}, not a field of Bridge's PackedSequenceSpecs "
                          f"({', '.join(packing.SPEC_FIELDS)}).", f"drop {bridge}.{name}."))
        for name in [n for n in packing.SPEC_PATHS if specs.get(n) is not None]:
            out.append(_v("R41", [key], f"{bridge}.{name}={_fmt(specs[name])}: reading the files of Bridge's "
                          "offline packing is not implemented; graphstep packs data.data_path (an SFT jsonl file) "
                          "itself when the run starts.", f"drop {bridge}.{name} and set data.data_path to the jsonl "
                          "file the packed data was made from."))
        size, mult = specs.get("packed_sequence_size", -1), specs.get("pad_seq_to_mult", 1)
        if not isinstance(size, int) or isinstance(size, bool) or (isinstance(seq, int) and size > seq):
            out.append(_v("R41", [key, "model.seq_length"], f"{bridge}.packed_sequence_size={_fmt(size)}: a packed "
                          f"row is an integer number of tokens, at most model.seq_length={_fmt(seq)} (the model's "
                          "RoPE table and static shapes).", f"set {bridge}.packed_sequence_size={_fmt(seq)} (or "
                          "-1: model.seq_length with data.packed_sequences=true)."))
        row = size if isinstance(size, int) and size > 0 else seq  # the row's width (-1: model.seq_length)
        if mult is not None and (not isinstance(mult, int) or isinstance(mult, bool) or mult < 1
                                 or (isinstance(row, int) and mult > row)):
            out.append(_v("R41", [key], f"{bridge}.pad_seq_to_mult={_fmt(mult)}: each example is padded to a "
                          "multiple of this positive integer, which must fit a packed row.",
                          f"set {bridge}.pad_seq_to_mult=1 (no padding) or a small multiple such as 8."))
        if not isinstance(specs.get("pad_cu_seqlens", False), bool):
            out.append(_v("R41", [key], f"{bridge}.pad_cu_seqlens={_fmt(specs['pad_cu_seqlens'])} is not a "
                          "boolean.", f"set {bridge}.pad_cu_seqlens=true (graphstep pads cu_seqlens either way)."))
    return out


def _r41(v: View) -> list[Violation]:
    """Packed SFT sequences (data/packing.py): valid specs, SFT data, and what packing runs with so far --
    data-parallel replicas of a dense graphstep transformer, rows of one width."""
    cfg = v.cfg
    out = _r41_specs(cfg)
    if not packing.packing_on(cfg):
        return out
    switch = _packing_switch(cfg)
    if cfg.data.dataset != "sft":
        out.append(_v("R41", ["data.packed_sequences", "data.dataset"], f"{switch} with data.dataset="
                      f"{_fmt(cfg.data.dataset)}: packing joins prompt/response examples, which only SFT data has.",
                      "set data.dataset=sft with data.data_path=FILE.jsonl, or data.packed_sequences=false."))
    if cfg.data.seq_length_buckets:
        out.append(_v("R41", ["data.packed_sequences", "data.seq_length_buckets"], f"{switch} with "
                      f"data.seq_length_buckets={_fmt(cfg.data.seq_length_buckets)}: packed rows all have one width, "
                      "there is nothing to bucket.", "set data.seq_length_buckets=null."))
    m, others = cfg.model, _beyond_replicas(cfg)
    if m.num_moe_experts is not None:
        others.append(("model.num_moe_experts", f"an MoE model (num_moe_experts={_fmt(m.num_moe_experts)})"))
    if m.hybrid_override_pattern:
        others.append(("model.hybrid_override_pattern", "a hybrid Mamba model (hybrid_override_pattern set: the "
                       "Mamba scan would carry state across documents)"))
    if m.hf_path:
        others.append(("model.hf_path", "a Hugging Face model (model.hf_path set)"))
    if cfg.compile.enable is True:
        others.append(("compile.enable", "torch.compile (compile.enable=true)"))
    for key, what in others:
        out.append(_v("R41", ["data.packed_sequences", key], f"{switch} with {what} is not implemented yet: packed "
                      "rows run on data-parallel replicas of graphstep's dense transformer.",
                      f"drop {what.split(' (')[0]}, or data.packed_sequences=false."))
    return out


def _get_field(cfg: Any, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def noop_notes(cfg: Any) -> list[str]:
    """One entry per no-op field you set or that differs from its default: ``key=value (graphstep: ...)``."""
    explicit, out = explicit_keys(cfg), []
    for section, name, value, default, _help, _unsupported in iter_fields(cfg):
        kind, instead = field_kind(section, name)
        if kind == "noop" and (f"{section}.{name}" in explicit or _differs(value, default)):
            out.append(f"{section}.{name}={_fmt(value)} (graphstep: {instead})")
    return out



def _r21(v: View) -> list[Violation]:
    buckets = v.cfg.data.seq_length_buckets
    if not v.per_layer or not buckets:
        return []
    return [_v("R21", ["data.seq_length_buckets", "model.cuda_graph_impl"], f"data.seq_length_buckets={_fmt(buckets)} "
               f"with per-layer graphs ({_impl_f(v)}) is not implemented: each bucket would need its own set of "
               "layer graphs.", "set model.cuda_graph_impl=full_iteration (one graph per bucket), or "
               "model.cuda_graph_impl=none, or data.seq_length_buckets=null.")]


def _r22(v: View) -> list[Violation]:
    if v.world_size <= 1 or v.cfg.ddp.grad_reduce_in_fp32 is True:
        return []
    return [_v("R22", ["ddp.grad_reduce_in_fp32"], f"ddp.grad_reduce_in_fp32={_fmt(v.cfg.ddp.grad_reduce_in_fp32)} "
               f"with {v.world_size} data-parallel ranks is not implemented: graphstep's gradient buffers are fp32 "
               "and are reduced in fp32.", "set ddp.grad_reduce_in_fp32=true (its default).")]


# Megatron's allgather and alltoall dispatchers both reduce to a local permutation on one expert-parallel
# rank, which is what graphstep's MoE layer does (models/moe_dispatch.py); across ranks both are implemented
# (models/moe_parallel.py; expert parallelism is R31). Its flex dispatcher makes alltoall's exchange with DeepEP
# or HybridEP kernels: graphstep runs it as alltoall (config_sections.py token_dispatcher).
DISPATCHERS = ("allgather", "alltoall", "flex")


def _r23(v: View) -> list[Violation]:
    m = v.cfg.model
    value = m.moe_token_dispatcher_type
    if _str(value) == "allgather" and m.variable_seq_lengths is True and m.num_moe_experts is not None:
        return [_v("R23", ["model.moe_token_dispatcher_type", "model.variable_seq_lengths"], "model.moe_token_"
                   "dispatcher_type=allgather with model.variable_seq_lengths=true: Megatron Core's allgather "
                   "dispatcher takes no variable sequence lengths (it refuses the pair).",
                   "set model.moe_token_dispatcher_type=alltoall, or model.variable_seq_lengths=false.")]
    if _str(value) in DISPATCHERS:
        return []
    return [_v("R23", ["model.moe_token_dispatcher_type"], f"model.moe_token_dispatcher_type={_fmt(value)} is not "
               "implemented: graphstep dispatches tokens locally, which is what allgather, alltoall and flex do on one "
               "expert-parallel rank, and across expert-parallel ranks all-gathers them (allgather) or sends them to "
               "their experts' ranks (alltoall, and flex as alltoall; R31).",
               "set model.moe_token_dispatcher_type=allgather (its default), alltoall or flex.")]


def _r24(v: View) -> list[Violation]:
    t = v.cfg.train
    if t.skip_step_on_nan is not True or t.check_for_nan_on_device is not False:
        return []
    return [_v("R24", ["train.skip_step_on_nan", "train.check_for_nan_on_device"], "train.skip_step_on_nan=true "
               "needs the device-side flag it skips on, but train.check_for_nan_on_device=false.",
               "set train.check_for_nan_on_device=true, or train.skip_step_on_nan=false.")]


def _r35(v: View) -> list[Violation]:
    """Activation recompute that graphstep cannot make exact: its recompute re-runs a region without replaying the
    RNG, so a recomputed region must draw no dropout; and selective recompute of the MoE block is not implemented
    (under full recompute its router counts its statistics in the first forward only: models/transformer.py)."""
    m, out = v.cfg.model, []
    layer_wise = [k for k in ("recompute_method", "recompute_num_layers") if getattr(m, k) is not None]
    if layer_wise and m.recompute_granularity != "full":
        keys = [f"model.{k}" for k in layer_wise]
        out.append(_v("R35", keys + ["model.recompute_granularity"], f"{', '.join(keys)} set, but "
                      f"model.recompute_granularity={_fmt(m.recompute_granularity)}: the layer-wise method is read "
                      "only with full recompute.", f"set model.recompute_granularity=full, or {keys[0]}=null."))
    if m.recompute_granularity == "full":
        dropouts = [k for k in ("attention_dropout", "hidden_dropout") if (_num(getattr(m, k)) or 0) > 0]
        if dropouts:
            out.append(_v("R35", ["model.recompute_granularity"] + [f"model.{k}" for k in dropouts],
                          f"model.recompute_granularity=full with {', '.join(f'model.{k}' for k in dropouts)} > 0: "
                          "the recomputed layers would draw other dropout masks than their forward.",
                          f"set {' '.join(f'model.{k}=0.0' for k in dropouts)} (as Bridge's pre-training recipes "
                          "do), or model.recompute_granularity=selective."))
    recomputed = _names(m.recompute_modules) or []
    if m.recompute_granularity == "selective" and "moe" in recomputed and m.num_moe_experts is not None:
        out.append(_v("R35", ["model.recompute_modules", "model.num_moe_experts"], "model.recompute_modules has moe: "
                      "recomputing graphstep's MoE block is not implemented (it would re-run the router's in-place "
                      "statistics; Megatron Core refuses it with the moe_router graph too).",
                      "remove moe from model.recompute_modules (recompute core_attn or mlp)."))
    graphed_attn = v.impl == "full_iteration" or (v.per_layer and v.covers("attn"))  # R15 judges those
    if (m.recompute_granularity == "selective" and "core_attn" in recomputed and not graphed_attn
            and (_num(m.attention_dropout) or 0) > 0):
        out.append(_v("R35", ["model.recompute_modules", "model.attention_dropout"], "selective recompute of "
                      f"core_attn with model.attention_dropout={_fmt(m.attention_dropout)}: the recomputed "
                      "attention would draw another dropout mask than its forward.",
                      "set model.attention_dropout=0.0, or remove core_attn from model.recompute_modules."))
    return out


RUN_RULES = (("R18", _r18), ("R19", _r19), ("R20", _r20), ("R21", _r21), ("R22", _r22), ("R23", _r23),
             ("R24", _r24), ("R32", _r32), ("R33", _r33),
             ("R34", lambda v: _refused(v, "R34")), ("R35", _r35),
             ("R36", lambda v: _refused(v, "R36")), ("R37", lambda v: _refused(v, "R37")), ("R38", _r38),
             ("R39", lambda v: _refused(v, "R39")), ("R40", _r40), ("R41", _r41))
