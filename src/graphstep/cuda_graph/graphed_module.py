"""One submodule as a forward graph and a backward graph behind an autograd.Function.

:class:`ModuleGraph` owns, for one module:

* static inputs (a :class:`StaticInputs` over the call's ``(args, kwargs)``),
  the forward graph and its graph-owned outputs (any pytree: tensors, tuples,
  ``None``);
* static output gradients, the backward graph and its graph-owned input gradients;
* the parameter gradients, in one of two ways per parameter:

  - **returned** (the default): the parameter is an input of the
    autograd.Function and its backward returns a *copy* of the graph-owned
    gradient, so autograd accumulates it into ``.grad`` and runs every hook
    -- ``Tensor.register_hook``, ``register_post_accumulate_grad_hook``,
    hooks on the AccumulateGrad node (torch DDP, FSDP) -- on every replayed
    backward, each seeing that backward's own gradient, never a buffer the
    next replay overwrites (pytorch issue 181723; TE's
    ``clone_param_grads_on_return``);
  - **accumulated in the graph**: a parameter whose ``main_grad`` is
    filled only by graphstep's own accumulation hook (the trainer's fp32
    buffers, see :func:`accumulates_in_graph`) has its gradient added into
    ``main_grad`` inside the backward graph; autograd never sees it, which
    saves an eager copy and accumulation per parameter. Hooks added after
    capture to such a parameter are refused.

  Either way gradient accumulation over micro-batches is exactly eager's
  (unlike ``torch.cuda.make_graphed_callables``).

Inputs and outputs are handled as flat lists of pytree leaves; an input leaf
index names the same argument at capture and at replay.

DTensors (tensor subclasses that wrap other tensors) among the arguments, the
outputs and the incoming gradients are compared and copied through their
local tensors (static_io.py): their own ``data_ptr()`` is 0. An incoming
gradient must have the layout (mesh, placements) the backward was captured
with, else :class:`ContractError`; the parameter gradients handed to autograd
are copies that keep the graph's placements (``Partial`` stays ``Partial``).

Copy-free chaining: when the module's input at run time *is* another graph's
output (or its incoming gradient is another graph's input gradient) the
static buffer was captured as that very tensor, and replay copies nothing.

One replay holds one micro-batch's activations: backward must run before the
next forward of the same module (as in any micro-batch loop).

The graphs read the parameters and buffers at the addresses they were
captured with. The parameters are taken when the forward is captured (a
module that swaps its parameters -- FSDP2 between its sharded and gathered
ones -- is captured with the ones it runs with), and every forward replay
first checks that the memory of the module's parameters (frozen ones too)
and buffers has not moved (``p.data = ...``, ``module.to(...)``, storage an
FSDP2 module freed and allocated again): a moved tensor is a
:class:`ContractError`, never a replay that reads stale or freed memory.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn
from .backend import Graph, GraphBackend
from .errors import ContractError, GraphUsageError
from .static_io import (StaticInputs, addresses, clone_keeping_layout, copy_data, describe_layout,
                        empty_keeping_layout, layout)
from .torch_compat import module_buffers, module_parameters, reparametrize_module, tensor_hooks, tree_flatten, \
    tree_unflatten


MAIN_GRAD_HOOK_FLAG = "graphstep_main_grad_hook"


def _hook_count(p: torch.Tensor) -> tuple[int, int]:
    backward, post = tensor_hooks(p)
    return len(backward), len(post)


def accumulates_in_graph(p: torch.Tensor) -> bool:
    """Whether ``p``'s gradient can be added into ``p.main_grad`` inside the backward graph.

    True when ``p`` has a ``main_grad`` and its only hooks are post-accumulate
    hooks marked with ``MAIN_GRAD_HOOK_FLAG`` (functions that do nothing but
    ``main_grad += grad``): skipping autograd then changes nothing observable.
    Any other hook (a user's, DDP's on the parameter) needs the gradient returned.
    """
    if getattr(p, "main_grad", None) is None:
        return False
    backward, post = tensor_hooks(p)
    return not backward and all(getattr(h, MAIN_GRAD_HOOK_FLAG, False) for h in post.values())


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _sample(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return clone_keeping_layout(leaf).requires_grad_(leaf.requires_grad)  # a DTensor keeps its placements
    return leaf


class ModuleGraph:
    """The graphs of one module (see module docstring)."""

    def __init__(self, module: nn.Module, forward: Callable[..., Any], name: str, *, retain_graph: bool = False):
        self.module = module
        self.forward_fn = forward
        self.name = name
        self.retain_graph = retain_graph
        self.params = [p for p in module.parameters() if p.requires_grad]  # taken again at capture
        # every parameter and buffer the captured graphs read: (the dict that holds it, its name, its addresses)
        self.watched: list[tuple[dict, str, tuple[int, ...]]] = []
        self.sample: Any = None  # (args, kwargs) of the last warm-up call, detached copies
        self.static: StaticInputs | None = None
        self.out_leaves: list[Any] = []  # output leaves: graph-owned tensors and captured constants
        self.out_spec: Any = None
        self.single_output = False  # the output is one tensor
        self.non_differentiable: list[int] = []  # indices of the tensor outputs autograd must not differentiate
        self.outputs: list[torch.Tensor] = []  # the tensor output leaves, in order
        self.grad_out: list[torch.Tensor | None] = []
        self.grad_out_layouts: list[Any] = []  # per output gradient buffer: a DTensor's layout, else None
        # gradient buffers that are views of one flat buffer each (plain dense tensors of one dtype): when outputs
        # of a group get no gradient, one fill of the flat buffer serves them all (a run's internal outputs)
        self.fill_groups: list[tuple[torch.Tensor, list[int]]] = []
        self.grad_in: list[torch.Tensor | None] = []
        self.fwd: Graph | None = None
        self.bwd: Graph | None = None
        self.grad_targets: list[torch.Tensor | None] = []  # per param: main_grad (in-graph) or None (returned)
        self.param_grads: list[torch.Tensor | None] = []  # per returned param: its graph-owned gradient
        self.returned: list[torch.Tensor] = []  # the parameters whose gradients autograd receives
        # the in-graph parameters with their buffer and hook counts at capture: checked before every backward replay
        self.in_graph: list[tuple[torch.Tensor, torch.Tensor, tuple[int, int]]] = []
        self.param_aliases: list[torch.Tensor] = []
        self.pending_backward = False
        self.shared_pool = True  # capture into the backend's shared pool (False: a pool of its own)
        # an output's gradient buffer, when autograd brings it no gradient: zeros, or -0.0 (cuda_graph/chains.py)
        self.absent_grad_negative_zero = False
        # Autograd calls a Function's backward only when an input requires grad; a
        # graphed module whose inputs do not (raw data) still owes its parameters
        # their gradients, so every call passes this anchor along.
        self.anchor = torch.empty(0, requires_grad=True)

    def copy(self, name: str) -> "ModuleGraph":
        """Another (uncaptured) set of graphs of the same module, with this one's warm-up sample."""
        other = ModuleGraph(self.module, self.forward_fn, name, retain_graph=self.retain_graph)
        other.sample = self.sample
        return other

    def record(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Keep a detached copy of a warm-up call's inputs: the capture's sample."""
        leaves, spec = tree_flatten((args, kwargs))
        self.sample = tree_unflatten([_sample(leaf) for leaf in leaves], spec)

    def call_eager(self, tree: Any) -> Any:
        args, kwargs = tree
        return self.forward_fn(*args, **kwargs)

    def _call_with_param_aliases(self, tree: Any) -> tuple[Any, list[torch.Tensor]]:
        """Run the forward on leaf aliases of the parameters (same memory); returns (output, aliases).

        Gradients are taken with respect to the aliases, never the parameters
        themselves: a parameter's autograd accumulator was made during eager
        warm-up on the default stream, and autograd would order that stream
        against the capturing one (illegal while capturing). The aliases'
        accumulators are made here, on the capture stream.
        """
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        aliases = {n: p.detach().requires_grad_(True) for n, p in named}
        with reparametrize_module(self.module, aliases):
            out = self.call_eager(tree)
        return out, [aliases[n] for n, _ in named]

    # ---- capture ------------------------------------------------------------
    def warmup(self, backend: GraphBackend) -> None:
        """One eager forward and backward on the capture stream (its effects are undone by the caller)."""
        if self.sample is None:
            return
        leaves, spec = tree_flatten(self.sample)
        leaves = [_sample(leaf) for leaf in leaves]
        with backend.warmup(), torch.enable_grad():
            result, params = self._call_with_param_aliases(tree_unflatten(leaves, spec))
            outs = [o for o in tree_flatten(result)[0] if _differentiable(o) and o.requires_grad]
            inputs = [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad] + params
            if outs and inputs:
                torch.autograd.grad(outs, inputs, grad_outputs=[torch.ones_like(o) for o in outs],
                                    allow_unused=True)

    def capture_forward(self, backend: GraphBackend, generators: Iterable[torch.Generator],
                        aliases: dict[int, torch.Tensor]) -> None:
        """Capture the forward on the sample inputs (``aliases``: input leaf index -> another graph's output)."""
        if self.sample is None:
            raise GraphUsageError(f"{self.name}: no warm-up call was recorded; run the module once before capturing")
        self.static = StaticInputs(self.sample, name=self.name)
        sample_leaves, _ = tree_flatten(self.sample)
        for i, tensor in aliases.items():  # reuse another graph's output as this graph's input buffer
            self.static.leaves[i] = tensor.detach()
        for static, sample in zip(self.static.leaves, sample_leaves):
            if isinstance(sample, torch.Tensor) and sample.requires_grad:
                static.requires_grad_(True)
        self.static.refresh()
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.watched = [(d, name, addresses(t)) for m in self.module.modules()
                        for d in (module_parameters(m), module_buffers(m))
                        for name, t in d.items() if t is not None]
        self.fwd = backend.new_graph(f"{self.name}.fwd", shared_pool=self.shared_pool)
        with backend.capture(self.fwd, generators), torch.enable_grad():
            out, self.param_aliases = self._call_with_param_aliases(self.static.tree)
        self.out_leaves, self.out_spec = tree_flatten(out)
        self.outputs = [o for o in self.out_leaves if isinstance(o, torch.Tensor)]
        self.single_output = isinstance(out, torch.Tensor)  # the output is its one tensor: no pytree to rebuild
        self.non_differentiable = [i for i, o in enumerate(self.outputs) if not _differentiable(o)]

    def capture_backward(self, backend: GraphBackend, generators: Iterable[torch.Generator],
                         grad_aliases: dict[int, torch.Tensor]) -> None:
        """Capture the backward; ``grad_aliases`` maps a tensor output index to another graph's input gradient."""
        diff_out = [i for i, o in enumerate(self.outputs) if _differentiable(o) and o.requires_grad]
        self.grad_out = [None] * len(self.outputs)
        leaves = self.static.leaves
        inputs = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        self.grad_targets = [p.main_grad if accumulates_in_graph(p) else None for p in self.params]
        self.returned = [p for p, t in zip(self.params, self.grad_targets) if t is None]
        self.in_graph = [(p, t, _hook_count(p)) for p, t in zip(self.params, self.grad_targets) if t is not None]
        self.param_grads = [None] * len(self.returned)
        self.grad_in = [None] * len(leaves)
        if not diff_out or not (inputs or self.params):
            return  # nothing to differentiate (e.g. routing metadata): a forward graph only
        self.bwd = backend.new_graph(f"{self.name}.bwd", shared_pool=self.shared_pool)
        with backend.capture(self.bwd, generators):
            # Output-gradient buffers are allocated inside the capture (on the capture
            # stream, from the graph's pool): a buffer made on the default stream would
            # make autograd order that stream against the capturing one. Their values
            # are copied in before every replay.
            for i in diff_out:
                alias = grad_aliases.get(i)
                if alias is not None:
                    self.grad_out[i] = alias
            self.fill_groups = _grouped_buffers(self.outputs, [i for i in diff_out if self.grad_out[i] is None],
                                                self.grad_out)
            grads = torch.autograd.grad(
                [self.outputs[i] for i in diff_out], inputs + self.param_aliases,
                grad_outputs=[self.grad_out[i] for i in diff_out],
                retain_graph=self.retain_graph, allow_unused=True,
            )
            returned = []
            with torch.no_grad():
                for target, g in zip(self.grad_targets, grads[len(inputs):]):
                    if target is None:
                        returned.append(g)
                    elif g is not None:
                        target.add_(g)
            self.param_grads = returned
        self.grad_out_layouts = [layout(g) if g is not None else None for g in self.grad_out]
        it = iter(grads[: len(inputs)])
        self.grad_in = [next(it) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in leaves]

    # ---- replay -------------------------------------------------------------
    def replay_forward(self, leaves: list[Any]) -> list[torch.Tensor]:
        """Replay the forward graph on a call's leaves (their structure checked: ``StaticInputs.call_leaves``)."""
        if self.pending_backward:
            raise GraphUsageError(
                f"{self.name}: forward replayed again before the backward of the previous call. A graphed module "
                "holds one micro-batch's activations: run backward before the next forward."
            )
        if self._moved():
            raise ContractError(
                f"{self.name}: a parameter's or buffer's memory moved after capture (p.data = ..., module.to(...), "
                "or storage freed and allocated again, as FSDP2 does with the parameters it gathers); the graphs "
                "read them where they were captured. Update them in place, or capture again."
            )
        self.static.copy_in_leaves(leaves)
        self.fwd.replay()
        self.pending_backward = self.bwd is not None
        return self.outputs

    def _moved(self) -> bool:
        """Whether a parameter or buffer the graphs read is gone or elsewhere than at capture."""
        for d, name, address in self.watched:
            t = d.get(name)
            if t is None or addresses(t) != address:
                return True
        return False

    def rebuild_output(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        """The module's output pytree, with ``tensors`` in place of the graph-owned tensor leaves."""
        if self.single_output:
            return tensors[0]
        it = iter(tensors)
        leaves = [next(it) if isinstance(o, torch.Tensor) else o for o in self.out_leaves]
        return tree_unflatten(leaves, self.out_spec)

    def replay_backward(self, grads: tuple[torch.Tensor | None, ...]) -> tuple[tuple, tuple]:
        """Replay the backward graph: (input gradients, gradients of the returned parameters)."""
        self._check_in_graph_params()
        # Absent gradients' buffers are filled before every replay, never once for all: the buffers were allocated
        # in the backward's capture, from the pool the graphs share, where their memory may be the scratch of a graph
        # captured before it -- whose next replay (the next micro-batch's forward) overwrites it. (Filled once, the
        # MoE partial scopes' losses left eager's on CUDA at the second replayed step; the CPU backend models the
        # shared pool, replay.py, and fails such a change too.) A group with an absent gradient is filled whole,
        # before the copies of its members' present gradients.
        filled = self._fill_groups(grads) if self.fill_groups else ()
        for i, (static, g, captured) in enumerate(zip(self.grad_out, grads, self.grad_out_layouts)):
            if static is None:
                continue
            if g is None:
                if i not in filled:
                    static.fill_(-0.0) if self.absent_grad_negative_zero else static.zero_()
            elif captured is None and type(g) is torch.Tensor:  # a plain gradient: the fast path
                if g.data_ptr() != static.data_ptr():
                    static.copy_(g)
            elif layout(g) != captured:
                raise ContractError(
                    f"{self.name}: the gradient of output {i} has another layout than the captured backward's: "
                    f"captured {describe_layout(static)}, now {describe_layout(g)}. Return the output to code "
                    "that produces its gradient with the output's placements, or leave this module eager."
                )
            else:
                copy_data(static, g)  # through the local tensors: a DTensor's data_ptr() is 0
        if self.bwd is not None:
            self.bwd.replay()
        self.pending_backward = False
        # A copy per returned gradient: autograd and the hooks get this backward's own
        # gradient, which the next replay does not overwrite. A DTensor's copy keeps its
        # placements (a Partial gradient stays Partial, reduced where eager reduces it).
        param_grads = tuple(None if g is None else g.clone() if type(g) is torch.Tensor else clone_keeping_layout(g)
                            for g in self.param_grads)
        return tuple(self.grad_in), param_grads

    def _fill_groups(self, grads: tuple[torch.Tensor | None, ...]) -> set[int]:
        """Fill each group that has an absent gradient with one kernel; the indices of the outputs so filled."""
        filled: set[int] = set()
        for flat, members in self.fill_groups:  # members' buffers are never handed out: no present gradient is one
            absent = [i for i in members if grads[i] is None]
            if absent:
                flat.fill_(-0.0) if self.absent_grad_negative_zero else flat.zero_()
                filled.update(absent)
        return filled

    def _check_in_graph_params(self) -> None:
        for p, target, counts in self.in_graph:
            if getattr(p, "main_grad", None) is not target and p.grad is not target:
                raise ContractError(
                    f"{self.name}: the gradient buffer of a parameter was replaced after capture; the backward graph "
                    "adds into the captured buffer. Zero gradients in place (zero_grad(set_to_none=False))."
                )
            if _hook_count(p) != counts:
                raise ContractError(
                    f"{self.name}: a gradient hook was added to or removed from a parameter after capture; its "
                    "gradient is accumulated into main_grad inside the graph, where hooks cannot run. Register "
                    "hooks before the capture (the graph then returns the gradient to autograd) or capture again."
                )

    def reset(self) -> None:
        for g in (self.fwd, self.bwd):
            if g is not None:
                g.reset()
        self.fwd = self.bwd = None
        self.static = None
        self.out_leaves, self.outputs = [], []
        self.single_output, self.non_differentiable = False, []
        self.grad_out, self.grad_in, self.grad_targets, self.param_aliases = [], [], [], []
        self.grad_out_layouts, self.fill_groups = [], []
        self.param_grads, self.returned, self.in_graph = [], [], []
        self.watched = []
        self.pending_backward = False


_ALIGN_BYTES = 512  # the CUDA caching allocator's block alignment


def _grouped_buffers(outputs: list[torch.Tensor], indices: list[int],
                     buffers: list[torch.Tensor | None]) -> list[tuple[torch.Tensor, list[int]]]:
    """Gradient buffers for ``outputs[indices]``, written into ``buffers``: the plain contiguous outputs of one
    dtype and device share a flat buffer (their buffers are its views), any other gets its own; returns the
    groups of more than one member as (flat buffer, indices)."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i in indices:
        o = outputs[i]
        if type(o) is torch.Tensor and o.is_contiguous() and o.layout == torch.strided:
            by_kind.setdefault((o.dtype, o.device), []).append(i)
        else:
            buffers[i] = empty_keeping_layout(o)
    groups = []
    for (dtype, device), members in by_kind.items():
        if len(members) == 1:
            buffers[members[0]] = torch.empty_like(outputs[members[0]])
            continue
        # each view starts where the caching allocator would start a tensor of its own (512-byte aligned): the
        # kernels that read a gradient, GEMMs among them, choose their code by its alignment as they do in eager
        step = max(1, _ALIGN_BYTES // dtype.itemsize)
        starts, total = [], 0
        for i in members:
            starts.append(total)
            total += -(-outputs[i].numel() // step) * step
        flat = torch.empty(total, dtype=dtype, device=device)
        for i, start in zip(members, starts):
            buffers[i] = flat[start: start + outputs[i].numel()].view(outputs[i].shape)
        groups.append((flat, members))
    return groups


class GraphedFunction(torch.autograd.Function):
    """Replays a :class:`ModuleGraph`: forward graph in forward, backward graph in backward.

    Called as ``apply(graph, anchor, n_leaves, *leaves, *returned_params)`` with the
    leaves of ``(args, kwargs)`` and the parameters whose gradients go back to autograd;
    returns the graph-owned tensor outputs (detached views), in order.
    """

    @staticmethod
    def forward(ctx, graph: ModuleGraph, anchor: torch.Tensor, n_leaves: int, *inputs: Any) -> Any:
        outputs = graph.replay_forward(inputs[:n_leaves])
        ctx.graph = graph
        ctx.set_materialize_grads(False)  # an output without a gradient comes as None: its buffer is filled here
        # detached views: autograd gives each call's outputs its own node, never the graph-owned tensors
        result = tuple(o.detach() for o in outputs)
        if graph.non_differentiable:
            ctx.mark_non_differentiable(*[result[i] for i in graph.non_differentiable])
        return result

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> Any:
        grad_in, param_grads = ctx.graph.replay_backward(grads)
        return (None, None, None, *grad_in, *param_grads)


def apply_graphed(graph: ModuleGraph, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``graph``'s module call by replaying its graphs (autograd-aware); returns the output pytree."""
    leaves = graph.static.call_leaves(args, kwargs)
    outputs = GraphedFunction.apply(graph, graph.anchor, len(leaves), *leaves, *graph.returned)
    return graph.rebuild_output(outputs)
