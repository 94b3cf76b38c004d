"""The run rules R18-R24: unimplemented fields, the tracker flags, torch.compile, and what training refused late.

Same shape as graph_rules.py (``_rN(view) -> list[Violation]`` over a
:class:`~graphstep.validation.graph_rules.View`). R21-R24 are the checks the
trainer used to make only once a run had started (per-layer graphs with shape
buckets, ``ddp.grad_reduce_in_fp32``, the token dispatcher, skipping a step on
NaN without the flag it skips on); the trainer keeps its guards, which a
validated config never reaches.

docs/rules.md describes every rule with an example override and its fix.
"""

from __future__ import annotations

from typing import Any

from graphstep.config import explicit_keys, iter_fields

from .graph_rules import View, _impl_f
from .report import Violation, as_num as _num, as_str as _str, fmt as _fmt, names as _names
from .report import violation as _v

_TRACKERS = ("model.use_te_rng_tracker", "rng.te_rng_tracker")


def _r19(v: View) -> list[Violation]:
    model, rng = v.cfg.model.use_te_rng_tracker, v.cfg.rng.te_rng_tracker
    if model is rng or not explicit_keys(v.cfg) >= set(_TRACKERS):
        return []
    return [_v("R19", _TRACKERS, f"model.use_te_rng_tracker={_fmt(model)} and rng.te_rng_tracker={_fmt(rng)} are "
               "both set by you and disagree: they are one switch (the graph-safe RNG tracker).",
               "set both to the same value, or set only one (the other follows).")]


COMPILE_COMPONENTS = ("model", "loss")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
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
            if unsupported and _differs(value, default)]



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
# (models/moe_parallel.py; expert parallelism is R31).
DISPATCHERS = ("allgather", "alltoall")


def _r23(v: View) -> list[Violation]:
    value = v.cfg.model.moe_token_dispatcher_type
    if _str(value) in DISPATCHERS:
        return []
    return [_v("R23", ["model.moe_token_dispatcher_type"], f"model.moe_token_dispatcher_type={_fmt(value)} is not "
               "implemented: graphstep dispatches tokens locally, which is what allgather and alltoall do on one "
               "expert-parallel rank, and across expert-parallel ranks all-gathers them (allgather) or sends them to "
               "their experts' ranks (alltoall; R31).",
               "set model.moe_token_dispatcher_type=allgather (its default) or alltoall.")]


def _r24(v: View) -> list[Violation]:
    t = v.cfg.train
    if t.skip_step_on_nan is not True or t.check_for_nan_on_device is not False:
        return []
    return [_v("R24", ["train.skip_step_on_nan", "train.check_for_nan_on_device"], "train.skip_step_on_nan=true "
               "needs the device-side flag it skips on, but train.check_for_nan_on_device=false.",
               "set train.check_for_nan_on_device=true, or train.skip_step_on_nan=false.")]


RUN_RULES = (("R18", _r18), ("R19", _r19), ("R20", _r20), ("R21", _r21), ("R22", _r22), ("R23", _r23),
             ("R24", _r24))
