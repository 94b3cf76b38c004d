"""The RNG tracker: Megatron seeding, fork, states, and replay of dropout streams."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphstep.cuda_graph.backend import get_backend
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
