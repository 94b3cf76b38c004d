"""The private PyTorch APIs graphstep uses: every probe passes on this torch, and a missing name is a clear error.

Each probe (cuda_graph/torch_compat.py, graphstep/engines_compat.py) checks that a
private name exists and behaves as graphstep expects. The CUDA-only ones are
skipped without a GPU (a `cuda` test runs every probe on the GPU machine's torch); the FSDP2 and DTensor ones run on a 1-rank gloo group.
The failure tests hand the accessors stand-in objects that lack the private
name (torch itself is left alone) and check the error names the torch version,
the name and the versions it was verified on. The last tests cover the one
monkeypatch mechanism (cuda_graph/monkeypatch.py) of the replay backend and the doctor.
"""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch
import torch.distributed as dist

from graphstep.cuda_graph import torch_compat as tc
from graphstep.cuda_graph.monkeypatch import Patches
from graphstep import engines_compat as tt


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A 1-rank gloo group for the probes that need one (FSDP2, DTensor)."""
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(tc.PROBES))
def test_every_probe_passes_on_this_torch(name, request):
    probe = tc.PROBES[name]
    if probe.needs == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"{name} checks a CUDA-only call ({', '.join(probe.names)}): no GPU here")
    if probe.needs == "transformers":
        pytest.importorskip("transformers", reason=f"{name} checks transformers' helpers: not installed")
    if probe.needs == "process_group":
        if not dist.is_available():
            pytest.skip(f"{name} needs torch.distributed, which this torch was built without")
        request.getfixturevalue("process_group")
    probe.run()


@pytest.mark.cuda
def test_every_probe_passes_on_the_gpu_machine(process_group):
    """On a GPU (scripts/gpu-check, torch 2.11 there): every probe, the CUDA-only ones included."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    failed = []
    for name, probe in sorted(tc.PROBES.items()):
        if probe.needs == "transformers" and importlib.util.find_spec("transformers") is None:
            continue
        try:
            probe.run()
        except tc.TorchCompatError as exc:
            failed.append(f"{name}: {exc}")
    assert not failed, failed


def test_every_probe_names_what_it_is_for_and_where_it_was_verified():
    for name, probe in tc.PROBES.items():
        assert probe.names and probe.purpose and probe.verified, name
        assert probe.needs in (None, "cuda", "process_group", "transformers"), name


def _says(err: pytest.ExceptionInfo, *words: str) -> None:
    text = str(err.value)
    assert "\n" not in text, text
    for word in (*words,):
        assert word in text, f"{word!r} not in {text!r}"


# --------------------------------------------------------------------------
# a failing probe, a missing name: one clear error


def test_a_failing_probe_names_the_torch_version_the_names_and_where_it_was_verified():
    def check() -> None:
        raise AttributeError("'FSDPState' object has no attribute '_fsdp_param_groups'")

    probe = tc.Probe(("FSDPState._fsdp_param_groups",), "keep gathered parameters", ("2.13.0 (CPU)",), check)
    with pytest.raises(tc.TorchCompatError) as err:
        probe.run()
    _says(err, f"torch {torch.__version__}", "FSDPState._fsdp_param_groups", "keep gathered parameters",
          "verified on torch 2.13.0 (CPU)", tc.SUPPORTED, "AttributeError")


def test_a_tensor_without_hook_dicts_is_an_error_not_no_hooks():
    with pytest.raises(tc.TorchCompatError) as err:
        tc.tensor_hooks(types.SimpleNamespace())
    _says(err, f"torch {torch.__version__}", "Tensor._backward_hooks", "verified on torch")


def test_hook_dicts_that_torch_has_not_made_yet_are_empty():
    assert tc.tensor_hooks(types.SimpleNamespace(_backward_hooks=None, _post_accumulate_grad_hooks=None)) == ({}, {})


def test_fsdp_param_groups_keeps_both_layouts_and_refuses_a_third():
    group = object()
    assert tc.fsdp_param_groups(types.SimpleNamespace(_fsdp_param_groups=[group])) == [group]  # torch 2.13
    assert tc.fsdp_param_groups(types.SimpleNamespace(_fsdp_param_group=group)) == [group]  # torch 2.11
    assert tc.fsdp_param_groups(types.SimpleNamespace(_fsdp_param_group=None)) == []
    with pytest.raises(tc.TorchCompatError) as err:
        tc.fsdp_param_groups(types.SimpleNamespace(param_groups=[group]))
    _says(err, f"torch {torch.__version__}", "_fsdp_param_groups", "_fsdp_param_group")


@pytest.mark.parametrize("call", [
    lambda: tc.fsdp_state(torch.nn.Linear(1, 1)),
    lambda: tc.fsdp_shared_contexts(types.SimpleNamespace(_state_ctx=1)),
    lambda: tc.group_sharded_state(types.SimpleNamespace()),
    lambda: tc.group_to_sharded(types.SimpleNamespace()),
    lambda: tc.keep_unsharded_storage(types.SimpleNamespace(free=lambda: None)),
], ids=["get_fsdp_state", "comm_ctx", "sharded_state", "to_sharded", "free_unsharded_param"])
def test_fsdp_internals_missing_on_a_stand_in_are_errors(call):
    with pytest.raises(tc.TorchCompatError) as err:
        call()
    _says(err, f"torch {torch.__version__}", "FSDPModule._get_fsdp_state", "for per-layer graphs")


@pytest.mark.parametrize("call, name", [
    (lambda: tc.generator_key(types.SimpleNamespace()), "Generator._cdata"),
    (lambda: tc.autocast_settings(types.SimpleNamespace(_enabled=True)), "autocast._cache_enabled"),
    (lambda: tc.grad_scaler_device(types.SimpleNamespace()), "GradScaler._device"),
    (lambda: tt.dtensor_local(types.SimpleNamespace()), "DTensor._local_tensor"),
    (lambda: tt.wrap_stage_setup(types.SimpleNamespace(), lambda init: init), "_initialize_stage"),
    (lambda: tt.forward_only_step(types.SimpleNamespace(step=lambda: None)), "_has_backward"),
    (lambda: tc._kernel("_foreach_not_in_this_torch")(), "torch._foreach_norm"),
], ids=["generator", "autocast", "grad_scaler", "dtensor", "initialize_stage", "has_backward", "foreach"])
def test_other_private_names_missing_on_a_stand_in_are_errors(call, name):
    with pytest.raises(tc.TorchCompatError) as err:
        call()
    _says(err, f"torch {torch.__version__}", name, "verified on torch")


def test_a_forward_only_step_without_eval_switches_backward_off_and_back():
    seen = []

    class OldSchedule:  # torch 2.11's schedules: no eval(), a _has_backward switch
        _has_backward = True

        def step(self, *args, **kwargs):
            seen.append((self._has_backward, args, kwargs))

    schedule = OldSchedule()
    tt.forward_only_step(schedule, 1, target=2)
    assert seen == [(False, (1,), {"target": 2})] and schedule._has_backward is True


def test_transformers_without_a_mask_helper_is_an_error_naming_its_version():
    transformers = pytest.importorskip("transformers")
    stand_in = types.ModuleType("masking_utils")
    stand_in.find_packed_sequence_indices = lambda position_ids: None
    with pytest.raises(tc.TorchCompatError) as err:
        tt.masking_functions(stand_in)
    _says(err, f"transformers {transformers.__version__}", "_ignore_causal_mask_sdpa",
          "_ignore_bidirectional_mask_sdpa", "verified on transformers")
    assert tt.masking_utils_missing() is None  # this transformers has masking_utils


# --------------------------------------------------------------------------
# the one monkeypatch mechanism


class _Base:
    def inherited(self) -> str:
        return "base"


class _Owner(_Base):
    def own(self) -> str:
        return "own"

    @staticmethod
    def static() -> str:
        return "static"


def test_patches_put_every_attribute_back_exactly():
    before = dict(vars(_Owner))
    with Patches() as patches:
        assert patches.wrap(_Owner, "own", lambda old: lambda self: "new " + old(self))
        assert patches.wrap(_Owner, "inherited", lambda old: lambda self: "new " + old(self))
        assert patches.wrap(_Owner, "static", lambda old: staticmethod(lambda: "new " + old()))
        assert not patches.wrap(_Owner, "absent", lambda old: old)  # nothing to wrap: nothing done
        assert (_Owner().own(), _Owner().inherited(), _Owner.static()) == ("new own", "new base", "new static")
        patches.wrap(_Owner, "own", lambda old: lambda self: "again " + old(self))  # twice: undone in reverse
        assert _Owner().own() == "again new own"
    assert dict(vars(_Owner)) == before  # the staticmethod object itself, no own copy of the inherited method
    assert "inherited" not in vars(_Owner) and isinstance(vars(_Owner)["static"], staticmethod)


def test_patches_are_put_back_on_errors_and_keep_metadata_when_asked():
    module = types.ModuleType("m")

    def synchronize(device=None):
        """Wait."""

    module.synchronize = synchronize
    with pytest.raises(ValueError):
        with Patches() as patches:
            patches.wrap(module, "synchronize", lambda old: lambda *a: None, keep_metadata=True)
            assert module.synchronize.__doc__ == "Wait." and module.synchronize.__wrapped__ is synchronize
            raise ValueError
    assert module.synchronize is synchronize
