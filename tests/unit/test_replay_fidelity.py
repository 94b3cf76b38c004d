"""The replay backend never replays a wrong answer: each graphed step equals eager bit for bit, or is refused.

Every case runs the same step eagerly and through ``graphstep.graph_step`` and
compares what it returned and every parameter and buffer with ``torch.equal``.
The ``cuda`` cases run the same comparison with CUDA graphs (scripts/gpu-check).
"""

from __future__ import annotations

import itertools
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import graphstep
from graphstep import CaptureError

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

Make = Callable[[torch.device], tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]]


def _run(make: Make, *, graphed: bool, steps: int = 6, device: str = "cpu", backend: str = "replay",
         shape: tuple[int, ...] = (4, 8)) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs of ``steps`` calls on fresh random inputs, then every parameter and buffer of the model."""
    dev = torch.device(device)
    torch.manual_seed(0)
    model, step = make(dev)
    fn = graphstep.graph_step(step, warmup_steps=2, device=dev, backend=backend, modules=[model]) if graphed else step
    g = torch.Generator().manual_seed(1)
    outs = []
    for _ in range(steps):
        outs.append(fn(torch.randn(*shape, generator=g).to(dev)).clone())
    graphstep.close_all()
    return outs, [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def _assert_equal_runs(make: Make, steps: int = 6, **kwargs) -> None:
    ref_outs, ref_state = _run(make, graphed=False, steps=steps, **kwargs)
    outs, state = _run(make, graphed=True, steps=steps, **kwargs)
    assert len(ref_outs) == len(outs) == steps
    assert not torch.equal(ref_outs[0], ref_outs[-1])  # the inputs changed, so must the results
    for i, (a, b) in enumerate(zip(ref_outs, outs)):
        assert torch.equal(a, b), f"call {i}: graphed {b} != eager {a}"
    for i, (a, b) in enumerate(zip(ref_state, state)):
        assert torch.equal(a, b), f"parameter/buffer {i} differs after {steps} steps"


def _train_step(model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = forward(x).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


# 1. an op that writes an argument and returns a new tensor


def _rrelu(dev):
    lin = nn.Linear(8, 8, device=dev)
    return lin, _train_step(lin, lambda x: F.rrelu(lin(x), training=True))


def test_op_writing_an_argument_and_returning_a_new_tensor_is_recomputed():
    # aten.rrelu_with_noise writes `noise` and returns a fresh output: replay must refill the output
    _assert_equal_runs(_rrelu)


# 2. checkpoint with preserve_rng_state (torch.get_rng_state / set_rng_state on the host)


def _checkpointed(dev):
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 8)).to(dev)
    return model, _train_step(model, lambda x: checkpoint(model, x, use_reentrant=False, preserve_rng_state=True))


def test_checkpoint_preserving_rng_state_equals_eager():
    _assert_equal_runs(_checkpointed, steps=10)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_checkpoint_preserving_rng_state_equals_eager_cuda(device):
    _assert_equal_runs(_checkpointed, steps=10, device=device, backend="auto")


def test_rng_state_copies_replay_in_order():
    def make(dev):
        lin = nn.Linear(8, 8, device=dev)

        def step(x):
            state = torch.get_rng_state()
            a = F.dropout(lin(x), 0.5)
            torch.set_rng_state(state)
            b = F.dropout(lin(x), 0.5)  # the same mask again, as eager draws it
            return (a + b).detach()

        return lin, step

    _assert_equal_runs(make)


# 3. reseeding inside the step


_SEEDS = itertools.count(100)


def _reseeding_step(x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(next(_SEEDS))  # refused while capturing (CUDA refuses a seed other than the current one)
    return F.dropout(x, 0.5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_manual_seed_inside_the_step_is_refused(device):
    step = graphstep.graph_step(_reseeding_step, warmup_steps=1, device=device)
    step(torch.ones(4, device=device))
    with pytest.raises(CaptureError, match="manual_seed|set_current_seed|seed") as info:
        step(torch.ones(4, device=device))
    if device == "cpu":
        assert info.value.op == "torch.manual_seed"
        assert info.value.where.filename == __file__
        assert info.value.where.lineno == _reseeding_step.__code__.co_firstlineno + 1


# 4. kernels that choose their path by grad mode


def _lstm(dev):
    lstm = nn.LSTM(8, 8, batch_first=True, device=dev)
    return lstm, _train_step(lstm, lambda x: lstm(x.view(1, 4, 8))[0])


def test_lstm_replays_bit_for_bit():
    # oneDNN's LSTM takes another path under no_grad: replay runs each op in the grad mode it was recorded in
    _assert_equal_runs(_lstm)


# 5. BatchNorm: running statistics written without being declared in the op's schema


def _batch_norm_module(dev):
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8)).to(dev)
    return model, _train_step(model, model)


def _functional_batch_norm(dev):
    model = nn.Linear(8, 8, device=dev)
    model.register_buffer("mean", torch.zeros(8, device=dev))
    model.register_buffer("var", torch.ones(8, device=dev))
    return model, _train_step(model, lambda x: F.batch_norm(model(x), model.mean, model.var, training=True))


@pytest.mark.parametrize("make", [_batch_norm_module, _functional_batch_norm], ids=["BatchNorm1d", "F.batch_norm"])
def test_batch_norm_running_stats_equal_eager(make):
    _assert_equal_runs(make, steps=8)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_batch_norm_running_stats_equal_eager_cuda(device):
    _assert_equal_runs(_batch_norm_module, steps=8, device=device, backend="auto")


def test_capture_leaves_undeclared_writes_undone():
    bn = nn.BatchNorm1d(4)
    x = torch.randn(8, 4)
    backend = graphstep.cuda_graph.registry.get_backend("cpu")
    graph = backend.new_graph("bn")
    with backend.capture(graph):
        bn(x)
    assert torch.equal(bn.running_mean, torch.zeros(4)) and torch.equal(bn.running_var, torch.ones(4))
    assert bn.num_batches_tracked.item() == 0
    graph.replay()
    ref = nn.BatchNorm1d(4)
    ref(x)
    assert torch.equal(bn.running_mean, ref.running_mean) and torch.equal(bn.running_var, ref.running_var)


# 6. printing a tensor is a host sync


def _print(y):
    print(y)


@pytest.mark.parametrize(
    "show, op",
    [(_print, "__repr__"), (str, "__repr__"), (repr, "__repr__"), (lambda y: format(y, ""), "__format__"),
     (lambda y: f"{y.sum():.3f}", "__format__")],
    ids=["print", "str", "repr", "format", "f-string"],
)
def test_printing_a_tensor_is_refused(show, op):
    def step(x):
        y = x * 2
        show(y)
        return y

    fn = graphstep.graph_step(step, warmup_steps=0, device="cpu", backend="replay")
    with pytest.raises(CaptureError, match="to the host") as info:
        fn(torch.ones(3))
    assert info.value.op == op
    assert info.value.where.filename == __file__
    assert str(torch.ones(2)) == "tensor([1., 1.])"  # printing works again once the capture ended


# 7. what the backend cannot replay exactly is refused


def _transposes_in_place(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    y.t_()  # refused: replay would refill y through its captured layout
    return y + 1


def test_in_place_layout_change_is_refused():
    fn = graphstep.graph_step(_transposes_in_place, warmup_steps=1, device="cpu", backend="replay")
    x = torch.arange(6.0).view(2, 3)
    assert torch.equal(fn(x), (x * 2).t() + 1)  # eager warm-up
    with pytest.raises(CaptureError, match="layout|in place") as info:
        fn(x)
    assert info.value.op == "t_"
    assert info.value.where.lineno == _transposes_in_place.__code__.co_firstlineno + 2


def test_in_place_metadata_ops_that_change_nothing_are_replayed():
    def step(x):
        y = x * 2
        y.squeeze_()  # no size-1 dimension: the layout is unchanged
        y.detach_()
        return y + 1

    _assert_equal_runs(lambda dev: (nn.Linear(1, 1), step))


def test_profiler_ranges_are_not_replayed():
    def step(x):
        with torch.profiler.record_function("graphed-range"):
            return x * 3

    _assert_equal_runs(lambda dev: (nn.Linear(1, 1), step))


def test_doctor_restores_undeclared_writes():
    from graphstep.doctor import check

    bn = nn.BatchNorm1d(4)
    check(lambda x: bn(x).sum(), torch.randn(8, 4))  # runs the step twice, then puts every tensor back
    assert torch.equal(bn.running_mean, torch.zeros(4)) and torch.equal(bn.running_var, torch.ones(4))
    assert bn.num_batches_tracked.item() == 0


# 8. a tensor subclass that converts its data underneath (torchao's float8 training tensors do)


class _Bf16Data(torch.Tensor):
    """A wrapper subclass holding its data in bf16, as float8 training tensors hold theirs in float8: each op
    unwraps it with ``.to(torch.float32)``, which below autograd reaches the recorder as ``aten.to.dtype`` -- an op
    whose schema says its result may alias its argument, and which here returns a new tensor."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32, device=data.device)

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t._data.to(torch.float32).contiguous() if isinstance(t, _Bf16Data) else t

        return func(*map(unwrap, args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})


class _ToBf16Data(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor) -> torch.Tensor:
        return _Bf16Data(w.to(torch.bfloat16))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _bf16_data_linear(dev):
    lin = nn.Linear(8, 8, bias=False, device=dev)
    return lin, _train_step(lin, lambda x: F.linear(x, _ToBf16Data.apply(lin.weight)))


def test_a_subclass_converting_its_data_with_to_is_recomputed_at_every_replay():
    # replay skipped aten.to.dtype as a view: every replay read the weights converted at capture
    _assert_equal_runs(_bf16_data_linear, steps=8)
