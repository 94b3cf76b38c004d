"""The CUDA-graph rules R1-R17 (spec section 2), each a small function over one view of the config.

Every rule is ``_rN(view) -> list[Violation]`` over a :class:`View`: the
normalised config (migrations.py) plus the facts derived from it -- the valid
impl or None, the coverage list, the field it came from (the one the user
wrote) -- and the environment the run will see (env vars, the device's
compute capability, the world size). Rules never raise; validation/__init__.py
runs them all (``checked`` turns a crash into a violation).

docs/rules.md describes every rule with an example override and its fix.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from graphstep.config import Config
from graphstep.config_sections import token_dispatcher
from graphstep.cuda_graph.settings import IMPL_VALUES, MOE_SCOPES, PER_LAYER, SCOPE_NAMES

from .migrations import coverage_field
from .report import Violation, as_int as _int, as_num as _num, as_str as _str, fmt as _fmt
from .report import names as _names, strs as _strs
from .report import violation as _v


@dataclass
class View:
    """What the rules read: the normalised config plus the facts derived from it."""

    cfg: Config
    impl: str | None  # one of IMPL_VALUES, or None when model.cuda_graph_impl is not one
    names: list[Any] | None  # coverage (union of both fields when both are set); None when malformed
    cov: tuple[str, ...]  # the field(s) the coverage came from
    scope_set: bool  # cuda_graph_scope still set after normalising: both fields given, or malformed
    env: Mapping[str, str]
    capability: tuple[int, int] | None
    world_size: int

    @property
    def on(self) -> bool:
        return self.impl in ("local", "transformer_engine", "full_iteration")

    @property
    def per_layer(self) -> bool:
        return self.impl in PER_LAYER

    def has(self, scope: str) -> bool:
        return self.per_layer and scope in _strs(self.names)

    def covers(self, scope: str) -> bool:
        """Whether per-layer graphs capture ``scope`` (named, or the whole layer)."""
        return self.per_layer and (self.names == [] or scope in _strs(self.names))


def make_view(cfg: Config, env: Mapping[str, str], capability: Any, world_size: int) -> View:
    m = cfg.model
    impl = _str(m.cuda_graph_impl)
    scope_set = m.cuda_graph_scope is not None
    scope, modules = _names(m.cuda_graph_scope), _names(m.cuda_graph_modules)
    if scope_set:
        names = None if scope is None or modules is None else scope + [n for n in modules if n not in scope]
        cov = ("model.cuda_graph_scope", "model.cuda_graph_modules")
    else:
        names = modules
        cov = (coverage_field(cfg),)
    return View(cfg, impl if impl in IMPL_VALUES else None, names, cov, scope_set, env, capability, world_size)


def _impl_f(v: View) -> str:
    return f"model.cuda_graph_impl={_fmt(v.cfg.model.cuda_graph_impl)}"


def _r1(v: View) -> list[Violation]:
    raw = v.cfg.model.cuda_graph_impl
    if v.impl is not None:
        return []
    close = difflib.get_close_matches(_str(raw) or "", IMPL_VALUES, n=1)
    fix = f"set model.cuda_graph_impl={close[0]}" if close else "set model.cuda_graph_impl to one of them"
    return [_v("R1", ["model.cuda_graph_impl"], f"model.cuda_graph_impl={_fmt(raw)} is not one of "
               f"{', '.join(IMPL_VALUES)}.", f"{fix} (local for per-layer graphs, full_iteration for the whole step).")]


def _r2(v: View) -> list[Violation]:
    m, out = v.cfg.model, []
    if v.scope_set and _names(m.cuda_graph_scope) is not None and _names(m.cuda_graph_modules):
        out.append(_v("R2", v.cov, f"model.cuda_graph_scope={_fmt(m.cuda_graph_scope)} and model.cuda_graph_modules="
                      f"{_fmt(m.cuda_graph_modules)} are both set.", "keep one: set model.cuda_graph_scope=null "
                      f"and model.cuda_graph_modules={_fmt(_names(m.cuda_graph_scope))} (the current field)."))
    for name in ("scope", "modules"):
        raw = getattr(m, f"cuda_graph_{name}")
        if (raw is not None or name == "modules") and _names(raw) is None:
            out.append(_v("R2", [f"model.cuda_graph_{name}"], f"model.cuda_graph_{name}={_fmt(raw)} is not a list "
                          "or comma string of scope names.", f"set model.cuda_graph_{name} to a list such as [attn,mlp]"
                          ", or [] for the whole layer."))
    known = SCOPE_NAMES + ("full_iteration", "full")
    for bad in [n for n in (v.names or []) if _str(n) not in known]:
        close = difflib.get_close_matches(_str(bad) or "", SCOPE_NAMES, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        out.append(_v("R2", v.cov, f"{_fmt(bad)} in {v.cov[0]} is not a scope name.",
                      f"use only {', '.join(SCOPE_NAMES)} in {v.cov[-1]}{hint}."))
    if "full" in _strs(v.names) and len(v.names or []) > 1:
        out.append(_v("R2", v.cov, f"{v.cov[0]}={_fmt(v.names)} combines full (the whole layer) with other scopes.",
                      f"set {v.cov[-1]}=[] for the whole layer, or list only the scopes you want."))
    return out


def _r3(v: View) -> list[Violation]:
    m = v.cfg.model
    enable, external = m.enable_cuda_graph is True, m.external_cuda_graph is True
    fields = ["model.enable_cuda_graph", "model.external_cuda_graph", "model.cuda_graph_impl"]
    if enable and external:
        return [_v("R3", fields, "the deprecated model.enable_cuda_graph=true and model.external_cuda_graph=true "
                   "are both set.", "set both to false and choose model.cuda_graph_impl=local or "
                   "model.cuda_graph_impl=transformer_engine.")]
    if not (enable or external) or _str(m.cuda_graph_impl) == "none":
        return []
    flag = "enable_cuda_graph" if enable else "external_cuda_graph"
    return [_v("R3", [f"model.{flag}", "model.cuda_graph_impl"], f"the deprecated model.{flag}=true is combined "
               f"with {_impl_f(v)}.", f"set model.{flag}=false and keep {_impl_f(v)}.")]


def _r4(v: View) -> list[Violation]:
    names, out = _strs(v.names), []
    if "full_iteration" in names and len(v.names or []) > 1:
        out.append(_v("R4", ("model.cuda_graph_impl",) + v.cov, f"{v.cov[0]}={_fmt(v.names)} combines full_iteration "
                      "with other scopes.", "use model.cuda_graph_impl=full_iteration with model.cuda_graph_modules=[] "
                      "for the whole iteration, or list only per-layer scopes with model.cuda_graph_impl=local."))
    if "full_iteration" in names and v.impl == "transformer_engine":
        out.append(_v("R4", ("model.cuda_graph_impl",) + v.cov, "transformer_engine graphs are per layer; "
                      f"{v.cov[0]} asks for full_iteration.", "use model.cuda_graph_impl=full_iteration with "
                      "model.cuda_graph_modules=[], or keep transformer_engine with per-layer scopes such as [attn]."))
    if v.impl == "full_iteration" and v.names and "full_iteration" not in names:
        out.append(_v("R4", ("model.cuda_graph_impl",) + v.cov, f"model.cuda_graph_impl=full_iteration captures the "
                      f"whole iteration, but {v.cov[0]}={_fmt(v.names)} asks for per-layer scopes.",
                      f"set {v.cov[-1]}=[], or model.cuda_graph_impl=local for per-layer graphs."))
    return out


def _r5(v: View) -> list[Violation]:
    if not v.on or v.cfg.model.use_te_rng_tracker is True:
        return []
    return [_v("R5", ["model.use_te_rng_tracker", "rng.te_rng_tracker", "model.cuda_graph_impl"],
               f"CUDA graphs are on ({_impl_f(v)}) but the graph-safe RNG tracker is off (model.use_te_rng_tracker="
               f"{_fmt(v.cfg.model.use_te_rng_tracker)}): a replayed graph would reuse the captured random numbers.",
               "set model.use_te_rng_tracker=true (rng.te_rng_tracker follows).")]


def _r6(v: View) -> list[Violation]:
    """Megatron Bridge refuses the host-side loss check with the full-iteration graph; so does graphstep.

    ``ddp.check_for_nan_in_grad`` passes (Bridge has no such rule): graphstep's check reads the gradient norm
    the replayed graph wrote, on the host after the replay -- never inside a capture (training/loop.py).
    """
    if v.impl != "full_iteration" or v.cfg.rerun_state_machine.check_for_nan_in_loss is not True:
        return []
    return [_v("R6", ["rerun_state_machine.check_for_nan_in_loss", "model.cuda_graph_impl"], "the full-iteration "
               "graph owns the loss: rerun_state_machine.check_for_nan_in_loss=true is Megatron's host-side check "
               "inside the step (Megatron Bridge refuses it with full_iteration too).", "set "
               "rerun_state_machine.check_for_nan_in_loss=false; graphstep's graph-safe "
               "train.check_for_nan_on_device=true replaces it (add train.skip_step_on_nan=true to skip the update "
               "on NaN/Inf; ddp.check_for_nan_in_grad=true stays allowed: it reads the gradient norm after the "
               "replay).")]


def _r7(v: View) -> list[Violation]:
    if not (v.has("moe") and v.has("moe_router")):
        return []
    return [_v("R7", v.cov, f"{v.cov[0]}={_fmt(v.names)} has moe (the whole MoE block, router included) and "
               "moe_router: the router would be captured twice.",
               f"keep one in {v.cov[-1]}: moe, or moe_router with moe_preprocess.")]


def _r8(v: View) -> list[Violation]:
    if v.impl != "transformer_engine" or not v.has("moe_preprocess") or v.has("moe_router"):
        return []
    return [_v("R8", v.cov, f"{v.cov[0]}={_fmt(v.names)} has moe_preprocess without moe_router.",
               f"add moe_router to {v.cov[-1]} (or remove moe_preprocess).")]


def _experts(v: View) -> bool:
    m = v.cfg.model
    pattern = _str(m.hybrid_override_pattern)
    return m.num_moe_experts is not None and (m.hybrid_override_pattern is None or "E" in (pattern or ""))


def _r9(v: View) -> list[Violation]:
    asked = [s for s in MOE_SCOPES if v.has(s)]
    experts = _int(v.cfg.model.num_moe_experts)
    if v.has("moe_router") and experts == 1 and _experts(v):
        return [_v("R9", v.cov + ("model.num_moe_experts",), f"{v.cov[0]} has moe_router but "
                   "model.num_moe_experts=1: there is nothing to route (Megatron Core refuses the router graph "
                   "with one expert).", f"remove moe_router and moe_preprocess from {v.cov[-1]} (graph the block: "
                   "moe), or give the model more experts.")]
    if not asked or _experts(v):
        return []
    m = v.cfg.model
    why = (f"model.num_moe_experts={_fmt(m.num_moe_experts)}" if m.num_moe_experts is None
           else f"model.hybrid_override_pattern={_fmt(m.hybrid_override_pattern)} has no E layer")
    return [_v("R9", v.cov + ("model.num_moe_experts", "model.hybrid_override_pattern"), f"{v.cov[0]} asks for "
               f"{', '.join(asked)} but the model has no experts ({why}).", f"remove {', '.join(asked)} from "
               f"{v.cov[-1]}, or give the model experts (model.num_moe_experts).")]


def _r10(v: View) -> list[Violation]:
    m = v.cfg.model
    pattern = _str(m.hybrid_override_pattern)
    if not v.has("mlp"):
        return []
    if pattern is not None and "-" not in pattern:
        why = f"model.hybrid_override_pattern={_fmt(pattern)} has no - (dense MLP) layer"
    elif m.hybrid_override_pattern is None and m.num_moe_experts is not None and m.moe_layer_freq == 1:
        why = f"every layer is MoE (model.num_moe_experts={_fmt(m.num_moe_experts)}, model.moe_layer_freq=1)"
    else:
        return []
    return [_v("R10", v.cov + ("model.num_moe_experts", "model.moe_layer_freq", "model.hybrid_override_pattern"),
               f"{v.cov[0]} asks for mlp but no layer has a dense MLP: {why}.",
               f"remove mlp from {v.cov[-1]} (use moe or moe_router for the MoE layers).")]


_MOE_FIELDS = ("model.moe_expert_capacity_factor", "model.moe_pad_expert_input_to_capacity", "model.moe_sync_free")
_ALLTOALL_FIELDS = ("model.moe_token_dispatcher_type", "model.expert_model_parallel_size")


def _routing_syncs(v: View) -> str | None:
    """Why MoE token dispatch would copy to the host (None when it is capturable).

    graphstep's MoE layer lays tokens out in static shapes whenever a capacity
    factor is set (dropped slots are zero rows, padded to capacity or not), and
    its sync-free dropless path keeps group sizes on the device: only dropless
    routing with ``moe_sync_free=false`` reads token counts on the host.
    """
    m = v.cfg.model
    if m.moe_expert_capacity_factor is None and m.moe_sync_free is not True:
        return "dropless routing with model.moe_sync_free=false"
    return None


def _alltoall_ranks(v: View) -> int | None:
    """The expert-parallel ranks when the alltoall dispatcher exchanges tokens across them (None otherwise).

    Megatron's all-to-all dispatcher (models/moe_parallel.py) reads its split
    sizes on the host between the moe_preprocess and the experts stage.
    """
    m = v.cfg.model
    ep = _int(m.expert_model_parallel_size)
    return ep if _dispatcher(m) == "alltoall" and ep is not None and ep > 1 else None


def _dispatcher(m: Any) -> str | None:
    """The dispatcher that runs: ``model.moe_token_dispatcher_type``, ``flex`` as ``alltoall`` (config_sections.py)."""
    return token_dispatcher(_str(m.moe_token_dispatcher_type))


def _r11(v: View) -> list[Violation]:
    """The MoE block inside a graph -- scope moe, the whole layer, the whole iteration -- only when it never syncs."""
    whole_layer = v.per_layer and v.names == []
    full = v.impl == "full_iteration"
    if not (v.has("moe") or whole_layer or full) or not _experts(v):
        return []
    if full:
        what, fields = "model.cuda_graph_impl=full_iteration captures the MoE block", ("model.cuda_graph_impl",)
    else:
        what = f"{v.cov[0]}=[] (the whole layer) includes the MoE block" if whole_layer else f"{v.cov[0]} has moe"
        fields = v.cov
    if (ep := _alltoall_ranks(v)) is not None:
        return [_v("R11", fields + _ALLTOALL_FIELDS, f"{what}, but the alltoall dispatcher (model.moe_token_"
                   f"dispatcher_type=alltoall over model.expert_model_parallel_size={ep} ranks) reads its all-to-all "
                   "split sizes on the host, which no graph can hold.", "graph what Megatron graphs -- the dispatch "
                   "and the experts stay eager: model.cuda_graph_impl=local model.cuda_graph_modules=[attn,moe_router,"
                   "moe_preprocess]; or set model.moe_token_dispatcher_type=allgather (sync-free, capturable whole).")]
    if (why := _routing_syncs(v)) is None:
        return []
    return [_v("R11", fields + _MOE_FIELDS, f"{what}, but {why} gives data-dependent expert shapes.",
               "set model.moe_sync_free=true with model.moe_expert_capacity_factor=null (sync-free dropless), or "
               "set a capacity factor: model.moe_expert_capacity_factor=1.0 (drop-and-pad).")]


def _r12(v: View) -> list[Violation]:
    m = v.cfg.model
    if (v.has("moe_preprocess") and _experts(v) and _dispatcher(m) == "alltoall"
            and m.moe_expert_capacity_factor is not None and m.moe_pad_expert_input_to_capacity is not True):
        return [_v("R12", v.cov + ("model.moe_token_dispatcher_type", "model.moe_expert_capacity_factor",
                                   "model.moe_pad_expert_input_to_capacity"), f"{v.cov[0]} has moe_preprocess with "
                   "the alltoall dispatcher and a capacity factor without padding: the tokens each expert keeps "
                   "are counted on the host (Megatron Core refuses it).",
                   "set model.moe_pad_expert_input_to_capacity=true (drop-and-pad), or "
                   "model.moe_expert_capacity_factor=null (dropless), or remove moe_router and moe_preprocess from "
                   f"{v.cov[-1]}.")]
    if not v.has("moe_preprocess") or not _experts(v) or (why := _routing_syncs(v)) is None:
        return []
    paired = " (local captures it with moe_router)" if v.impl == "local" else ""
    return [_v("R12", v.cov + _MOE_FIELDS, f"{v.cov[0]} has moe_preprocess{paired}, but {why} copies token counts "
               "to the host during preprocessing.", "set model.moe_sync_free=true (dropless) or "
               "model.moe_expert_capacity_factor=1.0 (drop-and-pad), or remove moe_preprocess"
               f"{' and moe_router' if paired else ''} from {v.cov[-1]}.")]


def _r13(v: View) -> list[Violation]:
    """The mamba scope on a model without Mamba layers graphs nothing there, which Megatron Core allows;
    refused only when it is the only scope, so that the per-layer impl would capture no graph at all."""
    pattern = _str(v.cfg.model.hybrid_override_pattern)
    if not v.has("mamba") or (pattern is not None and "M" in pattern) or set(_strs(v.names)) - {"mamba"}:
        return []
    return [_v("R13", v.cov + ("model.hybrid_override_pattern",), f"{v.cov[0]}={_fmt(v.names)} asks for mamba alone "
               f"but the model has no Mamba layer (model.hybrid_override_pattern="
               f"{_fmt(v.cfg.model.hybrid_override_pattern)}): {_impl_f(v)} would capture no graph.",
               f"graph other scopes too (e.g. {v.cov[-1]}=[attn,mamba]), or set a hybrid_override_pattern with M "
               "layers, or model.cuda_graph_impl=none.")]


def _r15(v: View) -> list[Violation]:
    m = v.cfg.model
    if v.impl == "full_iteration":
        return _r15_full_iteration(v)
    if not v.per_layer:
        return []
    if m.recompute_granularity == "full":
        return [_v("R15", ["model.recompute_granularity", "model.cuda_graph_impl"], "model.recompute_granularity=full "
                   f"re-runs whole layers in backward, which per-layer graphs ({_impl_f(v)}) cannot capture.",
                   "use model.cuda_graph_impl=full_iteration, or model.recompute_granularity=selective (or null).")]
    if m.recompute_granularity != "selective":
        return []
    recomputed = _strs(_names(m.recompute_modules))
    out = []
    for module, scope, dropout in (("core_attn", "attn", "attention_dropout"), ("mlp", "mlp", "hidden_dropout"),
                                   ("moe", "moe", "hidden_dropout")):
        p = _num(getattr(m, dropout))
        if module in recomputed and v.covers(scope) and p is not None and p > 0:
            ungraph = (f"{scope} (remove it from {v.cov[-1]})" if v.names
                       else f"the whole layer (list the other scopes in {v.cov[-1]})")
            out.append(_v("R15", ["model.recompute_modules", f"model.{dropout}"] + list(v.cov), f"selective recompute "
                          f"of {module} inside the graphed {scope} scope would redraw dropout (model.{dropout}={p}).",
                          f"set model.{dropout}=0.0, or remove {module} from model.recompute_modules, or stop graphing "
                          f"{ungraph}."))
    return out


def _r15_full_iteration(v: View) -> list[Violation]:
    """Megatron Core refuses graphed recompute regions that draw dropout; the full-iteration graph holds them all."""
    m, out = v.cfg.model, []
    if m.recompute_granularity != "selective":
        return out
    recomputed = _strs(_names(m.recompute_modules))
    for module, dropout in (("core_attn", "attention_dropout"), ("mlp", "hidden_dropout"), ("moe", "hidden_dropout")):
        p = _num(getattr(m, dropout))
        if module in recomputed and p is not None and p > 0:
            out.append(_v("R15", ["model.recompute_modules", f"model.{dropout}", "model.cuda_graph_impl"],
                          f"selective recompute of {module} inside the full-iteration graph would redraw its dropout "
                          f"(model.{dropout}={p}): Megatron Core refuses graphed recompute regions with dropout.",
                          f"set model.{dropout}=0.0, or remove {module} from model.recompute_modules, or "
                          "model.cuda_graph_impl=none."))
    return out


def _alloc_conf(v: View) -> str | None:
    """The env var whose allocator settings turn on expandable_segments, if any."""
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for item in str(v.env.get(var, "")).split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return var
    return None


def _capability(v: View) -> tuple[int, int] | None:
    if v.capability is not None:
        return v.capability
    try:
        return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None
    except Exception:
        return None


def _r16(v: View) -> list[Violation]:
    if not v.on or v.world_size <= 1 or str(v.env.get("NCCL_GRAPH_REGISTER", "")) == "0":
        return []
    if v.cfg.train.device == "cpu" or (var := _alloc_conf(v)) is None:
        return []  # on the CPU there is neither NCCL nor the CUDA allocator
    if v.impl != "transformer_engine":
        cap = _capability(v)
        if (cap is None and v.cfg.train.device != "cuda") or (cap is not None and tuple(cap) >= (10, 0)):
            return []
    return [_v("R16", ["model.cuda_graph_impl", f"env.{var}", "env.NCCL_GRAPH_REGISTER"], f"{var} has "
               f"expandable_segments:True while {_impl_f(v)} graphs capture NCCL collectives ({v.world_size} ranks): "
               "NCCL's graph buffer registration then hits illegal memory accesses.",
               f"export NCCL_GRAPH_REGISTER=0 (or remove expandable_segments:True from {var}).")]


def _r17(v: View) -> list[Violation]:
    if not v.on or v.cfg.model.variable_seq_lengths is not True or v.cfg.data.seq_length_buckets:
        return []
    buckets = ("set data.seq_length_buckets (e.g. [64,128]; one graph per bucket)" if not v.per_layer else
               "set data.seq_length_buckets (e.g. [64,128]) with model.cuda_graph_impl=full_iteration (one graph per "
               "bucket; per-layer graphs take no buckets: R21)")
    return [_v("R17", ["model.variable_seq_lengths", "data.seq_length_buckets"], f"model.variable_seq_lengths=true "
               f"with {_impl_f(v)} graphs and no data.seq_length_buckets: captured graphs need static shapes.",
               f"{buckets}, or model.variable_seq_lengths=false.")]


GRAPH_RULES = (
    ("R1", _r1), ("R2", _r2), ("R3", _r3), ("R4", _r4), ("R5", _r5), ("R6", _r6), ("R7", _r7), ("R8", _r8),
    ("R9", _r9), ("R10", _r10), ("R11", _r11), ("R12", _r12), ("R13", _r13), ("R15", _r15),
    ("R16", _r16), ("R17", _r17),
)
