"""The RNG tracker: Megatron seeding, fork, states, and replay of dropout streams."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphstep.cuda_graph.registry import get_backend
from graphstep.cuda_graph.full_iteration import GraphedStep
from graphstep.cuda_graph.rng import (
    DATA_PARALLEL_RNG,
    EXPERT_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    RNGTracker,
    initialize_rng_tracker,
)


def test_megatron_seeds():
    t = initialize_rng_tracker(100, "cpu", pp_rank=1)
    assert t.seeds == {DATA_PARALLEL_RNG: 200, MODEL_PARALLEL_RNG: 200 + 2718, EXPERT_PARALLEL_RNG: 200 + 1024}
    t = initialize_rng_tracker(100, "cpu", dp_rank=3, data_parallel_random_init=True)
    assert t.seeds[DATA_PARALLEL_RNG] == 130


def test_fork_draws_from_the_named_stream_and_leaves_default_alone():
    t = RNGTracker("cpu")
    t.add("a", 1)
    torch.manual_seed(5)
    default_before = torch.default_generator.get_state()
    with t.fork("a"):
        x = torch.rand(4)
    assert torch.equal(torch.default_generator.get_state(), default_before)
    ref = torch.Generator().manual_seed(1)
    assert torch.equal(x, torch.rand(4, generator=ref))
    with t.fork("a"):
        y = torch.rand(4)
    assert torch.equal(y, torch.rand(4, generator=ref))  # the stream continued


def test_states_round_trip_and_errors():
    t = RNGTracker("cpu")
    t.add("a", 1)
    states = t.get_all_states()
    with t.fork("a"):
        first = torch.rand(3)
    t.set_all_states(states)
    with t.fork("a"):
        assert torch.equal(torch.rand(3), first)
    with pytest.raises(ValueError, match="already exists"):
        t.add("a", 2)
    with pytest.raises(ValueError, match="seed 1"):
        t.add("b", 1)
    with pytest.raises(KeyError, match="not tracked"):
        with t.fork("missing"):
            pass


def test_graph_replays_draw_the_same_numbers_as_eager_steps():
    """Dropout inside fork, replayed: each replay advances the stream exactly as an eager step."""

    def run(graphed: bool) -> list[torch.Tensor]:
        t = RNGTracker("cpu")
        t.add("model-parallel-rng", 7)
        x = torch.ones(64)

        def step(inp: torch.Tensor) -> torch.Tensor:
            with t.fork("model-parallel-rng"):
                return F.dropout(inp, 0.5, True)

        fn = GraphedStep(step, get_backend("cpu"), warmup_steps=2, generators=t.generators) if graphed else step
        return [fn(x).clone() for _ in range(6)]

    eager, graphed = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))
    assert not torch.equal(graphed[3], graphed[4])  # the stream moves between replays


CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
NESTED_CASES = [
    pytest.param("cpu", False, id="cpu"),
    pytest.param("cuda", False, id="cuda-copying", marks=CUDA),
    pytest.param("cuda", True, id="cuda-graph-safe", marks=CUDA),
]


def _nested_draws(t: RNGTracker, device: str) -> dict[str, list[torch.Tensor]]:
    """a, then b with a nested inside it, then a again: Megatron's nesting of the same stream."""
    with t.fork("a"):
        x = torch.randn(3, device=device)
        with t.fork("b"):
            u = torch.randn(2, device=device)
            with t.fork("a"):
                y = torch.randn(3, device=device)
            v = torch.randn(2, device=device)
        z = torch.randn(3, device=device)
    with t.fork("a"):
        w = torch.randn(3, device=device)
    return {"a": [x, y, z, w], "b": [u, v]}


@pytest.mark.parametrize("device,graph_safe", NESTED_CASES)
def test_nested_forks_continue_the_enclosing_stream(device, graph_safe):
    t = RNGTracker(device, graph_safe=graph_safe)
    t.add("a", 1)
    t.add("b", 2)
    torch.manual_seed(5)
    default = t._default()
    default_before = default.get_state()
    drawn = _nested_draws(t, device)
    assert torch.equal(default.get_state(), default_before)  # the default stream never moved
    assert not torch.equal(drawn["a"][0], drawn["a"][1])  # the nested fork did not repeat the outer draw
    for name, seed in (("a", 1), ("b", 2)):  # nested draws == the same stream drawn sequentially
        ref = torch.Generator(device=device).manual_seed(seed)
        for got in drawn[name]:
            assert torch.equal(got, torch.randn(got.shape, device=device, generator=ref))


def test_nested_forks_replay_as_eager_steps():
    """The copying swaps are host callbacks: a replayed step with nested forks draws what eager steps draw."""

    def run(graphed: bool) -> list[torch.Tensor]:
        t = RNGTracker("cpu")
        t.add("a", 1)
        t.add("b", 2)

        def step(inp: torch.Tensor) -> torch.Tensor:
            drawn = _nested_draws(t, "cpu")
            return inp + torch.cat(drawn["a"] + drawn["b"])

        fn = GraphedStep(step, get_backend("cpu"), warmup_steps=1, generators=t.generators) if graphed else step
        return [fn(torch.zeros(16)).clone() for _ in range(5)]

    eager, graphed = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))
    assert not torch.equal(graphed[2], graphed[3])


def test_preserved_leaves_every_stream_and_the_default_generator_where_they_were():
    t = RNGTracker("cpu")
    t.add("a", 1)
    t.add("b", 2)
    torch.manual_seed(5)
    before = {**t.get_all_states(), "default": torch.default_generator.get_state()}
    with t.preserved():
        with t.fork("a"):
            torch.rand(4)
        with t.fork("b"):
            torch.rand(4)
        torch.rand(4)
    after = {**t.get_all_states(), "default": torch.default_generator.get_state()}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with t.fork("a"):  # and the stream draws on from there, as if the block had not run
        x = torch.rand(4)
    assert torch.equal(x, torch.rand(4, generator=torch.Generator().manual_seed(1)))
