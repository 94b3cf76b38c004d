"""The CPU replay backend: what it records, skips, re-runs, restores and refuses."""

from __future__ import annotations

import pytest
import torch

from graphstep.cuda_graph.registry import get_backend
from graphstep.cuda_graph.errors import CaptureError
from graphstep.cuda_graph.replay import record_host_op


def _capture(fn, generators=()):
    backend = get_backend("cpu")
    graph = backend.new_graph("t")
    with backend.capture(graph, generators):
        out = fn()
    return graph, out


def test_replay_recomputes_into_the_captured_outputs():
    x = torch.arange(4.0)
    graph, out = _capture(lambda: (x * 2).view(2, 2).sum(0))
    x.copy_(torch.tensor([10.0, 20.0, 30.0, 40.0]))  # a new batch copied into the static input
    graph.replay()
    assert torch.equal(out, torch.tensor([80.0, 120.0]))  # [20+60, 40+80]


def test_capture_has_no_observable_effect_on_existing_memory():
    w = torch.ones(3)
    counter = torch.zeros(())
    graph, _ = _capture(lambda: (w.mul_(2), counter.add_(1)))
    assert torch.equal(w, torch.ones(3)) and counter.item() == 0  # as on a GPU: capture executes nothing
    graph.replay()
    graph.replay()
    assert torch.equal(w, torch.full((3,), 4.0)) and counter.item() == 2


def test_generators_are_restored_after_capture():
    torch.manual_seed(3)
    state = torch.default_generator.get_state()
    graph, out = _capture(lambda: torch.rand(5))
    assert torch.equal(torch.default_generator.get_state(), state)
    graph.replay()
    torch.manual_seed(3)
    assert torch.equal(out, torch.rand(5))


@pytest.mark.parametrize(
    "fn, op",
    [
        (lambda x: x.sum().item(), "_local_scalar_dense"),
        (lambda x: bool(x.sum() > 0), "_local_scalar_dense"),
        (lambda x: x.tolist(), "tolist"),
        (lambda x: x.numpy(), "numpy"),
        (lambda x: torch.nonzero(x), "nonzero"),
        (lambda x: x[x > 1], "index"),
        (lambda x: torch.masked_select(x, x > 1), "masked_select"),
        (lambda x: torch.unique(x), "_unique2"),
        (lambda x: torch.repeat_interleave(torch.tensor([1, 2])), "repeat_interleave"),
        (lambda x: torch.equal(x, x), "equal"),
    ],
    ids=["item", "bool", "tolist", "numpy", "nonzero", "bool_mask", "masked_select", "unique", "repeat_interleave", "equal"],
)
def test_host_syncs_and_dynamic_shapes_raise(fn, op):
    x = torch.arange(4.0)
    with pytest.raises(CaptureError) as info:
        _capture(lambda: fn(x))
    assert info.value.op == op
    assert info.value.where is not None and info.value.where.filename == __file__


def test_static_shape_variants_are_allowed():
    reps = torch.tensor([1, 2])
    x = torch.arange(4.0)
    graph, out = _capture(lambda: (torch.repeat_interleave(reps, output_size=3), x[torch.tensor([0, 2])]))
    graph.replay()
    assert out[0].tolist() == [0, 1, 1] and out[1].tolist() == [0.0, 2.0]


def test_unregistered_generator_is_refused():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(CaptureError, match="not registered"):
        _capture(lambda: torch.rand(3, generator=gen))
    graph, out = _capture(lambda: torch.rand(3, generator=gen), generators=[gen])
    graph.replay()
    assert torch.equal(out, torch.rand(3, generator=torch.Generator().manual_seed(0)))


def test_host_callbacks_replay_in_order():
    log: list[int] = []
    x = torch.ones(2)

    def body():
        record_host_op(lambda: log.append(1))
        y = x * 3
        record_host_op(lambda: log.append(2))
        return y

    graph, _ = _capture(body)
    assert log == [1, 2]
    graph.replay()
    assert log == [1, 2, 1, 2]


def test_nested_capture_is_refused():
    backend = get_backend("cpu")
    outer, inner = backend.new_graph("outer"), backend.new_graph("inner")
    with pytest.raises(CaptureError, match="another capture"):
        with backend.capture(outer):
            with backend.capture(inner):
                pass


def test_nested_host_callbacks_are_recorded_once():
    log: list[str] = []

    def inner():
        log.append("inner")

    def outer():
        log.append("outer")
        record_host_op(inner)  # runs inside the outer callback: part of it, not a second entry

    graph, _ = _capture(lambda: record_host_op(outer))
    assert log == ["outer", "inner"]
    graph.replay()
    assert log == ["outer", "inner", "outer", "inner"]


def test_replay_keeps_each_recorded_grad_mode():
    modes: list[bool] = []
    x = torch.ones(2, requires_grad=True)

    def body():
        record_host_op(lambda: modes.append(torch.is_grad_enabled()))
        with torch.no_grad():
            y = x * 2
            record_host_op(lambda: modes.append(torch.is_grad_enabled()))
        return y

    graph, out = _capture(body)
    assert modes == [True, False]
    x.data.fill_(3.0)
    graph.replay()
    assert modes == [True, False, True, False]
    assert torch.equal(out, torch.full((2,), 6.0)) and x.grad is None  # replay builds no autograd graph


def test_a_replay_overwrites_what_later_captured_graphs_of_its_pool_allocated_as_a_shared_cuda_pool_may():
    """One shared pool, as the CUDA backend has: graph ``w`` captured before graph ``x``. What ``x``'s capture
    allocated with ``empty`` (a buffer the host fills, e.g. an incoming gradient) may be memory ``w`` used as
    scratch, so every replay of ``w`` leaves garbage there (0xFF bytes: NaN): written once by the host and read
    after ``w`` replays again, it is wrong here as it can be on a GPU. Written before each replay of ``x``, it is
    right; what ``x``'s own ops write is written again by ``x``; a graph with its own pool is not touched."""
    backend = get_backend("cpu")
    a = torch.arange(4.0)
    w = backend.new_graph("w")
    with backend.capture(w):
        w_out = (a * 2).sum()
    x = backend.new_graph("x")
    with backend.capture(x):
        held = torch.empty(4)  # allocated in x's capture, filled by the host
        own = torch.empty(4).fill_(3.0)  # allocated and filled by x's own (recorded) op
        x_out = held * own
    apart = backend.new_graph("apart", shared_pool=False)
    with backend.capture(apart):
        apart_held = torch.empty(2)
    try:
        held.fill_(1.0)
        apart_held.fill_(5.0)
        x.replay()
        assert torch.equal(x_out, torch.full((4,), 3.0))
        w.replay()  # the next micro-batch's first graph
        assert w_out.item() == 12.0
        assert held.isnan().all() and torch.equal(apart_held, torch.full((2,), 5.0))
        x.replay()  # read without being written again: garbage, as on a GPU whose pool reused the memory
        assert x_out.isnan().all()
        held.fill_(1.0)  # written before every replay that reads it: right
        x.replay()
        assert torch.equal(x_out, torch.full((4,), 3.0)) and torch.equal(own, torch.full((4,), 3.0))
        x.reset()  # a reset graph leaves the pool: w's replays no longer touch its memory
        held.fill_(1.0)
        w.replay()
        assert torch.equal(held, torch.ones(4))
    finally:
        for g in (w, x, apart):
            g.reset()


def test_the_pool_model_leaves_a_storage_resized_after_capture_alone():
    """A buffer of a later graph whose storage was resized after its capture (freed, as FSDP2 frees) is not
    written through the byte view taken at capture: that would write past the storage (a segfault here). At its
    captured size again, it is modelled again."""
    backend = get_backend("cpu")
    w = backend.new_graph("w")
    with backend.capture(w):
        torch.ones(2).mul(2)
    x = backend.new_graph("x")
    with backend.capture(x):
        held = torch.empty(8)
    try:
        held.untyped_storage().resize_(0)
        w.replay()  # no write into the freed storage
        held.untyped_storage().resize_(32)
        held.fill_(1.0)
        w.replay()
        assert held.isnan().all()
    finally:
        w.reset()
        x.reset()
