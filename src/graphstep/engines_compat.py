"""Private APIs of PyTorch's parallel engines and of transformers that the trainer uses: one place, with probes.

The companion of cuda_graph/torch_compat.py (which holds the mechanism's
private accesses, the probe registry and :class:`TorchCompatError`): tensor
parallel's partition hook and row-wise output hook, FSDP2's one-rank gradient
reduction, the parallel style's apply, the device mesh's flattened views, the
pipelining schedules' set-up and backward switch, a module's shallow view (an
interleaved pipeline's chunks), DTensor's local tensor, a view's base,
dynamo's compile callbacks and reset, and transformers' mask helpers. Each
access is a small named function
with a probe registered in the same ``PROBES``; a missing name raises a
TorchCompatError naming the torch (or transformers) version when the feature is
used. docs/library.md lists them with the versions they were verified on.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import sys
from types import ModuleType
from typing import Any, Callable

import torch
from torch import nn

from .cuda_graph.torch_compat import CPU_2_13, GPU_2_11, PROBES, expect, probe

# --------------------------------------------------------------------------
# tensors: a view's base, DTensor's local tensor


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of, or None (``Tensor._base``)."""
    return t._base


def dtensor_local(dt: Any) -> torch.Tensor:
    """The part of DTensor ``dt`` this rank holds, sharing its storage and outside autograd's view of ``dt``
    (``DTensor._local_tensor``; ``to_local()`` would be a differentiable op)."""
    try:
        return dt._local_tensor
    except AttributeError as e:
        raise PROBES["probe_tensor_internals"].error(str(e)) from e


@probe("Tensor._base", "DTensor._local_tensor", purpose="recognise a view of the step's labels and reach a "
       "sharded parameter's local storage", verified=(CPU_2_13, GPU_2_11), needs="process_group")
def probe_tensor_internals() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    whole = torch.arange(6.0)
    expect(view_base(whole[2:4]) is whole and view_base(whole) is None, "a slice's base")
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    local = torch.ones(2)
    dt = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
    expect(dtensor_local(dt).data_ptr() == local.data_ptr(), "the local tensor shares the storage")


# --------------------------------------------------------------------------
# FP8 matmul (converters/fp8_delayed.py)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype,
              fast_accum: bool = False) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` of FP8 ``a`` (row-major) and ``b`` (column-major) in ``out_dtype``, the
    scales fp32 scalars (``torch._scaled_mm``; on the CPU too from torch 2.13)."""
    try:
        mm = torch._scaled_mm
    except AttributeError as e:
        raise PROBES["probe_scaled_mm"].error(str(e)) from e
    return mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum)


@probe("torch._scaled_mm", purpose="FP8 matmuls of delayed scaling (fp8_recipe=delayed)", verified=(CPU_2_13,))
def probe_scaled_mm() -> None:
    a = torch.tensor([[1.0, 2.0] * 8] * 16).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16).to(torch.float8_e5m2).t().contiguous().t()
    out = scaled_mm(a, b, torch.tensor(0.5), torch.tensor(2.0), torch.float32)
    expect(out.shape == (16, 16) and bool((out == 24.0).all()), "sum of 8 x (1 + 2), scaled by 0.5 x 2")


# --------------------------------------------------------------------------
# torchao's FP8 all-gather under FSDP2 (converters/fp8.py FsdpWeightScales)

TORCHAO_VERIFIED = ("0.18.0",)


def fsdp_float8_weight(local: torch.Tensor) -> bool:
    """Whether ``local`` (a sharded parameter's local tensor) all-gathers in FP8 under FSDP2: torchao's
    ``WeightWithDynamicFloat8CastTensor`` (``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return isinstance(local, WeightWithDynamicFloat8CastTensor)


def set_fsdp_float8_scale(local: torch.Tensor, scale: torch.Tensor) -> None:
    """Make FSDP2's pre-all-gather cast of ``local`` to FP8 use ``scale`` (a 0-d fp32 tensor, read at each gather)
    instead of computing it with an all-reduce (torchao's ``_precomputed_scale``, which
    ``precompute_float8_dynamic_scale_for_fsdp`` assigns anew each step)."""
    try:
        local._precomputed_scale = scale
    except AttributeError as e:
        raise PROBES["probe_fsdp_float8_scale"].error(str(e)) from e


def fsdp_float8_scale(local: torch.Tensor) -> torch.Tensor | None:
    """The scale :func:`set_fsdp_float8_scale` gave ``local`` (None: torchao computes it at each gather)."""
    return getattr(local, "_precomputed_scale", None)


@probe("torchao WeightWithDynamicFloat8CastTensor._precomputed_scale", purpose="keep the FP8 all-gather's "
       "weight scales in graph-owned tensors updated inside the optimizer step (FSDP2 with FP8)",
       verified=TORCHAO_VERIFIED, library="torchao")
def probe_fsdp_float8_scale() -> None:
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return  # FP8 is not used without torchao (rule V21)
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # as converters/fp8.py imports it
    from torchao.float8 import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    local = WeightWithDynamicFloat8CastTensor(torch.ones(2, 2), LinearMMConfig(), torch.float8_e4m3fn)
    expect(fsdp_float8_weight(local) and not fsdp_float8_weight(torch.ones(1)), "the wrapper is recognised")
    expect(fsdp_float8_scale(local) is None, "no scale before one is set")
    scale = torch.tensor(2.0)
    set_fsdp_float8_scale(local, scale)
    expect(fsdp_float8_scale(local) is scale, "the scale is the tensor set, not a copy")
    (data,), (used,) = local.fsdp_pre_all_gather(None)
    expect(used is scale or bool(used == scale), "the pre-all-gather cast uses the scale set")
    expect(data.dtype == torch.float8_e4m3fn and bool((data.float() == 2.0).all()), "ones x 2 in e4m3")


# --------------------------------------------------------------------------
# FSDP2: what its gradient reduction does on a one-rank mesh


@functools.cache
def fsdp_one_rank_reduce_divides() -> bool:
    """Whether FSDP2's gradient reduction on a one-rank mesh divides by the module's gradient divide factor
    where the reduce-scatter would run (torch 2.13: the copy that stands in for it is divided). There a forced
    sum (``set_force_sum_reduction_for_comms``) adds a second division after it, so parallel/fsdp.py forces the
    sum only where this is False or the mesh has more than one rank. Read from ``foreach_reduce``'s source."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    try:
        source = inspect.getsource(_fsdp_collectives.foreach_reduce)
    except (AttributeError, OSError, TypeError) as e:
        raise PROBES["probe_fsdp_one_rank_reduce"].error(str(e)) from e
    return "reduce_scatter_input / gradient_divide_factor" in source


@probe("torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_reduce", purpose="divide an expert's "
       "gradient once on a one-rank expert-data-parallel mesh (FSDP2 with expert parallel)",
       verified=(CPU_2_13,))
def probe_fsdp_one_rank_reduce() -> None:
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives

    expect(callable(getattr(collectives, "foreach_reduce", None)), "foreach_reduce exists")
    expect(isinstance(fsdp_one_rank_reduce_divides(), bool), "its source is readable")


# --------------------------------------------------------------------------
# tensor parallel: a colwise style that partitions its own way


def _with_partition(style: type, name: str) -> type:
    """``style`` (ColwiseParallel or RowwiseParallel) with a public :meth:`partition_linear` its subclasses
    override; torch calls it through the style's ``_partition_linear_fn``, the per-module partition its ``_apply``
    hands to ``distribute_module``; a torch without that name is an error when the style is made, never a style
    whose override is silently not called."""
    probe_name = f"probe_{name}_partition"

    class WithPartition(style):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if not callable(getattr(style, "_partition_linear_fn", None)):
                raise PROBES[probe_name].error()
            super().__init__(*args, **kwargs)

        def partition_linear(self, name: str, module: nn.Module, device_mesh: Any) -> None:
            """Shard ``module``'s parameters over ``device_mesh`` (the style's own partition)."""
            return super()._partition_linear_fn(name, module, device_mesh)

        def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
            return self.partition_linear(name, module, device_mesh)

    WithPartition.__name__ = WithPartition.__qualname__ = f"{style.__name__.replace('Parallel', '')}WithPartition"
    return WithPartition


@functools.cache
def colwise_with_partition() -> type:
    """``ColwiseWithPartition``, made on first use: importing tensor parallel costs every process about a
    second, and only tensor-parallel runs need it (this module is imported by every ``import graphstep``).
    A ``ColwiseParallel`` whose subclasses say how a Linear is partitioned by overriding ``partition_linear``."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    return _with_partition(ColwiseParallel, "colwise")


@functools.cache
def rowwise_with_partition() -> type:
    """``RowwiseWithPartition``: the same for ``RowwiseParallel`` (made on first use, as above)."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    return _with_partition(RowwiseParallel, "rowwise")


@functools.cache
def rowwise_with_waited_output() -> type:
    """``RowwiseParallel`` (with :func:`rowwise_with_partition`'s hook) whose output redistribution -- the
    all-reduce or reduce-scatter of the partial sums -- is waited before the module returns. torch's style
    starts it asynchronously and hands on an ``AsyncCollectiveTensor``; for the embedding, whose output enters
    the decoder layers compiled one by one (parallel/compile.py), the compiled layer's backward then hands that
    redistribution a plain gradient (an AttributeError, torch 2.13). The numbers are the same either way: the
    next operation waits for the collective anyway. The override is torch's ``_prepare_output_fn``, which
    ``_apply`` passes to ``distribute_module``; a torch without it is an error when the style is made."""
    style = rowwise_with_partition()

    class RowwiseWithWaitedOutput(style):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if not callable(getattr(style, "_prepare_output_fn", None)):
                raise PROBES["probe_rowwise_output"].error()
            super().__init__(*args, **kwargs)

        @staticmethod
        def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
                               device_mesh: Any) -> Any:
            if outputs.placements != output_layouts:
                outputs = outputs.redistribute(placements=output_layouts, async_op=False)
            return outputs.to_local() if use_local_output else outputs

    return RowwiseWithWaitedOutput


def _probe_partition(style: type, made: Callable[[], type]) -> None:
    made()()
    params = list(inspect.signature(style._partition_linear_fn).parameters)
    expect(params == ["self", "name", "module", "device_mesh"], f"signature {params}")
    expect("_partition_linear_fn" in inspect.getsource(style._apply), "_apply partitions with it")


@probe("ColwiseParallel._partition_linear_fn", purpose="shard fused projections (qkv, gate+up) part by part",
       verified=(CPU_2_13, GPU_2_11))
def probe_colwise_partition() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    _probe_partition(ColwiseParallel, colwise_with_partition)


@probe("RowwiseParallel._partition_linear_fn", purpose="shard LoRA adapters of rowwise projections (lora_A "
       "rowwise, lora_B replicated)", verified=(CPU_2_13,))
def probe_rowwise_partition() -> None:
    from torch.distributed.tensor.parallel import RowwiseParallel

    _probe_partition(RowwiseParallel, rowwise_with_partition)


@probe("RowwiseParallel._prepare_output_fn", purpose="wait for the embedding's output all-reduce or "
       "reduce-scatter before the compiled decoder layers take it (compile with tensor parallel)",
       verified=(CPU_2_13,))
def probe_rowwise_output() -> None:
    from torch.distributed.tensor.parallel import RowwiseParallel

    rowwise_with_waited_output()()
    params = list(inspect.signature(RowwiseParallel._prepare_output_fn).parameters)
    expect(params == ["output_layouts", "use_local_output", "mod", "outputs", "device_mesh"], f"signature {params}")
    expect("_prepare_output_fn" in inspect.getsource(RowwiseParallel._apply), "_apply hands it to distribute_module")


# --------------------------------------------------------------------------
# parallel styles of graphstep's own: ParallelStyle with a public apply


@functools.cache
def module_style() -> type:
    """``ModuleStyle``, made on first use (as above): a ``ParallelStyle`` whose subclasses implement the public
    :meth:`apply` (``parallelize_module`` calls the style's abstract ``_apply``, which hands it on)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    class ModuleStyle(ParallelStyle):
        def apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            """Parallelize ``module`` over ``device_mesh`` in place and return it (the style's own)."""
            raise NotImplementedError

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            return self.apply(module, device_mesh)

    return ModuleStyle


@probe("ParallelStyle._apply", purpose="expert parallel as a parallel style (parallelize_module applies it)",
       verified=(CPU_2_13,))
def probe_parallel_style() -> None:
    from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

    expect("_apply" in getattr(ParallelStyle, "__abstractmethods__", ()), "_apply is the style's abstract method")
    expect("._apply(" in inspect.getsource(parallelize_module), "parallelize_module calls it")
    module_style()()


# --------------------------------------------------------------------------
# device mesh: a view of several dimensions as one


def flatten_mesh(mesh: Any, name: str) -> Any:
    """``mesh`` (a view of some dimensions of a root DeviceMesh) as one dimension named ``name``, on the same
    root (``DeviceMesh._flatten``): FSDP2 and DTensor then combine it with the root's other dimensions, e.g.
    the data-parallel ranks with the tensor-parallel ones."""
    flatten = getattr(mesh, "_flatten", None)
    if not callable(flatten):
        raise PROBES["probe_mesh_flatten"].error(f"{type(mesh).__name__} has no _flatten")
    return flatten(name)


@probe("DeviceMesh._flatten", purpose="the data-parallel ranks as one mesh dimension (FSDP2's mesh, the gradient "
       "all-reduce's group) over the layout's finer dimensions", verified=(CPU_2_13,), needs="process_group")
def probe_mesh_flatten() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    root = init_device_mesh("cpu", (world, 1), mesh_dim_names=("probe_a", "probe_b"))
    flat = flatten_mesh(root[("probe_a", "probe_b")], "probe_ab")
    expect(flat.mesh_dim_names == ("probe_ab",) and flat.size() == world, "a flattened 1-D mesh over the world")


# --------------------------------------------------------------------------
# pipelining: the stage set-up, forward-only steps


def module_view(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` with submodule, parameter and buffer tables of its own (nn.Module's
    ``_modules``, ``_parameters``, ``_buffers``) and hook tables of its own: it holds the same objects, setting a
    submodule on the copy leaves ``module`` as it was, and a hook registered on the copy (FSDP2's, on an
    interleaved pipeline's chunk: parallel/interleaved.py) runs on the copy's calls only."""
    view = copy.copy(module)
    try:
        view._modules, view._parameters = dict(module._modules), dict(module._parameters)
        view._buffers = dict(module._buffers)
        for key in [k for k, v in vars(module).items() if "hooks" in k and isinstance(v, dict)]:
            setattr(view, key, type(vars(module)[key])(vars(module)[key]))  # hooks registered on it stay its own
    except AttributeError as e:
        raise PROBES["probe_module_view"].error(str(e)) from e
    return view


@probe("nn.Module._modules", "nn.Module._parameters", "nn.Module._buffers", purpose="run one chunk of an "
       "interleaved pipeline rank's model through a view holding only that chunk's layers", verified=(CPU_2_13,))
def probe_module_view() -> None:
    whole = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    view = module_view(whole)
    view[1] = nn.Identity()
    expect(isinstance(whole[1], nn.Linear) and view[0] is whole[0], "the copy's submodules are its own table")
    expect(next(view.parameters()) is whole[0].weight, "the copy holds the same parameters")
    view.register_forward_pre_hook(lambda *_: None)
    expect(not whole._forward_pre_hooks, "a hook registered on the copy is the copy's only")


def wrap_stage_setup(schedule: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``schedule``'s stage set-up (``_initialize_stage`` of a single-stage schedule, ``_initialize_stages``
    of a multi-stage one; called at the start of every step, it sets the stages up on the first) by
    ``wrap(original)`` on this instance."""
    for name in ("_initialize_stage", "_initialize_stages"):
        init = getattr(schedule, name, None)
        if init is not None:
            setattr(schedule, name, wrap(init))
            return
    raise PROBES["probe_pipeline_schedules"].error(f"{type(schedule).__name__} has no _initialize_stage(s)")


def forward_only_step(schedule: Any, *args: Any, **kwargs: Any) -> None:
    """One forward-only step: ``schedule.eval(...)`` where torch has it (2.13), else ``step(...)`` with the
    schedule's ``_has_backward`` off, which is what ``eval`` does (the older path, kept for torch 2.11)."""
    if hasattr(schedule, "eval"):
        schedule.eval(*args, **kwargs)
        return
    if not hasattr(schedule, "_has_backward"):
        raise PROBES["probe_pipeline_schedules"].error(f"{type(schedule).__name__} has no eval or _has_backward")
    had = schedule._has_backward
    schedule._has_backward = False
    try:
        schedule.step(*args, **kwargs)
    finally:
        schedule._has_backward = had


@probe("_PipelineScheduleSingle._initialize_stage", "PipelineScheduleMulti._initialize_stages",
       "PipelineSchedule.eval (2.13) / _has_backward (2.11)",
       purpose="keep a pipeline stage's set-up from drawing dropout masks, and run evaluation forward only",
       verified=(CPU_2_13, GPU_2_11))
def probe_pipeline_schedules() -> None:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleLoopedBFS

    for kind in (Schedule1F1B, ScheduleGPipe):
        expect(callable(getattr(kind, "_initialize_stage", None)), f"{kind.__name__}._initialize_stage")
    for kind in (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleLoopedBFS):
        expect(callable(getattr(kind, "_initialize_stages", None)), f"{kind.__name__}._initialize_stages")
    has_eval = callable(getattr(ScheduleGPipe, "eval", None))
    expect(has_eval or "_has_backward" in inspect.getsource(_PipelineSchedule.__init__), "eval or _has_backward")
    if has_eval:
        expect("_has_backward" in inspect.getsource(_PipelineSchedule), "eval switches _has_backward")


# --------------------------------------------------------------------------
# dynamo


def dynamo_callbacks() -> Any:
    """Dynamo's compile callback registry (``torch._dynamo.callback.callback_handler``): start/end callbacks
    around every compilation."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError as e:
        raise PROBES["probe_dynamo"].error(str(e)) from e
    return callback_handler


def reset_dynamo() -> None:
    """Drop everything torch.compile compiled, CUDA graph trees included (``torch._dynamo.reset``)."""
    import torch._dynamo

    torch._dynamo.reset()


@probe("torch._dynamo.callback.callback_handler", "torch._dynamo.reset",
       purpose="time compilation, and free compiled graphs between benchmark rows", verified=(CPU_2_13, GPU_2_11))
def probe_dynamo() -> None:
    handler = dynamo_callbacks()
    for name in ("register_start_callback", "register_end_callback", "remove_start_callback",
                 "remove_end_callback"):
        expect(callable(getattr(handler, name, None)), f"callback_handler.{name}")
    reset_dynamo()


# --------------------------------------------------------------------------
# transformers' mask helpers

TRANSFORMERS_VERIFIED = ("5.17.0", "5.25.0")
MASKING_UTILS = "transformers.masking_utils"
PACKED = "find_packed_sequence_indices"
MASK_SKIPS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")
"""transformers' private answers to "can SDPA's is_causal replace the mask?" (masking_utils)."""


def masking_functions(masks: ModuleType) -> dict[str, Callable[..., Any]]:
    """The mask helpers of ``transformers.masking_utils`` that graphstep turns into decision points, by name:
    ``find_packed_sequence_indices`` and the two private mask-skip checks. A missing one is an error naming
    the transformers version (an older transformers decides masks elsewhere: see masking_utils_missing)."""
    found = {name: getattr(masks, name, None) for name in (PACKED, *MASK_SKIPS)}
    absent = [name for name, fn in found.items() if not callable(fn)]
    if absent:
        raise PROBES["probe_transformers_masks"].error(f"no {', '.join(absent)}")
    return found


def masking_utils_missing() -> str | None:
    """Why graphstep cannot freeze transformers' mask decisions: None when transformers is not imported or
    has masking_utils; else a one-line warning naming the version."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    import importlib.util

    if importlib.util.find_spec(MASKING_UTILS) is not None:
        return None
    return str(PROBES["probe_transformers_masks"].error(
        "no such module: whole-step graphs of Hugging Face models may take another attention path than eager"))


@probe(MASKING_UTILS + ".find_packed_sequence_indices", *(f"{MASKING_UTILS}.{n}" for n in MASK_SKIPS),
       purpose="freeze transformers' host-side mask decisions at capture", verified=TRANSFORMERS_VERIFIED,
       needs="transformers", library="transformers")
def probe_transformers_masks() -> None:
    import transformers.masking_utils as masks

    fns = masking_functions(masks)
    expect(fns[MASK_SKIPS[0]](None, 4, 4, 0, 0) is True, "no mask, square causal attention: SDPA's is_causal")
    expect(fns[MASK_SKIPS[1]](None, 4) is True, "no mask, bidirectional: no mask needed")
    expect(fns[PACKED](torch.arange(4)[None]) is None, "one sequence: not packed")
