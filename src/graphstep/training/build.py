"""``build_run(cfg, ...)``: one rank's run -- model, gradients, optimizer, steps and graphs -- built once.

The trainer (training/loop.py), the doctor (doctor/recipe.py) and the bench
(bench/harness.py) all build a run here, so what the doctor judges and what
the bench measures is what ``graphstep train`` runs: the same RNG tracker
(``model.use_te_rng_tracker``), the same data-parallel reducers, MoE hooks
and non-finite checks, the same graphs through ``prepare``. What differs is
passed in: the device, the data-parallel ranks, the graph backend (the
process's for the device, or the doctor's), a ``restore`` callback that
loads a checkpoint, and, for the bench, a compiled model.

The data is not part of the run: the trainer, the doctor and the bench read
different data (a rank's shard, a few batches, pinned batches cycled).

:class:`Run` is what they get back; ``run.iteration(data)`` is one training
iteration (forward/backward of every micro-batch, optimizer step, MoE bias
update), ``run.close()`` frees the run's graphs -- and only them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..config import Config, ConfigError
from ..cuda_graph.backend import GraphBackend
from ..cuda_graph.registry import get_backend
from ..cuda_graph.rng import initialize_rng_tracker
from ..cuda_graph.settings import CudaGraphSettings
from ..data.buckets import parse_buckets
from ..models import build_model, resolve_dtype
from ..models.hf import load_hf_weights
from ..validation import REPLAY_COMPILE_REASON, resolve_cuda_graph_settings
from .compile import CompileTimeReport, apply_compile, describe_compile
from .distributed import DataParallel
from .moe_hooks import MoEHooks
from .optim import AdamW, GradBuffers, build_optimizer
from .parallel import parallelize, reshard_all
from .pipeline import Pipeline, PipelineEvalStep, PipelineTrainStep, keep_stage, stage_layers
from .prepare import Runner, prepare
from .step import EvalStep, TrainStep

Restore = Callable[[nn.Module, AdamW], int]


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


def build_run(
    cfg: Config,
    *,
    device: torch.device,
    dp: DataParallel | None = None,
    backend: GraphBackend | None = None,
    settings: CudaGraphSettings | None = None,
    restore: Restore | None = None,
    compile_mode: str | None = None,
    on_capture_error: Callable[..., None] | None = None,
) -> Run:
    """Build one rank's run of ``cfg`` on ``device``.

    The order is fixed, each step needing the ones before it:

    1. the RNG tracker (graph-safe with ``model.use_te_rng_tracker``), seeded
       per rank: the model's initialisation draws from it;
    2. the model; ``model.hf_path`` weights are copied in and, with
       ``rng.data_parallel_random_init``, rank 0's weights broadcast -- both
       before step 3, which takes the fp32 master copy;
    3. gradient buffers (fixed addresses), then the optimizer over them;
    4. ``restore(model, optimizer)`` loads a checkpoint in place before any
       graph exists, so warm-up and capture count from the resume iteration;
    5. the training and evaluation steps (data-parallel reducers, MoE hooks,
       the non-finite flag), over the compiled model with ``compile.enable``
       (training/compile.py; ``compile_mode``, the bench's, enables it too);
    6. the graphs, through ``prepare`` with ``backend`` (default: the
       process's backend for ``device``); the run owns what it captures.

    ``dp``: this rank's place (default: one rank). ``settings``: the resolved
    graph settings (default: resolved from ``cfg`` here).
    """
    settings = settings if settings is not None else resolve_cuda_graph_settings(cfg)
    dp = dp if dp is not None else DataParallel()
    _check_nonfinite_settings(cfg)
    model = _build_model(cfg, device, dp)  # 1, 2
    grads = GradBuffers(model, dp.mesh)  # 3
    optimizer = build_optimizer(cfg, model, grads)
    start = restore(model, optimizer) if restore is not None else 0  # 4
    num_mb = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp.dp_size)  # per pipeline too
    moe = MoEHooks(model, num_mb)  # 5
    compile_mode = compile_mode if compile_mode is not None else (cfg.compile.mode if cfg.compile.enable else None)
    train_step, eval_step = _build_steps(cfg, settings, model, grads, moe, dp, device, compile_mode, num_mb)
    if settings.enabled and backend is None:  # 6
        backend = get_backend(device, settings.backend)
    if compile_mode is not None and settings.enabled and getattr(backend, "name", None) == "replay":
        raise ConfigError(f"R20: {REPLAY_COMPILE_REASON} Fix: run the graphs on a GPU, or compile.enable=false "
                          "for the CPU dry run, or model.cuda_graph_impl=none to train compiled without graphs")
    runner = prepare(
        model, train_step, eval_step, optimizer, settings, backend=backend, device=device,
        num_micro_batches=num_mb, skip_on_nonfinite=cfg.train.skip_step_on_nan,
        capture_barrier=dp.barrier if dp.enabled else None, buckets=parse_buckets(cfg),
        on_capture_error=on_capture_error,
    )
    return Run(cfg, settings, device, dp, model, grads, optimizer, train_step, eval_step, moe, runner, num_mb, start)


def _check_nonfinite_settings(cfg: Config) -> None:
    tr = cfg.train
    if tr.skip_step_on_nan and not tr.check_for_nan_on_device:
        raise ConfigError("train.skip_step_on_nan=true needs the device-side flag it skips on, but "
                          "train.check_for_nan_on_device=false: set train.check_for_nan_on_device=true "
                          "or train.skip_step_on_nan=false")


def _build_model(cfg: Config, device: torch.device, dp: DataParallel) -> nn.Module:
    def seed_tracker(pp_rank: int) -> None:
        initialize_rng_tracker(cfg.rng.seed, device, graph_safe=cfg.model.use_te_rng_tracker, pp_rank=pp_rank,
                               dp_rank=dp.dp_rank, tp_rank=dp.tp_rank,
                               data_parallel_random_init=cfg.rng.data_parallel_random_init)

    seed_tracker(0)  # every stage builds the whole model from the same seed, then keeps its own layers
    dtype = resolve_dtype(cfg.model.params_dtype, device)
    # FSDP2 keeps fp32 shards (the optimizer's main weights) and casts to the model dtype when it gathers them.
    model = build_model(cfg.model, device, dtype=torch.float32 if dp.layout.fsdp else dtype)
    if cfg.model.hf_path:
        load_hf_weights(model, cfg.model.hf_path, cfg.model)  # in place, before the optimizer copies the weights
    model.train()
    if cfg.rng.data_parallel_random_init:
        dp.broadcast_parameters(model)  # different seeds per rank, the same starting weights (Megatron)
    if dp.layout.pp > 1:  # training/pipeline.py; dropout streams differ per stage (Megatron: seed + 100 x stage)
        m = cfg.model
        layers = stage_layers(m.num_layers, dp.layout.pp, m.num_layers_in_first_pipeline_stage,
                              m.num_layers_in_last_pipeline_stage)[dp.pp_rank]
        keep_stage(model, layers, first=dp.pp_rank == 0, last=dp.pp_rank == dp.layout.pp - 1)
        seed_tracker(dp.pp_rank)
    return parallelize(model, dp.layout, dp.mesh, dtype)  # tensor parallel, FSDP2 (training/parallel.py)


def _build_steps(cfg: Config, settings: CudaGraphSettings, model: nn.Module, grads: GradBuffers, moe: MoEHooks,
                 dp: DataParallel, device: torch.device, compile_mode: str | None,
                 num_micro_batches: int) -> tuple[Any, Any]:
    hooks = dict(reduce_grads=dp.grad_reducer(grads, cfg.ddp), reduce_loss=dp.loss_reducer(),
                 before_step=moe.before_step if moe.enabled else None,
                 check_nonfinite=cfg.train.check_for_nan_on_device)
    if dp.layout.pp > 1:  # the schedule runs forward and backward (training/pipeline.py)
        pipeline = Pipeline(model, stage_index=dp.pp_rank, stages=dp.layout.pp, group=dp.pp_group, device=device,
                            schedule=cfg.model.pipeline_schedule, num_micro_batches=num_micro_batches)
        return PipelineTrainStep(pipeline, grads, **hooks), PipelineEvalStep(pipeline, device, dp.loss_reducer())
    step_model = apply_compile(model, compile_mode, settings) if compile_mode is not None else model
    train_step = TrainStep(step_model, grads, retain_graph=settings.retain_backward_graph, **hooks)
    eval_step = EvalStep(step_model, device, reduce_loss=dp.loss_reducer(),
                         release=partial(reshard_all, model) if dp.layout.fsdp is not None else None)
    if compile_mode is None:
        return train_step, eval_step
    return CompileTimeReport(train_step, describe_compile(compile_mode, settings)), eval_step
