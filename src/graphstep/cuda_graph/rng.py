"""A graph-safe RNG tracker in Megatron's shape.

Named generators (``data-parallel-rng``, ``model-parallel-rng``,
``expert-parallel-rng``) seeded as Megatron seeds them; ``fork(name)`` makes
the device's default generator draw from the named one for the duration of a
block, so ``F.dropout`` inside the block uses that stream::

    tracker = get_rng_tracker()
    with tracker.fork():                       # model-parallel-rng
        probs = F.dropout(probs, p, training)

Graph safety. On CUDA with ``graph_safe=True`` (``model.use_te_rng_tracker``)
each named stream is a ``torch.Generator`` whose *state* the default generator
adopts through ``graphsafe_set_state`` -- no bytes are copied, so the swap is
legal during capture and each graph that registers the generators (see
``generators()``) advances their offsets on every replay, as eager does. With
``graph_safe=False`` the swap copies states with ``get_state``/``set_state``
(Megatron's classic tracker), which works eagerly but breaks capture.

Nested forks follow Megatron's graph-safe tracker in both modes: a nested
fork of a stream continues that stream where the enclosing fork has it, and
leaving a fork restores the enclosing stream at its current position (the
copying mode writes the default generator's progress back to the stream it
stands for before another stream takes over).

On the CPU the swap copies states; the replay backend records each swap as a
host callback (:func:`record_host_op`) so replays draw the same numbers as the
eager steps would.
"""

from __future__ import annotations

import contextlib
import random
from typing import Callable, Iterator

import torch

from .devices import normalize_device
from .replay import record_host_op

DATA_PARALLEL_RNG = "data-parallel-rng"
MODEL_PARALLEL_RNG = "model-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"


class RNGTracker:
    """Named generators and a ``fork`` context manager (Megatron's CudaRNGStatesTracker)."""

    def __init__(self, device: torch.device | str = "cpu", *, graph_safe: bool = True) -> None:
        self.device = normalize_device(device)
        self.graph_safe = graph_safe and self.device.type == "cuda"
        self.states: dict[str, torch.Generator] = {}
        self.seeds: dict[str, int] = {}
        self._active: list[str] = []  # streams of the open forks, innermost last (state-copying mode)

    def reset(self) -> None:
        self.states.clear()
        self.seeds.clear()
        self._active.clear()

    def add(self, name: str, seed: int) -> None:
        """Add a stream ``name`` seeded with ``seed`` (each name and seed once)."""
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        if seed in self.seeds.values():
            raise ValueError(f"seed {seed} is already used by another RNG stream")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        self.states[name] = gen
        self.seeds[name] = seed

    def generators(self) -> list[torch.Generator]:
        """Every generator a graph must register to replay these streams correctly."""
        return list(self.states.values())

    def get_all_states(self) -> dict[str, torch.Tensor]:
        """Byte states of every stream (for checkpoints)."""
        return {name: gen.get_state() for name, gen in self.states.items()}

    def set_all_states(self, states: dict[str, torch.Tensor]) -> None:
        missing = set(self.states) ^ set(states)
        if missing:
            raise ValueError(f"RNG states do not match the tracker's streams: {sorted(missing)}")
        for name, state in states.items():
            self.states[name].set_state(state)

    @contextlib.contextmanager
    def preserved(self) -> Iterator[None]:
        """Whatever the block draws, every stream and the default generators (the device's and the CPU's) are left
        where they were: ``torch.random.fork_rng`` for the tracker's streams too.

        For eager work that must not count as a draw, such as torch's set-up of a pipeline stage, which runs a real
        forward to infer shapes (parallel/pipeline.py). Not for a capture: CUDA cannot copy a generator's state then.
        """
        gens = [*self.states.values(), self._default()]
        if self.device.type != "cpu":
            gens.append(torch.default_generator)
        saved = [(gen, gen.get_state()) for gen in gens]
        try:
            yield
        finally:
            for gen, state in saved:
                gen.set_state(state)

    def _default(self) -> torch.Generator:
        if self.device.type == "cuda":
            return torch.cuda.default_generators[self.device.index]
        return torch.default_generator

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default stream is untouched.

        Forks nest as Megatron's do: a nested fork of a stream continues where the
        enclosing use of that stream is, and leaving a fork puts the enclosing
        stream back at its *current* position.
        """
        try:
            gen = self.states[name]
        except KeyError:
            raise KeyError(f"RNG stream {name!r} is not tracked (streams: {sorted(self.states)})") from None
        enter, leave = self._swap_graph_safe(gen) if self.graph_safe else self._swap_copying(name)
        record_host_op(enter)
        try:
            yield
        finally:
            record_host_op(leave)

    def _swap_graph_safe(self, gen: torch.Generator) -> tuple[Callable[[], None], Callable[[], None]]:
        """The default generator adopts ``gen``'s state object: nesting continues every stream by itself."""
        default = self._default()
        saved: list = []

        def enter() -> None:
            saved.append(default.graphsafe_get_state())
            default.graphsafe_set_state(gen)

        def leave() -> None:
            default.graphsafe_set_state(saved.pop())

        return enter, leave

    def _swap_copying(self, name: str) -> tuple[Callable[[], None], Callable[[], None]]:
        """State copies: the stream the default generator stands for is written back before another takes over.

        ``self._active`` names the streams of the open forks, innermost last; it changes inside the
        callbacks, so a replay (which re-runs them in order) walks it exactly as the eager step did.
        """
        default = self._default()
        gen = self.states[name]
        saved: list = []

        def enter() -> None:
            if self._active:  # the enclosing fork's progress goes back to its stream first
                self.states[self._active[-1]].set_state(default.get_state())
                saved.append(None)
            else:
                saved.append(default.get_state())
            self._active.append(name)
            default.set_state(gen.get_state())

        def leave() -> None:
            gen.set_state(default.get_state())
            self._active.pop()
            outer = saved.pop()
            # the enclosing stream at its current position (it may be this one, advanced)
            default.set_state(self.states[self._active[-1]].get_state() if self._active else outer)

        return enter, leave

_TRACKER: RNGTracker | None = None


def get_rng_tracker() -> RNGTracker:
    """The process's tracker (a CPU tracker seeded with 1234 until initialised)."""
    global _TRACKER
    if _TRACKER is None:
        _TRACKER = RNGTracker("cpu")
        _seed_streams(_TRACKER, 1234)
    return _TRACKER


CP_SEED_OFFSET = 10007  # between context-parallel ranks' streams: above every other offset of a seed


def _seed_streams(tracker: RNGTracker, seed: int, tp_rank: int = 0, ep_rank: int = 0, cp_rank: int = 0) -> None:
    tracker.add(DATA_PARALLEL_RNG, seed + CP_SEED_OFFSET * cp_rank)
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank + CP_SEED_OFFSET * cp_rank)
    tracker.add(EXPERT_PARALLEL_RNG, seed + 1024 + 100 * ep_rank + tp_rank)


def initialize_rng_tracker(
    seed: int,
    device: torch.device | str,
    *,
    graph_safe: bool = True,
    pp_rank: int = 0,
    dp_rank: int = 0,
    tp_rank: int = 0,
    cp_rank: int = 0,
    data_parallel_random_init: bool = False,
) -> RNGTracker:
    """Seed Python, torch and the tracker as Megatron's ``_set_random_seed`` does.

    The data-parallel stream is the same on every tensor-parallel rank of a
    replica (they hold the same activations); the model-parallel stream
    differs per tensor-parallel rank (``seed + 2718 + tp_rank``). Context-parallel
    ranks hold other tokens of the same sequences, so both streams are offset by
    ``CP_SEED_OFFSET x cp_rank`` (Megatron keeps them equal, which drops the same
    positions of every rank's chunks); ``cp_rank`` 0 is seeded as without it.
    """
    global _TRACKER
    seed = seed + 100 * pp_rank
    if data_parallel_random_init:
        seed += 10 * dp_rank
    random.seed(seed)
    torch.manual_seed(seed)
    tracker = RNGTracker(device, graph_safe=graph_safe)
    _seed_streams(tracker, seed, tp_rank=tp_rank, cp_rank=cp_rank)
    _TRACKER = tracker
    return tracker
