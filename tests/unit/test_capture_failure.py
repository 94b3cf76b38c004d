"""A failed capture leaves no trace: the program goes on exactly as if it had never tried.

CUDA executes nothing of a failed capture on the device, but the step's Python runs until the error:
FSDP2 walks through its forward and backward states and sets gradients, ``zero_grad()`` sets them to
None, a CPU step counter is incremented, generators advance. The CPU replay backend executes the region
and restores the tensors it wrote and its generators, so the Python-side effects are the same on both
backends and the CPU tests below fail without GraphedStep's snapshot (backup.py's StepSnapshot); each
has a ``cuda`` twin (scripts/gpu-check). Also here: a torch optimizer that cannot be captured gives the
same error on both backends, before its step runs, and ``warmup_steps=0`` over FSDP2 (its lazy
initialisation inside the capture) equals eager.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import graphstep
from graphstep import CaptureError
from graphstep.cuda_graph.backup import StepSnapshot
from graphstep.cuda_graph.full_iteration import GraphedStep
from graphstep.cuda_graph.replay import ReplayBackend
from graphstep.doctor import capture_error_hook

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]

ADAMW_REFUSED = ("AdamW.step() cannot be captured: AdamW(capturable=False, fused=False) keeps its step counter on "
                 "the host and reads it there; create it with capturable=True on CUDA (fused=True on the CPU)")


def _batches(device: str, n: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, 8, generator=g).to(device) for _ in range(n)]


def _capturable_adamw(params, device: str) -> torch.optim.Optimizer:
    if device == "cuda":
        return torch.optim.AdamW(params, lr=1e-2, capturable=True)
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


# --------------------------------------------------------------------------
# FSDP2: the program (non-capturable foreach AdamW), and failures in the forward and the backward


class _HostRead(torch.autograd.Function):
    """Identity that reads a device value on the host in its forward or backward (``where``):
    harmless eagerly, a failed capture on both backends."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, where: str) -> torch.Tensor:
        ctx.where = where
        if where == "forward":
            float(x.sum())
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if ctx.where == "backward":
            float(g.sum())
        return g.clone(), None


class _Block(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.up, self.drop, self.down = nn.Linear(8, 16), nn.Dropout(0.1), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(_HostRead.apply(torch.relu(self.up(x)), self.where)))


def _fsdp_model(device: str, where: str = "nowhere") -> nn.Module:
    """Two ZeRO-3 blocks under a root ``fully_shard`` on a one-rank mesh; the first block breaks at ``where``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(_Block(where), _Block("nowhere")).to(device)
    mesh = init_device_mesh(device, (1,))
    for block in model:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp_step(model: nn.Module, where: str, device: str):
    if where == "optimizer":  # the default a torchtitan-style loop builds: reads its step counter on the host
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    else:
        opt = _capturable_adamw(model.parameters(), device)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()  # set_to_none: the grads the failed capture set are new tensors
        return loss.detach()

    return step, opt


def _shards(model: nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def _fsdp_run(device: str, where: str, graphed: bool):
    model = _fsdp_model(device, "nowhere" if where == "optimizer" else where)
    step, _ = _fsdp_step(model, where, device)
    run = graphstep.graph_step(step, warmup_steps=2, device=device, on_failure="eager") if graphed else step
    torch.manual_seed(1)  # dropout's stream: the same for both runs
    losses = [run(x).clone() for x in _batches(device)]
    return losses, _shards(model), run


@pytest.mark.parametrize("where", ["optimizer", "forward", "backward"])
@pytest.mark.parametrize("device", DEVICES)
def test_failed_capture_over_fsdp2_continues_exactly_as_eager(one_rank_group, device, where):
    eager, eager_shards, _ = _fsdp_run(device, where, graphed=False)
    graphed, graphed_shards, run = _fsdp_run(device, where, graphed=True)
    expected = {"optimizer": "optimizer", "forward": "host_sync", "backward": "host_sync"}[where]
    if device == "cuda" and where != "optimizer":
        expected = "cuda"  # CUDA names no cause for a sync while capturing (the doctor re-ran the step)
    assert run.failed is not None and run.failed.category == expected and run.state == "eager"
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed)), (eager, graphed)
    assert all(torch.equal(a, b) for a, b in zip(eager_shards, graphed_shards))


def _fsdp_signature(model: nn.Module, opt: torch.optim.Optimizer) -> list:
    """What a program sees of FSDP2 between steps: which parameter objects (sharded DTensors) the modules
    hold, their gradients, and the optimizer's state objects."""
    return ([(name, type(p).__name__, id(p), id(p.grad)) for name, p in model.named_parameters()]
            + [(id(p), {k: id(v) for k, v in s.items()}) for p, s in opt.state.items()])


@pytest.mark.parametrize("where", ["optimizer", "forward", "backward"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_raised_capture_error_leaves_fsdp2_and_the_optimizer_as_before(one_rank_group, device, where):
    model = _fsdp_model(device, "nowhere" if where == "optimizer" else where)
    step, opt = _fsdp_step(model, where, device)
    graphed = graphstep.graph_step(step, warmup_steps=1, device=device)
    xs = _batches(device, 3)
    graphed(xs[0])
    before = _fsdp_signature(model, opt)
    with pytest.raises(CaptureError):
        graphed(xs[1])
    assert _fsdp_signature(model, opt) == before  # resharded, no gradient left, no state replaced
    assert torch.isfinite(step(xs[2])).all()  # and the plain step runs on (FSDP2 is between iterations)


# --------------------------------------------------------------------------
# the same without FSDP2: gradients, and an on_capture_error hook that re-runs the step


def _plain_run(device: str, graphed: bool, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)  # not capturable

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    run = graphstep.graph_step(step, warmup_steps=2, device=device, on_failure="eager", **kwargs) if graphed else step
    losses = [run(x).clone() for x in _batches(device)]
    return losses, [p.detach().clone() for p in model.parameters()], run


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_set_inside_a_failed_capture_are_put_back(device):
    """Before the capture the gradients are None (zero_grad at the end of each step); the failed capture's
    backward set them: left there, the eager step would accumulate into them."""
    eager, eager_params, _ = _plain_run(device, graphed=False)
    graphed, graphed_params, run = _plain_run(device, graphed=True)
    assert run.failed.category == "optimizer"
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))
    assert all(torch.equal(a, b) for a, b in zip(eager_params, graphed_params))


class _CauselessReplay(ReplayBackend):
    """The replay backend reporting every capture error as CUDA does a sync while capturing: without a cause
    (category ``cuda``), so the doctor hook re-runs the step."""

    @contextlib.contextmanager
    def capture(self, graph, generators=()):
        try:
            with super().capture(graph, generators):
                yield
        except CaptureError as exc:
            raise CaptureError.from_cuda(RuntimeError("operation not permitted when stream is capturing"),
                                         graph.name) from exc


def test_fsdp2_state_is_as_before_after_the_doctor_re_ran_the_failed_step(one_rank_group):
    """A failure CUDA names no cause of: the doctor re-runs the step eagerly, FSDP2 and its DTensor optimizer
    state included, and must restore what it wrote (the local tensors under the DTensor moments too); then
    GraphedStep puts the host state back again, and the eager fallback equals eager."""
    runs = []
    for graphed in (False, True):
        model = _fsdp_model("cpu", "backward")
        step, _ = _fsdp_step(model, "backward", "cpu")
        run = step
        if graphed:
            run = GraphedStep(step, _CauselessReplay(torch.device("cpu")), warmup_steps=2, on_failure="eager",
                              on_capture_error=capture_error_hook)
        torch.manual_seed(1)
        runs.append(([run(x).clone() for x in _batches("cpu")], _shards(model)))
    assert run.failed.category == "cuda" and [f.category for f in run.failed.findings] == ["host_sync"]
    (eager, eager_shards), (graphed, graphed_shards) = runs
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))
    assert all(torch.equal(a, b) for a, b in zip(eager_shards, graphed_shards))


def test_snapshot_puts_back_what_a_cuda_capture_changes_on_the_host():
    """What runs on the host during a CUDA capture -- CPU tensors of the optimizer state, Python settings,
    new state, replaced gradients, generator draws -- is put back (``device`` is the graph's: CPU tensors are
    saved only when it is another kind of device), and restore() works twice."""
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    grads = [p.grad for p in model.parameters()]
    state = {p: dict(s) for p, s in opt.state.items()}
    steps = [s["step"].clone() for s in opt.state.values()]
    gen = torch.Generator().manual_seed(5)
    draw = torch.rand(3, generator=gen)
    gen.manual_seed(5)
    snapshot = StepSnapshot(optimizers=[opt], modules=[model], generators=[gen], device=torch.device("cuda"))
    for _ in range(2):
        for s in opt.state.values():
            s["step"] += 1  # a non-capturable step counter, on the host
            s["extra"] = torch.zeros(1)
        opt.state[torch.nn.Parameter(torch.zeros(1))]["exp_avg"] = torch.zeros(1)  # state made in the capture
        opt.param_groups[0]["lr"] = 0.5
        model.weight.grad, model.bias.grad = None, torch.ones(2)
        torch.rand(3, generator=gen)
        snapshot.restore()
        assert [p.grad for p in model.parameters()] == grads
        assert list(opt.state) == list(state) and all(dict(opt.state[p]) == state[p] for p in state)
        assert all(torch.equal(s["step"], b) for s, b in zip(opt.state.values(), steps))
        assert opt.param_groups[0]["lr"] == 0.1
        assert torch.equal(torch.rand(3, generator=gen), draw)
        gen.manual_seed(5)


# --------------------------------------------------------------------------
# a torch optimizer that is not capturable: one error, before its step runs, on both backends


def _adamw_step(device: str, **opt_kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 1).to(device)
    opt = torch.optim.AdamW(model.parameters(), **opt_kwargs)

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        opt.step()
        return x

    return step, opt


@pytest.mark.parametrize("device", DEVICES)
def test_non_capturable_optimizer_is_the_same_error_on_every_backend(device):
    step, opt = _adamw_step(device)  # the default: capturable=False, fused=False
    graphed = graphstep.graph_step(step, warmup_steps=1, device=device)
    x = torch.randn(2, 4, device=device)
    graphed(x)
    counters = [s["step"].clone() for s in opt.state.values()]
    with pytest.raises(CaptureError) as info:
        graphed(x)
    err = info.value
    assert str(err).splitlines()[0] == ADAMW_REFUSED
    assert err.category == "optimizer" and err.op == "AdamW.step" and err.findings == []  # no doctor re-run
    assert err.where.filename == __file__ and err.where.line.strip() == "opt.step()"
    assert all(torch.equal(s["step"], c) for s, c in zip(opt.state.values(), counters))  # refused before it ran


class _NoFusedReplay(ReplayBackend):
    captures_fused_optimizers = False  # as CudaGraphBackend


def test_fused_optimizer_is_refused_only_where_torch_cannot_capture_it():
    step, _ = _adamw_step("cpu", fused=True)
    graphed = GraphedStep(step, ReplayBackend(torch.device("cpu")), warmup_steps=1)
    for _ in range(3):
        graphed(torch.ones(2, 4))
    assert graphed.state == "replayed"
    step, _ = _adamw_step("cpu", fused=True)
    graphed = GraphedStep(step, _NoFusedReplay(torch.device("cpu")), warmup_steps=1)
    graphed(torch.ones(2, 4))
    with pytest.raises(CaptureError, match=r"^AdamW.step\(\) cannot be captured: AdamW\(capturable=False, "
                                           r"fused=True\): on CUDA torch captures only capturable optimizers; "
                                           r"create it with capturable=True on CUDA \(fused=True on the CPU\)"):
        graphed(torch.ones(2, 4))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_optimizer_without_capturable_is_refused_on_cuda():
    device = "cuda"
    step, _ = _adamw_step(device, fused=True)
    graphed = graphstep.graph_step(step, warmup_steps=1, device=device)
    graphed(torch.ones(2, 4, device=device))
    with pytest.raises(CaptureError, match=r"AdamW\(capturable=False, fused=True\): on CUDA") as info:
        graphed(torch.ones(2, 4, device=device))
    assert info.value.category == "optimizer"


def test_torchs_own_optimizer_refusal_is_an_optimizer_error():
    exc = RuntimeError("Attempting CUDA graph capture of step() for an instance of AdamW but param_groups' "
                       "capturable is False.")
    err = CaptureError.from_cuda(exc, "step")
    assert err.category == "optimizer" and "create it with capturable=True on CUDA" in str(err)


# --------------------------------------------------------------------------
# warmup_steps=0 over FSDP2: its lazy initialisation and first all-gather run inside the capture


@pytest.mark.parametrize("device", DEVICES)
def test_graph_step_without_warmup_over_fsdp2_with_sgd_equals_eager(one_rank_group, device):
    runs = []
    for graphed in (False, True):
        model = _fsdp_model(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: nothing to create lazily

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss.detach()

        run = graphstep.graph_step(step, warmup_steps=0, device=device) if graphed else step
        torch.manual_seed(1)
        runs.append(([run(x).clone() for x in _batches(device)], _shards(model), run))
    (eager, eager_shards, _), (graphed, graphed_shards, run) = runs
    assert run.state == "replayed"
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed)), (eager, graphed)
    assert all(torch.equal(a, b) for a, b in zip(eager_shards, graphed_shards))


def test_storages_freed_inside_the_capture_are_told_apart_when_one_reuses_the_others_address():
    """Two storages the capture allocates and frees in turn (FSDP2's all-gather outputs of two modules): the second
    often gets the address the first freed. Each is given its size back at the start of a replay, whatever its
    address was (the replay backend once tracked them by address, skipped the second and wrote into its freed
    memory: a segmentation fault when the allocator reused the address)."""
    for attempt in range(30):
        n = (256, 1024, 4096, 16384, 65536)[attempt % 5] + 64 * (attempt // 5)  # sizes the heap reuses often
        held: list[torch.Tensor] = []
        addresses: list[int] = []

        def step(x: torch.Tensor) -> torch.Tensor:
            for b in held:  # allocated again before their use (after the capture)
                b.untyped_storage().resize_(4 * n)
            total = x.new_zeros(())
            for i in range(2):
                if len(held) < 2:  # the first step: allocated inside the capture
                    held.append(torch.empty(n))
                    addresses.append(held[-1].data_ptr())
                held[i].copy_(x).mul_(i + 2)  # no temporary of the buffers' size: the freed one is the one reused
                total = total + held[i].sum()
                held[i].untyped_storage().resize_(0)  # freed after its use
            return total

        graphed = graphstep.graph_step(step, warmup_steps=0, backend="replay")
        outs = [float(graphed(torch.full((n,), float(i)))) for i in range(3)]
        assert outs == [5.0 * n * i for i in range(3)]
        if addresses[0] == addresses[1]:
            return  # the second storage took the first's address, and the replays were right
    pytest.skip("the allocator never gave the second storage the first's address in 30 captures")


def test_storage_allocated_and_freed_inside_the_capture_is_allocated_again_on_replay():
    """A CUDA graph's pool keeps what its capture allocated; the replay backend gives such a storage its
    size back at the start of every replay (it crashed writing into the freed storage)."""
    held: list[torch.Tensor] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        if held:  # allocated again before each use, freed after (FSDP2's unsharded parameters)
            held[0].untyped_storage().resize_(4 * 4)
        else:  # the first use allocates it (FSDP2's first all-gather): inside the capture
            held.append(torch.empty(4))
        buf = held[0]
        buf.copy_(x * 2)
        y = buf.sum() + 1
        buf.untyped_storage().resize_(0)
        return y

    graphed = graphstep.graph_step(step, warmup_steps=0, backend="replay")
    outs = [graphed(torch.full((4,), float(i))).clone() for i in range(4)]
    assert [o.item() for o in outs] == [8 * i + 1 for i in range(4)]
