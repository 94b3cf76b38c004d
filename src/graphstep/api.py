"""graphstep as a library: CUDA graphs in your own training loop.

Three entry points, in the shape of ``torch.cuda.graphs`` (docs/library.md):

* :func:`graph_step` -- a whole training step (forward, backward, optimizer
  step) as one graph: the trainer's full-iteration graph;
* :func:`graph_layers` -- a forward and a backward graph per submodule of any
  ``nn.Module``, picked by name pattern or scope map (built-in maps for
  Hugging Face Llama / Qwen2 / Qwen3 / Mistral / Mixtral / Qwen3-MoE): the
  trainer's per-layer engine;
* :func:`get_rng_tracker` / :class:`RNGTracker`, :func:`capture_stream`
  (build DDP/FSDP under it) and :func:`close_all`.

The same backends serve both: CUDA graphs on a GPU, the CPU replay backend
elsewhere (or anywhere with ``backend="replay"``).
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from .cuda_graph.devices import default_device, normalize_device
from .cuda_graph.errors import CaptureError, ContractError
from .cuda_graph.frames import mark_internal
from .cuda_graph.full_iteration import FailedCapture, GeneratorSource, GraphedStep, generator_source
from .cuda_graph.fsdp import prepare_fsdp
from .cuda_graph.layers import LayerGraphs
from .cuda_graph.registry import close_all_backends, get_backend
from .cuda_graph.rng import get_rng_tracker
from .cuda_graph.torch_compat import module_buffers, module_children, module_parameters
from .cuda_graph.settings import GraphImpl
from .cuda_graph.static_io import addresses
from .integrations import transformers as _hf_decisions  # noqa: F401  (transformers' mask check, see there)

log = logging.getLogger("graphstep")

mark_internal(__file__)  # these wrappers are never the user's line in a capture error

# Hugging Face decoder layouts: scope -> module name pattern.
HF_SCOPE_MAPS: dict[str, dict[str, str]] = {
    "llama": {"attn": "model.layers.*.self_attn", "mlp": "model.layers.*.mlp"},
    "qwen2": {"attn": "model.layers.*.self_attn", "mlp": "model.layers.*.mlp"},
    "qwen3": {"attn": "model.layers.*.self_attn", "mlp": "model.layers.*.mlp"},
    "mistral": {"attn": "model.layers.*.self_attn", "mlp": "model.layers.*.mlp"},
    # Their MoE blocks route with data-dependent shapes: graph attention, or
    # the whole MoE only where the routing is capturable.
    "mixtral": {"attn": "model.layers.*.self_attn", "moe": "model.layers.*.block_sparse_moe"},
    "qwen3_moe": {"attn": "model.layers.*.self_attn", "moe": "model.layers.*.mlp"},
}


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else default_device()


def _diagnose_with_doctor(exc: CaptureError, failed: FailedCapture) -> None:
    """graph_step's ``on_capture_error``: the doctor names the line (imported only when a capture fails)."""
    from .doctor import capture_error_hook

    capture_error_hook(exc, failed)


class ParamGuard:
    """Parameters and buffers must be updated in place after capture, never replaced: checks it before each replay.

    ``arm()`` (right after the capture) notes every submodule, parameter and buffer of the modules with the
    dict that holds it and where its data is (a DTensor's: its local tensor's); ``check()`` looks each one up
    again in its dict -- no walk over the modules per replay -- and raises at the first one replaced.
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = list(modules)
        # (kind, qualified name, the dict that holds it, its key, the tensor or module, its addresses)
        self.snapshot: list[tuple[str, str, dict, str, Any, tuple[int, ...]]] | None = None

    def _held(self) -> Iterable[tuple[str, str, dict, str, Any, tuple[int, ...]]]:
        for i, root in enumerate(self.modules):
            prefix = f"{i}." if len(self.modules) > 1 else ""
            for path, m in root.named_modules():
                where = f"{prefix}{path}." if path else prefix
                for name, child in module_children(m).items():
                    yield "submodule", where + name, module_children(m), name, child, ()
                for kind, held in (("parameter", module_parameters(m)), ("buffer", module_buffers(m))):
                    for name, t in held.items():
                        if t is not None:
                            yield kind, where + name, held, name, t, addresses(t)

    def arm(self) -> None:
        self.snapshot = list(self._held())

    def check(self) -> None:
        if self.snapshot is None:
            return
        for kind, name, held, key, value, address in self.snapshot:
            now = held.get(key)
            if now is not value or (address and addresses(now) != address):
                if kind == "submodule":
                    what, fix = "a new module", "Replace submodules before the capture"
                else:
                    what, fix = "a new tensor or new storage", f"Update {kind}s in place (`t.copy_(new)` under no_grad)"
                raise ContractError(f"{kind} {name!r} was replaced after capture ({what}); the graph still reads and "
                                    f"updates the old one. {fix}, or call reset() to capture again.")


class _GuardedStep(GraphedStep):
    def __init__(self, *args: Any, guard: ParamGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.captured:
            self.guard.check()
        out = super().__call__(*args, **kwargs)
        if self.captured and self.guard.snapshot is None:
            self.guard.arm()
        return out

    def reset(self) -> None:
        super().reset()
        self.guard.snapshot = None

    close = reset


def graph_step(
    fn: Callable[..., Any],
    *,
    warmup_steps: int = 3,
    device: torch.device | str | None = None,
    backend: str = "auto",
    modules: Sequence[nn.Module] = (),
    optimizers: Sequence[torch.optim.Optimizer] = (),
    generators: GeneratorSource = None,
    on_failure: str = "raise",
) -> GraphedStep:
    """Capture ``fn`` -- a whole training step -- as one graph after ``warmup_steps`` eager calls.

    Call the result with the tensors that change each step (batches), positional
    or by keyword; they are copied into static buffers and the graph is replayed. Everything else the
    step touches (parameters, gradients, optimizer state) must live at fixed
    addresses: update in place, zero gradients with ``set_to_none=False``.

    Args:
        fn: the step. Returns tensors (or a pytree of them): graph-owned outputs.
        warmup_steps: eager calls before the capture.
        device: where the graph runs (default: the current CUDA device, else the CPU).
        backend: ``auto`` (CUDA graphs on a GPU, the CPU replay backend elsewhere),
            ``cuda``, or ``replay`` (a dry run on any device).
        modules: models whose parameters the step updates; checked before each
            replay for parameters, buffers or submodules replaced instead of updated in
            place, and at capture for parameters or buffers the capture created.
        optimizers: optimizers whose state the capture must not create (those the
            step function refers to are found without being listed).
        generators: the RNG generators to register: a callable returning them, or
            an iterable of generators (default: graphstep's RNG tracker's).
        on_failure: ``raise``, or ``eager`` to keep running eagerly when capture fails.

    .. warning::
        Outputs are graph-owned: the next call overwrites them. ``out.clone()``
        what you keep; read values on the host (``.item()``) only outside the step.
    .. warning::
        Every call must pass tensors of the captured shapes and dtypes, and the
        same non-tensor values; anything else raises ``ContractError``.
    .. warning::
        The step must not sync the host (``.item()``, ``.tolist()``, ``print(t)``,
        data-dependent shapes): capture raises ``CaptureError`` naming the line; on a GPU,
        where CUDA names no line, the doctor re-runs the step once to find it (``error.findings``).
        ``graphstep.doctor.check(fn, ...)`` lists every such line at once.
    .. warning::
        torch optimizers must be constructed with ``capturable=True`` on CUDA
        (``fused=True`` on the CPU); the default ones read their step counter on the host.
    .. warning::
        Optimizer state (momentum, Adam moments) must exist before the capture:
        with ``warmup_steps=0`` and a lazily created state the capture raises
        ``CaptureError`` (category ``lazy_state``).
    """
    device = normalize_device(device) if device is not None else default_device()
    return _GuardedStep(fn, get_backend(device, backend), warmup_steps=warmup_steps, name=getattr(fn, "__name__", "step"),
                        generators=_generators(generators), on_failure=on_failure, guard=ParamGuard(modules),
                        modules=modules, optimizers=optimizers, on_capture_error=_diagnose_with_doctor)


def _generators(generators: GeneratorSource) -> Callable[[], Iterable[torch.Generator]]:
    """``generators=`` of the API as a callable; None: the RNG tracker's streams at capture time."""
    if generators is None:
        return lambda: get_rng_tracker().generators()
    return generator_source(generators)


def parse_scope_map(text: str) -> dict[str, str]:
    """``"attn -> model.layers.*.self_attn, mlp -> model.layers.*.mlp"`` -> {scope: pattern}."""
    out: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        if "->" not in item:
            raise ValueError(f"scope map entry {item.strip()!r}: expected 'scope -> module.name.pattern'")
        scope, pattern = (s.strip() for s in item.split("->", 1))
        out[scope] = pattern
    return out


def scope_map_for(model: nn.Module) -> dict[str, str]:
    """The built-in scope map of a Hugging Face model (by ``model.config.model_type``)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in HF_SCOPE_MAPS:
        raise ValueError(f"no built-in scope map for model_type={model_type!r} (built in: {', '.join(HF_SCOPE_MAPS)}); "
                         "pass a scope map such as 'attn -> model.layers.*.self_attn'")
    return HF_SCOPE_MAPS[model_type]


def _builtin_scopes(model: nn.Module) -> dict[str, str]:
    try:
        return scope_map_for(model)
    except ValueError:
        return {}


def select_by_pattern(model: nn.Module, scopes: Sequence[str] | Mapping[str, str] | str) -> list[tuple[str, nn.Module]]:
    """Submodules of ``model`` picked by module names, name patterns or scope names, in model order.

    Each entry is, in this order: an exact submodule name (``"features"``,
    ``"blocks.0.attn"``); a pattern (``"blocks.*.attn"``, anything with ``.``
    or ``*``); else a scope name of the model's built-in scope map (``"attn"``
    on a Hugging Face Llama). A mapping is a scope map: its values are patterns.
    """
    if isinstance(scopes, str):
        scopes = parse_scope_map(scopes) if "->" in scopes else [s.strip() for s in scopes.split(",") if s.strip()]
    if isinstance(scopes, Mapping):
        patterns = list(scopes.values())
    else:
        builtin = None
        patterns = []
        names = {name for name, _ in model.named_modules() if name}
        for s in scopes:
            if s in names or "." in s or "*" in s:
                patterns.append(s)
            else:
                builtin = builtin if builtin is not None else _builtin_scopes(model)
                if s not in builtin:
                    known = f"scopes of its scope map: {', '.join(builtin)}" if builtin else "no built-in scope map"
                    raise ValueError(f"{s!r} is neither a submodule of {type(model).__name__} nor a built-in scope "
                                     f"({known}); pass a module name, a pattern such as 'layers.*.attn' or a "
                                     "scope map such as 'attn -> layers.*.attn'")
                patterns.append(builtin[s])
    picked: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if not name or not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            continue
        if any(name.startswith(outer + ".") for outer, _ in picked):
            continue  # inside a module already picked: it is captured as part of that one
        picked.append((name, m))
    if not picked:
        raise ValueError(f"no submodule of {type(model).__name__} matches {patterns}")
    return picked


_PER_LAYER_SEMANTICS = {impl.value: impl for impl in (GraphImpl.LOCAL, GraphImpl.TRANSFORMER_ENGINE)}


def graph_layers(
    model: nn.Module,
    scopes: Sequence[str] | Mapping[str, str] | str,
    *,
    warmup_steps: int = 3,
    semantics: str = "local",
    backend: str = "auto",
    generators: GeneratorSource = None,
    retain_graph: bool = False,
) -> LayerGraphs:
    """A forward and a backward graph per selected submodule of ``model``.

    ``scopes`` are module names (``"features"``), name patterns
    (``"model.layers.*.mlp"``), scope names of the model's built-in map
    (``["attn", "mlp"]`` for Hugging Face Llama/Qwen/Mistral) or a scope map
    (``"attn -> model.layers.*.self_attn"``). ``generators``: a callable
    returning the RNG generators to register, or an iterable of them.
    The first ``warmup_steps`` training forwards (grad enabled, module in
    training mode) run eagerly and record the call order and input shapes; the
    next one captures every graph, then replays. Evaluation runs eagerly.

    .. warning::
        Backward must run before the next training forward of the same module
        (one micro-batch's activations per graph).
    .. warning::
        A selected module must not sync the host or change shapes; non-tensor
        arguments (flags, ``None`` caches) are part of the captured contract.
        For Hugging Face models pass ``use_cache=False`` while training.
    .. warning::
        Parameter gradients are returned to autograd (a copy per backward), so
        ``.grad`` accumulation and every hook (DDP's, FSDP's, yours) run as eagerly;
        graphstep's own ``main_grad`` buffers are accumulated inside the graph.
    .. warning::
        Over FSDP2 (``fully_shard``), the gathered parameters of the FSDP2 modules
        that manage the selected modules stay allocated for the whole run (the graphs
        read them where they were captured): ZeRO-2's memory, not ZeRO-3's.
    """
    if warmup_steps < 1:
        raise ValueError("graph_layers needs warmup_steps >= 1: an eager call records the call order and shapes")
    impl = _PER_LAYER_SEMANTICS.get(semantics)  # the library's edge: the string becomes the engine's enum here
    if impl is None:
        raise ValueError(f"graph_layers(semantics={semantics!r}): expected 'local' or 'transformer_engine'")
    device = _model_device(model)
    modules = select_by_pattern(model, scopes)
    return LayerGraphs(modules, get_backend(device, backend), semantics=impl,
                       generators=_generators(generators), retain_graph=retain_graph, warmup_calls=warmup_steps,
                       fsdp_modules=prepare_fsdp(model, [m for _, m in modules]))


def close_all() -> None:
    """Free every graph and pool of this process (call before ``destroy_process_group``)."""
    close_all_backends()
