"""The layout rules R25-R31: tensor/sequence, pipeline and expert parallel, and sharded data parallel (FSDP2).

Same shape as graph_rules.py (``_rN(view) -> list[Violation]``). The layout
itself -- which ranks form the data-parallel and tensor-parallel dimensions of
the device mesh, what each sharding strategy means -- is
parallel/; these rules say which configurations it takes:

* R25 -- the layout fits the model and the world: the world size is a
  multiple of ``tensor_model_parallel_size``; heads, query groups, the MLP
  width, the vocabulary and a hybrid model's Mamba heads and groups divide
  over the tensor-parallel ranks;
  ``sequence_parallel`` needs tensor parallelism;
* R26 -- the data-parallel sharding strategy is one FSDP2 implements;
* R27 -- what tensor parallelism and FSDP2 do not combine with yet: MoE
  models with both, or with FSDP2 without expert parallel; per-layer graphs with FSDP2 ZeRO-3 (their gathered
  parameters stay allocated), torch.compile with an MoE model under FSDP2,
  compile with graphs over tensor, pipeline, context or expert parallel
  (compile over a layout compiles each decoder layer: parallel/compile.py;
  inside graphs over FSDP2 alone it is checked on a GPU);
  and a capture of the very first iteration (no warm-up step). Each is
  refused by name, never ignored. Activation recompute,
  selective or full, combines with both: a recomputed region re-runs DTensor's
  collectives inside the backward, and a layer full recompute re-enters is
  gathered by FSDP2 as for a forward (its pre-forward hook leaves a layer its
  pre-backward hook gathered as it is), so the backward computes the bits of
  the run without recompute, eagerly or inside the full-iteration graph (R15
  and R35 keep dropout out of recomputed regions, as on one process);
* R28 -- the pipeline layout fits the model and the world: the world size is
  a multiple of pipeline x tensor-parallel ranks, the decoder layers split
  over the stages (Megatron Bridge's ``num_layers_in_first/last_pipeline_stage``,
  ``pipeline_model_parallel_layout``, ``account_for_embedding/loss_in_pipeline_split``:
  validation/stage_split.py), 1F1B has at least as many micro-batches per step
  as stages, the schedule is one graphstep runs, virtual stages (interleaved
  schedules) have at least 2 pipeline ranks and micro-batches per step in
  rounds of ``pp``, and what is not implemented (another activation dtype,
  tied embeddings across more than 2 stages or with virtual stages, GPipe or
  per-layer graphs under interleaved zero bubble) is refused -- virtual
  stages combine with tensor (+ sequence) parallel, FSDP2, or both, with
  activation recompute, and with MoE and hybrid models;
* R29 -- what pipeline parallelism does not combine with yet (shape buckets,
  ...; tensor parallelism, FSDP2, MoE and hybrid models -- an MoE model over
  tensor, context or expert x tensor parallel too --, recompute, compile (R27)
  and the overlapped gradient reduction combine with it);
* R30 -- context parallel: the layout fits the world and the sequence (2 x cp
  equal chunks, and each rank's share divides over sequence-parallel ranks),
  the communication types graphstep implements (``all_gather``, ``a2a``),
  a hybrid model's Mamba heads and groups divide over the ranks, and what it
  does not combine with yet (sequence-length buckets) is refused (expert
  parallel combines: each context-parallel rank's MoE blocks exchange their
  chunks' tokens with the expert-parallel ranks holding the same chunks);
  pipeline stages, plain or
  virtual, combine with it (each stage's attention gathers over its own
  context-parallel ranks; the last stage's loss is ContextParallel's);
* R31 -- expert parallel: an MoE model whose experts and data-parallel ranks
  divide over the expert-parallel ranks, dispatched the ways graphstep
  implements (``allgather``: all-gather, dropless and sync-free; ``alltoall``:
  Megatron's all-to-all, whose host sync R11 keeps out of graphs), with
  tensor parallel or FSDP2 (``allgather``), over pipeline stages (``allgather``
  over replicated data parallel, eager, the whole iteration graphed or per
  layer, with or without recompute); expert tensor parallel
  (``expert_tensor_parallel_size`` 1 or the tensor-parallel size, null
  meaning the latter as in Megatron: dropless, sync-free, the MoE block
  graphed as one); and what it does not combine with yet.

docs/rules.md describes every rule with an example override and its fix.
"""

from __future__ import annotations

from typing import Any

from graphstep.config import Config

from .graph_rules import View, _dispatcher, _impl_f
from .report import Violation, as_int as _int, as_str as _str, fmt as _fmt
from .report import violation as _v
from .stage_split import StageSplitError, nearest_layout, split_chunks, virtual_stages

STRATEGIES = ("no_shard", "optim_grads", "optim_grads_params")
INTERLEAVED_SCHEDULES = ("interleaved_1f1b", "interleaved_zero_bubble")
PIPELINE_SCHEDULES = ("1f1b", "gpipe", *INTERLEAVED_SCHEDULES)


def tensor_parallel_size(cfg: Config) -> int:
    tp = _int(cfg.model.tensor_model_parallel_size)
    return tp if tp is not None and tp >= 1 else 1


def shards_data_parallel(cfg: Config) -> bool:
    """FSDP2 shards the data-parallel dimension (use_megatron_fsdp with a sharding strategy, or the distributed optimizer)."""
    d = cfg.ddp
    if d.use_megatron_fsdp is True:
        return _str(d.data_parallel_sharding_strategy) != "no_shard"
    return d.use_distributed_optimizer is True or cfg.optimizer.use_distributed_optimizer is True


def pipeline_parallel_size(cfg: Config) -> int:
    pp = _int(cfg.model.pipeline_model_parallel_size)
    return pp if pp is not None and pp >= 1 else 1


def context_parallel_size(cfg: Config) -> int:
    cp = _int(cfg.model.context_parallel_size)
    return cp if cp is not None and cp >= 1 else 1


def data_parallel_size(cfg: Config, world_size: int) -> int:
    """The data-parallel ranks (each reads its own samples): the world over pipeline x context x tensor ranks."""
    model_parallel = tensor_parallel_size(cfg) * pipeline_parallel_size(cfg) * context_parallel_size(cfg)
    return max(1, max(world_size, 1) // model_parallel)


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
    if m.hybrid_override_pattern is not None and "M" in str(m.hybrid_override_pattern):
        heads, mamba_groups = _mamba_heads(m), _int(m.mamba_num_groups)
        # each rank runs its share of the Mamba heads and whole groups of B and C (Megatron asks the same)
        for name, n in (("model.mamba_head_dim", heads), ("model.mamba_num_groups", mamba_groups)):
            if n is not None and n % tp:
                what = f"the {n} Mamba heads (2 x hidden_size / model.mamba_head_dim) do not" \
                    if name.endswith("dim") else f"model.mamba_num_groups={n} does not"
                out.append(_v("R25", [name, "model.tensor_model_parallel_size"], f"{what} divide over "
                              f"model.tensor_model_parallel_size={tp} ranks: each rank runs an equal share of the "
                              "heads and whole groups of B and C.", f"set {name} so that it divides by {tp}, or "
                              f"model.tensor_model_parallel_size to a divisor of {n}."))
    seq = _int(m.seq_length)
    if m.sequence_parallel is True and seq is not None and seq % tp:
        out.append(_v("R25", ["model.seq_length", "model.sequence_parallel"], f"model.seq_length={seq} does not divide "
                      f"over {tp} sequence-parallel ranks.", f"set model.seq_length to a multiple of {tp}."))
    elif m.num_moe_experts is not None and seq is not None and seq % tp:
        out.append(_v("R25", ["model.seq_length", "model.num_moe_experts"], f"model.seq_length={seq} does not divide "
                      f"over {tp} tensor-parallel ranks: each runs the MoE blocks on its share of the sequence.",
                      f"set model.seq_length to a multiple of {tp}."))
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
    return _r27_sharded(v) + _compiled_layers_over_a_layout(v)


def _r27_sharded(v: View) -> list[Violation]:
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

    ep = _int(m.expert_model_parallel_size) or 1
    if m.num_moe_experts is not None and tp > 1 and fsdp:
        refuse("model.num_moe_experts", f"model.num_moe_experts={_fmt(m.num_moe_experts)} (an MoE model)",
               "train MoE models with tensor parallel over replicated data parallel (the default ddp settings), or "
               "with FSDP2 and model.tensor_model_parallel_size=1.")
    elif m.num_moe_experts is not None and fsdp and ep == 1:
        refuse("model.num_moe_experts", f"model.num_moe_experts={_fmt(m.num_moe_experts)} (an MoE model) and "
               "model.expert_model_parallel_size=1", "set model.expert_model_parallel_size=2 or more (FSDP2 shards "
               "the experts over the ranks holding the same ones), or train with replicated data parallel.")
    if v.per_layer and fsdp and _str(cfg.ddp.data_parallel_sharding_strategy) == "optim_grads_params" \
            and cfg.ddp.use_megatron_fsdp is True:
        out.append(_v("R27", ["model.cuda_graph_impl", *_fsdp_fields(cfg)], f"FSDP2 ({_fsdp_f(cfg)}) with per-layer "
                      f"graphs ({_impl_f(v)}) would not save the parameter memory ZeRO-3 is for: a layer graph "
                      "reads the gathered parameters where it was captured, so they stay gathered for the whole run.",
                      "set ddp.data_parallel_sharding_strategy=optim_grads (ZeRO-2: the same memory, without "
                      "gathering every layer twice per step), or model.cuda_graph_impl=full_iteration (the gathers "
                      "and frees are inside the graph)."))
    if cfg.compile.enable is True and fsdp and m.num_moe_experts is not None:
        refuse("compile.enable", "compile.enable=true and an MoE model (its experts are an FSDP2 module of their "
               "own inside each compiled layer, whose gathers Dynamo would trace)", "set compile.enable=false, or "
               "compile the MoE model over expert parallel with replicated data parallel.")
    warmup = _int(m.cuda_graph_warmup_steps)
    if v.impl == "full_iteration" and warmup == 0:
        refuse("model.cuda_graph_warmup_steps", "model.cuda_graph_warmup_steps=0 (the first iteration would be "
               "captured: FSDP2 initialises lazily and DTensor builds its sharding plans on the first step, and "
               "neither may happen inside a capture)", "set model.cuda_graph_warmup_steps=1 or more.")
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


def _r28(v: View) -> list[Violation]:
    m, t = v.cfg.model, v.cfg.train
    pp = _int(m.pipeline_model_parallel_size)
    if pp is None or pp < 1:
        return [_v("R28", ["model.pipeline_model_parallel_size"], f"model.pipeline_model_parallel_size={_fmt(pp)} is "
                   "not a positive number of stages.", "set model.pipeline_model_parallel_size=1 or more.")]
    out = []
    vpp = _int(m.virtual_pipeline_model_parallel_size)
    if m.virtual_pipeline_model_parallel_size is not None and (vpp is None or vpp < 1):
        out.append(_v("R28", ["model.virtual_pipeline_model_parallel_size"], "model.virtual_pipeline_model_parallel_"
                      f"size={_fmt(m.virtual_pipeline_model_parallel_size)} is not a positive number of stages per "
                      "rank.", "set model.virtual_pipeline_model_parallel_size=null, or 2 or more."))
        vpp = None
    chunks = virtual_stages(m.pipeline_model_parallel_layout, vpp, pp)
    schedule = _str(m.pipeline_schedule)
    if schedule not in PIPELINE_SCHEDULES:
        out.append(_v("R28", ["model.pipeline_schedule"], f"model.pipeline_schedule={_fmt(schedule)} is not a "
                      f"schedule graphstep runs ({', '.join(PIPELINE_SCHEDULES)}).", "set model.pipeline_schedule=1f1b "
                      "or gpipe" + (", or interleaved_zero_bubble" if chunks > 1 else "") + "."))
    out += _interleaved_violations(v, pp, chunks, schedule)
    if pp == 1:
        if m.pipeline_model_parallel_layout is not None:
            out += _stage_split_violations(m, pp, vpp)
        return out
    tp, world = tensor_parallel_size(v.cfg), max(v.world_size, 1)
    if world % (pp * tp):
        out.append(_v("R28", ["model.pipeline_model_parallel_size"], f"model.pipeline_model_parallel_size={pp} "
                      + (f"x tensor_model_parallel_size={tp} " if tp > 1 else "") + f"does not divide the world "
                      f"size {world} (torchrun's WORLD_SIZE): the device mesh is pipeline x data-parallel x "
                      "tensor-parallel ranks.", f"launch a multiple of {pp * tp} processes."))
    out += _stage_split_violations(m, pp, vpp)
    if m.pipeline_dtype is not None and _str(m.pipeline_dtype) not in (_str(m.params_dtype), "auto"):
        out.append(_v("R28", ["model.pipeline_dtype", "model.params_dtype"], f"model.pipeline_dtype="
                      f"{_fmt(m.pipeline_dtype)} differs from model.params_dtype={_fmt(m.params_dtype)}: stages "
                      "send the activations they compute, in the parameter dtype.", "set model.pipeline_dtype=null."))
    if m.share_embeddings_and_output_weights is True and pp > 2:
        out.append(_v("R28", ["model.share_embeddings_and_output_weights", "model.pipeline_model_parallel_size"],
                      f"model.share_embeddings_and_output_weights=true ties the first stage's embedding to the last "
                      f"stage's output layer, which is implemented for 2 pipeline stages, not {pp}.",
                      "set model.pipeline_model_parallel_size=2, or model.share_embeddings_and_output_weights=false."))
    mbs, gbs = _int(t.micro_batch_size), _int(t.global_batch_size)
    if schedule == "1f1b" and chunks == 1 and mbs and gbs and mbs > 0:
        per_step = gbs // (mbs * data_parallel_size(v.cfg, world))
        if per_step < pp:
            out.append(_v("R28", ["model.pipeline_schedule", "train.global_batch_size", "train.micro_batch_size"],
                          f"the 1F1B schedule needs at least as many micro-batches per step as stages: "
                          f"{per_step} micro-batches, {pp} stages.", f"raise train.global_batch_size to "
                          f"{pp * mbs * data_parallel_size(v.cfg, world)} or more, or set model.pipeline_schedule=gpipe."))
    return out


SPLIT_FIELDS = ("model.num_layers_in_first_pipeline_stage", "model.num_layers_in_last_pipeline_stage",
                "model.pipeline_model_parallel_layout", "model.account_for_embedding_in_pipeline_split",
                "model.account_for_loss_in_pipeline_split", "model.virtual_pipeline_model_parallel_size")


def _stage_split_violations(m: Any, pp: int, vpp: int | None) -> list[Violation]:
    """The decoder layers split over the pipeline's stages as the split fields say (validation/stage_split.py)."""
    layers = _int(m.num_layers)
    if layers is None:
        return []
    first, last = _int(m.num_layers_in_first_pipeline_stage), _int(m.num_layers_in_last_pipeline_stage)
    try:
        split_chunks(layers, pp, vpp=vpp, first=first, last=last, layout=m.pipeline_model_parallel_layout,
                     account_for_embedding=m.account_for_embedding_in_pipeline_split is True,
                     account_for_loss=m.account_for_loss_in_pipeline_split is True)
    except StageSplitError as e:
        defaults = {"model.account_for_embedding_in_pipeline_split": False,
                    "model.account_for_loss_in_pipeline_split": False}
        set_fields = [f for f in SPLIT_FIELDS if getattr(m, f.split(".")[1]) not in (None, defaults.get(f))]
        stages = pp * virtual_stages(m.pipeline_model_parallel_layout, vpp, pp)
        near = nearest_layout(layers, stages)
        fix = (f"the nearest split that works: model.pipeline_model_parallel_layout=\"{near}\" (the {layers} layers "
               f"as evenly as {stages} stages allow) with the other split fields unset" if near is not None else
               f"fewer stages than {layers} layers: lower model.pipeline_model_parallel_size or the virtual stages")
        return [_v("R28", ["model.num_layers", "model.pipeline_model_parallel_size", *set_fields], f"{e}.",
                   f"{fix}; or choose the split fields (docs/parallel.md) so that the layers divide.")]
    return []


def _interleaved_violations(v: View, pp: int, chunks: int, schedule: str) -> list[Violation]:
    """Virtual stages (interleaved schedules): what they need and what they do not combine with yet."""
    m, t, out = v.cfg.model, v.cfg.train, []
    vfield = ["model.virtual_pipeline_model_parallel_size"] if m.pipeline_model_parallel_layout is None \
        else ["model.pipeline_model_parallel_layout"]
    if chunks == 1:
        if schedule in INTERLEAVED_SCHEDULES:
            out.append(_v("R28", ["model.pipeline_schedule", *vfield], f"model.pipeline_schedule={schedule} "
                          "interleaves the virtual stages of each rank, but each rank holds one stage.",
                          "set model.virtual_pipeline_model_parallel_size=2 or more, or model.pipeline_schedule=1f1b."))
        return out
    what = f"{chunks} virtual stages per pipeline rank ({'='.join([vfield[0], _fmt(getattr(m, vfield[0][6:]))])})"
    if pp == 1:
        out.append(_v("R28", ["model.pipeline_model_parallel_size", *vfield], f"{what} with "
                      "model.pipeline_model_parallel_size=1: interleaving needs at least 2 pipeline ranks.",
                      "set model.pipeline_model_parallel_size=2 or more, or model.virtual_pipeline_model_parallel_"
                      "size=null."))
        return out
    if schedule == "gpipe":
        out.append(_v("R28", ["model.pipeline_schedule", *vfield], f"{what} with model.pipeline_schedule=gpipe is "
                      "not implemented: the interleaved schedules are 1F1B and zero bubble.",
                      "set model.pipeline_schedule=1f1b (interleaved 1F1B) or interleaved_zero_bubble."))
    mbs, gbs = _int(t.micro_batch_size), _int(t.global_batch_size)
    if mbs and gbs and mbs > 0:
        dp = data_parallel_size(v.cfg, max(v.world_size, 1))
        per_step = gbs // (mbs * dp)
        if per_step % pp:
            out.append(_v("R28", [*vfield, "train.global_batch_size", "train.micro_batch_size"], f"{what}: the "
                          f"interleaved schedule runs the micro-batches in rounds of {pp} (one per pipeline rank), "
                          f"and {per_step} micro-batches per step are not a multiple of {pp}.",
                          f"set train.global_batch_size to a multiple of {pp * mbs * dp}."))
    if m.share_embeddings_and_output_weights is True:
        out.append(_v("R28", ["model.share_embeddings_and_output_weights", *vfield], f"{what} with "
                      "model.share_embeddings_and_output_weights=true is not implemented (the tied copies live in "
                      "two chunks).", "set model.share_embeddings_and_output_weights=false, or "
                      "model.virtual_pipeline_model_parallel_size=null."))
    if v.per_layer and schedule == "interleaved_zero_bubble":
        out.append(_v("R28", ["model.cuda_graph_impl", "model.pipeline_schedule", *vfield], f"{what} with "
                      f"model.pipeline_schedule=interleaved_zero_bubble and per-layer graphs ({_impl_f(v)}) is not "
                      "implemented: a layer's backward graph computes its input and weight gradients in one replay, "
                      "so zero bubble's weight gradients, summed later in param.grad, would be summed in the graph "
                      "per micro-batch instead (other bits with bf16 parameters) and deferred nowhere.",
                      "set model.pipeline_schedule=interleaved_1f1b (per-layer graphs), or "
                      "model.cuda_graph_impl=full_iteration (zero bubble in one graph per rank)."))
    return out


def _r29(v: View) -> list[Violation]:
    cfg, m = v.cfg, v.cfg.model
    pp = pipeline_parallel_size(cfg)
    if pp == 1:
        return []
    out = []

    def refuse(fields: list[str], value: str, fix: str) -> None:
        out.append(_v("R29", [*fields, "model.pipeline_model_parallel_size"], f"model.pipeline_model_parallel_size="
                      f"{pp} with {value} is not implemented.", fix))

    warmup = _int(m.cuda_graph_warmup_steps)
    if v.impl == "full_iteration" and warmup == 0:
        refuse(["model.cuda_graph_warmup_steps"], "model.cuda_graph_warmup_steps=0 (the first step infers the shapes "
               "the stages exchange, on the host, which may not happen inside a capture)",
               "set model.cuda_graph_warmup_steps=1 or more.")
    if v.per_layer and warmup is not None and warmup < 2:
        refuse(["model.cuda_graph_warmup_steps"], f"per-layer graphs and model.cuda_graph_warmup_steps={warmup} (the "
               "layer graphs take their order and micro-batches in flight from the last warm-up step, and the first "
               "step also runs torch's shape inference, an extra forward of every layer)",
               "set model.cuda_graph_warmup_steps=2 or more.")
    if cfg.data.seq_length_buckets is not None:
        refuse(["data.seq_length_buckets"], "data.seq_length_buckets (the stages exchange one fixed shape)",
               "set data.seq_length_buckets=null.")
    if m.cuda_graph_retain_backward_graph is True:
        refuse(["model.cuda_graph_retain_backward_graph"], "model.cuda_graph_retain_backward_graph=true (torch's "
               "schedule runs the backward, without retain_graph)", "set model.cuda_graph_retain_backward_graph=false.")
    return out


CP_COMM_TYPES = ("all_gather", "p2p", "a2a", "a2a+p2p")  # Megatron Core's; graphstep implements all_gather, a2a


def _r30(v: View) -> list[Violation]:
    cfg, m = v.cfg, v.cfg.model
    cp = _int(m.context_parallel_size)
    if cp is None or cp < 1:
        return [_v("R30", ["model.context_parallel_size"], f"model.context_parallel_size={_fmt(cp)} is not a "
                   "positive number of ranks.", "set model.context_parallel_size=1 or more.")]
    out = _cp_comm_type_violations(m, cp)
    if cp == 1:
        return out
    field = "model.context_parallel_size"

    def refuse(fields: list[str], why: str, fix: str) -> None:
        out.append(_v("R30", [*fields, field], f"model.context_parallel_size={cp}: {why}", fix))

    tp, pp, world = tensor_parallel_size(cfg), pipeline_parallel_size(cfg), max(v.world_size, 1)
    if world % (pp * cp * tp):
        refuse([f for f, n in (("model.pipeline_model_parallel_size", pp), ("model.tensor_model_parallel_size", tp))
                if n > 1], (f"{pp} pipeline-stage x " if pp > 1 else "") + f"{cp} context-parallel" + (
            f" x {tp} tensor-parallel" if tp > 1 else "") + f" ranks do not divide the world size {world} "
            "(torchrun's WORLD_SIZE): the device mesh is pipeline-stage x data-parallel x context-parallel x "
            "tensor-parallel ranks.", f"launch a multiple of {pp * cp * tp} processes.")
    seq = _int(m.seq_length)
    if seq is not None and seq % (2 * cp):
        refuse(["model.seq_length"], f"model.seq_length={seq} does not cut into 2 x {cp} equal chunks (each rank "
               f"holds chunk r and its mirror 2 x {cp} - 1 - r, which balances causal attention).",
               f"set model.seq_length to a multiple of {2 * cp}.")
    elif seq is not None and m.sequence_parallel is True and (seq // cp) % tp:
        refuse(["model.seq_length", "model.sequence_parallel"], f"each rank's {seq // cp} tokens of "
               f"model.seq_length={seq} do not divide over {tp} sequence-parallel ranks.",
               f"set model.seq_length to a multiple of {2 * cp * tp}.")
    others = [(cfg.data.seq_length_buckets is not None, ["data.seq_length_buckets"], "data.seq_length_buckets "
               "(every bucket would need its own chunking)", "set data.seq_length_buckets=null (pad to "
               "model.seq_length).")]
    for on, fields, what, fix in others:
        if on:
            refuse(fields, f"context parallel with {what} is not implemented.", fix)
    if m.hybrid_override_pattern is not None and "M" in str(m.hybrid_override_pattern):
        out.extend(_v("R30", [*fields, field], f"model.context_parallel_size={cp}: {why}", fix)
                   for fields, why, fix in _mamba_heads_violations(m, cp))
    return out


def _mamba_heads(m: Any) -> int | None:
    """A hybrid model's Mamba heads (2 x hidden_size / mamba_head_dim); None when V24 refuses the shape."""
    hidden, head_dim = _int(m.hidden_size), _int(m.mamba_head_dim)
    if not (hidden and head_dim) or (2 * hidden) % head_dim:
        return None
    return 2 * hidden // head_dim


def _mamba_heads_violations(m: Any, cp: int) -> list[tuple[list[str], str, str]]:
    """A hybrid model's Mamba layers under context parallel exchange whole sequences of ``1 / cp`` of their heads
    (models/mamba.py): the heads divide over the ranks, and the groups of B and C too, or the ranks over them."""
    heads, groups, tp = _mamba_heads(m), _int(m.mamba_num_groups), _int(m.tensor_model_parallel_size) or 1
    if not (heads and groups) or heads % tp or groups % tp:
        return []  # V24 or R25 says what is wrong with the Mamba shape
    heads, groups = heads // tp, groups // tp  # what each tensor-parallel rank holds
    per_rank = f" of each of the {tp} tensor-parallel ranks" if tp > 1 else ""
    if heads % cp:
        return [(["model.mamba_head_dim", "model.hidden_size"], f"the {heads} Mamba heads{per_rank} (2 x hidden_size "
                 f"/ model.mamba_head_dim{f' / {tp}' if tp > 1 else ''}) do not divide over the {cp} "
                 "context-parallel ranks, each of which runs the scan along the whole sequences of its share of the "
                 "heads.", f"set model.mamba_head_dim so that 2 x hidden_size / mamba_head_dim is a multiple of "
                 f"{cp * tp}.")]
    if groups % cp and cp % groups:
        return [(["model.mamba_num_groups"], f"the {groups} groups of B and C{per_rank} (model.mamba_num_groups="
                 f"{groups * tp}) and the {cp} context-parallel ranks do not divide one another: each rank takes "
                 "whole groups of B and C, or shares one.",
                 f"set model.mamba_num_groups to a divisor or a multiple of {cp * tp}.")]
    return []


def _cp_comm_type_violations(m: Any, cp: int) -> list[Violation]:
    """model.cp_comm_type: one of Megatron's names (a string, or one per layer); all_gather or null with cp > 1."""
    kinds = m.cp_comm_type if isinstance(m.cp_comm_type, list) else [m.cp_comm_type]
    names = [_str(k) for k in kinds if k is not None]
    unknown = [n for n in names if n not in CP_COMM_TYPES]
    if unknown:
        return [_v("R30", ["model.cp_comm_type"], f"model.cp_comm_type={_fmt(m.cp_comm_type)} is not a context-"
                   f"parallel communication type ({', '.join(CP_COMM_TYPES)}).", "set model.cp_comm_type=all_gather "
                   "(or null).")]
    other = sorted({n for n in names if n not in ("all_gather", "a2a")})
    if cp == 1:
        return []
    fields = ["model.cp_comm_type", "model.context_parallel_size"]
    if other:
        why = {"p2p": "p2p (ring attention: key/value chunks passed around the ring, overlapped with attention)",
               "a2a+p2p": "a2a+p2p (hierarchical: all-to-all inside, ring across)"}
        return [_v("R30", fields, f"model.cp_comm_type={_fmt(m.cp_comm_type)}: {', '.join(why[n] for n in other)} "
                   "is not implemented; graphstep's context parallel all-gathers the keys and values of every rank "
                   "inside attention (all_gather), or exchanges heads for sequence by all-to-all (a2a, Ulysses).",
                   "set model.cp_comm_type=all_gather (or null, which means all_gather), or a2a.")]
    if "a2a" not in names:
        return []
    if len(set(kinds)) > 1:
        return [_v("R30", fields, f"model.cp_comm_type={_fmt(m.cp_comm_type)} mixes a2a with another type over the "
                   "layers, which is not implemented (one type for every layer).",
                   "set model.cp_comm_type=a2a, or all_gather.")]
    tp = _int(m.tensor_model_parallel_size) or 1
    heads = _int(m.num_attention_heads)
    groups = _int(m.num_query_groups) or heads
    if heads is not None and groups is not None and (heads % (tp * cp) or groups % (tp * cp)):
        return [_v("R30", [*fields, "model.num_attention_heads", "model.num_query_groups"], "model.cp_comm_type=a2a "
                   f"splits each tensor-parallel rank's heads over the {cp} context-parallel ranks, but "
                   f"model.num_attention_heads={heads} and model.num_query_groups={groups} (key/value heads) do not "
                   f"both divide by {tp} tensor-parallel x {cp} context-parallel ranks.",
                   "set model.cp_comm_type=all_gather, or a head count and query-group count divisible by "
                   f"{tp * cp}.")]
    return []


def _r31(v: View) -> list[Violation]:
    cfg, m = v.cfg, v.cfg.model
    ep = _int(m.expert_model_parallel_size)
    out = []
    out += _expert_tensor_parallel(v)
    if ep is None or ep < 1:
        return out + [_v("R31", ["model.expert_model_parallel_size"], f"model.expert_model_parallel_size={_fmt(ep)} "
                         "is not a positive number of ranks.", "set model.expert_model_parallel_size=1 or more.")]
    if ep == 1:
        return out
    field = ["model.expert_model_parallel_size"]

    def refuse(fields: list[str], why: str, fix: str) -> None:
        out.append(_v("R31", [*fields, *field], f"model.expert_model_parallel_size={ep}: {why}", fix))

    experts = _int(m.num_moe_experts)
    if experts is None:
        refuse(["model.num_moe_experts"], "expert parallel needs an MoE model (model.num_moe_experts is null).",
               "set model.num_moe_experts, or model.expert_model_parallel_size=1.")
    elif experts % ep:
        refuse(["model.num_moe_experts"], f"model.num_moe_experts={experts} does not divide over {ep} ranks.",
               f"set model.expert_model_parallel_size to a divisor of {experts}.")
    dp = data_parallel_size(cfg, v.world_size)
    if dp % ep:
        refuse([], f"the {dp} data-parallel rank(s) do not divide into groups of {ep} expert-parallel ranks "
               "(the expert-parallel ranks are data-parallel ranks that share their tokens).",
               f"launch a multiple of {ep} data-parallel ranks.")
    # Both dispatchers are implemented, flex runs as alltoall (R23 refuses any other value); alltoall's host sync
    # is R11's.
    dispatcher = _dispatcher(m)
    if m.moe_expert_capacity_factor is not None:
        refuse(["model.moe_expert_capacity_factor"], "expert parallel is dropless; a capacity factor is not "
               "implemented with it.", "set model.moe_expert_capacity_factor=null.")
    if m.moe_sync_free is False:
        refuse(["model.moe_sync_free"], "model.moe_sync_free=false is not implemented with expert parallel: "
               "allgather runs the sync-free grouped GEMM only, alltoall picks its GEMM from the sizes it reads.",
               "set model.moe_sync_free=true.")
    tp, fsdp = tensor_parallel_size(cfg), shards_data_parallel(cfg)
    if dispatcher == "alltoall" and tp > 1:
        refuse(["model.moe_token_dispatcher_type", "model.tensor_model_parallel_size"],
               f"the alltoall dispatcher with model.tensor_model_parallel_size={tp} is not implemented.",
               "set model.moe_token_dispatcher_type=allgather (the default).")
    if fsdp and v.covers("moe"):
        refuse([*v.cov, *_fsdp_fields(cfg)], f"per-layer graphs of the MoE block ({_impl_f(v)}) with FSDP2 "
               f"({_fsdp_f(cfg)}) are not implemented: the experts are an FSDP2 module of their own, sharded over "
               "the ranks holding them, whose all-gathers would not run when the block's graph replays.",
               "graph the attention only (model.cuda_graph_modules=[attn]), or model.cuda_graph_impl=full_iteration.")
    if dispatcher == "allgather" and v.per_layer and ({"moe_router", "moe_preprocess"} & set(v.names or ())):
        refuse([*v.cov, "model.moe_token_dispatcher_type"], "the moe_router and moe_preprocess scopes are not "
               "implemented with the allgather dispatcher: its block runs router, dispatch, experts and combine "
               "as one.", "graph the whole block (scope moe, or [] for the whole layer), or model.cuda_graph_impl="
               "full_iteration; or set model.moe_token_dispatcher_type=alltoall for Megatron's "
               "[attn,moe_router,moe_preprocess].")
    if cfg.ddp.overlap_grad_reduce is True and not fsdp:
        # FSDP2 reduce-scatters each layer's gradients (the experts' too) during the backward whatever the field says
        refuse(["ddp.overlap_grad_reduce"], "ddp.overlap_grad_reduce with expert parallel over replicated data "
               "parallel is not implemented: the expert and the other gradients are reduced over different groups "
               "after the backward.", "set ddp.overlap_grad_reduce=false, or shard with FSDP2 "
               "(ddp.use_distributed_optimizer=true), whose reduce-scatters overlap the backward.")
    return out


def _expert_tensor_parallel(v: View) -> list[Violation]:
    """``expert_tensor_parallel_size`` (null: the tensor-parallel size, as Megatron reads it): 1, or every
    tensor-parallel rank, whose experts are then split and whose MoE blocks exchange tokens by all-gather."""
    m, tp = v.cfg.model, tensor_parallel_size(v.cfg)
    field = ["model.expert_tensor_parallel_size"]
    etp = tp if m.expert_tensor_parallel_size is None else _int(m.expert_tensor_parallel_size)
    if etp not in (1, tp):
        return [_v("R31", [*field, "model.tensor_model_parallel_size"], "model.expert_tensor_parallel_size="
                   f"{_fmt(m.expert_tensor_parallel_size)}: the experts are split over 1 or all "
                   f"model.tensor_model_parallel_size={tp} tensor-parallel ranks.",
                   f"set model.expert_tensor_parallel_size=1 or {tp} (null means {tp}).")]
    if etp == 1 or m.num_moe_experts is None:
        return []
    what = (f"model.expert_tensor_parallel_size={_fmt(m.expert_tensor_parallel_size)}" +
            (f" (null: model.tensor_model_parallel_size={tp})" if m.expert_tensor_parallel_size is None else ""))
    out = []

    def refuse(fields: list[str], why: str, fix: str) -> None:
        out.append(_v("R31", [*fields, *field], f"{what} splits each expert over the tensor-parallel ranks: {why}",
                      f"{fix}, or set model.expert_tensor_parallel_size=1 (each tensor-parallel rank holds whole "
                      "experts)."))

    ffn = _int(m.moe_ffn_hidden_size) or _int(m.ffn_hidden_size)
    if ffn is not None and ffn % tp:
        refuse(["model.moe_ffn_hidden_size"], f"the experts' {ffn} hidden columns do not divide over {tp} ranks.",
               f"set model.moe_ffn_hidden_size to a multiple of {tp}")
    if m.moe_expert_capacity_factor is not None:
        refuse(["model.moe_expert_capacity_factor"], "it is dropless; a capacity factor is not implemented with it.",
               "set model.moe_expert_capacity_factor=null")
    if m.moe_sync_free is False:
        refuse(["model.moe_sync_free"], "it runs the sync-free grouped GEMM only.", "set model.moe_sync_free=true")
    if v.per_layer and ({"moe_router", "moe_preprocess"} & set(v.names or ())):
        refuse([*v.cov], "its MoE block (the allgather dispatcher over the tensor-parallel ranks, whichever "
               "model.moe_token_dispatcher_type says with one expert-parallel rank) runs router, dispatch, experts "
               "and combine as one, so the moe_router and moe_preprocess scopes are not implemented.",
               "graph the whole block (scope moe, or [] for the whole layer), or model.cuda_graph_impl=full_iteration")
    return out


def _compiled_layers_over_a_layout(v: View) -> list[Violation]:
    """Compile over a parallel layout compiles each decoder layer (parallel/compile.py), tested eagerly; inside
    graphs (the full-iteration graph, or per-layer graphs, which compile their scope modules instead) it is
    checked against the same compiled layout eager on a GPU over FSDP2 only (a one-rank mesh: compiled layers
    hold no collective, FSDP2's run eagerly around them); tensor, pipeline, context and expert parallel put
    collectives or transfers next to or inside the compiled code that one GPU cannot run."""
    cfg = v.cfg
    layout = [f for f, n in (("model.tensor_model_parallel_size", tensor_parallel_size(cfg)),
                             ("model.pipeline_model_parallel_size", pipeline_parallel_size(cfg)),
                             ("model.context_parallel_size", context_parallel_size(cfg)),
                             ("model.expert_model_parallel_size", _int(cfg.model.expert_model_parallel_size) or 1))
              if n > 1]
    if cfg.compile.enable is not True or not v.on or not layout:
        return []
    return [_v("R27", ["compile.enable", "model.cuda_graph_impl", *layout], f"compile.enable=true with graphs "
               f"({_impl_f(v)}) over a parallel layout is not implemented yet: the compiled layers inside graphs "
               "over tensor, pipeline, context or expert parallel have not been checked against eager on GPUs.",
               "set model.cuda_graph_impl=none (the layout's layers compiled, no graphs), or compile.enable=false "
               "(the layout graphed); over FSDP2 alone compile and graphs combine.")]


PARALLEL_RULES = (("R25", _r25), ("R26", _r26), ("R27", _r27), ("R28", _r28), ("R29", _r29), ("R30", _r30),
                  ("R31", _r31))
