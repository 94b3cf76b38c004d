"""Data parallel over ``torch.distributed``, launched by torchrun.

``torchrun --nproc_per_node N -m graphstep train ...`` starts N processes;
torchrun's environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``MASTER_ADDR``/``PORT``, or its own rendezvous across nodes) is all this
module reads. :func:`init_data_parallel` then:

1. picks the device and the backend: NCCL on ``cuda:LOCAL_RANK``, gloo on
   the CPU;
2. says in the log what collectives inside captured graphs rely on
   (:func:`check_collective_env`; rule R16, which raises, was checked with
   every other rule before: NCCL reads its environment when the
   communicator is created, so nothing may change after this point);
3. creates the process group with ``device_id`` (so NCCL initialises its
   communicator eagerly) and runs one warm-up all-reduce: a communicator
   must never be created while a stream is being captured;
4. makes a small gloo group for host-side agreement (stop signals,
   checkpoint names) that never touches the GPU stream;
5. builds the run's device mesh when the layout needs one (parallel/dims.py:
   the layout is read from the config once, here, and every rank index and
   group of :class:`DataParallel` is read from that mesh);
6. leaves logging to rank 0 (other ranks keep warnings, tagged with their
   rank).

Gradient reduction (:class:`GradReducer`, parallel/data_parallel.py) is one all-reduce per bucket of
the flat fp32 gradient buffer (``ddp.bucket_size`` elements), averaging by
pre-dividing (Megatron's gradient scaling factor) or with ``ReduceOp.AVG``
when ``ddp.average_in_collective`` and NCCL allow it. TrainStep calls it after
the last backward: inside the full-iteration graph when there is one, eagerly
after the backward graphs with per-layer graphs. The logged loss is averaged
over ranks the same way (:meth:`DataParallel.mean_`), a device all-reduce
with no host read.

Teardown order matters: :meth:`DataParallel.close` destroys the process group
and must run after every graph is freed -- a captured NCCL collective that is
still alive makes ``destroy_process_group`` hang (pytorch #115388). The
trainer frees its graphs in an inner ``finally`` and calls ``close()`` in an
outer one.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..config import Config
from ..cuda_graph.devices import normalize_device
from ..cuda_graph.settings import CudaGraphSettings
from ..parallel.data_parallel import dp_group, grad_group
from ..parallel.dims import (CP, DP, PP, STAGE, TP, ParallelDims, WorldMesh, build_mesh, forget_shared_groups,
                              shared_groups)
from .rundir import RunSetupError

log = logging.getLogger("graphstep")

@dataclass
class DataParallel:
    """This process's place among the data-parallel ranks (one rank when not launched by torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None  # "nccl", "gloo", or None without a process group
    owns_group: bool = False  # created here, so destroyed here
    control: Any = None  # a gloo group for host-side agreement (None: the default group)
    layout: ParallelDims = field(default_factory=ParallelDims)  # the run's layout (parallel/dims.py)
    mesh: WorldMesh | None = None  # the run's device mesh when the layout needs one
    _log_filter: logging.Filter | None = field(default=None, repr=False)
    _log_level: int | None = field(default=None, repr=False)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- this rank's place in the layout: read from the mesh -----------------------
    def _index(self, name: str) -> int:
        """This rank's index along dimension ``name`` of the mesh (without one: of the rank grid it would have)."""
        if self.mesh is not None:
            return self.mesh.local_rank(name)
        return self.layout.coordinate(self.rank)[name]

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (each reads its own shard of the data), replicated or sharded."""
        return self.mesh.size(DP) if self.mesh is not None else self.layout.dp

    @property
    def dp_rank(self) -> int:
        return self._index(DP)

    @property
    def tp_rank(self) -> int:
        return self._index(TP)

    @property
    def cp_rank(self) -> int:
        return self._index(CP)

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    def data_shard(self) -> dict[str, int]:
        """Which data this rank reads (data/loader.py ``build_data``): its data-parallel rank's samples and, with
        context parallel, its chunks of their sequences."""
        return dict(dp_rank=self.dp_rank, dp_size=self.dp_size, cp_rank=self.cp_rank, cp_size=self.cp_size)

    @property
    def pp_rank(self) -> int:
        return self._index(PP)

    @property
    def dp_group(self) -> Any:
        """The data-parallel ranks of this tensor-parallel rank and stage (None: the default group)."""
        return dp_group(self.layout, self.mesh)

    @property
    def stage_group(self) -> Any:
        """Every rank of this pipeline stage (None without stages: the default group), over which a MoE model's
        token counts are summed: its data-parallel ranks and, with tensor or context parallel, the ranks a MoE
        block's tokens are split over."""
        if self.mesh is None or self.layout.pp == 1:
            return None
        # the mesh has a stage view where the stage's ranks are more than its data-parallel ones (parallel/dims.py)
        return self.mesh.group(STAGE) if STAGE in self.mesh.views else self.dp_group

    @property
    def pp_group(self) -> Any:
        """The pipeline stages of this data-parallel and tensor-parallel rank (None without stages)."""
        return self.mesh.group(PP) if self.mesh is not None and self.layout.pp > 1 else None

    # ---- loss reduction (the gradients': parallel/data_parallel.py) ---------------
    def loss_reducer(self) -> Callable[[torch.Tensor], None] | None:
        # tensor-parallel ranks compute the same loss; context-parallel ranks their share (parallel/context_parallel.py)
        return self.mean_ if self.layout.grad_ranks > 1 else None

    def mean_(self, t: torch.Tensor) -> None:
        """Average ``t`` over data-parallel replicas (and context-parallel ranks) in place, as the gradients are:
        a device all-reduce, capturable, no host read."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=grad_group(self.layout, self.mesh))
        t.div_(self.layout.grad_ranks)

    def broadcast_parameters(self, model: nn.Module) -> None:
        """Rank 0's parameters and buffers everywhere (Megatron does this with data_parallel_random_init)."""
        if not self.enabled:
            return
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=0)

    # ---- host-side agreement -------------------------------------------------
    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank (a gloo all-reduce on the host).

        Called once per iteration with the stop flag: a SIGTERM reaches the
        ranks at slightly different moments, and a rank that stopped one step
        earlier than the others would leave them waiting in the next
        step's all-reduce.
        """
        if not self.enabled:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return bool(t.item())  # a CPU tensor: no device sync

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.control)

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (through the gloo group)."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (through the gloo group)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    # ---- teardown ---------------------------------------------------------------
    def close(self) -> None:
        """Destroy the process group this module created; call after every graph was freed."""
        if self.owns_group and dist.is_initialized():
            gc.collect()  # graphs caught in reference cycles must go before the communicators
            if self.backend == "nccl":
                torch.cuda.synchronize()
            forget_shared_groups()  # the mesh and groups made on this default group go with it
            dist.destroy_process_group()
            self.owns_group = False
            log.info("process group destroyed (after every graph was freed)")
        if self._log_filter is not None:
            logger = logging.getLogger("graphstep")
            logger.removeFilter(self._log_filter)
            if self._log_level is not None:
                logger.setLevel(self._log_level)
            self._log_filter = self._log_level = None


# --------------------------------------------------------------------------
# start-up


def init_data_parallel(cfg: Config, settings: CudaGraphSettings, *,
                       env: Mapping[str, str] | None = None) -> DataParallel:
    """Join torchrun's process group (or run as one rank); see the module docstring for the order."""
    env = os.environ if env is None else env
    if dist.is_available() and dist.is_initialized():  # the caller made the group: use it, leave it
        world = dist.get_world_size()
        dp = DataParallel(rank=dist.get_rank(), world_size=world, local_rank=int(env.get("LOCAL_RANK", 0)),
                          backend=dist.get_backend(), layout=ParallelDims.from_config(cfg, world))
        _check_ddp(cfg, dp)
        return _finish(dp, settings, device_id=None)
    world_size = _int_env(env, "WORLD_SIZE", 1)
    layout = ParallelDims.from_config(cfg, world_size)  # the one read of the layout
    if world_size <= 1:
        return _one_rank(cfg, layout) if layout.needs_mesh else DataParallel()
    if not dist.is_available():
        raise RuntimeError(f"WORLD_SIZE={world_size} but this PyTorch has no torch.distributed")
    rank, local_rank = _int_env(env, "RANK", 0), _int_env(env, "LOCAL_RANK", 0)
    use_cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
    if cfg.train.device.startswith("cuda") and not use_cuda:  # every rank says so and exits 2, before any group
        raise RunSetupError(f"train.device={cfg.train.device} but this machine has no CUDA device; "
                            "use train.device=cpu or auto")
    device_id = None
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise RunSetupError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPU(s) are visible: "
                                "torchrun --nproc_per_node must not exceed the GPUs of a node")
        torch.cuda.set_device(local_rank)
        device_id = torch.device("cuda", local_rank)
    dp = DataParallel(rank=rank, world_size=world_size, local_rank=local_rank,
                      backend="nccl" if use_cuda else "gloo", owns_group=True, layout=layout)
    _check_ddp(cfg, dp)
    for note in check_collective_env(dp.backend, settings, world_size):  # before NCCL reads it
        log.info(note)
    dist.init_process_group(dp.backend, device_id=device_id)
    return _finish(dp, settings, device_id)


def _one_rank(cfg: Config, layout: ParallelDims) -> DataParallel:
    """One process with a layout that needs a device mesh (FSDP2 on one rank): a one-rank process group."""
    use_cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    device_id = normalize_device("cuda") if use_cuda else None
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)
    dp = DataParallel(backend=backend, owns_group=True, layout=layout)
    dp.mesh = build_mesh(layout, "cuda" if use_cuda else "cpu")
    return dp


def _finish(dp: DataParallel, settings: CudaGraphSettings, device_id: torch.device | None) -> DataParallel:
    if dp.backend == "nccl":  # host-side agreement never waits on the GPU stream; once per process (dims.py)
        dp.control = shared_groups("control", lambda: dist.new_group(backend="gloo"))
    device = device_id or (normalize_device("cuda") if dp.backend == "nccl" else torch.device("cpu"))
    if dp.layout.needs_mesh:
        dp.mesh = build_mesh(dp.layout, device.type)
    # One collective before any capture: NCCL creates a communicator at the
    # first collective on a group, and that cannot happen inside a capture.
    warm = torch.ones(1, device=device)
    dist.all_reduce(warm)
    dp.barrier()
    _rank_zero_logging(dp)
    log.info("data parallel: %s, %s backend (rank %d on %s), %s", dp.layout.describe(), dp.backend, dp.rank,
             device, "full-iteration graphs capture the gradient all-reduce" if settings.full_iteration
             else ("gradients all-reduced eagerly after the backward graphs" if settings.per_layer
                   else "gradients all-reduced after the backward"))
    return dp


def _check_ddp(cfg: Config, dp: DataParallel) -> None:
    # the config was validated for this world size (group_world_size), so R22 has refused an fp16/bf16 reduce
    assert not dp.enabled or cfg.ddp.grad_reduce_in_fp32 is True, "rule R22 refuses ddp.grad_reduce_in_fp32=false"


def group_world_size() -> int | None:
    """The world size of a process group the caller made before the run (None: torchrun's WORLD_SIZE says it).

    The config is validated for it (``resolve_cuda_graph_settings(..., world_size=...)``): a group made by the
    caller need not set WORLD_SIZE.
    """
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


def _rank_zero_logging(dp: DataParallel) -> None:
    if not dp.enabled:
        return
    logger = logging.getLogger("graphstep")
    rank = dp.rank

    class _Tag(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if rank != 0 and not getattr(record, "_rank_tagged", False):
                record.msg, record._rank_tagged = f"rank {rank}: {record.msg}", True
            return True

    dp._log_filter = _Tag()
    logger.addFilter(dp._log_filter)
    if rank != 0:  # rank 0 speaks for all; the others keep their warnings and errors
        dp._log_level = logger.level
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(env.get(name, default))
    except (TypeError, ValueError):
        raise RuntimeError(f"environment variable {name}={env.get(name)!r} is not an integer "
                           "(it is set by torchrun)") from None


def check_collective_env(backend: str | None, settings: CudaGraphSettings, world_size: int) -> list[str]:
    """What captured NCCL collectives need, said in the log (the notes returned).

    Applies only when a full-iteration graph captures the all-reduce on NCCL
    (per-layer graphs reduce eagerly; gloo never captures). Rule R16
    (expandable segments need ``NCCL_GRAPH_REGISTER=0``) is checked earlier,
    with every other rule, by ``resolve_cuda_graph_settings``, and raises.
    ``TORCH_NCCL_BLOCKING_WAIT=1`` was checked on torch 2.11 / NCCL 2.28: a
    captured all-reduce waited with it replays correctly, so it is allowed.
    """
    if backend != "nccl" or world_size <= 1 or not settings.full_iteration:
        return []
    return [
        "collectives in CUDA graphs: the NCCL communicator is created eagerly (init_process_group(device_id=...)) "
        "and warmed up with one all-reduce before any capture; ranks meet at a barrier before capturing; capture "
        "uses capture_error_mode=thread_local so the NCCL watchdog thread may keep querying events",
        "collectives in CUDA graphs are not tracked by the NCCL watchdog: a replay waiting for a rank that died "
        "does not time out by itself (torchrun stops the job when a worker exits)",
    ]
