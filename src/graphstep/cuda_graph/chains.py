"""Chained graphs: consecutive scope modules of a layer replayed as one forward and one backward graph.

Under the MoE partial scopes (``[attn,moe_router,moe_preprocess]``) a layer
runs ``attn``, the router stage and the preprocess stage one after the other,
each fed only by the one before, and then the expert GEMMs eagerly. Graphed
one by one they cost three replays forward and three backward, each with
its autograd node, input checks and graph launch. A :class:`ChainedGraph`
captures such a run as one call -- the first module's call, then each later
module on the outputs it was fed during warm-up -- so the first module's
call replays all of them and the later modules' calls hand back their part
of the outputs. Autograd sees one node for the run: its backward runs once
every output has its gradient, as one graph.

When a run is chained (:func:`find_runs`, at capture, from the last warm-up
micro-batch): the model declares that each module of the run may directly
follow the one before it -- its layer calls them one after the other with
nothing in between, no tensor work and no change of state, or the model
calls one layer's last module and the next layer's first so (``graph_runs()``
on layers and models, cuda_graph/scopes.py: what the warm-up cannot see) --,
their forwards ran one after the other, every tensor argument of each later
module was an output of an earlier one of the run (the very tensor;
constants are captured), no hook would run between two of them (no later
module has hooks of its own -- its ``__call__`` is not what runs it --, the
first one none but forward-pre hooks, and no module entered or left between
two of them any: a layer's, an MoE block's), and their backwards ran one
after the other too (graphs share one memory pool, replayed in the capture
order). At replay a later module's call must pass exactly the tensors the
run handed out for those arguments, in the run's order; anything else is a
:class:`ContractError` (the work is already done, with the captured inputs).

Exactness. An output that nothing outside the run uses gets no gradient from
autograd; its gradient buffer is then filled with ``-0.0`` before every
backward replay (graphed_module.py says why every time; the buffers of a
run's outputs are views of one flat buffer per dtype, so one kernel fills
all of them), and autograd inside
the graph adds the run's own contribution to it: ``v + (-0.0) == v`` for
every float ``v`` (``+0.0`` would turn a ``-0.0`` into ``+0.0``), so the
gradients are eager's bit for bit. An output with one use outside and one
inside sums the two as eager does (addition of two terms commutes exactly).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from .errors import ContractError
from .graphed_module import GraphedFunction, ModuleGraph
from .static_io import same_value
from .torch_compat import module_has_hooks, tree_flatten, tree_unflatten

CHAIN_JOIN = "+"


class _Parts(nn.Module):
    """The run's modules as children, so that the chained graph reads the union of their parameters and buffers."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)


class ChainedGraph:
    """One :class:`ModuleGraph` for a run of modules (module docstring); ``call(pos, args, kwargs)`` replays it."""

    def __init__(self, members: Sequence[int], graphs: Sequence[ModuleGraph],
                 feeds: dict[tuple[int, int], tuple[int, int]]) -> None:
        self.members = list(members)  # graph indices, in forward order
        self.pos = {g: k for k, g in enumerate(self.members)}
        self.parts = [graphs[g] for g in self.members]
        # per later member: its input leaf index -> (member position, tensor output index) it is fed from
        self.feeds: list[dict[int, tuple[int, int]]] = [{} for _ in self.members]
        for (g, k), (p, o) in feeds.items():
            if g in self.pos and self.pos[g] > 0:
                self.feeds[self.pos[g]][k] = (self.pos[p], o)
        # per member: its warm-up call's leaves and spec, and whether the call is its leaves as positional arguments
        self.calls = [tree_flatten(g.sample) for g in self.parts]
        self.flat_calls = [tree_flatten((tuple(leaves), {}))[1] == spec for leaves, spec in self.calls]
        self.templates: list[tuple[list[Any], Any, bool]] = []  # per member: output leaves, spec, one tensor
        self.offsets: list[int] = []  # per member: its first tensor among the graph's outputs
        first = self.parts[0]
        name = run_name([g.name for g in self.parts])
        self.graph = ModuleGraph(_Parts([g.module for g in self.parts]), self._forward, name,
                                 retain_graph=first.retain_graph)
        self.graph.sample = first.sample
        self.graph.absent_grad_negative_zero = True  # module docstring, exactness
        self._tensors: tuple[torch.Tensor, ...] | None = None  # this micro-batch's outputs, handed out part by part
        self._next = 0

    @property
    def name(self) -> str:
        return self.graph.name

    def _forward(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """The run: the first module's call, then each later one's on the outputs it was fed in warm-up."""
        outs = [self.parts[0].forward_fn(*args, **kwargs)]
        flats = [[o for o in tree_flatten(outs[0])[0] if isinstance(o, torch.Tensor)]]
        for pos in range(1, len(self.parts)):
            part = self.parts[pos]
            leaves, spec = list(self.calls[pos][0]), self.calls[pos][1]
            for k, (p, o) in self.feeds[pos].items():
                leaves[k] = flats[p][o]
            a, kw = tree_unflatten(leaves, spec)
            outs.append(part.forward_fn(*a, **kw))
            flats.append([o for o in tree_flatten(outs[-1])[0] if isinstance(o, torch.Tensor)])
        self.templates, self.offsets, at = [], [], 0
        for out, flat in zip(outs, flats):
            leaves, spec = tree_flatten(out)
            self.templates.append((leaves, spec, isinstance(out, torch.Tensor)))
            self.offsets.append(at)
            at += len(flat)
        return tuple(outs)

    def count(self, member: int) -> int:
        """How many tensor outputs graph ``member`` has (after capture)."""
        pos = self.pos[member]
        end = self.offsets[pos + 1] if pos + 1 < len(self.offsets) else len(self.graph.outputs)
        return end - self.offsets[pos]

    def output_of(self, member: int, index: int) -> torch.Tensor | None:
        """The graph-owned tensor that is tensor output ``index`` of graph ``member`` (None before capture)."""
        at = self.offsets[self.pos[member]] + index if self.offsets else None
        return self.graph.outputs[at] if at is not None and at < len(self.graph.outputs) else None

    def call(self, pos: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Member ``pos``'s call: the first replays the run's forward graph, the later ones hand back their part."""
        if pos == 0:
            leaves = self.graph.static.call_leaves(args, kwargs)
            self._tensors = GraphedFunction.apply(self.graph, self.graph.anchor, len(leaves), *leaves,
                                                  *self.graph.returned)
            self._next = 1
        else:
            self._check_call(pos, args, kwargs)
            self._next += 1
        tensors = self._tensors
        if self._next == len(self.parts):
            self._tensors = None  # every part handed out: the run holds nothing of this micro-batch
        return self._part(pos, tensors)

    def _check_call(self, pos: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        part = self.parts[pos]
        if self._tensors is None or pos != self._next:
            raise ContractError(
                f"{part.name}: called out of its chained run's order ({self.name}: its forward is replayed with "
                f"the first module's call, the later modules take their outputs in turn)")
        sample, sample_spec = self.calls[pos]
        if self.flat_calls[pos] and not kwargs and len(args) == len(sample):
            leaves, same_structure = args, True  # the usual call: tensors as positional arguments, no pytree walk
        else:
            leaves, spec = tree_flatten((args, kwargs))
            same_structure = spec == sample_spec
        fed = self.feeds[pos]
        ok = same_structure and all(
            leaf is self._tensors[self.offsets[fed[k][0]] + fed[k][1]] if k in fed
            else not isinstance(leaf, torch.Tensor) and same_value(leaf, sample[k])
            for k, leaf in enumerate(leaves))
        if not ok:
            raise ContractError(
                f"{part.name}: called with other arguments than the outputs it was fed in warm-up; it is replayed "
                f"inside the chained graph {self.name}, which computed it from those. Call it on them, unchanged "
                "(no eager work between the chained modules)")

    def _part(self, pos: int, tensors: tuple[torch.Tensor, ...]) -> Any:
        leaves, spec, single = self.templates[pos]
        it = iter(tensors[self.offsets[pos]:])
        if single:
            return next(it)
        return tree_unflatten([next(it) if isinstance(o, torch.Tensor) else o for o in leaves], spec)

    def reset(self) -> None:
        self.graph.reset()
        self.graph.sample = None
        self._tensors = None


def run_name(names: Sequence[str]) -> str:
    """``layer0.attn+mlp`` for ``layer0.attn``, ``layer0.mlp``; a run over layers names each layer's part:
    ``layer0.attn+mlp+layer1.attn+mlp``."""
    parts: list[str] = []
    prefix = None
    for name in names:
        head, _, tail = name.rpartition(".")
        parts.append(tail if head == prefix else name)
        prefix = head
    return CHAIN_JOIN.join(parts)


def find_runs(graphs: Sequence[ModuleGraph], order: Sequence[tuple[str, int]],
              feeds: dict[tuple[int, int], tuple[int, int]],
              may_follow: Mapping[tuple[int, int], Sequence[nn.Module]]) -> list[list[int]]:
    """Runs of two or more graph indices to chain (module docstring), from one micro-batch's recorded ``order``;
    ``may_follow``: for the ``(id(a), id(b))`` of each module ``b`` the model lets directly follow ``a`` in a
    run, the modules entered or left between the two (whose hooks would run there)."""
    fwd = [i for kind, i in order if kind == "fwd"]
    bwd = [i for kind, i in order if kind == "bwd"]
    runs: list[list[int]] = []
    run: list[int] = []
    for i in fwd:
        if run and _continues(run, i, graphs, feeds, may_follow):
            run.append(i)
            continue
        if len(run) > 1:
            runs.append(run)
        run = [i]
    if len(run) > 1:
        runs.append(run)
    return [r for r in runs if _backwards_together(r, bwd)]


def _continues(run: list[int], i: int, graphs: Sequence[ModuleGraph],
               feeds: dict[tuple[int, int], tuple[int, int]],
               may_follow: Mapping[tuple[int, int], Sequence[nn.Module]]) -> bool:
    g, before = graphs[i], graphs[run[-1]].module
    between = may_follow.get((id(before), id(g.module)))
    if i in run or between is None or module_has_hooks(g.module) or g.sample is None \
            or any(module_has_hooks(m) for m in between) \
            or (len(run) == 1 and module_has_hooks(before, forward_pre=False)):
        return False
    leaves, _ = tree_flatten(g.sample)
    return all(not isinstance(leaf, torch.Tensor) or (feeds.get((i, k)) or (None,))[0] in run
               for k, leaf in enumerate(leaves))


def _backwards_together(run: list[int], bwd: list[int]) -> bool:
    """Whether the run's recorded backwards (if any) came one after the other, no other graph's between."""
    at = [k for k, i in enumerate(bwd) if i in run]
    return not at or at[-1] - at[0] + 1 == len(at)
