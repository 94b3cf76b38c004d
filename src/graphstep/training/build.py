"""``build_run(cfg, options)``: one rank's run -- model, gradients, optimizer, steps and graphs -- built once.

The trainer (training/loop.py), the doctor (doctor/recipe.py) and the bench
(bench/harness.py) all build a run here, so what the doctor judges and what
the bench measures is what ``graphstep train`` runs: the same RNG tracker
(``model.use_te_rng_tracker``), the same data-parallel reducers, MoE hooks
and non-finite checks, the same graphs. What differs is in
:class:`RunOptions`: the device, the data-parallel ranks, the graph backend
(the process's for the device, or the doctor's), a ``restore`` callback that
loads a checkpoint, the capture-error hook and, for the bench, a compile mode.

``build_run`` is the one place the run is assembled, in a fixed order; its
comments say why each part comes where it does. The graph parts that are
policy (what an iteration reads, when layer graphs capture, a graph per
bucket) are in training/graphs.py; the mechanisms in cuda_graph/.

The data is not part of the run: the trainer, the doctor and the bench read
different data (a rank's shard, a few batches, pinned batches cycled).

:class:`Run` is what they get back; ``run.iteration(data)`` is one training
iteration (forward/backward of every micro-batch, optimizer step, MoE bias
update), ``run.close()`` frees the run's graphs -- and only them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import Config, ConfigError
from ..cuda_graph.backend import GraphBackend
from ..cuda_graph.full_iteration import CaptureErrorHook, CaptureOptions, GraphedStep
from ..cuda_graph.layers import apply_layer_graphs
from ..cuda_graph.registry import get_backend
from ..cuda_graph.rng import get_rng_tracker, initialize_rng_tracker
from ..cuda_graph.run_backend import RunBackend
from ..cuda_graph.settings import CudaGraphSettings, GraphImpl
from ..data.buckets import parse_buckets
from ..converters import fp8, lora
from ..models import build_model, resolve_dtype
from ..models.hf import load_hf_weights, load_peft_adapter
from ..validation import REPLAY_COMPILE_REASON, resolve_cuda_graph_settings
from ..parallel.compile import compile_mode_of, describe_compile
from ..parallel.data_parallel import grad_reducer
from ..parallel.fsdp import reshard_all
from ..parallel.parallelize import compile_by_layer, parallelize
from ..parallel.interleaved import InterleavedPipeline, directed_p2p_groups
from ..parallel.pipeline import Pipeline, TiedEmbeddingReducer, model_chunks, split_stage, tied_embedding_grad
from .checkpoint import load_pretrained
from .compile import CompileTimeReport
from .distributed import DataParallel
from .graphs import CaptureLayersAfterWarmup, GraphPerBucket, Runner, evaluating, on_device, over_micro_batches
from .moe_hooks import MoEHooks
from .optim import AdamW, GradBuffers, build_optimizer
from .step import EvalStep, PipelineEvalStep, PipelineTrainStep, TrainStep

log = logging.getLogger("graphstep")

Restore = Callable[[nn.Module, AdamW], int]


@dataclass(frozen=True)
class RunOptions:
    """What the trainer, the doctor and the bench each pass for a run of the same config."""

    device: torch.device
    dp: DataParallel | None = None  # this rank's place (default: one rank)
    settings: CudaGraphSettings | None = None  # the resolved graph settings (default: resolved from cfg here)
    backend: GraphBackend | None = None  # captures every graph (default: the process's backend for device)
    restore: Restore | None = None  # loads a checkpoint in place; returns the iteration to continue after
    compile_mode: str | None = None  # the bench's torch.compile mode (default: compile.mode with compile.enable)
    on_capture_error: CaptureErrorHook | None = None  # a failed capture is diagnosed here (the trainer: the doctor)


@dataclass
class Run:
    """One rank's built run; ``close()`` frees its graphs (harmless twice)."""

    cfg: Config
    settings: CudaGraphSettings
    device: torch.device
    dp: DataParallel
    model: nn.Module
    grads: GradBuffers
    optimizer: AdamW
    train_step: TrainStep
    eval_step: EvalStep
    moe: MoEHooks
    runner: Runner
    num_micro_batches: int
    start_iteration: int = 0  # what ``restore`` returned: the iteration to continue after

    @property
    def checks_nonfinite(self) -> bool:
        return self.cfg.train.check_for_nan_on_device

    def iteration(self, data: Iterator[Any]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """One training iteration: the training step's and the optimizer's (graph-owned) outputs."""
        out = self.runner.train_step(data)
        opt = self.runner.optimizer_step(out)
        if self.moe.enabled:
            self.moe.after_optimizer_step()  # eagerly, outside every graph (moe_hooks.py)
        return out, opt

    def nonfinite(self, out: dict[str, torch.Tensor], opt: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The iteration's device flag (loss or gradients not finite); None without the device check."""
        if not self.checks_nonfinite:
            return None
        return torch.maximum(out["nonfinite"], opt["found_nonfinite"])

    def close(self) -> None:
        self.runner.close()


def build_run(cfg: Config, options: RunOptions) -> Run:
    """Build one rank's run of ``cfg`` as ``options`` say; the order is fixed, each part needing the ones before.

    ``cfg`` is validated (``validation.resolve``): ``options.settings`` are its resolved settings, or resolved here.
    """
    device = options.device
    settings = options.settings if options.settings is not None else resolve_cuda_graph_settings(cfg)
    dp = options.dp if options.dp is not None else DataParallel()
    tr, buckets = cfg.train, parse_buckets(cfg)
    assert tr.check_for_nan_on_device or not tr.skip_step_on_nan, \
        "R24 guarantees train.skip_step_on_nan=true comes with train.check_for_nan_on_device=true"
    assert not (buckets and settings.per_layer), "R21 guarantees no data.seq_length_buckets with per-layer graphs"

    # 1. The model, after seeding the RNG tracker per rank (its initialisation draws from it); model.hf_path
    #    weights copied in and, with rng.data_parallel_random_init, rank 0's weights broadcast -- before step 3
    #    takes the fp32 master copy; with peft=lora the model is frozen and its adapters added (converters/lora.py),
    #    so steps 2-3 see only the adapters as trainable. A pipeline stage keeps its own layers.
    dtype = resolve_dtype(cfg.model.params_dtype, device)
    model = _build_model(cfg, device, dp, dtype)
    # 2. The layout's engines, in parallelize's order (parallel/parallelize.py: tensor parallel, context parallel,
    #    expert parallel, compile, FSDP2): they turn parameters into DTensors (FSDP2: fp32 shards), so they come
    #    before anything holds on to a parameter. torch.compile (compile.enable, or the bench's compile_mode) is
    #    one of them and comes before the layer graphs (step 5): it compiles the graphed modules' forwards, which
    #    the engine then keeps as the modules' own and patches over (parallel/compile.py). step_model is what the
    #    steps call.
    compile_mode = compile_mode_of(cfg, options.compile_mode)
    step_model = parallelize(model, dp.layout, dp.mesh, cfg, param_dtype=dtype, settings=settings,
                             compile_mode=compile_mode)
    # 3. Gradient buffers at fixed addresses (the graphs write them), the optimizer over them; restore loads a
    #    checkpoint in place before any graph exists, so warm-up and capture count from the resume iteration.
    grads = GradBuffers(model, dp.mesh)
    optimizer = build_optimizer(cfg, model, grads)
    start = options.restore(model, optimizer) if options.restore is not None else 0
    # FSDP2's FP8 all-gather (fp8_param_gather): the weights' scales, from the weights as built or loaded, then
    # rewritten after every optimizer step (step 7, inside the optimizer graph when there is one)
    fp8_gather = _fp8_gather_scales(cfg, model, dp)
    # 4. The training and evaluation steps: data-parallel reducers, MoE hooks, the non-finite flag, FP8 delayed
    #    scaling's end-of-step update of the amax histories and scales (inside the full-iteration graph), and the
    #    FP8 weight casts made once per step (dropped at the start of each training step, on the host).
    num_mb = tr.global_batch_size // (tr.micro_batch_size * dp.dp_size)  # per pipeline too
    # the expert-bias update sums the token counts over the ranks of this stage -- its data-parallel ranks and the
    # tensor- and context-parallel ranks a MoE block's tokens are split over (each stage holds other MoE layers;
    # without stages they are the whole world, the default group)
    moe = MoEHooks(model, num_mb, group=dp.stage_group, token_shares=dp.layout.tp,
                   stages=dp.pp_group, moe_model=cfg.model.num_moe_experts is not None)
    weight_casts = _fp8_weight_casts(cfg, settings, model, dp, compiled=compile_mode is not None)
    train_step, eval_step = _build_steps(cfg, settings, model, step_model, grads, moe, dp, device, num_mb,
                                         weight_casts)
    if _overwrites_gradients(train_step, settings, model):
        grads.overwrite_first()  # a step's first gradients copied into the buffers, not added to zeros
    if compile_mode is not None:
        train_step = CompileTimeReport(train_step, describe_compile(
            compile_mode, settings, by_layer=compile_by_layer(dp.layout), backend=cfg.compile.backend))

    # 5-7. The graphs, all made through this run's view of the backend: close() frees these and no others.
    backend = _run_backend(settings, options.backend, device, compiled=compile_mode is not None)
    capture = CaptureOptions(warmup_steps=settings.warmup_steps, generators=get_rng_tracker().generators,
                             shared_pool=settings.use_single_mempool, on_failure=settings.on_failure,
                             on_capture_error=options.on_capture_error)
    graphs: list[Any] = []
    # 5. Per-layer graphs patch the selected modules' forward in place: after compile (step 2), whose compiled
    #    forwards the engine keeps as the modules' own; the steps of step 4 look the forward up at each call,
    #    so they run the graphed modules from now on. Before step 6, which wraps the iteration that warms the
    #    layer graphs up and captures them.
    #    A pipeline rank's chunks (virtual stages) share the model's layers and each counts its own micro-batches.
    pipeline = getattr(train_step, "pipeline", None)
    #    Runs replayed as one graph span layers unless a data-parallel reduction overlaps the backward (it starts
    #    a bucket once its layers' gradients are in; a run's come at the end of its backward).
    layers = apply_layer_graphs(model, settings, backend, generators=capture.generators,
                                chunks=pipeline.chunk_models() if pipeline is not None else (),
                                across_layers=not (dp.enabled and cfg.ddp.overlap_grad_reduce)) \
        if settings.per_layer else None
    # 6. The iteration: forward/backward of all micro-batches, as one graph with full_iteration (never together
    #    with step 5: R4) and a separate graph for evaluation. train_step holds the data-parallel reductions, so
    #    the ranks meet before each capture of these graphs (a barrier; Megatron does the same).
    if settings.full_iteration:
        barrier = dp.barrier if dp.enabled else None
        train, evaluate_batches, graphs = _full_iteration_graphs(
            train_step, eval_step, backend, replace(capture, input_device=device, before_capture=barrier),
            num_mb, buckets)
    else:
        train = over_micro_batches(on_device(train_step, device), num_mb)
        evaluate_batches = on_device(eval_step, device)
        if layers is not None:
            train = CaptureLayersAfterWarmup(train, layers, settings.warmup_steps)
            graphs = [train, layers]
    # 7. The optimizer graph last: it reads the training step's outputs (the non-finite flag) and is captured
    #    after the training graph, into the same pool.
    optimizer_step = _optimizer_step(optimizer, skip_on_nonfinite=tr.skip_step_on_nan,
                                     after=fp8_gather.update if fp8_gather is not None else None)
    if settings.optimizer_graph and settings.enabled:
        optimizer_step = GraphedStep(optimizer_step, backend, capture, name="optimizer")
        graphs.append(optimizer_step)
    if settings.impl is GraphImpl.TRANSFORMER_ENGINE:
        log.info("cuda_graph_impl=transformer_engine: per-layer capture with Transformer Engine's semantics, "
                 "performed by graphstep's own engine (Transformer Engine is not used)")
    runner = Runner(train, optimizer_step, evaluating(model, evaluate_batches), backend, graphs,
                    _describe(settings, backend, layers, buckets))
    return Run(cfg, settings, device, dp, model, grads, optimizer, train_step, eval_step, moe, runner, num_mb, start)


def _build_model(cfg: Config, device: torch.device, dp: DataParallel, dtype: torch.dtype) -> nn.Module:
    def seed_tracker(pp_rank: int) -> None:
        initialize_rng_tracker(cfg.rng.seed, device, graph_safe=cfg.model.use_te_rng_tracker, pp_rank=pp_rank,
                               dp_rank=dp.dp_rank, tp_rank=dp.tp_rank, cp_rank=dp.cp_rank,
                               data_parallel_random_init=cfg.rng.data_parallel_random_init)

    seed_tracker(0)  # every stage builds the whole model from the same seed, then keeps its own layers
    # FSDP2 keeps fp32 shards (the optimizer's main weights) and casts to the model dtype when it gathers them.
    model = build_model(cfg.model, device, dtype=torch.float32 if dp.layout.fsdp else dtype)
    if cfg.model.hf_path:
        load_hf_weights(model, cfg.model.hf_path, cfg.model)  # in place, before the optimizer copies the weights
    if cfg.checkpoint.pretrained_checkpoint:  # the same, from a graphstep checkpoint (R33: not with hf_path)
        load_pretrained(cfg.checkpoint.pretrained_checkpoint, model, dp, cfg)
    plan = fp8.plan_from(cfg.mixed_precision, cfg.model.num_layers, fsdp=_fp8_all_gather(cfg, dp))
    if plan is not None:  # torchao's Float8Linear in place of the layers' nn.Linear: before anything holds them
        converted, total = fp8.convert(model, plan)
        log.info("%s", plan.describe(len(converted), total))
    adapters = lora.plan_from(cfg.peft)
    if adapters is not None:  # after the base weights are loaded (they are frozen as loaded), before step 3
        adapted = lora.apply_lora(model, adapters)  # takes the trainable parameters (the adapters only)
        log.info("%s", adapters.describe(len(adapted), *lora.count_parameters(model)))
        if cfg.peft.adapter_path:  # a Hugging Face peft adapter to continue training (models/hf.py)
            load_peft_adapter(model, cfg.model, cfg.peft.adapter_path)
    model.train()
    if cfg.rng.data_parallel_random_init:
        dp.broadcast_parameters(model)  # different seeds per rank, the same starting weights (Megatron)
    if dp.layout.pp > 1:  # parallel/pipeline.py; dropout streams differ per stage (Megatron: seed + 100 x stage)
        split_stage(model, cfg.model, dp.layout.pp, dp.pp_rank)
        seed_tracker(dp.pp_rank)
    return model


def _build_steps(cfg: Config, settings: CudaGraphSettings, model: nn.Module, step_model: nn.Module,
                 grads: GradBuffers, moe: MoEHooks, dp: DataParallel, device: torch.device,
                 num_micro_batches: int, weight_casts: fp8.WeightCastCache | None = None) -> tuple[Any, Any]:
    """The steps over ``step_model`` (the compiled model, or ``model``); a pipeline stage's over its schedule."""
    reduce_grads = grad_reducer(grads, cfg.ddp, dp.layout, dp.mesh, dp.backend)
    if dp.layout.pp > 1:  # tied embeddings: the first and last stage's copies take the sum of their gradients
        tied = tied_embedding_grad(model, tied=cfg.model.share_embeddings_and_output_weights is True,
                                   first=dp.pp_rank == 0, last=dp.pp_rank == dp.layout.pp - 1)
        if tied is not None:
            reduce_grads = TiedEmbeddingReducer(tied, dp.pp_group, then=reduce_grads)
    befores = [f for f in (moe.before_step if moe.enabled else None,
                           weight_casts.begin_step if weight_casts is not None else None) if f is not None]
    hooks = dict(reduce_grads=reduce_grads, reduce_loss=dp.loss_reducer(),
                 before_step=_in_order(befores), check_nonfinite=cfg.train.check_for_nan_on_device)
    # FSDP2: an evaluation step reshards what its forwards gathered, so every step ends with the parameters sharded
    release = partial(reshard_all, model) if dp.layout.fsdp is not None else None
    if dp.layout.pp > 1:  # the schedule runs forward and backward (parallel/pipeline.py); R32: no FP8 there
        pipeline = _pipeline(cfg, model, dp, device, num_micro_batches)
        return (PipelineTrainStep(pipeline, grads, **hooks),
                PipelineEvalStep(pipeline, device, dp.loss_reducer(), release=release))
    train_step = TrainStep(step_model, grads, retain_graph=settings.retain_backward_graph,
                           after_backward=_fp8_scaling_update(cfg, model, dp), **hooks)
    eval_step = EvalStep(step_model, device, reduce_loss=dp.loss_reducer(), release=release)
    return train_step, eval_step


def _pipeline(cfg: Config, model: nn.Module, dp: DataParallel, device: torch.device,
              num_micro_batches: int) -> Pipeline:
    """This rank's stage and schedules; with virtual stages its chunks, their interleaved schedule and a process
    group per direction between neighbouring pipeline ranks (parallel/interleaved.py)."""
    chunks = model_chunks(cfg.model, dp.layout.pp)
    mine = [c for c in chunks if c.index % dp.layout.pp == dp.pp_rank]
    if len(mine) == 1:
        return Pipeline(model, stage_index=dp.pp_rank, stages=dp.layout.pp, group=dp.pp_group, device=device,
                        schedule=cfg.model.pipeline_schedule, num_micro_batches=num_micro_batches)
    pipeline = InterleavedPipeline(model, chunks=mine, num_chunks=len(chunks), group=dp.pp_group,
                                   p2p_groups=directed_p2p_groups(dp.mesh), device=device,
                                   schedule=cfg.model.pipeline_schedule, num_micro_batches=num_micro_batches)
    log.info("%s", pipeline.describe())
    return pipeline


def _overwrites_gradients(train_step: Any, settings: CudaGraphSettings, model: nn.Module) -> bool:
    """Whether the step's first gradients may be copied into the buffers (GradBuffers.overwrite_first): nothing
    but the buffers' own hooks writes them before the step's last backward ends -- no per-layer graph (they add
    into ``main_grad`` inside their backward), no data-parallel reduction (an overlapped one starts during the
    backward), no pipeline schedule (interleaved stages add ``param.grad`` in themselves), no DTensor parameter."""
    return (type(train_step) is TrainStep and train_step.reduce_grads is None and not settings.per_layer
            and not any(isinstance(p, DTensor) for p in model.parameters()))


def _in_order(calls: list[Callable[[], None]]) -> Callable[[], None] | None:
    """One call of each of ``calls``, in order (None: no calls)."""
    if len(calls) <= 1:
        return calls[0] if calls else None

    def run() -> None:
        for call in calls:
            call()

    return run


def _fp8_weight_casts(cfg: Config, settings: CudaGraphSettings, model: nn.Module, dp: DataParallel, *,
                      compiled: bool) -> fp8.WeightCastCache | None:
    """FP8 weight casts once per training step (converters/fp8.py WeightCastCache), where the step runs every
    micro-batch's forward itself: not with per-layer graphs (one layer graph serves every micro-batch),
    torch.compile, FSDP2 or pipeline stages. None there, and without FP8."""
    plan = fp8.plan_from(cfg.mixed_precision, cfg.model.num_layers, fsdp=_fp8_all_gather(cfg, dp))
    if plan is None or settings.per_layer or compiled or dp.layout.fsdp is not None or dp.layout.pp > 1:
        return None
    casts = fp8.cache_weight_casts(model, plan)
    if casts is not None:
        log.info("FP8: %d linear layers cast their weights once per step, at the first micro-batch", len(casts))
    return casts


def _fp8_scaling_update(cfg: Config, model: nn.Module, dp: DataParallel) -> Callable[[], None] | None:
    """FP8 delayed scaling's end-of-step update (converters/fp8_delayed.py; None for the other recipes): the
    replicas' amaxes max-reduced in one device all-reduce, then the scales and histories, inside the step."""
    plan = fp8.plan_from(cfg.mixed_precision, cfg.model.num_layers)
    if plan is None:
        return None
    scaling = fp8.delayed_scaling(model, plan, reduce=_max_over_data_parallel(dp) if dp.dp_size > 1 else None)
    return scaling.update if scaling is not None else None


def _max_over_data_parallel(dp: DataParallel) -> Callable[[torch.Tensor], None]:
    """An in-place MAX all-reduce over the data-parallel ranks (replicas or FSDP2 shards): a device collective,
    capturable, no host read."""
    group = dp.dp_group

    def reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)

    return reduce


def _fp8_all_gather(cfg: Config, dp: DataParallel) -> bool:
    """FSDP2 with fp8_param_gather (Bridge's FP8 presets set it): the weights are all-gathered in FP8."""
    gather = cfg.mixed_precision.fp8_param_gather is True or cfg.model.fp8_param_gather is True
    return dp.layout.fsdp is not None and gather


def _fp8_gather_scales(cfg: Config, model: nn.Module, dp: DataParallel) -> fp8.FsdpWeightScales | None:
    """The FP8 all-gather's weight scales (converters/fp8.py), computed now from the weights as built or loaded,
    then after every optimizer step; None without FSDP2's FP8 all-gather."""
    plan = fp8.plan_from(cfg.mixed_precision, cfg.model.num_layers, fsdp=_fp8_all_gather(cfg, dp))
    if plan is None:
        return None
    scales = fp8.fsdp_weight_scales(model, plan, _max_over_data_parallel(dp))
    if scales is not None:
        scales.update()
    return scales


def _run_backend(settings: CudaGraphSettings, backend: GraphBackend | None, device: torch.device, *,
                 compiled: bool) -> RunBackend | None:
    """The run's view of the backend that captures its graphs (default: the process's for ``device``); None
    without graphs."""
    if not settings.enabled:
        return None
    backend = backend if backend is not None else get_backend(device, settings.backend)
    # R20 refuses compile with the replay backend where the config names it (cuda_graph_backend=replay, or auto
    # with train.device=cpu); train.device=auto means the CPU only on a machine without a GPU, which the rule
    # cannot see: refused here, once the backend is known.
    if compiled and backend.name == "replay":
        raise ConfigError(f"R20: {REPLAY_COMPILE_REASON} Fix: run the graphs on a GPU, or compile.enable=false "
                          "for the CPU dry run, or model.cuda_graph_impl=none to train compiled without graphs")
    return RunBackend(backend)


def _full_iteration_graphs(train_step: Any, eval_step: Any, backend: RunBackend, capture: CaptureOptions,
                           num_micro_batches: int, buckets: list[int] | None) -> tuple[Any, Any, list[Any]]:
    """The training iteration over its graph (a graph per bucket with ``buckets``), the evaluation graph, and
    both graphs, training first."""
    eval_graph = GraphedStep(eval_step, backend, capture, name="eval")
    if buckets:
        per_bucket = GraphPerBucket(lambda width: GraphedStep(train_step, backend, capture, name=f"train[{width}]"),
                                    num_micro_batches)
        return per_bucket, eval_graph, [per_bucket, eval_graph]
    train_graph = GraphedStep(train_step, backend, capture, name="train")
    return over_micro_batches(train_graph, num_micro_batches), eval_graph, [train_graph, eval_graph]


def _optimizer_step(optimizer: AdamW, *, skip_on_nonfinite: bool, after: Callable[[], None] | None = None,
                    ) -> Callable[[dict[str, torch.Tensor]], Any]:
    """The optimizer step; ``after``: device work on the new weights, in the same step (and graph)."""
    def opt_fn(train_out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = optimizer.step(train_out.get("nonfinite") if skip_on_nonfinite else None)
        if after is not None:
            after()
        return out

    return opt_fn


def _describe(settings: CudaGraphSettings, backend: RunBackend | None, layers: Any, buckets: list[int] | None) -> str:
    if layers is not None:
        text = layers.describe()
    elif settings.full_iteration:
        per = f", a graph per bucket of {buckets}" if buckets else ""
        text = f"full iteration{per} ({backend.name} backend)"
    else:
        text = "eager"
    return text + (" + optimizer graph" if settings.optimizer_graph and settings.enabled else "")
