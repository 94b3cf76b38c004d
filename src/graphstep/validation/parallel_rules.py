"""The layout rules R25-R27: tensor/sequence parallel (DTensor) and sharded data parallel (FSDP2).

Same shape as graph_rules.py (``_rN(view) -> list[Violation]``). The layout
itself -- which ranks form the data-parallel and tensor-parallel dimensions of
the device mesh, what each sharding strategy means -- is
training/parallel.py; these rules say which configurations it takes:

* R25 -- the layout fits the model and the world: the world size is a
  multiple of ``tensor_model_parallel_size``; heads, query groups, the MLP
  width and the vocabulary divide over the tensor-parallel ranks;
  ``sequence_parallel`` needs tensor parallelism;
* R26 -- the data-parallel sharding strategy is one FSDP2 implements;
* R27 -- what tensor parallelism and FSDP2 do not combine with yet: MoE and
  hybrid (Mamba) models, per-layer graphs with FSDP2, torch.compile and activation
  recompute; and a capture of the very first iteration (no warm-up step).
  Each is refused by name, never ignored.

docs/rules.md describes every rule with an example override and its fix.
"""

from __future__ import annotations

from graphstep.config import Config

from .graph_rules import View, _impl_f
from .report import Violation, as_int as _int, as_str as _str, fmt as _fmt
from .report import violation as _v

STRATEGIES = ("no_shard", "optim_grads", "optim_grads_params")


def tensor_parallel_size(cfg: Config) -> int:
    tp = _int(cfg.model.tensor_model_parallel_size)
    return tp if tp is not None and tp >= 1 else 1


def shards_data_parallel(cfg: Config) -> bool:
    """FSDP2 shards the data-parallel dimension (use_megatron_fsdp with a sharding strategy, or the distributed optimizer)."""
    d = cfg.ddp
    if d.use_megatron_fsdp is True:
        return _str(d.data_parallel_sharding_strategy) != "no_shard"
    return d.use_distributed_optimizer is True or cfg.optimizer.use_distributed_optimizer is True


def data_parallel_size(cfg: Config, world_size: int) -> int:
    return max(1, max(world_size, 1) // tensor_parallel_size(cfg))


def _r25(v: View) -> list[Violation]:
    m, out = v.cfg.model, []
    tp = _int(m.tensor_model_parallel_size)
    if tp is None or tp < 1:
        return [_v("R25", ["model.tensor_model_parallel_size"], f"model.tensor_model_parallel_size={_fmt(tp)} is not "
                   "a positive number of ranks.", "set model.tensor_model_parallel_size=1 or more.")]
    world = max(v.world_size, 1)
    if world % tp:
        out.append(_v("R25", ["model.tensor_model_parallel_size"], f"model.tensor_model_parallel_size={tp} does not "
                      f"divide the world size {world} (torchrun's WORLD_SIZE): the device mesh is data-parallel x "
                      "tensor-parallel ranks.", f"launch a multiple of {tp} processes, or set "
                      f"model.tensor_model_parallel_size to a divisor of {world}."))
    if m.sequence_parallel is True and tp == 1:
        out.append(_v("R25", ["model.sequence_parallel", "model.tensor_model_parallel_size"], "model.sequence_parallel="
                      "true shards the sequence over the tensor-parallel ranks, but model.tensor_model_parallel_size=1.",
                      "set model.tensor_model_parallel_size=2 or more, or model.sequence_parallel=false."))
    if tp == 1:
        return out
    groups = m.num_query_groups if m.num_query_groups is not None else m.num_attention_heads
    sizes = [("model.num_attention_heads", m.num_attention_heads), ("model.num_query_groups", groups),
             ("model.ffn_hidden_size", m.ffn_hidden_size), ("model.vocab_size", m.vocab_size)]
    for name, value in sizes:
        n = _int(value)
        if n is not None and n % tp:
            out.append(_v("R25", [name, "model.tensor_model_parallel_size"], f"{name}={n} does not divide over "
                          f"model.tensor_model_parallel_size={tp} ranks: each rank holds an equal share.",
                          f"set model.tensor_model_parallel_size to a divisor of {n}."))
    seq = _int(m.seq_length)
    if m.sequence_parallel is True and seq is not None and seq % tp:
        out.append(_v("R25", ["model.seq_length", "model.sequence_parallel"], f"model.seq_length={seq} does not divide "
                      f"over {tp} sequence-parallel ranks.", f"set model.seq_length to a multiple of {tp}."))
    return out


def _r26(v: View) -> list[Violation]:
    d = v.cfg.ddp
    strategy = _str(d.data_parallel_sharding_strategy)
    if d.overlap_param_gather is True and not shards_data_parallel(v.cfg):
        return [_v("R26", ["ddp.overlap_param_gather", "ddp.use_megatron_fsdp", "ddp.use_distributed_optimizer"],
                   "ddp.overlap_param_gather=true overlaps the all-gather of sharded parameters, but the data-parallel "
                   "ranks hold whole replicas (no FSDP2).", "set ddp.use_distributed_optimizer=true (or "
                   "ddp.use_megatron_fsdp=true with a sharding strategy), or ddp.overlap_param_gather=false.")]
    if strategy in STRATEGIES:
        return []
    why = ("optim (ZeRO-1) keeps gradients whole, which FSDP2 does not: it reduce-scatters them with the optimizer "
           "state" if strategy == "optim" else f"it is not a strategy ({', '.join(STRATEGIES)}, optim)")
    return [_v("R26", ["ddp.data_parallel_sharding_strategy"], f"ddp.data_parallel_sharding_strategy={_fmt(strategy)} "
               f"is not implemented: {why}.", "set ddp.data_parallel_sharding_strategy=optim_grads (ZeRO-2) or "
               "optim_grads_params (ZeRO-3).")]


def _r27(v: View) -> list[Violation]:
    cfg, m = v.cfg, v.cfg.model
    tp, fsdp = tensor_parallel_size(cfg), shards_data_parallel(cfg)
    if tp == 1 and not fsdp:
        return []
    what = " and ".join(x for x in (f"model.tensor_model_parallel_size={tp}" if tp > 1 else "",
                                    "FSDP2 (" + _fsdp_f(cfg) + ")" if fsdp else "") if x)
    fields = (["model.tensor_model_parallel_size"] if tp > 1 else []) + (_fsdp_fields(cfg) if fsdp else [])
    out = []

    def refuse(field: str, value: str, fix: str) -> None:
        out.append(_v("R27", [field, *fields], f"{what} with {value} is not implemented.", fix))

    if m.num_moe_experts is not None:
        refuse("model.num_moe_experts", f"model.num_moe_experts={_fmt(m.num_moe_experts)} (an MoE model)",
               "train MoE models with replicated data parallel (the default ddp settings, tensor_model_parallel_size=1).")
    if m.hybrid_override_pattern is not None:
        refuse("model.hybrid_override_pattern", "a hybrid (Mamba) model", "train hybrid models with replicated data "
               "parallel (the default ddp settings, tensor_model_parallel_size=1).")
    if v.per_layer and fsdp:
        out.append(_v("R27", ["model.cuda_graph_impl", *_fsdp_fields(cfg)], f"FSDP2 ({_fsdp_f(cfg)}) with per-layer "
                      f"graphs ({_impl_f(v)}) is not implemented: FSDP2 gathers each layer's parameters into memory "
                      "it allocates anew every step, and a layer graph reads the addresses it was captured with.",
                      "set model.cuda_graph_impl=full_iteration (the gathers are inside the graph), or none."))
    warmup = _int(m.cuda_graph_warmup_steps)
    if v.impl == "full_iteration" and warmup == 0:
        refuse("model.cuda_graph_warmup_steps", "model.cuda_graph_warmup_steps=0 (the first iteration would be "
               "captured: FSDP2 initialises lazily and DTensor builds its sharding plans on the first step, and "
               "neither may happen inside a capture)", "set model.cuda_graph_warmup_steps=1 or more.")
    if cfg.compile.enable is True:
        refuse("compile.enable", "compile.enable=true", "set compile.enable=false.")
    if m.recompute_granularity is not None:
        refuse("model.recompute_granularity", f"model.recompute_granularity={_fmt(m.recompute_granularity)}",
               "set model.recompute_granularity=null.")
    return out


def _fsdp_f(cfg: Config) -> str:
    d = cfg.ddp
    if d.use_megatron_fsdp is True:
        return f"ddp.use_megatron_fsdp=true, ddp.data_parallel_sharding_strategy={_str(d.data_parallel_sharding_strategy)}"
    return ("ddp" if d.use_distributed_optimizer is True else "optimizer") + ".use_distributed_optimizer=true"


def _fsdp_fields(cfg: Config) -> list[str]:
    if cfg.ddp.use_megatron_fsdp is True:
        return ["ddp.use_megatron_fsdp", "ddp.data_parallel_sharding_strategy"]
    return ["ddp.use_distributed_optimizer" if cfg.ddp.use_distributed_optimizer is True
            else "optimizer.use_distributed_optimizer"]


PARALLEL_RULES = (("R25", _r25), ("R26", _r26), ("R27", _r27))
