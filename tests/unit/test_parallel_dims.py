"""The layout object (parallel/dims.py): where each rank sits, read from one rank grid; the mesh built on it; the
layouts it refuses to describe; and parallelize's refusals (the ``cuda`` twin builds the mesh over NCCL)."""

from __future__ import annotations

import pytest
import torch

from graphstep.parallel.dims import ParallelDims

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def test_every_rank_of_a_three_dimensional_layout_has_one_place():
    """pp2 x dp2 x tp2 on 8 ranks: tensor-parallel ranks are neighbours, then replicas, then stages -- and every
    (pp, dp, tp) place is taken by exactly one rank."""
    dims = ParallelDims(pp=2, dp_replicate=2, tp=2)
    places = [dims.coordinate(r) for r in range(8)]
    assert [(c["pp"], c["dp"], c["tp"]) for c in places] == [(p, d, t) for p in (0, 1) for d in (0, 1) for t in (0, 1)]
    assert all(c["dp_replicate"] == c["dp"] and c["dp_shard"] == 0 and c["cp"] == 0 for c in places)


def test_context_parallel_ranks_sit_between_the_data_parallel_and_tensor_parallel_ones():
    """dp2 x cp2 x tp2 on 8 ranks: the tensor-parallel ranks are neighbours, then the context-parallel ones; gradients
    and losses are averaged over the dp x cp ranks of a tensor-parallel rank (``dp_cp``), data is read per dp."""
    dims = ParallelDims(dp_replicate=2, cp=2, tp=2)
    places = [dims.coordinate(r) for r in range(8)]
    assert [(c["dp"], c["cp"], c["tp"]) for c in places] == [(d, c, t) for d in (0, 1) for c in (0, 1) for t in (0, 1)]
    assert [c["dp_cp"] for c in places] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert (dims.grad_ranks, dims.grad_dim, dims.flattened()["dp_cp"]) == (4, "dp_cp", ("dp_replicate", "dp_shard",
                                                                                          "cp"))
    assert dims.describe() == "2 data-parallel x 2 context-parallel x 2 tensor-parallel ranks"
    assert (ParallelDims(dp_replicate=2).grad_dim, ParallelDims(cp=2).needs_mesh) == ("dp", True)


def test_expert_parallel_ranks_are_neighbours_within_the_replicas():
    """dp4 with ep2: ranks 0,1 and 2,3 exchange tokens (ep); 0,2 and 1,3 hold the same experts (edp)."""
    dims = ParallelDims(dp_replicate=4, ep=2)
    assert [(dims.coordinate(r)["edp"], dims.coordinate(r)["ep"], dims.coordinate(r)["dp"]) for r in range(4)] == \
        [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    assert [name for name, _ in dims.mesh_dims()] == ["pp", "edp", "ep", "dp_shard", "cp", "tp"]


def test_expert_parallel_with_fsdp2_and_tensor_parallel_places_every_rank():
    """FSDP2 over 4 ranks with ep2: the sharded ranks are (edp, ep), neighbours exchange tokens; ep2 x tp2 over 8
    ranks: the tensor-parallel ranks of an expert-parallel rank hold its experts too (``expert_dp`` = (edp, tp))."""
    fsdp = ParallelDims(dp_shard=4, ep=2, fsdp="optim_grads")
    assert [name for name, _ in fsdp.mesh_dims()] == ["pp", "dp_replicate", "edp", "ep", "cp", "tp"]
    assert fsdp.flattened() == {"dp": ("dp_replicate", "edp", "ep"), "dp_shard": ("edp", "ep")}
    assert [(c["edp"], c["ep"], c["dp_shard"], c["dp"]) for c in map(fsdp.coordinate, range(4))] == \
        [(0, 0, 0, 0), (0, 1, 1, 1), (1, 0, 2, 2), (1, 1, 3, 3)]
    tp = ParallelDims(dp_replicate=4, ep=2, tp=2)
    assert tp.flattened()["expert_dp"] == ("edp", "tp")
    places = [tp.coordinate(r) for r in range(8)]
    assert [(c["edp"], c["ep"], c["tp"]) for c in places] == [(e, p, t) for e in (0, 1) for p in (0, 1) for t in (0, 1)]
    assert [c["expert_dp"] for c in places] == [0, 1, 0, 1, 2, 3, 2, 3]  # same ep index: one expert_dp group


def test_fsdp_shards_over_dp_shard_and_from_config_says_so():
    from helpers.runs import tiny_config

    dims = ParallelDims.from_config(tiny_config("ddp.use_distributed_optimizer=true",
                                                "model.tensor_model_parallel_size=2"), 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp, dims.ranks) == (1, 4, 2, 4, 8)
    plain = ParallelDims.from_config(tiny_config(), 4)
    assert (plain.dp_replicate, plain.dp_shard, plain.needs_mesh) == (4, 1, False)


@pytest.mark.parametrize("kwargs,words", [
    (dict(dp_replicate=2, dp_shard=2, fsdp="optim_grads"), "hybrid sharding is not implemented"),
    (dict(dp_shard=2), "without an FSDP2 strategy"),
    (dict(dp_replicate=2, fsdp="optim_grads"), "FSDP2 shards over dp_shard"),
    (dict(tp=0), "positive integers: tp=0"),
])
def test_a_layout_it_cannot_run_is_a_one_line_error(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ParallelDims(**kwargs)


def test_expert_parallel_ranks_must_divide_the_replicas():
    with pytest.raises(ValueError, match="do not divide dp_replicate=3"):
        ParallelDims(dp_replicate=3, ep=2).mesh_dims()
    with pytest.raises(ValueError, match="do not divide dp_shard=6"):
        ParallelDims(dp_shard=6, ep=4, fsdp="optim_grads").mesh_dims()
    with pytest.raises(ValueError, match="rank 4 is not one of the 4 ranks"):
        ParallelDims(dp_replicate=4).coordinate(4)


@pytest.mark.parametrize("device", DEVICES)
def test_the_mesh_on_one_rank_has_every_dimension_and_the_flattened_dp(one_rank_group, device):
    """FSDP2 on one rank (the trainer's one-rank mesh): every named dimension is there, ``dp`` is a view of the
    same root, and ranks read from the mesh are those of the grid."""
    from graphstep.parallel.dims import build_mesh, counted_here

    dims = ParallelDims(fsdp="optim_grads_params")
    mesh = build_mesh(dims, device)
    assert mesh.root.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert mesh["dp"].mesh_dim_names == ("dp",) and mesh.size("dp") == 1 and mesh.spans("dp") == ("dp_replicate",
                                                                                                   "dp_shard")
    assert all(mesh.local_rank(name) == index for name, index in dims.coordinate(0).items())
    assert counted_here(torch.zeros(2), mesh)


def test_runs_of_one_layout_share_the_mesh_until_the_default_group_changes():
    """The mesh's groups are made once per layout and default process group (parallel/dims.py ``shared_groups``):
    a second run with the same mesh dimensions -- another sharding strategy included -- gets the same DeviceMesh
    and views; a new default group, a new mesh. (The launches of tests/distributed run layouts of other
    dimensions one after another in one process.)"""
    import torch.distributed as dist

    from graphstep.parallel.dims import build_mesh

    def mesh(**layout):
        return build_mesh(ParallelDims(**layout), "cpu")

    roots = []
    for _ in range(2):  # two default groups, one after the other
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            first = mesh(fsdp="optim_grads_params")
            again, other = mesh(fsdp="optim_grads"), mesh(fsdp="optim_grads_params", ep=1, cp=1)
            assert again.root is first.root and again.views["dp"] is first.views["dp"] and other.root is first.root
            assert again.dims.fsdp == "optim_grads"  # the run's own layout, on the shared mesh
            roots.append(first.root)
        finally:
            dist.destroy_process_group()
    assert roots[0] is not roots[1]


def test_parallelize_refuses_a_layout_without_its_mesh():
    from graphstep.parallel.parallelize import parallelize
    from graphstep.validation import resolve_cuda_graph_settings
    from helpers.runs import tiny_config

    model, cfg = torch.nn.Linear(2, 2), tiny_config()
    settings = resolve_cuda_graph_settings(cfg)
    with pytest.raises(RuntimeError, match="needs a device mesh"):
        parallelize(model, ParallelDims(tp=2), None, cfg, param_dtype=torch.float32, settings=settings)
    with pytest.raises(RuntimeError, match="needs a device mesh"):
        parallelize(model, ParallelDims(cp=2), None, cfg, param_dtype=torch.float32, settings=settings)
