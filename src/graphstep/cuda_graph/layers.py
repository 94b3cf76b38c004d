"""Per-layer scoped graphs: ``apply_layer_graphs(model, settings, backend)``.

Each selected submodule of each layer (scopes from cuda_graph/scopes.py; ``[]``
= the whole layer) gets a forward and a backward graph (graphed_module.py).
The engine patches the submodule's ``forward`` with a dispatcher:

* evaluation (no grad, or ``module.eval()``): the original forward, eagerly;
* warm-up (before capture): the original forward, eagerly, while recording
  the order of forward and backward calls, a sample of each module's inputs,
  and which module's output feeds which module's input;
* after capture: ``apply_graphed`` replays the graphs (parameter hooks still run).

``capture()`` captures every graph into the backend's one pool, in an order
that depends on the semantics, a per-layer :class:`~.settings.GraphImpl`
(parsed from strings at the config edge, never here):

* ``local`` (Megatron Core's CudaGraphManager): the order of forward and
  backward calls recorded during warm-up;
* ``transformer_engine`` (TE's make_graphed_callables): all forwards in
  the order they ran during warm-up, then all backwards in reverse order.

For a plain forward/backward over a stack of layers the two orders coincide;
the log says which semantics ran. In one pool, a graph may reuse as scratch the
memory a graph captured before it freed, and a tensor made during a capture
and kept (an output, a gradient buffer) may lie in what an earlier-captured
graph uses as scratch. So the replays follow the capture order, and such a
tensor holds what was written into it only until the next replay of a graph
captured before its own -- the next micro-batch's first: what the host writes
into one (the incoming gradients, an absent gradient's zeros) it writes before
every replay that reads it, never once for all. The CPU replay backend models
that reuse (replay.py), so a breach fails the CPU tests too.

Capture must not change training state:
the module buffers, the gradient buffers and the RNG streams are saved before
and restored after (on a GPU nothing executes during capture anyway; the CPU
replay backend executes and is restored by the backend, this is a second
guard for buffers the step may have touched through other paths).

Capture happens when the owner calls ``capture()`` (the trainer does it after
``cuda_graph_warmup_steps`` iterations), or automatically before the
``warmup_calls``-th training forward when that is given (the library API).

Micro-batches in flight. A graphed module holds one micro-batch's
activations, so a schedule that runs several forwards of a layer before
their backwards (a pipeline stage: GPipe keeps every micro-batch of the step
in flight, 1F1B up to the number of later stages) needs several copies of
its graphs. An owner that marks its steps (:meth:`LayerGraphs.start_step`,
as the trainer does) lets the warm-up count the most micro-batches in flight
in its last step; capture then makes that many *slots* of graphs -- Megatron's
runner per in-flight micro-batch -- and micro-batch ``i`` of a step replays
slot ``i mod slots`` (in 1F1B, micro-batch ``i``'s backward always runs
before micro-batch ``i + slots``' forward). The slots are captured in the
order the step first ran them, each graph with a memory pool of its own: a
step replays a slot's graphs again between other slots' graphs, which one
shared pool would not allow. With one micro-batch in flight (any plain
micro-batch loop) there is one slot and nothing changes.

Chains. A micro-batch starts with the forward of the first graphed module;
that holds while every micro-batch runs through all of the graphed modules
in turn. An interleaved pipeline rank runs several chunks of the model
(virtual stages) and interleaves them: chunk 0 runs micro-batches 0 and 1
before chunk 2 runs micro-batch 0. The owner then names each module's
*chain* (``chains``: one per chunk, :func:`apply_layer_graphs` finds the
chunk that holds each module), and each chain counts its own micro-batches
and micro-batches in flight, from its own first module: micro-batch ``i``
of a chain replays slot ``i mod slots``, the slot count being the most any
chain had in flight. The chains' graphs replay in orders that vary from one
micro-batch to the next, so with several chains every graph has a pool of
its own, even with one slot.

Runs. Where graphed modules run one after the other with nothing in
between (the model says so: ``graph_runs()`` on its layers and on itself,
:func:`model_links`), each fed only by the ones before it (``[attn,mlp]``:
every layer's attn and mlp, one layer after the other; under
``[attn,moe_router,moe_preprocess]``: a layer's combine stage, the next
layer's attn, router and preprocess stage), they are captured as one forward
and one backward graph (cuda_graph/chains.py): the first module's call
replays the run, the later ones hand back their outputs -- the same kernels
in the same order, one replay, one autograd node and one set of input checks
instead of one per module: the host work that per-layer graphs are bound by
on small kernels. A hook between two modules (a layer's, FSDP2's) ends a run
there. Only with one slot and one chain (``links=None``: every module its
own graphs). A run's parameters get their gradients together, at the end of
its backward: the owner keeps runs within layers where a data-parallel
reduction overlaps the backward (``across_layers=False``).

FSDP2. When FSDP2 modules (``fully_shard``) manage the graphed modules'
parameters, their gathered parameters are kept allocated where the graphs
read them, and the capture runs with those modules unsharded (cuda_graph/fsdp.py).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from .backend import GraphBackend, default_generators
from .backup import StateBackup
from .chains import ChainedGraph, find_runs
from .devices import GiB
from .errors import GraphUsageError
from .fsdp import gathered, prepare_fsdp, release_gathered
from .graph_state import GraphState
from .graphed_module import ModuleGraph, apply_graphed
from .scopes import scope_modules
from .settings import CudaGraphSettings, GraphImpl
from .static_io import local_tensors
from .torch_compat import tree_flatten

log = logging.getLogger("graphstep")


class LayerGraphs:
    """Forward/backward graphs for a list of submodules (see module docstring)."""

    def __init__(
        self,
        modules: Sequence[tuple[str, nn.Module]],
        backend: GraphBackend,
        *,
        semantics: GraphImpl = GraphImpl.LOCAL,
        generators: Callable[[], Iterable[torch.Generator]] | None = None,
        retain_graph: bool = False,
        warmup_calls: int | None = None,
        fsdp_modules: Sequence[nn.Module] = (),
        chains: Sequence[int] | None = None,
        links: Mapping[tuple[int, int], Sequence[nn.Module]] | None = None,
    ) -> None:
        if not modules:
            raise ValueError("no module to graph: the selected scopes match no submodule of the model")
        self.backend = backend
        self.semantics = semantics
        self.generators = generators or (lambda: ())
        self.warmup_calls = warmup_calls
        self.fsdp_modules = list(fsdp_modules)  # unsharded while capturing (their gathered storage is kept)
        # (id(a), id(b)) -> the modules entered or left between them: module b may directly follow module a in a
        # run replayed as one graph (module docstring, :func:`model_links`)
        self.may_follow = dict(links or {})
        self.graphs: list[ModuleGraph] = []  # slot 0: a graph per module
        self.slots: list[list[ModuleGraph]] = [self.graphs]  # one list per micro-batch in flight
        self._by_module: dict[int, ModuleGraph] = {}
        self.order: list[tuple[str, int]] = []  # ("fwd"|"bwd", graph index) of the last warm-up micro-batch
        # ("fwd"|"bwd", micro-batch, graph index) of the current warm-up step, when the owner marks steps
        self.step_order: list[tuple[str, int, int]] | None = None
        # per chain, keyed by its first graph (module docstring): micro-batches started in this step; in warm-up,
        # the first graph's forwards whose backward has not run, and the most seen
        self._micro_batch: dict[int, int] = {}
        self._in_flight: dict[int, list[int]] = {}
        self._feeds: dict[tuple[int, int], tuple[int, int]] = {}  # (graph, input) -> (producer, output)
        # id(output tensor) -> (producer, output, tensor) during this micro-batch; holding the tensor keeps its id unique
        self._last_out: dict[int, tuple[int, int, torch.Tensor]] = {}
        self.training_calls = 0
        self.state = GraphState.EAGER
        self._capturing = False  # a graphed module inside another one runs as part of the outer capture
        self.chain_of: list[int] = []  # per graph: its chain's first graph, whose forward starts a micro-batch
        self.runs: list[ChainedGraph] = []  # runs of graphs replayed as one (cuda_graph/chains.py), set at capture
        self._run_of: dict[int, tuple[ChainedGraph, int]] = {}  # graph index -> (its run, its position in it)
        self._captured = False
        starts: dict[int, int] = {}  # chain given -> its first graph
        if chains is not None and len(chains) != len(modules):
            raise ValueError(f"{len(chains)} chains for {len(modules)} modules: one chain per module")
        for k, (name, module) in enumerate(modules):
            if id(module) in self._by_module:
                continue
            g = ModuleGraph(module, module.forward, name, retain_graph=retain_graph)
            self._by_module[id(module)] = g
            self.graphs.append(g)
            self.chain_of.append(starts.setdefault(chains[k] if chains is not None else 0, len(self.graphs) - 1))
            module.forward = self._dispatcher(len(self.graphs) - 1)
        self._micro_batch = {start: -1 for start in starts.values()}
        self._in_flight = {start: [0, 0] for start in starts.values()}

    @property
    def captured(self) -> bool:
        return self._captured

    def describe(self) -> str:
        names = sorted({g.name.split(".")[-1] for g in self.graphs})
        slots = f", {len(self.slots)} micro-batches in flight" if len(self.slots) > 1 else ""
        chains = f", {len(self._micro_batch)} chains" if len(self._micro_batch) > 1 else ""
        runs = (f", {len(self.runs)} runs replayed as one graph each (the first: {self.runs[0].name})"
                if self.runs else "")
        return (f"per-layer graphs ({self.semantics.value} semantics, {len(self.graphs)} modules: {', '.join(names)}"
                f"{slots}{chains}{runs})")

    def start_step(self) -> None:
        """A new step begins: micro-batches count from 0 (the slot of micro-batch ``i`` is ``i mod slots``).

        With ``warmup_calls``, the automatic capture happens here, at the first step start after that many
        training forwards, with the last warm-up step's order and micro-batches in flight.
        """
        for start in self._micro_batch:
            self._micro_batch[start] = -1
        if self.captured:
            return
        if self.step_order and self.warmup_calls is not None and self.training_calls >= self.warmup_calls:
            self.capture()
            return
        self.step_order = []
        for counts in self._in_flight.values():
            counts[:] = [0, 0]  # in place: the recorded hooks hold these lists

    # ---- dispatch -----------------------------------------------------------
    def _dispatcher(self, index: int) -> Callable[..., Any]:
        graph = self.graphs[index]

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._capturing or not (torch.is_grad_enabled() and graph.module.training):
                return graph.forward_fn(*args, **kwargs)
            chain = self.chain_of[index]
            if index == chain:
                self._start_micro_batch(chain)
            if not self.captured:
                return self._warmup_call(index, args, kwargs)
            self.state = GraphState.REPLAYED
            run = self._run_of.get(index)
            if run is not None:
                return run[0].call(run[1], args, kwargs)
            return apply_graphed(self.slots[self._micro_batch[chain] % len(self.slots)][index], args, kwargs)

        return forward

    def _start_micro_batch(self, chain: int) -> None:
        self._micro_batch[chain] += 1
        if chain == 0:
            self.training_calls += 1
        if not self.captured:
            unmarked = chain == 0 and self.step_order is None and self.warmup_calls is not None
            if unmarked and self.training_calls > self.warmup_calls:
                self.capture()  # with the order recorded over the previous micro-batch (steps unmarked)
                return
            self.order.clear()
            self._last_out.clear()

    def _warmup_call(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        graph = self.graphs[index]
        self.order.append(("fwd", index))
        chain = self.chain_of[index]
        if self.step_order is not None:
            self.step_order.append(("fwd", self._micro_batch[chain], index))
        leaves, _ = tree_flatten((args, kwargs))
        for i, a in enumerate(leaves):
            entry = self._last_out.get(id(a)) if isinstance(a, torch.Tensor) else None
            if entry is not None and entry[2] is a:  # the very tensor (ids of freed tensors are reused)
                self._feeds[(index, i)] = entry[:2]
            else:
                self._feeds.pop((index, i), None)
        graph.record(args, kwargs)
        out = graph.forward_fn(*args, **kwargs)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        hook = self._bwd_recorder(index)
        for k, o in enumerate(outs):
            self._last_out[id(o)] = (index, k, o)
            if o.requires_grad:
                o.register_hook(hook)
        if index == chain and any(o.requires_grad for o in outs):
            counts = self._in_flight[chain]
            counts[0] += 1
            counts[1] = max(counts)
        return out

    def _bwd_recorder(self, index: int) -> Callable[[torch.Tensor], None]:
        # not self: autograd (C++) holds the hook, and a reference back would be a hidden cycle
        chain = self.chain_of[index]
        order, step_order, done = self.order, self.step_order, []
        in_flight, mb = self._in_flight[chain], self._micro_batch[chain]

        def hook(grad: torch.Tensor) -> None:
            if done:  # once per call, however many outputs it has
                return
            done.append(True)
            if ("bwd", index) not in order:
                order.append(("bwd", index))
            if step_order is not None:
                step_order.append(("bwd", mb, index))
            if index == chain:
                in_flight[0] -= 1

        return hook

    # ---- capture ------------------------------------------------------------
    def slot_count(self) -> int:
        """Micro-batches in flight at most in the last warm-up step (1 when the owner does not mark steps)."""
        return max(1, *(most for _, most in self._in_flight.values())) if self.step_order is not None else 1

    def slot_capture_order(self, slots: int) -> list[tuple[str, int, int]]:
        """(kind, slot, graph index) in the order the last warm-up step first ran each slot's graph."""
        order = list(dict.fromkeys((kind, mb % slots, i) for kind, mb, i in self.step_order or ()))
        seen = set(order)
        for s in range(slots):
            order += [("fwd", s, i) for i in range(len(self.graphs)) if ("fwd", s, i) not in seen]
            order += [("bwd", s, i) for i in reversed(range(len(self.graphs))) if ("bwd", s, i) not in seen]
        return order

    def capture_order(self) -> list[tuple[str, int]]:
        """The capture order: it must be the replay order, as graphs share one pool.

        A block that an earlier-captured graph used as scratch can become a later
        graph's output; replayed in another order, the earlier graph would
        overwrite that output (e.g. a MoE layout that eager code still reads).
        """
        n = len(self.graphs)
        if self.semantics is GraphImpl.TRANSFORMER_ENGINE or not self.order:
            # forwards in the order they ran (not the order the scopes are listed), backwards reversed
            ran = list(dict.fromkeys(i for kind, i in self.order if kind == "fwd"))
            fwd = ran + [i for i in range(n) if i not in ran]
            return [("fwd", i) for i in fwd] + [("bwd", i) for i in reversed(fwd)]
        order = list(self.order)
        seen = set(order)
        # a module whose output needs no gradient never records a backward
        order += [("bwd", i) for i in reversed(range(n)) if ("bwd", i) not in seen]
        return order

    def capture(self) -> None:
        """Capture every forward and backward graph, in the order of the semantics."""
        missing = [g.name for g in self.graphs if g.sample is None]
        if missing:
            raise GraphUsageError(f"cannot capture: no warm-up training call reached {', '.join(missing[:4])}")
        backend, gens = self.backend, list(self.generators())
        slots = self.slot_count()
        # one slot of one chain replays in one order every micro-batch; otherwise a pool per graph (module docstring)
        shared = slots == 1 and len(self._micro_batch) == 1
        self.slots[1:] = [[g.copy(f"{g.name}[{s}]") for g in self.graphs] for s in range(1, slots)]
        for slot in self.slots:
            for g in slot:
                g.shared_pool = shared
        saved = _save_state(self.graphs, gens + default_generators(backend.device))
        alloc0, reserved0 = backend.memory()
        n_reports = len(backend.reports)
        self._capturing = True
        order = ([(kind, 0, i) for kind, i in self.capture_order()] if shared
                 else self.slot_capture_order(slots))
        if shared and self.may_follow:  # one slot, one chain: runs of modules replayed as one graph (chains.py)
            self.runs = [ChainedGraph(run, self.graphs, self._feeds)
                         for run in find_runs(self.graphs, self.order, self._feeds, self.may_follow)]
            self._run_of = {i: (run, k) for run in self.runs for k, i in enumerate(run.members)}
        done: set[int] = set()  # the runs whose backward is captured
        try:
            with gathered(self.fsdp_modules):
                if backend.needs_stream_warmup:  # as TE's make_graphed_callables: state is restored below
                    for g in [*self.graphs, *(run.graph for run in self.runs)]:
                        g.warmup(backend)
                for kind, s, i in order:
                    graphs = self.slots[s]
                    run, pos = self._run_of.get(i, (None, 0))
                    if pos > 0 or (run is not None and kind == "bwd" and id(run) in done):
                        continue  # captured with its run's first module (forward) or first backward
                    target = run.graph if run is not None else graphs[i]
                    if kind == "fwd":
                        aliases = {k: out for (g, k), (p, o) in self._feeds.items()
                                   if g == i and (out := self._output(graphs, p, o)) is not None}
                        target.capture_forward(backend, gens, aliases)
                    else:
                        done.add(id(run))
                        target.capture_backward(backend, gens, self._grad_aliases(graphs, i))
        except BaseException:
            for slot in self.slots:
                for g in slot:
                    g.reset()
            del self.slots[1:]
            self._drop_runs()
            raise
        finally:
            self._capturing = False
            saved.restore()
        # The warm-up outputs (and, through their backward hooks, this object) are no longer needed:
        # holding them would keep a micro-batch of activations alive for the whole run.
        self._last_out.clear()
        reports = backend.reports[n_reports:]
        alloc1, reserved1 = backend.memory()
        for r in reports:
            log.debug("captured %s in %.3f s, +%.3f GiB", r.name, r.seconds, r.allocated_delta / GiB)
        log.info(
            "captured %d per-layer graphs (%s semantics) in %.2f s, allocated %.2f GiB, reserved %.2f GiB "
            "(+%.2f / +%.2f GiB)", len(reports), self.semantics.value, sum(r.seconds for r in reports),
            alloc1 / GiB, reserved1 / GiB, (alloc1 - alloc0) / GiB, (reserved1 - reserved0) / GiB,
        )
        self._captured = True
        self.state = GraphState.CAPTURED

    def _output(self, graphs: list[ModuleGraph], producer: int, index: int) -> torch.Tensor | None:
        """The captured tensor that is output ``index`` of graph ``producer`` (its run's, when chained)."""
        run = self._run_of.get(producer)
        if run is not None:
            return run[0].output_of(producer, index)
        outputs = graphs[producer].outputs
        return outputs[index] if outputs else None

    def _grad_aliases(self, graphs: list[ModuleGraph], index: int) -> dict[int, torch.Tensor]:
        """An output's gradient buffer is its consumer's input gradient when exactly one graph consumes it.

        ``index`` stands for its run when chained: the run's outputs, each the output of one of its modules; a
        consumer inside the run takes no gradient buffer (the run's backward differentiates through it)."""
        run = self._run_of.get(index)
        produced = ([(m, o) for m in run[0].members for o in range(run[0].count(m))] if run is not None
                    else [(index, o) for o in range(len(graphs[index].outputs))])
        aliases: dict[int, torch.Tensor] = {}
        for out_idx, src in enumerate(produced):
            consumers = [(g, k) for (g, k), fed in self._feeds.items() if fed == src]
            if len(consumers) != 1:
                continue
            g, k = consumers[0]
            inner = self._run_of.get(g)
            if inner is not None and inner[1] > 0:
                continue  # fed inside a run
            consumer = inner[0].graph if inner is not None else graphs[g]
            if consumer.bwd is not None and k < len(consumer.grad_in) and consumer.grad_in[k] is not None:
                aliases[out_idx] = consumer.grad_in[k]
        return aliases

    def _drop_runs(self) -> None:
        for run in self.runs:
            run.reset()
        self.runs, self._run_of = [], {}

    def close(self) -> None:
        """Free every graph and restore the modules' own forward (harmless twice)."""
        for slot in self.slots[1:]:
            for g in slot:
                g.reset()
        del self.slots[1:]
        for g in self.graphs:
            g.reset()
            g.sample = None
            if "forward" in g.module.__dict__:
                del g.module.forward
        self._drop_runs()
        self._captured = False
        self.graphs.clear()
        self._by_module.clear()
        release_gathered(self.fsdp_modules)  # FSDP2 frees its gathered parameters again
        self.fsdp_modules = []
        # A recorded output's backward hook refers back to this object through autograd (C++),
        # a cycle the garbage collector cannot see: drop the outputs so nothing outlives close().
        self._last_out.clear()
        self._feeds.clear()
        self.order.clear()
        self.step_order = None


class _SavedState:
    """The module buffers, the ``main_grad`` views and the RNG states a capture must leave as they were.

    ``restore()`` writes the saved values back through ``t.data``, which shares the storage but not the
    autograd version counter: an eager node that saved the buffer (a mask shared by an eager block and a
    graphed one; BatchNorm's running statistics when the capture comes between an eager forward and its
    backward) would otherwise refuse its backward ("modified by an inplace operation") -- and on CUDA the
    stream warm-up really changes BatchNorm's statistics, so there is something to write back. A
    DTensor is written through its local tensors (its own clone of a ``Partial`` tensor would change the
    placements).
    """

    def __init__(self, tensors: Iterable[torch.Tensor | None], gens: list[torch.Generator]) -> None:
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen: set[int] = set()
        for t in tensors:
            for local in local_tensors(t) if t is not None else ():
                if id(local) not in seen:
                    seen.add(id(local))
                    self.tensors.append((local, local.detach().clone()))
        self.generators = StateBackup()
        self.generators.save_generators(gens)

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in self.tensors:
                t.data.copy_(saved)  # .data: the value comes back, the version counter stays
        self.tensors.clear()
        self.generators.restore()


def _save_state(graphs: list[ModuleGraph], gens: list[torch.Generator]) -> _SavedState:
    """What a capture must leave as it was (see :class:`_SavedState`)."""
    tensors = [t for g in graphs for t in [*g.module.buffers(), *(getattr(p, "main_grad", None) for p in g.params)]]
    return _SavedState(tensors, gens)


def select_modules(model: nn.Module, modules: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """The submodules the scopes pick, layer by layer (in the layer's order, whatever the scopes' order: a
    micro-batch starts at the first module picked); ``[]`` = each whole layer."""
    if not hasattr(model, "graph_layers"):
        raise TypeError(f"{type(model).__name__} has no graph_layers(): it does not expose per-layer graph scopes")
    picked: list[tuple[str, nn.Module]] = []
    for li, layer in enumerate(model.graph_layers()):
        if not modules:
            picked.append((f"layer{li}", layer))
            continue
        of_layer = [(f"{scope}{k or ''}", m) for scope in modules for k, m in enumerate(scope_modules(layer, scope))]
        position = {id(m): i for i, m in enumerate(layer.modules())}
        of_layer.sort(key=lambda named: position.get(id(named[1]), len(position)))
        picked += [(f"layer{li}.{name}", m) for name, m in of_layer]
    return picked


def model_links(model: nn.Module, *, across_layers: bool = True) -> dict[tuple[int, int], tuple[nn.Module, ...]]:
    """Which submodule of ``model`` may directly follow which in a run replayed as one graph: ``(id(a), id(b))``
    -> the modules entered or left between ``a`` and ``b`` (their ancestors below the nearest common one, whose
    hooks would run between them), from the runs ``model``'s layers call one after the other with nothing in
    between (each layer's ``graph_runs()``, cuda_graph/scopes.py; none for a layer without it) and, with
    ``across_layers``, the model's own ``graph_runs()`` (a layer's last module, then the next layer's first)."""
    runs = [list(run) for layer in model.graph_layers() if hasattr(layer, "graph_runs") for run in layer.graph_runs()]
    if across_layers and hasattr(model, "graph_runs"):
        runs += [list(run) for run in model.graph_runs()]
    parent = {id(child): module for module in model.modules() for child in module.children()}

    def ancestors(m: nn.Module) -> list[nn.Module]:
        up = []
        while id(m) in parent:
            m = parent[id(m)]
            up.append(m)
        return up

    links: dict[tuple[int, int], tuple[nn.Module, ...]] = {}
    for run in runs:
        for a, b in zip(run, run[1:]):
            up_a, up_b = ancestors(a), ancestors(b)
            common = {id(m) for m in up_a} & {id(m) for m in up_b}
            links[(id(a), id(b))] = tuple(m for m in up_a + up_b if id(m) not in common)
    return links


def apply_layer_graphs(model: nn.Module, settings: CudaGraphSettings, backend: GraphBackend, *,
                       generators: Callable[[], Iterable[torch.Generator]] | None = None,
                       chunks: Sequence[nn.Module] = (), across_layers: bool = True) -> LayerGraphs:
    """Wrap the scoped submodules of ``model`` for per-layer capture (``settings.impl`` local or transformer_engine).

    ``chunks``: the parts of ``model`` that run their micro-batches each on its own count (the virtual stages of
    a pipeline rank, which share ``model``'s layers); each selected module's chain is the chunk that holds it.
    ``across_layers``: runs replayed as one graph may span layers (:func:`model_links`); False keeps each layer's
    gradients ready at the end of its own backward (a data-parallel reduction overlapped with the backward)."""
    modules = select_modules(model, settings.modules)
    return LayerGraphs(modules, backend, semantics=settings.impl, generators=generators,
                       retain_graph=settings.retain_backward_graph,
                       fsdp_modules=prepare_fsdp(model, [m for _, m in modules]),
                       links=model_links(model, across_layers=across_layers),
                       chains=[chunk_holding(m, chunks) for _, m in modules] if len(chunks) > 1 else None)


def chunk_holding(module: nn.Module, chunks: Sequence[nn.Module]) -> int:
    """The index of the one chunk among ``chunks`` whose submodules include ``module``."""
    holders = [k for k, chunk in enumerate(chunks) if any(m is module for m in chunk.modules())]
    if len(holders) != 1:
        raise ValueError(f"{type(module).__name__} is held by {len(holders)} of the {len(chunks)} chunks, not one")
    return holders[0]
