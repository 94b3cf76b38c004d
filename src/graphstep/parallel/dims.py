"""The run's layout: how many ranks each way of splitting the work takes, and the one device mesh over them.

:class:`ParallelDims` is the world split into ``pp`` pipeline stages x
``dp_replicate`` replicated and ``dp_shard`` sharded (FSDP2) data-parallel
ranks x ``cp`` context-parallel x ``tp`` tensor-parallel ranks; ``ep``
expert-parallel ranks borrow from the data-parallel ones, as Megatron's do
(each holds ``num_moe_experts / ep`` experts; the ranks holding the same
experts form the ``edp`` dimension). It is made once per start from the
validated config (:meth:`ParallelDims.from_config`: rules R25-R31 decide
which layouts a config may ask for) and says nothing about this rank.

:class:`WorldMesh` is the run's one :class:`DeviceMesh`, built once from the
layout (:func:`build_mesh`), with the dimensions outermost first:
``(pp, dp_replicate, dp_shard, cp, tp)``; with expert parallel the
data-parallel ranks are ``(edp, ep)``: ``(pp, edp, ep, dp_shard, cp, tp)``
over replicas, ``(pp, dp_replicate, edp, ep, cp, tp)`` under FSDP2 -- torchrun's
ranks in that order, so the tensor-parallel ranks of one replica are
neighbours (one node's NVLink), and so are the expert-parallel ranks that
exchange tokens. The data-parallel ranks seen as one dimension (``dp``:
FSDP2's mesh, the gradient all-reduce's group; and ``dp_replicate`` or
``dp_shard`` over ``(edp, ep)``) are flattened views of it, kept here; so is
``expert_dp`` = ``(edp, tp)`` with expert and tensor parallel when the experts
are not split over the tensor-parallel ranks (``expert_tensor_parallel_size``
``etp`` 1): each of those runs the MoE blocks on its own share of the tokens,
so they hold the same experts as the ``edp`` ranks do and sum their gradients
with them (with context parallel ``expert_dp`` spans ``(edp, cp)`` or
``(edp, cp, tp)``: a context-parallel rank routes its own chunks' tokens, over
the expert-parallel ranks that hold the same chunks) (Megatron's expert grid
re-folds the tensor-parallel ranks into its expert dimensions too; it makes
them expert-parallel, here they are expert-data-parallel). With ``etp`` = ``tp``
(Megatron's default: ``expert_tensor_parallel_size`` null) each expert is split
over the tensor-parallel ranks too, and the ranks that exchange tokens are
``ep_tp`` = ``(ep, tp)`` (Megatron's ``tp_ep`` group; parallel/expert_parallel.py).
Every rank index and process group of a run is read from this mesh
(``mesh.local_rank("tp")``, ``mesh["dp"].get_group()``); nothing derives
them from the rank number. Without a mesh (plain data parallel, or a test
placing a rank) :meth:`ParallelDims.coordinate` reads the same rank grid the
mesh would be built on.

Context-parallel ranks (parallel/context_parallel.py) hold other tokens of
the same samples: they read the data of their data-parallel rank, and their
gradients and losses are averaged with the data-parallel ranks' -- over the
flattened ``dp_cp`` view of ``(dp_replicate, dp_shard, cp)``, Megatron's
data-parallel-with-context-parallel group, which FSDP2 also shards over.
With one context-parallel rank that group is ``dp`` (:meth:`ParallelDims.grad_dim`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..config import Config, expert_tensor_parallel
from ..engines_compat import dtensor_local, flatten_mesh
from .pipeline import is_tied_copy

PP, DP_REPLICATE, DP_SHARD, CP, TP = "pp", "dp_replicate", "dp_shard", "cp", "tp"
EDP, EP = "edp", "ep"  # expert parallel: the data-parallel ranks as (expert-data-parallel, expert-parallel) ranks
DP = "dp"  # every data-parallel rank, replicated or sharded: a flattened view
EXPERT_DP = "expert_dp"  # expert x tensor/context parallel: every rank holding the same experts, (edp, [cp], [tp])
EP_TP = "ep_tp"  # expert tensor parallel with expert parallel: the ranks exchanging tokens, (ep, tp)
DP_CP = "dp_cp"  # the data-parallel and context-parallel ranks: gradients and losses are averaged over them
STAGE = "stage"  # every rank of a pipeline stage (all but pp), with tensor or context parallel: MoE token counts


@dataclass(frozen=True)
class ParallelDims:
    """How many ranks each dimension of the layout takes, and how the data-parallel ones hold the model.

    ``dp_replicate`` and ``dp_shard`` are not both above 1 (hybrid sharding
    is not implemented); ``dp_shard`` > 1 needs ``fsdp``, and ``fsdp`` on one
    rank (``dp_shard`` 1) is FSDP2 over a one-rank mesh. ``ep`` divides
    the data-parallel ranks, replicated or sharded (rule R31).
    """

    pp: int = 1  # pipeline stages (parallel/pipeline.py)
    dp_replicate: int = 1  # data-parallel replicas: gradients all-reduced (parallel/data_parallel.py)
    dp_shard: int = 1  # FSDP2-sharded data-parallel ranks (parallel/fsdp.py)
    cp: int = 1  # context-parallel ranks (parallel/context_parallel.py; R30)
    tp: int = 1  # tensor-parallel ranks (parallel/tensor_parallel.py)
    ep: int = 1  # expert-parallel ranks among the data-parallel ones (parallel/expert_parallel.py)
    etp: int = 1  # expert tensor parallel: 1 (experts whole) or tp (each expert split over the tp ranks)
    sequence_parallel: bool = False
    fsdp: str | None = None  # None (replicated), "optim_grads" (ZeRO-2) or "optim_grads_params" (ZeRO-3)
    prefetch: bool = False  # FSDP2 explicit forward prefetch (ddp.overlap_param_gather)

    def __post_init__(self) -> None:
        sizes = dict(pp=self.pp, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, cp=self.cp, tp=self.tp,
                     ep=self.ep)
        bad = [f"{k}={v}" for k, v in sizes.items() if not isinstance(v, int) or v < 1]
        if bad:
            raise ValueError(f"parallel dimensions are positive integers: {', '.join(bad)}")
        if self.dp_replicate > 1 and self.dp_shard > 1:
            raise ValueError(f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard}: hybrid sharding is not "
                             "implemented; shard over every data-parallel rank or replicate over them")
        if self.dp_shard > 1 and self.fsdp is None:
            raise ValueError(f"dp_shard={self.dp_shard} without an FSDP2 strategy (fsdp=None): use dp_replicate")
        if self.etp not in (1, self.tp):
            raise ValueError(f"etp={self.etp}: the experts are split over 1 or all tp={self.tp} tensor-parallel ranks")
        if self.fsdp is not None and self.dp_replicate > 1:
            raise ValueError(f"fsdp={self.fsdp} with dp_replicate={self.dp_replicate}: FSDP2 shards over dp_shard")

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> "ParallelDims":
        """The layout of a validated config (R25-R31) on ``world_size`` ranks: called once per start."""
        d, m = cfg.ddp, cfg.model
        tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
        if d.use_megatron_fsdp:
            fsdp = None if d.data_parallel_sharding_strategy == "no_shard" else d.data_parallel_sharding_strategy
        else:
            fsdp = "optim_grads" if d.use_distributed_optimizer or cfg.optimizer.use_distributed_optimizer else None
        dp = max(1, world_size // (tp * pp * cp))
        etp = expert_tensor_parallel(m) if m.num_moe_experts is not None else 1
        return cls(pp=pp, dp_replicate=1 if fsdp else dp, dp_shard=dp if fsdp else 1, cp=cp, tp=tp,
                   ep=m.expert_model_parallel_size, etp=etp, sequence_parallel=m.sequence_parallel, fsdp=fsdp,
                   prefetch=d.overlap_param_gather)

    @property
    def dp(self) -> int:
        """Data-parallel ranks, replicated or sharded: each reads its own share of the data."""
        return self.dp_replicate * self.dp_shard

    @property
    def grad_ranks(self) -> int:
        """The ranks every gradient and loss is averaged over: data-parallel x context-parallel."""
        return self.dp * self.cp

    @property
    def grad_dim(self) -> str:
        """The mesh view of :attr:`grad_ranks`: ``dp_cp``, or ``dp`` itself with one context-parallel rank."""
        return DP_CP if self.cp > 1 else DP

    @property
    def expert_holders(self) -> int:
        """The ranks holding the same part of an expert, which sum its gradient: the ``edp`` ranks, their
        context-parallel ranks, and their tensor-parallel ones unless the experts are split over those (``etp``)."""
        return self.dp // self.ep * self.cp * (self.tp if self.etp == 1 else 1)

    @property
    def ranks(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def needs_mesh(self) -> bool:
        """Tensor, pipeline, context or expert parallel, or FSDP2: ranks are placed on a device mesh (even one)."""
        return self.tp > 1 or self.fsdp is not None or self.pp > 1 or self.ep > 1 or self.cp > 1

    def describe(self) -> str:
        """e.g. ``4 data-parallel (FSDP2 optim_grads_params) x 2 tensor-parallel + sequence-parallel ranks``."""
        parts = [f"{self.pp} pipeline-stage"] if self.pp > 1 else []
        parts.append(f"{self.dp} data-parallel" + (f" (FSDP2 {self.fsdp})" if self.fsdp else "")
                     + (f" ({self.ep} expert-parallel)" if self.ep > 1 else ""))
        if self.cp > 1:
            parts.append(f"{self.cp} context-parallel")
        if self.tp > 1:
            parts.append(f"{self.tp} tensor-parallel" + (" + sequence-parallel" if self.sequence_parallel else "")
                         + (" (experts too)" if self.etp > 1 else ""))
        return " x ".join(parts) + (" rank" if self.ranks == 1 else " ranks")

    # ---- the rank grid the mesh is built on -------------------------------------
    def mesh_dims(self) -> list[tuple[str, int]]:
        """The mesh's dimensions and sizes, outermost first (see the module docstring)."""
        if self.ep == 1:
            return [(PP, self.pp), (DP_REPLICATE, self.dp_replicate), (DP_SHARD, self.dp_shard), (CP, self.cp),
                    (TP, self.tp)]
        if self.dp % self.ep:
            kind = f"dp_shard={self.dp_shard}" if self.fsdp else f"dp_replicate={self.dp_replicate}"
            raise ValueError(f"ep={self.ep} expert-parallel ranks do not divide {kind} data-parallel ranks (rule R31)")
        experts = [(EDP, self.dp // self.ep), (EP, self.ep)]
        if self.fsdp:  # the sharded data-parallel ranks are (edp, ep): FSDP2 shards the experts over edp
            return [(PP, self.pp), (DP_REPLICATE, 1), *experts, (CP, self.cp), (TP, self.tp)]
        return [(PP, self.pp), *experts, (DP_SHARD, 1), (CP, self.cp), (TP, self.tp)]

    def flattened(self) -> dict[str, tuple[str, ...]]:
        """The mesh's one-dimensional views over several of its dimensions: name -> the dimensions it spans."""
        if self.ep == 1:
            views = {DP: (DP_REPLICATE, DP_SHARD)}
            if self.cp > 1:
                views[DP_CP] = (DP_REPLICATE, DP_SHARD, CP)
            if self.pp > 1 and (self.tp > 1 or self.cp > 1):  # the stage's ranks: a MoE model's token counts
                views[STAGE] = (DP_REPLICATE, DP_SHARD, CP, TP)
            return views
        # expert parallel
        if self.fsdp:
            views = {DP: (DP_REPLICATE, EDP, EP), DP_SHARD: (EDP, EP)}
        else:
            views = {DP: (EDP, EP, DP_SHARD), DP_REPLICATE: (EDP, EP)}
        if self.cp > 1:  # each context-parallel rank's MoE blocks route the tokens of its own chunks
            views[DP_CP] = (*views[DP], CP)
        # the ranks holding the same experts: the edp ranks, and the context- and tensor-parallel ranks, each of
        # which runs the MoE blocks on its own share of the tokens (tensor_parallel.py, context_parallel.py) --
        # but the tensor-parallel ranks hold other parts of the experts under expert tensor parallel, where they
        # exchange tokens with the expert-parallel ranks (expert_parallel.py)
        holders = (EDP, *((CP,) if self.cp > 1 else ()), *((TP,) if self.tp > 1 and self.etp == 1 else ()))
        if len(holders) > 1:
            views[EXPERT_DP] = holders
        if self.etp > 1:
            views[EP_TP] = (EP, TP)
        if self.pp > 1 and (self.tp > 1 or self.cp > 1):  # the stage's ranks, over which the token counts are summed
            views[STAGE] = tuple(name for name, _ in self.mesh_dims() if name != PP)
        return views

    @property
    def holders_dim(self) -> str:
        """The mesh view of :attr:`expert_holders` with expert parallel: ``expert_dp``, or ``edp`` alone."""
        return EXPERT_DP if EXPERT_DP in self.flattened() else EDP

    def rank_grid(self) -> torch.Tensor:
        """torchrun's ranks laid out over :meth:`mesh_dims`: the mesh's rank tensor."""
        return torch.arange(self.ranks).view(*(size for _, size in self.mesh_dims()))

    def coordinate(self, rank: int) -> dict[str, int]:
        """``rank``'s index along every dimension and flattened view, read from :meth:`rank_grid`."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} is not one of the {self.ranks} ranks of the layout {self.describe()}")
        grid, names = self.rank_grid(), [name for name, _ in self.mesh_dims()]
        where = [int(i) for i in (grid == rank).nonzero()[0]]
        out = dict(zip(names, where))
        for view, spans in self.flattened().items():  # the rank's place in the ranks that differ only there
            index = tuple(slice(None) if name in spans else where[i] for i, name in enumerate(names))
            out[view] = grid[index].flatten().tolist().index(rank)
        return out


# The process groups of this process's runs, made once per default process group: a run whose layout an earlier
# run of the same process had (a sweep, the tests' launches of many runs) takes that run's device mesh and groups.
# Made anew per run they would pile up: each idle gloo group keeps a thread that wakes up every 10 ms (hundreds of
# groups took whole cores), and destroying them would not do -- DTensor's sharding caches hand later runs the
# earlier, equal meshes, whose destroyed groups no longer resolve.
_SHARED: dict[Any, Any] = {}


def shared_groups(key: Any, make: Callable[[], Any]) -> Any:
    """``make()`` -- process groups, or a device mesh and its views -- once per ``key`` and default process group:
    later calls with the same key return the same objects. Every rank calls it in the same order (``make`` may
    create groups: a collective call)."""
    world = dist.group.WORLD
    if _SHARED.get("world") is not world:  # a new default group: the groups of the old one are gone with it
        _SHARED.clear()
        _SHARED["world"] = world
    if key not in _SHARED:
        _SHARED[key] = make()
    return _SHARED[key]


def forget_shared_groups() -> None:
    """Drop the shared groups before the default process group they were made on is destroyed."""
    _SHARED.clear()


class WorldMesh:
    """The run's one DeviceMesh (``root``) and its flattened views; ``mesh[name]`` is either, as a DeviceMesh.
    Runs of one process with the same mesh dimensions share them (:func:`shared_groups`)."""

    def __init__(self, dims: ParallelDims, device_type: str) -> None:
        world = dist.get_world_size()
        if dims.ranks != world:
            raise RuntimeError(f"the layout {dims.describe()} needs {dims.ranks} ranks, the process group has {world}")
        self.dims = dims
        names = tuple(n for n, _ in dims.mesh_dims())

        def make() -> tuple[DeviceMesh, dict[str, DeviceMesh]]:
            root = DeviceMesh(device_type, dims.rank_grid(), mesh_dim_names=names)
            return root, {name: flatten_mesh(root[spans], name) for name, spans in dims.flattened().items()}

        key = ("mesh", device_type, tuple(dims.mesh_dims()), tuple(dims.flattened().items()))
        self.root, self.views = shared_groups(key, make)
        # Slices of the root and this rank's coordinates, made once: DeviceMesh makes a new slice (and computes the
        # coordinates anew) at every call, milliseconds each, and the step asks for them per parameter.
        self._slices: dict[str | tuple[str, ...], DeviceMesh] = {}
        self._local_ranks: dict[str, int] = {}

    def __getitem__(self, name: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(name, str) and name in self.views:
            return self.views[name]
        mesh = self._slices.get(name)
        if mesh is None:
            mesh = self._slices[name] = self.root[name]
        return mesh

    def local_rank(self, name: str) -> int:
        rank = self._local_ranks.get(name)
        if rank is None:
            rank = self._local_ranks[name] = self[name].get_local_rank()
        return rank

    def size(self, name: str) -> int:
        return self[name].size()

    def group(self, name: str) -> Any:
        return self[name].get_group()

    def spans(self, name: str) -> tuple[str, ...]:
        """The root dimensions ``name`` covers (itself for a root dimension)."""
        return self.dims.flattened().get(name, (name,))


def build_mesh(dims: ParallelDims, device_type: str) -> WorldMesh:
    """The run's mesh over the default process group: once per run (its groups once per process and layout)."""
    return WorldMesh(dims, device_type)


# --------------------------------------------------------------------------
# what the optimizer needs of a sharded parameter


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The part of ``p`` this rank holds (``p`` itself when it is not a DTensor); shares its storage."""
    return dtensor_local(p) if isinstance(p, DTensor) else p


def counted_here(p: torch.Tensor, mesh: WorldMesh | None) -> bool:
    """Whether this rank counts ``p``'s local gradient in the global norm: each element once over the mesh.

    A gradient replicated over a mesh dimension (a replicated parameter, or any
    parameter over replicated data-parallel ranks) is counted on that
    dimension's rank 0 only; a sharded one on every rank (and every pipeline
    stage counts its own parameters, but the last stage's copy of a tied
    embedding, whose gradient is the first stage's).
    """
    if mesh is None:
        return True
    if is_tied_copy(p):
        return False
    sharded: set[str] = {PP}  # each pipeline stage holds other parameters
    if isinstance(p, DTensor):  # a parameter is replicated or sharded (Shard, or FSDP2's _StridedShard) per dimension
        for name, placement in zip(p.device_mesh.mesh_dim_names or (), p.placements):
            if not placement.is_replicate():
                sharded.update(mesh.spans(name))
    return all(mesh.local_rank(name) == 0 for name, _ in mesh.dims.mesh_dims() if name not in sharded)
