"""PyTorch's private APIs that the mechanism (cuda_graph/, the doctor) uses: one place, each with a probe.

graphstep reaches below PyTorch's public surface where the public one cannot
do the job: the dispatcher (the replay backend records and re-runs aten ops),
autograd's hook dicts (a graphed module must know whether a hook wants the
gradient), the caching allocator's pool calls (a failed capture must hand its
pool back), FSDP2's internals (per-layer graphs keep its gathered parameters
in place), and a few kernels (foreach, fused AdamW, grouped matmul). Private
names change between releases without notice, so every access lives here:

* behind a small named function or constant with a docstring;
* with a **probe** (:data:`PROBES`): a function that checks the name exists
  and behaves as graphstep expects, and the torch versions it was verified
  on. tests/unit/test_torch_compat.py runs every probe;
* a missing name raises :class:`TorchCompatError` -- one line naming the
  torch version, the private name, what graphstep uses it for and the
  versions it was verified on -- when the feature is used (at import for
  what every capture needs: pytree, dispatch modes). Never a silent skip.

The parallel engines' private names (tensor parallel, pipelining, dynamo,
transformers' mask helpers) live in graphstep/engines_compat.py, which adds its
probes to the same :data:`PROBES`. tests/unit/test_architecture.py checks that
no other module reaches a private torch name. docs/library.md lists them all.

"Verified" below means seen working: on torch 2.13.0 CPU (CI) every probe
but the CUDA-only ones runs; on torch 2.11.0+cu130 (an H200) the same names
were checked (present, with the shapes and signatures the probes expect, the
CUDA-only calls run). The two layouts of FSDP2's parameter groups are both
kept: 2.11 has ``_fsdp_param_group``, 2.13 ``_fsdp_param_groups``.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .errors import GraphstepError

SUPPORTED = "torch>=2.11,<2.14"
CPU_2_13 = "2.13.0 (CPU)"
GPU_2_11 = "2.11.0+cu130 (H200)"


class TorchCompatError(GraphstepError, RuntimeError):
    """A private PyTorch name graphstep relies on is missing or behaves differently in this torch."""


def missing(name: str, purpose: str, verified: tuple[str, ...], detail: str = "", library: str = "torch"
            ) -> TorchCompatError:
    """The error for a private name this torch (or ``library``) lacks: version, name, what for, where verified,
    what to do."""
    extra = f" ({detail})" if detail else ""
    version = torch.__version__ if library == "torch" else _version_of(library)
    wanted = f"graphstep's range ({SUPPORTED})" if library == "torch" else f"a {library} graphstep was verified with"
    return TorchCompatError(
        f"{library} {version}: {name} is missing or changed{extra}; graphstep uses it to {purpose} "
        f"(verified on {library} {', '.join(verified)}): install {wanted}")


def _version_of(library: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return "(not installed)"


@dataclass(frozen=True)
class Probe:
    """One private access: its names, what graphstep uses it for, where it was verified, and its check.

    ``needs``: None (runs anywhere), ``"cuda"`` (a GPU), ``"process_group"`` (an
    initialized torch.distributed group; the test gives it a 1-rank gloo one) or
    ``"transformers"`` (installed). ``library``: whose private names these are.
    """

    names: tuple[str, ...]
    purpose: str
    verified: tuple[str, ...]
    check: Callable[[], None]
    needs: str | None = None
    library: str = "torch"

    def error(self, detail: str = "") -> TorchCompatError:
        return missing(" / ".join(self.names), self.purpose, self.verified, detail, self.library)

    def run(self) -> None:
        """Run the check; any failure becomes this probe's :class:`TorchCompatError`."""
        try:
            self.check()
        except TorchCompatError:
            raise
        except Exception as e:  # the check's own failure, re-raised with the version and the names
            raise self.error(f"{type(e).__name__}: {e}") from e


PROBES: dict[str, Probe] = {}


def probe(*names: str, purpose: str, verified: tuple[str, ...], needs: str | None = None, library: str = "torch"
          ) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Register the decorated check as the probe of ``names`` (keyed by the check's name)."""
    def register(check: Callable[[], None]) -> Callable[[], None]:
        PROBES[check.__name__] = Probe(names, purpose, verified, check, needs, library)
        return check

    return register


def expect(ok: bool, what: str) -> None:
    """In a probe: fail with ``what`` unless ``ok``."""
    if not ok:
        raise AssertionError(what)


# --------------------------------------------------------------------------
# pytree and dispatch modes: every capture needs them, so a missing one fails at import

_PYTREE_PURPOSE = "walk nested arguments and outputs (static inputs, recorded ops)"
_DISPATCH_PURPOSE = "record every aten op of a capture (replay backend) and of a doctor run"

try:
    from torch.utils._pytree import (keystr, tree_flatten, tree_flatten_with_path, tree_leaves, tree_map,
                                     tree_unflatten)
except ImportError as e:  # pragma: no cover - only on an unsupported torch
    raise missing("torch.utils._pytree", _PYTREE_PURPOSE, (CPU_2_13, GPU_2_11), str(e)) from e
try:
    from torch._ops import OpOverload
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError as e:  # pragma: no cover - only on an unsupported torch
    raise missing("torch._ops / torch._subclasses.fake_tensor / torch.utils._python_dispatch", _DISPATCH_PURPOSE,
                  (CPU_2_13, GPU_2_11), str(e)) from e

__all__ = ["FakeTensor", "OpOverload", "TorchDispatchMode", "keystr", "tree_flatten", "tree_flatten_with_path",
           "tree_leaves", "tree_map", "tree_unflatten"]


@probe("torch.utils._pytree", purpose=_PYTREE_PURPOSE, verified=(CPU_2_13, GPU_2_11))
def probe_pytree() -> None:
    tree = {"a": (torch.zeros(1), [1, None]), "b": torch.ones(2)}
    leaves, spec = tree_flatten(tree)
    expect(tree_unflatten(leaves, spec).keys() == tree.keys(), "tree_unflatten rebuilds the dict")
    expect(len(tree_leaves(tree)) == 4 and tree_map(lambda x: x, tree)["b"] is tree["b"], "leaves and map")
    paths, _ = tree_flatten_with_path(tree)
    expect(keystr(paths[0][0]) == "['a'][0]", f"keystr gives {keystr(paths[0][0])!r}")


@probe("torch.utils._python_dispatch.TorchDispatchMode", "torch._ops.OpOverload", "OpOverload._schema",
       purpose=_DISPATCH_PURPOSE, verified=(CPU_2_13, GPU_2_11))
def probe_dispatch_mode() -> None:
    seen: list[Any] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Watch():
        torch.ones(2).add_(1)
    add = [f for f in seen if isinstance(f, OpOverload) and f.overloadpacket is torch.ops.aten.add_]
    expect(bool(add), f"a dispatch mode saw {seen}, no aten.add_ OpOverload")
    schema = op_schema(add[0])
    expect(schema.arguments[0].alias_info.is_write and schema.returns[0].alias_info is not None,
           "aten.add_'s schema marks self as written and returned")


def op_schema(func: OpOverload) -> Any:
    """The op's ``torch._C.FunctionSchema`` (arguments, returns, alias annotations): ``OpOverload._schema``."""
    return func._schema


@probe("torch._subclasses.fake_tensor.FakeTensor", purpose="tell fake tensors (torch.compile's tracing) from "
       "real ones while recording", verified=(CPU_2_13, GPU_2_11))
def probe_fake_tensor() -> None:
    expect(issubclass(FakeTensor, torch.Tensor), "FakeTensor is a Tensor subclass")


# --------------------------------------------------------------------------
# functional collectives (what DTensor redistributes with)

FUNCTIONAL_COLLECTIVES = "_c10d_functional"
"""The op namespace of functional collectives: their results are pending until ``wait_tensor``."""


def wait_tensor(t: torch.Tensor) -> torch.Tensor:
    """Wait for a functional collective's result: ``torch.ops._c10d_functional.wait_tensor``."""
    return getattr(torch.ops, FUNCTIONAL_COLLECTIVES).wait_tensor(t)


def async_collective_tensor_types() -> tuple[type, ...]:
    """``(AsyncCollectiveTensor,)``: the result of a functional collective, a tensor whose data is still
    arriving (tensor parallel's ``use_local_output`` hands it to a module); ``()`` on a torch built without
    distributed. Private: ``torch.distributed._functional_collectives``."""
    if not torch.distributed.is_available():
        return ()
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
    except ImportError as e:
        raise PROBES["probe_functional_collectives"].error(str(e)) from e
    return (AsyncCollectiveTensor,)


@probe("torch.distributed._functional_collectives.AsyncCollectiveTensor", "torch.ops._c10d_functional.wait_tensor",
       purpose="read and replay functional collectives' results after their collective finished",
       verified=(CPU_2_13, GPU_2_11))
def probe_functional_collectives() -> None:
    if not torch.distributed.is_available():
        return
    (act,) = async_collective_tensor_types()
    expect(issubclass(act, torch.Tensor) and callable(getattr(act, "trigger_wait", None)),
           "AsyncCollectiveTensor is a Tensor with trigger_wait()")
    expect(isinstance(getattr(torch.ops, FUNCTIONAL_COLLECTIVES).wait_tensor.default, OpOverload),
           "wait_tensor is an op")


# --------------------------------------------------------------------------
# dispatch keys: replaying ops below autograd and outside autocast

_AUTOCAST_DEVICE_KEYS = ("AutocastCUDA", "AutocastXPU", "AutocastMPS", "AutocastHPU", "AutocastXLA",
                         "AutocastPrivateUse1")


def _autocast_keys() -> Any:
    """``AutocastCPU`` plus the autocast keys of the other devices this build knows (a build may lack some)."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    for name in _AUTOCAST_DEVICE_KEYS:
        key = getattr(torch._C.DispatchKey, name, None)  # a key of a device this build has no backend for
        if key is not None:
            keys = keys | torch._C.DispatchKeySet(key)
    return keys


_AUTOCAST_KEYS: Any = None


@contextlib.contextmanager
def below_autograd_outside_autocast() -> Iterator[None]:
    """Run ops below autograd (nothing recorded for backward, in-place writes to leaves legal) and outside
    autocast: ``torch._C._AutoDispatchBelowAutograd`` and ``_ExcludeDispatchKeyGuard`` over the autocast keys."""
    global _AUTOCAST_KEYS
    try:
        if _AUTOCAST_KEYS is None:
            _AUTOCAST_KEYS = _autocast_keys()
        below, exclude = torch._C._AutoDispatchBelowAutograd, torch._C._ExcludeDispatchKeyGuard
    except AttributeError as e:
        raise PROBES["probe_dispatch_guards"].error(str(e)) from e
    with below(), exclude(_AUTOCAST_KEYS):
        yield


@probe("torch._C._AutoDispatchBelowAutograd", "torch._C._ExcludeDispatchKeyGuard", "torch._C.DispatchKeySet",
       purpose="replay recorded ops below autograd and outside autocast", verified=(CPU_2_13, GPU_2_11))
def probe_dispatch_guards() -> None:
    leaf = torch.ones(2, 2, requires_grad=True)
    with below_autograd_outside_autocast():
        out = leaf * 2
        leaf.add_(1)  # in place on a leaf that requires grad: legal only below autograd
    expect(out.grad_fn is None, "no autograd graph below autograd")
    with torch.autocast("cpu", dtype=torch.bfloat16), below_autograd_outside_autocast():
        prod = torch.ones(2, 2) @ torch.ones(2, 2)
    expect(prod.dtype == torch.float32, f"autocast excluded (got {prod.dtype})")


# --------------------------------------------------------------------------
# generators, tensors, modules


def generator_key(gen: torch.Generator) -> int:
    """The C++ generator behind ``gen`` (``Generator._cdata``): the dispatcher hands ops a new Python wrapper
    of the same generator, so generators are compared by this key."""
    try:
        return gen._cdata
    except AttributeError as e:
        raise PROBES["probe_generator_key"].error(str(e)) from e


@probe("torch.Generator._cdata", purpose="recognise a registered generator in a recorded op's arguments",
       verified=(CPU_2_13, GPU_2_11))
def probe_generator_key() -> None:
    gen = torch.Generator().manual_seed(0)
    seen: list[Any] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.extend(v for v in (kwargs or {}).values() if isinstance(v, torch.Generator))
            return func(*args, **(kwargs or {}))

    with Watch():
        torch.randn(2, generator=gen)
    expect(bool(seen) and all(generator_key(g) == generator_key(gen) for g in seen),
           "the generator an op receives has the caller's key")
    expect(generator_key(torch.Generator()) != generator_key(gen), "two generators, two keys")


def tensor_hooks(t: torch.Tensor) -> tuple[dict, dict]:
    """``t``'s hook dicts: ``(Tensor._backward_hooks, Tensor._post_accumulate_grad_hooks)`` -- the hooks of
    ``register_hook`` and ``register_post_accumulate_grad_hook``. torch keeps each None until its first hook:
    an empty dict then. A tensor type without these attributes is an error, never "no hooks"."""
    try:
        backward, post = t._backward_hooks, t._post_accumulate_grad_hooks
    except AttributeError as e:
        raise PROBES["probe_tensor_hooks"].error(str(e)) from e
    return backward if backward is not None else {}, post if post is not None else {}


@probe("Tensor._backward_hooks", "Tensor._post_accumulate_grad_hooks",
       purpose="see a parameter's gradient hooks, which decide whether a graph returns its gradient",
       verified=(CPU_2_13, GPU_2_11))
def probe_tensor_hooks() -> None:
    p = nn.Parameter(torch.zeros(2))
    expect(tensor_hooks(p) == ({}, {}), "no hooks: two empty dicts")
    p.register_hook(lambda g: g)
    p.register_post_accumulate_grad_hook(lambda t: None)
    backward, post = tensor_hooks(p)
    expect(len(backward) == 1 and len(post) == 1, f"one hook each, got {len(backward)}, {len(post)}")


def module_has_hooks(m: nn.Module, *, forward_pre: bool = True) -> bool:
    """Whether ``m`` has forward, forward-pre, backward or backward-pre hooks of its own (``register_forward_hook``
    and its kin: ``nn.Module._forward_hooks``, ``_forward_pre_hooks``, ``_backward_hooks``, ``_backward_pre_hooks``),
    which its ``__call__`` runs; ``forward_pre=False``: other hooks than forward-pre ones."""
    try:
        return bool(m._forward_hooks or (forward_pre and m._forward_pre_hooks) or m._backward_hooks
                    or m._backward_pre_hooks)
    except AttributeError as e:
        raise PROBES["probe_module_has_hooks"].error(str(e)) from e


@probe("nn.Module._forward_hooks", "nn.Module._forward_pre_hooks", "nn.Module._backward_hooks",
       "nn.Module._backward_pre_hooks", purpose="see a module's own hooks, which keep it out of a chained run of "
       "graphs (cuda_graph/chains.py)", verified=(CPU_2_13,))
def probe_module_has_hooks() -> None:
    for register in ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
                     "register_full_backward_pre_hook"):
        m = nn.Linear(2, 2)
        expect(not module_has_hooks(m), "a new module has no hooks")
        handle = getattr(m, register)(lambda *_: None)
        expect(module_has_hooks(m), f"{register} is seen")
        expect(module_has_hooks(m, forward_pre=False) == (register != "register_forward_pre_hook"),
               f"{register} told from forward-pre hooks")
        handle.remove()
        expect(not module_has_hooks(m), f"{register} removed is no longer seen")


def module_parameters(m: nn.Module) -> dict[str, Any]:
    """The dict holding ``m``'s own parameters by name (``nn.Module._parameters``; values may be None)."""
    return m._parameters


def module_buffers(m: nn.Module) -> dict[str, Any]:
    """The dict holding ``m``'s own buffers by name (``nn.Module._buffers``; values may be None)."""
    return m._buffers


def module_children(m: nn.Module) -> dict[str, Any]:
    """The dict holding ``m``'s direct submodules by name (``nn.Module._modules``)."""
    return m._modules


MODULE_DICTS = frozenset({"_parameters", "_buffers", "_modules"})
"""The attribute names of those three dicts (a walk over ``vars(module)`` skips them)."""


class AfterApply(nn.Module):
    """A module that fixes itself up after ``.to()``/``.float()``/``.cuda()``: :meth:`after_apply` runs after
    ``nn.Module._apply`` (which all of them call), e.g. to keep some buffers in fp32."""

    def after_apply(self) -> None:
        """Called after every ``_apply`` of this module."""

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> "AfterApply":
        super()._apply(fn, recurse)
        self.after_apply()
        return self


@probe("nn.Module._parameters", "nn.Module._buffers", "nn.Module._modules", "nn.Module._apply",
       purpose="find and swap a module's tensors in place, and fix buffers up after .to()",
       verified=(CPU_2_13, GPU_2_11))
def probe_module_dicts() -> None:
    m = nn.Sequential(nn.Linear(2, 2))
    m.register_buffer("b", torch.zeros(1))
    expect(module_parameters(m[0])["weight"] is m[0].weight and module_buffers(m)["b"] is m.b, "own dicts")
    expect(module_children(m)["0"] is m[0], "children dict")
    expect(set(MODULE_DICTS) <= set(vars(m)), "the dicts are instance attributes")
    calls: list[torch.dtype] = []

    class Fixed(AfterApply):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("x", torch.zeros(1))

        def after_apply(self) -> None:
            calls.append(self.x.dtype)

    f = Fixed().double()
    f.to(torch.float16)
    expect(calls == [torch.float64, torch.float16], f"after_apply ran after each _apply: {calls}")


def reparametrize_module(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Any:
    """A context in which ``module``'s parameters/buffers named in ``tensors`` are those tensors
    (``torch.nn.utils.stateless._reparametrize_module``, what ``torch.func.functional_call`` uses)."""
    try:
        from torch.nn.utils.stateless import _reparametrize_module
    except ImportError as e:
        raise PROBES["probe_reparametrize"].error(str(e)) from e
    return _reparametrize_module(module, tensors)


@probe("torch.nn.utils.stateless._reparametrize_module", purpose="capture a module's forward with its "
       "parameters swapped for aliases", verified=(CPU_2_13, GPU_2_11))
def probe_reparametrize() -> None:
    lin = nn.Linear(2, 2, bias=False)
    w = torch.eye(2)
    with reparametrize_module(lin, {"weight": w}):
        expect(lin.weight is w and torch.equal(lin(torch.ones(1, 2)), torch.ones(1, 2)), "swapped in")
    expect(isinstance(lin.weight, nn.Parameter), "put back after")


# --------------------------------------------------------------------------
# amp objects the doctor reads


def autocast_settings(ac: Any) -> tuple[bool, bool]:
    """``(enabled, cache_enabled)`` of a ``torch.autocast`` object (``autocast._enabled``, ``._cache_enabled``)."""
    try:
        return bool(ac._enabled), bool(ac._cache_enabled)
    except AttributeError as e:
        raise PROBES["probe_amp_objects"].error(str(e)) from e


def grad_scaler_device(scaler: Any) -> str:
    """The device type a ``GradScaler`` was made for (``GradScaler._device``), even when it is disabled."""
    try:
        return scaler._device
    except AttributeError as e:
        raise PROBES["probe_amp_objects"].error(str(e)) from e


@probe("torch.autocast._enabled", "torch.autocast._cache_enabled", "GradScaler._device",
       purpose="recognise an autocast cache and a dynamic loss scaler in a doctor run", verified=(CPU_2_13, GPU_2_11))
def probe_amp_objects() -> None:
    ac = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True)
    expect(autocast_settings(ac) == (True, True), f"autocast settings {autocast_settings(ac)}")
    off = torch.autocast("cpu", enabled=False, cache_enabled=False)
    expect(autocast_settings(off) == (False, False), "a disabled autocast")
    expect(grad_scaler_device(torch.amp.GradScaler("cuda", enabled=False)) == "cuda", "the scaler's device type")


# --------------------------------------------------------------------------
# the CUDA caching allocator


def end_allocate_to_pool(device: torch.device, pool: Any) -> bool:
    """Stop routing allocations to ``pool`` (``torch._C._cuda_endAllocateToPool``): what ``capture_end``
    does, for a capture whose ``capture_end`` raised. False when the allocator answers that it was not
    routing to ``pool`` (``capture_end`` raised after ending it, e.g. when instantiating the graph failed):
    then there is nothing to end or release. (torch before 2.3 called it
    ``_cuda_endAllocateCurrentStreamToPool``, outside graphstep's range.)"""
    end = _allocator("_cuda_endAllocateToPool")
    try:
        end(device.index, pool)
    except RuntimeError:  # "not currently recording to mempool_id": capture_end got that far
        return False
    return True


def release_pool(device: torch.device, pool: Any) -> None:
    """Drop the capture's reference to ``pool`` so its memory is freed once no graph uses it
    (``torch._C._cuda_releasePool``)."""
    _allocator("_cuda_releasePool")(device.index, pool)


def _allocator(name: str) -> Callable[..., Any]:
    fn = getattr(torch._C, name, None)
    if fn is None:
        raise PROBES["probe_allocator_pools"].error(f"no torch._C.{name}")
    return fn


@probe("torch._C._cuda_endAllocateToPool", "torch._C._cuda_releasePool",
       purpose="hand a failed capture's memory pool back to the allocator", verified=(CPU_2_13, GPU_2_11))
def probe_allocator_pools() -> None:
    for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
        expect(callable(_allocator(name)), f"torch._C.{name} is callable")


def clear_cublas_workspaces() -> None:
    """Free cuBLAS's per-(thread, stream) workspaces (``torch._C._cuda_clearCublasWorkspaces``): the benchmark
    gives every row the same start."""
    fn = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if fn is None:
        raise PROBES["probe_cublas_workspaces"].error()
    fn()


@probe("torch._C._cuda_clearCublasWorkspaces", purpose="free cuBLAS workspaces between benchmark rows",
       verified=(GPU_2_11,), needs="cuda")
def probe_cublas_workspaces() -> None:
    clear_cublas_workspaces()


def record_memory_history(max_entries: int) -> None:
    """Start recording CUDA allocations for a snapshot (``torch.cuda.memory._record_memory_history``)."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def stop_memory_history() -> None:
    """Stop recording CUDA allocations (``_record_memory_history(enabled=None)``)."""
    torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: str) -> None:
    """Write the recorded allocations to ``path`` (``torch.cuda.memory._dump_snapshot``; pytorch.org/memory_viz)."""
    torch.cuda.memory._dump_snapshot(path)


@probe("torch.cuda.memory._record_memory_history", "torch.cuda.memory._dump_snapshot",
       purpose="write a CUDA memory snapshot of the profiled iterations", verified=(GPU_2_11,), needs="cuda")
def probe_memory_history() -> None:
    import os
    import tempfile

    record_memory_history(1000)
    torch.empty(1024, device="cuda")
    with tempfile.TemporaryDirectory() as d:
        dump_memory_snapshot(os.path.join(d, "snapshot.pickle"))
        expect(os.path.getsize(os.path.join(d, "snapshot.pickle")) > 0, "a snapshot was written")
    stop_memory_history()


# --------------------------------------------------------------------------
# kernels: foreach ops, fused AdamW, grouped matmul


def _kernel(name: str) -> Callable[..., Any]:
    fn = getattr(torch, name, None)
    if fn is not None:
        return fn

    def absent(*args: Any, **kwargs: Any) -> Any:
        raise PROBES["probe_foreach" if name.startswith("_foreach") else "probe_fused_adamw"].error(f"no torch.{name}")

    return absent


# The multi-tensor ops torch.optim uses (``torch._foreach_*``): one kernel launch per list, not per tensor.
foreach_norm = _kernel("_foreach_norm")
foreach_copy_ = _kernel("_foreach_copy_")
foreach_mul_ = _kernel("_foreach_mul_")
foreach_lerp_ = _kernel("_foreach_lerp_")
foreach_addcmul_ = _kernel("_foreach_addcmul_")
foreach_sqrt = _kernel("_foreach_sqrt")
foreach_div_ = _kernel("_foreach_div_")
foreach_div = _kernel("_foreach_div")
foreach_add_ = _kernel("_foreach_add_")
foreach_zero_ = _kernel("_foreach_zero_")
# The fused AdamW step torch.optim.AdamW(fused=True) runs (``torch._fused_adamw_``), on CUDA and CPU.
fused_adamw_ = _kernel("_fused_adamw_")


@probe("torch._foreach_norm", "_foreach_copy_", "_foreach_mul_", "_foreach_lerp_", "_foreach_addcmul_",
       "_foreach_sqrt", "_foreach_div_", "_foreach_div", "_foreach_add_", "_foreach_zero_",
       purpose="run the optimizer's update as multi-tensor kernels", verified=(CPU_2_13, GPU_2_11))
def probe_foreach() -> None:
    a, b = [torch.tensor([3.0, 4.0]), torch.tensor([1.0])], [torch.tensor([1.0, 1.0]), torch.tensor([2.0])]
    expect([float(n) for n in foreach_norm(a, 2.0)] == [5.0, 1.0], "norm")
    x = [t.clone() for t in a]
    foreach_mul_(x, 2.0)
    foreach_add_(x, b)
    foreach_addcmul_(x, b, b, value=1.0)
    foreach_lerp_(x, b, 0.5)
    foreach_div_(x, 2.0)
    y = foreach_div(foreach_sqrt(x), 1.0)
    ref = [((t * 2 + u + u * u) * 0.5 + u * 0.5) / 2 for t, u in zip(a, b)]
    expect(all(torch.allclose(yy, r.sqrt()) for yy, r in zip(y, ref)), "foreach arithmetic matches per tensor")
    foreach_copy_(x, b)
    expect(all(torch.equal(xx, u) for xx, u in zip(x, b)), "copy")
    z = [torch.ones(2), torch.ones(3, dtype=torch.int64)]
    foreach_zero_(z)
    expect(all(not t.any() for t in z), "zero_ over tensors of two dtypes")


@probe("torch._fused_adamw_", purpose="run the fused AdamW step", verified=(CPU_2_13, GPU_2_11))
def probe_fused_adamw() -> None:
    p = nn.Parameter(torch.tensor([1.0, -2.0]))
    p.grad = torch.tensor([0.5, 0.25])
    ref = torch.optim.AdamW([p], lr=0.1, weight_decay=0.01, foreach=False)
    mine = [p.detach().clone()]
    ref.step()
    m, v, step = [torch.zeros(2)], [torch.zeros(2)], [torch.tensor(1.0)]
    fused_adamw_(mine, [p.grad], m, v, [], step, lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
                 amsgrad=False, maximize=False, grad_scale=None, found_inf=None)
    expect(torch.allclose(mine[0], p.detach()), f"one step as AdamW: {mine[0]} vs {p.detach()}")
    # grad_scale divides the gradients (the optimizer's clipping): twice the gradient scaled by 2 is the same step
    scaled, m, v, step = [torch.tensor([1.0, -2.0])], [torch.zeros(2)], [torch.zeros(2)], [torch.tensor(1.0)]
    fused_adamw_(scaled, [p.grad * 2], m, v, [], step, lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
                 amsgrad=False, maximize=False, grad_scale=torch.tensor(2.0), found_inf=None)
    expect(torch.allclose(scaled[0], p.detach()), f"grad_scale=2 on twice the gradient: {scaled[0]} vs {p.detach()}")


def grouped_mm_available() -> bool:
    """Whether this torch has ``torch._grouped_mm`` (whether it runs sync-free is the caller's test)."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x [P, k] @ w[g] [k, n]`` for each group ``g`` of rows ending at ``offs[g]`` (``torch._grouped_mm``)."""
    if not grouped_mm_available():
        raise PROBES["probe_grouped_mm"].error()
    return torch._grouped_mm(x, w, offs=offs)


@probe("torch._grouped_mm", purpose="run the MoE experts as one grouped matmul", verified=(CPU_2_13, GPU_2_11))
def probe_grouped_mm() -> None:
    x, w = torch.randn(5, 8), torch.randn(2, 4, 8)  # w as the experts store it: [groups, out, in]
    out = grouped_mm(x, w.transpose(-2, -1), torch.tensor([2, 5], dtype=torch.int32))
    expect(torch.allclose(out, torch.cat([x[:2] @ w[0].t(), x[2:] @ w[1].t()]), atol=1e-5), "per-group products")


# --------------------------------------------------------------------------
# FSDP2 (fully_shard) internals: per-layer graphs keep the gathered parameters in place

_FSDP_PURPOSE = "keep FSDP2's gathered parameters in place for per-layer graphs and restore its state after a " \
                "failed capture"


def fsdp_state(module: nn.Module) -> Any:
    """The FSDP2 state of an FSDP2 module (``FSDPModule._get_fsdp_state()``)."""
    try:
        get = module._get_fsdp_state
    except AttributeError as e:
        raise PROBES["probe_fsdp2"].error(str(e)) from e
    return get()


def fsdp_param_groups(state: Any) -> list[Any]:
    """The parameter groups of an FSDP2 state (none when it manages no parameter).

    Two layouts, both kept: ``state._fsdp_param_groups`` (a list; torch 2.13) and
    ``state._fsdp_param_group`` (one group or None; torch 2.11).
    """
    groups = vars(state).get("_fsdp_param_groups")
    if groups is not None:
        return list(groups)
    if "_fsdp_param_group" in vars(state) or hasattr(type(state), "_fsdp_param_group"):
        group = state._fsdp_param_group
        return [group] if group is not None else []
    raise PROBES["probe_fsdp2"].error("no _fsdp_param_groups or _fsdp_param_group on its state")


def fsdp_shared_contexts(state: Any) -> tuple[Any, Any]:
    """``(state._state_ctx, state._comm_ctx)``: the contexts the FSDP2 states of one root share."""
    try:
        return state._state_ctx, state._comm_ctx
    except AttributeError as e:
        raise PROBES["probe_fsdp2"].error(str(e)) from e


def unsharded_param(fsdp_param: Any) -> Any:
    """An FSDPParam's gathered parameter, or None before its first all-gather (``_unsharded_param``)."""
    return vars(fsdp_param).get("_unsharded_param")


ACCUMULATED_GRAD = "unsharded_accumulated_grad"
"""An FSDPParam's attribute holding the gradient accumulated without reduce-scatter (absent when none)."""


def accumulated_grad(fsdp_param: Any) -> dict[str, Any]:
    """``{ACCUMULATED_GRAD: grad}`` when the FSDPParam holds one, else ``{}`` (to restore with vars().update)."""
    return {k: vars(fsdp_param)[k] for k in (ACCUMULATED_GRAD,) if k in vars(fsdp_param)}


def group_sharded_state(group: Any) -> Any:
    """An FSDP2 parameter group's ``_sharded_state`` (a ShardedState: SHARDED, UNSHARDED, ...)."""
    try:
        return group._sharded_state
    except AttributeError as e:
        raise PROBES["probe_fsdp2"].error(str(e)) from e


def set_group_sharded_state(group: Any, state: Any) -> None:
    """Write a group's ``_sharded_state`` without running any transition."""
    vars(group)["_sharded_state"] = state


def group_to_sharded(group: Any) -> None:
    """Register a group's sharded parameters again and free the gathered ones (``group._to_sharded()``)."""
    try:
        to_sharded = group._to_sharded
    except AttributeError as e:
        raise PROBES["probe_fsdp2"].error(str(e)) from e
    to_sharded()


def _keep(*_: Any) -> None:
    """In place of ``FSDPParam.free_unsharded_param``: the gathered storage stays allocated."""


def keep_unsharded_storage(fsdp_param: Any) -> None:
    """Make FSDP2 never free this FSDPParam's gathered storage: its ``free_unsharded_param`` (which FSDP2
    calls on the instance whenever it reshards) becomes a no-op on this instance."""
    if not callable(getattr(type(fsdp_param), "free_unsharded_param", None)):
        raise PROBES["probe_fsdp2"].error("FSDPParam has no free_unsharded_param")
    fsdp_param.free_unsharded_param = _keep


def stop_keeping_unsharded_storage(fsdp_param: Any) -> None:
    """Undo :func:`keep_unsharded_storage`; frees the gathered storage now when the parameter is sharded."""
    vars(fsdp_param).pop("free_unsharded_param", None)
    if fsdp_param.sharded_state.name == "SHARDED":  # resharded while kept: nothing else would free it
        fsdp_param.free_unsharded_param()


@probe("FSDPModule._get_fsdp_state", "FSDPState._fsdp_param_groups (2.13) / _fsdp_param_group (2.11)",
       "FSDPState._state_ctx", "FSDPState._comm_ctx", "FSDPParamGroup._sharded_state",
       "FSDPParamGroup._to_sharded", "FSDPParam._unsharded_param", "FSDPParam.free_unsharded_param",
       "FSDPParam.unsharded_accumulated_grad", purpose=_FSDP_PURPOSE, verified=(CPU_2_13, GPU_2_11),
       needs="process_group")
def probe_fsdp2() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    unit = model[0]
    state = fsdp_state(unit)
    groups = fsdp_param_groups(state)
    expect(len(groups) == 1 and len(groups[0].fsdp_params) == 2, "one group of two parameters")
    expect(all(c is not None for c in fsdp_shared_contexts(state)), "shared contexts")
    group = groups[0]
    expect(group_sharded_state(group).name == "SHARDED", "sharded before the first forward")
    fps = group.fsdp_params
    expect(ACCUMULATED_GRAD in inspect.getsource(type(fps[0])), "FSDPParam keeps an unsharded_accumulated_grad")
    for fp in fps:
        keep_unsharded_storage(fp)
    model(torch.ones(1, 4)).sum().backward()  # unshard, reshard after forward and after backward
    expect(group_sharded_state(group).name == "SHARDED", "resharded after backward")
    expect(all(unsharded_param(fp) is not None and unsharded_param(fp).untyped_storage().size() > 0 for fp in fps),
           "the kept gathered storage stays allocated while sharded")
    unit.unshard()
    expect(group_sharded_state(group).name == "UNSHARDED", "unshard() switches the group")
    group_to_sharded(group)
    expect(group_sharded_state(group).name == "SHARDED", "_to_sharded() switches it back")
    before = group_sharded_state(group)
    set_group_sharded_state(group, before)
    for fp in fps:
        stop_keeping_unsharded_storage(fp)
        expect(unsharded_param(fp).untyped_storage().size() == 0, "freed when no longer kept")
