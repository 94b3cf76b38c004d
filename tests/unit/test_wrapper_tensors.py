"""Graphs over tensor subclasses and module state: DTensor arguments, outputs and gradients (compared and copied
through their local tensors, placements kept), and a capture that leaves module buffers as eager autograd saw
them; ``graph_step(..., modules=)`` refusing replaced buffers. One-rank meshes in this process (gloo, or NCCL for
the ``cuda`` twins); the two-rank sequence-parallel case runs this file's ``two_rank_worker`` under torchrun.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import graphstep
from graphstep import ContractError, GraphUsageError

from helpers.launch import torchrun_reports
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
TWO_RANKS = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")])]


def _mesh(device: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, (1,))


def _dtensor(t: torch.Tensor, mesh, placement=None):
    from torch.distributed.tensor import Replicate, distribute_tensor

    return distribute_tensor(t, mesh, [placement or Replicate()])


# ---- item: a DTensor argument is copied into the static input -----------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_a_dtensor_argument_is_copied_into_the_graph(one_rank_group, device):
    """A DTensor's ``data_ptr()`` is 0: the copy-in must compare and copy its local tensor, every call."""
    mesh = _mesh(device)
    step = graphstep.graph_step(lambda x: (x * 2).to_local(), warmup_steps=1, device=device)
    for i in range(4):
        x = _dtensor(torch.full((4,), float(i), device=device), mesh)
        assert torch.equal(step(x), torch.full((4,), 2.0 * i, device=device)), i
    assert step.state == "replayed"


@pytest.mark.parametrize("device", DEVICES)
def test_a_dtensor_of_another_layout_is_a_contract_error_naming_the_argument(one_rank_group, device):
    from torch.distributed.tensor import Shard

    mesh = _mesh(device)
    step = graphstep.graph_step(lambda x, y: x * y.to_local(), warmup_steps=1, device=device)
    ones = torch.ones(4, 2, device=device)
    for _ in range(2):
        step(ones, _dtensor(ones, mesh))
    with pytest.raises(ContractError, match=r"argument \[1\] has another layout.*Replicate.*now DTensor.*Shard"):
        step(ones, _dtensor(ones, mesh, Shard(0)))
    with pytest.raises(ContractError, match=r"argument \[1\] differs .*captured DTensor\(shape=\(4, 2\).*\(4, 3\)"):
        step(ones, _dtensor(torch.ones(4, 3, device=device), mesh))
    with pytest.raises(ContractError, match=r"argument \[1\] has another layout.*DTensor.*now tensor"):
        step(ones, ones)
    with pytest.raises(ContractError, match=r"argument \[0\] has another layout.*tensor.*now DTensor"):
        step(_dtensor(ones, mesh), _dtensor(ones, mesh))


def test_same_data_sees_a_dtensor_through_its_local_tensor_and_keeps_the_fast_path(one_rank_group):
    """The no-copy path: the static buffer itself (or a view of all of it) passed back is not copied -- for a
    plain tensor as for a DTensor; a copy of either is."""
    from graphstep.cuda_graph.static_io import StaticInputs, clone_keeping_layout, same_data

    x = _dtensor(torch.arange(4.0), _mesh("cpu"))
    assert same_data(x, x.detach()) and not same_data(x, clone_keeping_layout(x))
    assert x.data_ptr() == clone_keeping_layout(x).data_ptr() == 0  # why addresses are read on the local tensor
    for example in (torch.arange(4.0), x):
        static = StaticInputs(((example,), {}), call=True)
        buffer = static.leaves[0]
        copies = []
        original = torch.Tensor.copy_

        def spy(self, src, *a, **k):
            copies.append(src)
            return original(self, src, *a, **k)

        torch.Tensor.copy_ = spy
        try:
            static.copy_in(((buffer.detach(),), {}))
            assert copies == []
            static.copy_in(((clone_keeping_layout(example) + 1,), {}))
            assert len(copies) == 1
        finally:
            torch.Tensor.copy_ = original
        assert torch.equal(clone_keeping_layout(buffer), clone_keeping_layout(example) + 1)


def _sequence_parallel_net(device: str, mesh, dtensor_output: bool) -> nn.Module:
    """torchtitan's sequence-parallel plan on a norm and an MLP block: the norm's output is a Shard(1) DTensor,
    ``PrepareModuleInput`` hands the block a Replicate DTensor (the graphed module's argument); the block's
    output is a DTensor too when ``dtensor_output`` (its incoming gradient then is one)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    torch.manual_seed(0)
    net = nn.Sequential(nn.RMSNorm(8), nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))).to(device)
    return parallelize_module(net, mesh, {
        "0": SequenceParallel(),
        "1": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "1.0": ColwiseParallel(),
        "1.2": RowwiseParallel(output_layouts=Shard(1), use_local_output=not dtensor_output),
    })


@pytest.mark.parametrize("dtensor_output", [False, True], ids=["plain_output", "dtensor_output"])
@pytest.mark.parametrize("device", DEVICES)
def test_graph_layers_over_a_sequence_parallel_block_equal_eager(one_rank_group, device, dtensor_output):
    """The graphed block gets a DTensor argument (and, with a DTensor output, a DTensor incoming gradient) that
    changes every step: losses and every gradient equal eager's, bit for bit, also after the capture."""
    mesh = _mesh(device)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 4, 8, generator=g).to(device), torch.randn(2, 4, 8, generator=g).to(device))
               for _ in range(5)]

    def run(graphed: bool) -> list[list[torch.Tensor]]:
        net = _sequence_parallel_net(device, mesh, dtensor_output)
        layers = graphstep.graph_layers(net, ["1"], warmup_steps=2) if graphed else None
        out = []
        for x, w in batches:
            y = net(x)
            loss = ((y.to_local() if dtensor_output else y) * w).sum()  # another output gradient every step
            loss.backward()
            out.append([loss.detach()] + [p.grad.full_tensor() for p in net.parameters()])
            for p in net.parameters():
                p.grad = None
        if layers is not None:
            assert layers.captured
            layers.close()
        return out

    for step, (a, b) in enumerate(zip(run(False), run(True))):
        for k, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), (step, k)


# ---- item: gradients keep their placements --------------------------------------------------------------------


def _norm_net(device: str, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.RMSNorm(8))).to(device)
    parallelize_module(net[0], mesh, {"0": SequenceParallel(use_local_output=True)})
    return net


def norm_grads(device: str, graphed: bool, steps: int = 3, micro_batches: int = 1) -> list[tuple[str, torch.Tensor]]:
    """Per step: the norm weight's accumulated gradient (its placements, and its local tensor)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (torch.distributed.get_world_size(),))
    net = _norm_net(device, mesh)
    layers = graphstep.graph_layers(net, ["0"], warmup_steps=1) if graphed else None
    weight = net[0][0].weight
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(steps):
        for _ in range(micro_batches):
            x = torch.randn(2, 4 * mesh.size(), 8, generator=g).to(device)
            local = distribute_tensor(x, mesh, [Shard(1)]).to_local()  # this rank's sequence shard
            (net(local) * local).sum().backward()
        out.append((str(weight.grad.placements), weight.grad.to_local().clone()))
        weight.grad = None
    if layers is not None:
        layers.close()
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_a_partial_gradient_stays_partial(one_rank_group, device):
    """The backward's copy of a sequence-parallel norm's gradient keeps ``Partial(sum)`` (DTensor's clone()
    would make it ``Replicate``, an all-reduce per micro-batch)."""
    eager, graphed = norm_grads(device, False), norm_grads(device, True)
    assert [p for p, _ in eager] == ["(Partial(sum),)"] * 3
    assert [p for p, _ in graphed] == [p for p, _ in eager]
    for (_, a), (_, b) in zip(eager, graphed):
        assert torch.equal(a, b)


def two_rank_worker(out: str, device: str) -> None:
    """A torchrun worker: the norm's accumulated gradient over 2 micro-batches, eager and graphed, on 2 ranks."""
    import os

    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    report: dict = {}
    try:
        eager = norm_grads(device, False, steps=3, micro_batches=2)
        graphed = norm_grads(device, True, steps=3, micro_batches=2)
        report["placements"] = [[p for p, _ in eager], [p for p, _ in graphed]]
        report["equal"] = [torch.equal(a, b) for (_, a), (_, b) in zip(eager, graphed)]
        report["max_diff"] = max((a - b).abs().max().item() for (_, a), (_, b) in zip(eager, graphed))
    finally:
        (Path(out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
        graphstep.close_all()
        dist.destroy_process_group()


@pytest.mark.parametrize("device", TWO_RANKS)
def test_sequence_parallel_norm_gradients_on_two_ranks_equal_eager(tmp_path, device):
    """2 ranks, 2 micro-batches: the accumulated norm-weight gradient keeps eager's ``Partial(sum)`` and its
    bits (a ``Replicate`` copy per micro-batch would all-reduce each and round differently)."""
    reports = torchrun_reports(__file__, "two_rank_worker", tmp_path, 2, device, timeout=300)
    for rank, report in enumerate(reports):
        assert report["placements"] == [["(Partial(sum),)"] * 3] * 2, rank
        assert report["equal"] == [True] * 3, (rank, report["max_diff"])


# ---- item: the capture leaves module buffers as eager autograd saw them ---------------------------------------


class MaskedLinear(nn.Module):
    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("mask", mask)  # the same tensor in every block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).masked_fill(self.mask, 0)  # saves the mask for backward


@pytest.mark.parametrize("device", DEVICES)
def test_a_buffer_shared_by_an_eager_and_a_graphed_block_equal_eager(device):
    """The eager block's backward needs the mask at the version it saved: the capture of the graphed block
    (which reads the same buffer) must not write it back in place."""
    g = torch.Generator().manual_seed(4)
    batches = [torch.randn(4, 8, generator=g).to(device) for _ in range(4)]

    def run(graphed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        mask = (torch.rand(4, 8) > 0.5).to(device)
        net = nn.Sequential(MaskedLinear(mask), MaskedLinear(mask)).to(device)
        layers = graphstep.graph_layers(net, ["1"], warmup_steps=1) if graphed else None
        out = []
        for x in batches:
            loss = net(x).pow(2).sum()
            loss.backward()
            out += [loss.detach()] + [p.grad.clone() for p in net.parameters()]
            net.zero_grad(set_to_none=False)
        assert mask._version == 0  # nothing wrote the buffer
        if layers is not None:
            assert layers.captured
            layers.close()
        return out

    for k, (a, b) in enumerate(zip(run(False), run(True))):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("device", DEVICES)
def test_forward_twice_before_backward_is_a_graph_usage_error(device):
    """docs/library.md: two forwards of a graphed module before the backward are a ``GraphUsageError`` -- not an
    autograd error raised at the capture step by buffers the capture wrote back (BatchNorm saves its running
    statistics for backward)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))).to(device)
    graphstep.graph_layers(net, ["0"], warmup_steps=1)
    with pytest.raises(GraphUsageError, match="before the backward"):
        for _ in range(3):
            a, b = net(torch.randn(4, 8, device=device)), net(torch.randn(4, 8, device=device))
            (a + b).sum().backward()


# ---- item: graph_step(modules=) refuses a replaced buffer ----------------------------------------------------


def _captured_bn_step(device: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    graphed = graphstep.graph_step(step, warmup_steps=1, device=device, modules=[model])
    for _ in range(3):
        graphed(torch.randn(4, 8, device=device))
    assert graphed.state == "replayed"
    return model, graphed


@pytest.mark.parametrize("device", DEVICES)
def test_a_replaced_buffer_is_refused_before_the_replay(device):
    model, graphed = _captured_bn_step(device)
    before = model[1].running_mean.clone()
    model[1].running_mean = torch.zeros(8, device=device)  # replaced, not updated in place
    with pytest.raises(ContractError, match=r"buffer '1.running_mean' was replaced after capture"):
        graphed(torch.randn(4, 8, device=device))
    assert torch.equal(model[1].running_mean, torch.zeros(8, device=device))
    assert not torch.equal(before, torch.zeros(8, device=device))


def test_a_buffer_updated_in_place_or_a_replaced_submodule():
    """In place is the contract (replays go on); a submodule swapped for a new one is refused too."""
    model, graphed = _captured_bn_step("cpu")
    with torch.no_grad():
        model[1].running_var.copy_(torch.ones(8))
    graphed(torch.randn(4, 8))
    model[1] = nn.BatchNorm1d(8)
    with pytest.raises(ContractError, match=r"submodule '1' was replaced after capture"):
        graphed(torch.randn(4, 8))


def test_a_dtensor_parameter_given_new_local_storage_is_refused(one_rank_group):
    """A DTensor parameter's address is its local tensor's (its own ``data_ptr()`` is 0)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = parallelize_module(nn.Sequential(nn.Linear(8, 8)), _mesh("cpu"), {"0": ColwiseParallel()})

    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).detach()

    graphed = graphstep.graph_step(step, warmup_steps=1, modules=[model])
    for _ in range(2):
        graphed(torch.randn(4, 8))
    model[0].weight._local_tensor = torch.zeros(8, 8)  # new storage under the same DTensor (as FSDP2 swaps it)
    with pytest.raises(ContractError, match=r"parameter '0.weight' was replaced after capture"):
        graphed(torch.randn(4, 8))
