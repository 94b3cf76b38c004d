"""The library's contract: keyword arguments, generators, lazily created state, states, errors, scopes.

Each test holds one promise of docs/library.md; the CUDA twins (marked ``cuda``) run in scripts/gpu-check.
"""

from __future__ import annotations

import contextlib
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphstep
from graphstep import CaptureError, ContractError, GraphstepError, GraphUsageError
from graphstep.api import select_by_pattern
from graphstep.cuda_graph.backend import Graph, GraphBackend
from graphstep.cuda_graph.errors import ACCUMULATE_GRAD_WARNING
from graphstep.cuda_graph.full_iteration import GraphedStep
from graphstep.doctor import capture_error_hook

from helpers.runs import NeverCapturedGraph

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=CUDA)]


@pytest.fixture(autouse=True)
def _free_graphs():
    yield
    graphstep.close_all()


def _model_and_step(device: str, opt_name: str = "sgd", seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 1)).to(device)
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    elif device == "cuda":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

    def step(x: torch.Tensor, *, target: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = F.mse_loss(model(x).squeeze(-1), target) * scale
        loss.backward()
        opt.step()
        return loss.detach()

    return model, opt, step


def _batches(device: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g).to(device), torch.randn(4, generator=g).to(device)) for _ in range(n)]


def _losses(device: str, steps: int = 8, opt_name: str = "sgd", **graph: object) -> tuple[list[torch.Tensor], object]:
    """Losses of ``steps`` training steps (dropout on), eager or with ``graph_step(**graph)``; and the step."""
    model, _, step = _model_and_step(device, opt_name)
    fn = graphstep.graph_step(step, device=device, modules=[model], **graph) if graph else step
    torch.manual_seed(7)  # the same dropout masks for the eager and the graphed run
    return [fn(x, target=y, scale=0.5).clone() for x, y in _batches(device, steps)], fn


# --------------------------------------------------------------------------
# keyword arguments


@pytest.mark.parametrize("device", DEVICES)
def test_keyword_arguments_are_copied_in_like_positional_ones(device):
    eager, _ = _losses(device)
    graphed, step = _losses(device, warmup_steps=2)
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed)) and len(graphed) == 8
    assert step.state == "replayed" and not torch.equal(graphed[6], graphed[7])


def test_keyword_arguments_keep_the_contract():
    graphed = graphstep.graph_step(lambda x, *, mask: x * mask, warmup_steps=0, device="cpu")
    graphed(torch.ones(2, 4), mask=torch.ones(2, 4))
    with pytest.raises(ContractError, match=r"argument mask differs.*\(2, 4\).*\(2, 5\)"):
        graphed(torch.ones(2, 4), mask=torch.ones(2, 5))
    with pytest.raises(ContractError, match=r"captured: \(tensor, mask=tensor\)\n  now:      \(tensor, tensor\)"):
        graphed(torch.ones(2, 4), torch.ones(2, 4))


def test_a_graphed_module_call_of_plain_arguments_keeps_the_whole_contract():
    """A graphed module's call whose arguments are all leaves is read without a pytree walk (its replay
    path): the leaves are the pytree's, and another structure, shape or value is still refused."""
    from graphstep.cuda_graph.static_io import StaticInputs
    from graphstep.cuda_graph.torch_compat import tree_flatten

    x, mask = torch.ones(2, 4), torch.zeros(2, 4)
    static = StaticInputs(((x, None, 3), {"mask": mask}), name="layer0.attn")
    assert static.flat_key == (3, ("mask",))
    args, kwargs = (torch.ones(2, 4), None, 3), {"mask": torch.ones(2, 4)}
    fast = static.call_leaves(args, kwargs)
    assert len(fast) == 4 and all(a is b for a, b in zip(fast, tree_flatten((args, kwargs))[0]))
    static.copy_in_leaves(fast)
    assert torch.equal(static.leaves[3], kwargs["mask"])
    for other in [((x, None, 3), {"pad": mask}), ((x, None), {"mask": mask}), (([x], None, 3), {"mask": mask}),
                  ((x, None, 3, mask), {})]:
        with pytest.raises(ContractError, match="another structure than the captured call"):
            static.call_leaves(*other)
    with pytest.raises(ContractError, match=r"non-tensor argument \[0\]\[2\] differs.*captured 3, now 4"):
        static.copy_in_leaves(static.call_leaves((x, None, 4), {"mask": mask}))
    with pytest.raises(ContractError, match=r"argument \[1\]\['mask'\] differs"):
        static.copy_in_leaves(static.call_leaves((x, None, 3), {"mask": torch.ones(2, 5)}))
    nested = StaticInputs((([x, mask],), {}), name="layer0.mlp")  # a list argument: the pytree path
    assert nested.flat_key is None
    assert len(nested.call_leaves(([x, mask],), {})) == 2


def test_contract_error_speaks_of_the_library():
    graphed = graphstep.graph_step(lambda x: x * 2, warmup_steps=0, device="cpu")
    graphed(torch.ones(3))
    with pytest.raises(ContractError) as info:
        graphed(torch.ones(4))
    assert "seq_length_buckets" not in str(info.value) and "pad inputs to a fixed shape" in str(info.value)


# --------------------------------------------------------------------------
# generators=


def _private_noise_step(gen: torch.Generator, device: str):
    def step(x: torch.Tensor) -> torch.Tensor:
        return x + torch.randn(x.shape, device=device, generator=gen)

    return step


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["list", "tuple", "callable", "one"])
def test_generators_take_a_list_a_callable_or_one_generator(device, form):
    gen, ref = (torch.Generator(device=device).manual_seed(3) for _ in range(2))
    generators = {"list": [gen], "tuple": (gen,), "callable": lambda: [gen], "one": gen}[form]
    graphed = graphstep.graph_step(_private_noise_step(gen, device), warmup_steps=1, device=device,
                                   generators=generators)
    eager = _private_noise_step(ref, device)
    x = torch.zeros(5, device=device)
    outs = [(graphed(x).clone(), eager(x)) for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in outs)
    assert not torch.equal(outs[2][0], outs[3][0])  # the registered stream advances on every replay


def test_generators_of_another_type_are_refused_clearly():
    with pytest.raises(TypeError, match="torch.Generator"):
        graphstep.graph_step(lambda x: x, device="cpu", generators=[1])


class _Noisy(nn.Module):
    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gen = gen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.rand(x.shape, generator=self.gen)


class _NoisyNet(nn.Module):
    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.features = _Noisy(gen)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x)).sum()


def _noisy_run(graphed: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(9)
    model = _NoisyNet(gen)
    if graphed:  # a plain module name ("features") and a list of generators
        graphstep.graph_layers(model, ["features"], warmup_steps=1, generators=[gen])
    grads = []
    for i in range(4):
        model.zero_grad(set_to_none=False)
        model(torch.full((2, 4), float(i))).backward()
        grads.append(model.features.lin.weight.grad.clone())
    return grads


def test_graph_layers_takes_module_names_and_a_generator_list():
    assert all(torch.equal(a, b) for a, b in zip(_noisy_run(False), _noisy_run(True)))


def test_module_names_select_before_builtin_scopes():
    model = _NoisyNet(torch.Generator())
    assert [n for n, _ in select_by_pattern(model, "features")] == ["features"]
    assert [n for n, _ in select_by_pattern(model, ["features.lin", "head"])] == ["features.lin", "head"]
    with pytest.raises(ValueError, match=r"'attn' is neither a submodule of _NoisyNet nor a built-in scope \(no built"):
        select_by_pattern(model, ["attn"])


# --------------------------------------------------------------------------
# optimizer state created inside the capture


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_lazily_created_optimizer_state_is_refused_at_capture(device, opt_name):
    model, opt, step = _model_and_step(device, opt_name)
    graphed = graphstep.graph_step(step, warmup_steps=0, device=device, modules=[model])
    x, y = _batches(device, 1)[0]
    with pytest.raises(CaptureError, match="warm up at least one step so the optimizer creates its state") as info:
        graphed(x, target=y)
    assert info.value.category == "lazy_state" and "state[param 0]" in str(info.value)
    assert len(opt.state) == 0  # rolled back: an eager step creates it as eager code would


@pytest.mark.parametrize("device", DEVICES)
def test_lazy_state_with_eager_fallback_equals_eager(device):
    eager, _ = _losses(device, 5, "adamw")
    graphed, step = _losses(device, 5, "adamw", warmup_steps=0, on_failure="eager")
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))
    assert step.failed is not None and step.failed.category == "lazy_state" and step.state == "eager"


def test_optimizers_passed_in_are_checked_too():
    model = nn.Linear(4, 1)
    holder = types.SimpleNamespace(opt=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def step(x: torch.Tensor) -> torch.Tensor:  # reaches the optimizer through an attribute: not found alone
        model(x).sum().backward()
        holder.opt.step()
        return x

    graphed = graphstep.graph_step(step, warmup_steps=0, device="cpu", optimizers=[holder.opt])
    with pytest.raises(CaptureError, match=r"SGD.state\[param 0\]\['momentum_buffer'\].*warm up at least one step"):
        graphed(torch.ones(2, 4))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_one_warmup_step_captures_optimizer_state_equal_to_eager(device, opt_name):
    eager, _ = _losses(device, 6, opt_name)
    graphed, step = _losses(device, 6, opt_name, warmup_steps=1)
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed)) and step.state == "replayed"


# --------------------------------------------------------------------------
# states and error types


def test_state_is_eager_before_the_first_call_and_after_reset():
    graphed = graphstep.graph_step(lambda x: x + 1, warmup_steps=1, device="cpu")
    states = [graphed.state]
    for _ in range(3):
        graphed(torch.ones(2))
        states.append(graphed.state)
    graphed.reset()
    assert states + [graphed.state] == ["eager", "eager", "captured", "replayed", "eager"]


def test_error_types_share_a_documented_base():
    assert issubclass(GraphUsageError, GraphstepError) and issubclass(GraphUsageError, RuntimeError)
    assert issubclass(CaptureError, GraphstepError) and issubclass(ContractError, GraphstepError)
    assert issubclass(ContractError, ValueError)


def test_print_in_the_step_is_refused_as_the_docs_say():
    def step(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        print(y)
        return y

    graphed = graphstep.graph_step(step, warmup_steps=0, device="cpu")
    with pytest.raises(CaptureError) as info:
        graphed(torch.ones(3))
    assert info.value.where.filename == __file__ and info.value.where.lineno == step.__code__.co_firstlineno + 2


# --------------------------------------------------------------------------
# out of memory inside a capture (the CUDA backend's error path, on the CPU)


class _OomBackend(GraphBackend):
    """Fails every capture as CudaGraphBackend does when the step runs out of device memory."""

    name = "cuda"

    def new_graph(self, name: str, *, shared_pool: bool = True) -> Graph:
        return self._track(NeverCapturedGraph())

    @contextlib.contextmanager
    def capture(self, graph, generators=()):
        try:
            yield
        except Exception as exc:
            raise CaptureError.from_cuda(exc, graph.name) from exc

    def memory(self):
        return 0, 0


def _oom_step(x: torch.Tensor) -> torch.Tensor:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 TiB. GPU 0 has a total capacity of "
                                 "139.81 GiB of which 138.90 GiB is free.")


def test_out_of_memory_in_capture_is_clear_and_not_rerun(monkeypatch):
    reruns = _spy_doctor(monkeypatch)
    graphed = GraphedStep(_oom_step, _OomBackend(torch.device("cpu")), warmup_steps=0,
                          on_capture_error=capture_error_hook)  # graph_step's hook: it never re-runs an OOM
    with pytest.raises(CaptureError, match=r"ran out of device memory \(asked for 4.00 TiB.*nothing was graphed") as info:
        graphed(torch.ones(2))
    assert info.value.category == "oom" and isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert graphed.graph is None and not graphed.captured and reruns == []


def _spy_doctor(monkeypatch) -> list[tuple]:
    """Calls of the doctor's diagnose (a failure inside it would only be logged)."""
    import graphstep.doctor as doctor

    calls: list[tuple] = []
    monkeypatch.setattr(doctor, "diagnose", lambda *args, **kwargs: calls.append(args) or [])
    return calls


def test_diagnose_of_a_device_graph_never_moves_device_work_to_the_host():
    from graphstep.doctor import diagnose

    made: list[torch.device] = []

    def step() -> torch.Tensor:
        t = torch.zeros(4, device="cuda")  # simulated, this would run on the CPU
        made.append(t.device)
        return t

    diagnose(step, (), device="cuda")
    assert all(d.type == "cuda" for d in made)
    diagnose(step, ())  # no device named, no tensor on a GPU: the CPU simulates the GPU step
    assert made[-1].type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_out_of_memory_in_a_real_capture_keeps_host_memory_flat():
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    step = graphstep.graph_step(lambda: torch.zeros(2**40, device="cuda"), warmup_steps=0)
    with pytest.raises(CaptureError, match="ran out of device memory") as info:
        step()
    assert info.value.category == "oom" and "asked for 4096.00 GiB" in str(info.value)  # 2**40 fp32
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 2**20  # < 1 GiB more at peak
    eager, _ = _losses("cuda", 5)  # later graphs still capture, and equal eager
    graphed, step = _losses("cuda", 5, warmup_steps=1)
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed)) and step.state == "replayed"


# --------------------------------------------------------------------------
# retained AccumulateGrad nodes (DDP) and the capture stream


def test_capture_stream_is_a_no_op_on_the_cpu():
    with graphstep.capture_stream("cpu"):
        model = nn.Linear(3, 1)
    graphed = graphstep.graph_step(lambda x: model(x).sum(), warmup_steps=1, device="cpu")
    x = torch.ones(2, 3)
    assert torch.equal(graphed(x), model(x).sum()) and torch.equal(graphed(x), model(x).sum())
    if not torch.cuda.is_available():
        with graphstep.capture_stream():  # no device: nothing to switch
            assert torch.equal(model(x), model(x))


@pytest.mark.parametrize("text", [
    "CUDA error: operation would make the legacy stream depend on a capturing blocking stream",
    "cudaErrorStreamCaptureImplicit: operation would make the legacy stream depend on a capturing blocking stream",
])
def test_implicit_stream_capture_failure_names_accumulate_grad_and_the_fix(monkeypatch, text):
    reruns = _spy_doctor(monkeypatch)

    def step(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(text)

    graphed = GraphedStep(step, _OomBackend(torch.device("cpu")), warmup_steps=0, on_capture_error=capture_error_hook)
    with pytest.raises(CaptureError, match=r"with graphstep.capture_stream\(\): model = DDP\(model\)") as info:
        graphed(torch.ones(2))
    assert info.value.category == "accumulate_grad_stream" and "AccumulateGrad" in str(info.value)
    assert reruns == []


def test_accumulate_grad_warning_in_warmup_fails_the_capture_clearly(monkeypatch):
    reruns = _spy_doctor(monkeypatch)
    ran = []

    def step(x: torch.Tensor) -> torch.Tensor:
        ran.append(x.clone())
        if len(ran) == 1:  # what autograd warns during a warm-up backward on the capture stream
            warnings.warn(f"{ACCUMULATE_GRAD_WARNING} the incoming gradient. ...", UserWarning)
        warnings.warn("an unrelated warning", UserWarning)
        return x * 2

    graphed = graphstep.graph_step(step, warmup_steps=1, device="cpu")
    with pytest.warns(UserWarning, match="an unrelated warning"):  # other warnings still reach the user
        graphed(torch.ones(2))
    with pytest.raises(CaptureError, match=r"warm-up on the capture stream warned.*graphstep.capture_stream") as info:
        graphed(torch.ones(2))
    assert info.value.category == "accumulate_grad_stream" and "graph 'step'" in str(info.value)
    assert len(ran) == 1 and graphed.graph is None and reruns == []  # refused before capturing anything


class _RetainAccumulators:
    """Keeps every parameter's AccumulateGrad node alive with a hook, as torch DDP and Megatron's DDP do
    (Megatron's test_ddp_grad_accumulators_share_full_cuda_graph_stream)."""

    def __init__(self, model: nn.Module) -> None:
        self.nodes = []
        for p in model.parameters():
            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(lambda *grads: None)
            self.nodes.append(acc)


def _retaining_run(graphed: bool, on_capture_stream: bool, steps: int = 10) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1)).cuda()
    with graphstep.capture_stream() if on_capture_stream else contextlib.nullcontext():
        keeper = _RetainAccumulators(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = F.mse_loss(model(x).squeeze(-1), y)
        loss.backward()
        opt.step()
        return loss.detach()

    fn = graphstep.graph_step(step, warmup_steps=2, modules=[model]) if graphed else step
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 32, generator=g).cuda(), torch.randn(16, generator=g).cuda()) for _ in range(steps)]
    losses = [fn(x, y).clone() for x, y in batches]
    assert len(keeper.nodes) == 4
    return losses


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_retained_accumulators_built_on_the_capture_stream_graph_equal_to_eager():
    eager = _retaining_run(graphed=False, on_capture_stream=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = _retaining_run(graphed=True, on_capture_stream=True)
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed)) and len(graphed) == 10
    assert not [w for w in caught if "AccumulateGrad node's stream does not match" in str(w.message)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_retained_accumulators_built_elsewhere_name_capture_stream():
    with pytest.raises(CaptureError, match=r"graphstep.capture_stream\(\)") as info:
        _retaining_run(graphed=True, on_capture_stream=False)
    assert info.value.category == "accumulate_grad_stream"
    graphstep.close_all()  # the failed capture left nothing behind: the fixed model graphs and equals eager
    eager, graphed = _retaining_run(False, False), _retaining_run(True, True)
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ddp_built_on_the_capture_stream_graphs_equal_to_eager_ddp(tmp_path, monkeypatch):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")  # PyTorch's advice for DDP under CUDA graphs
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            device_id=device)
    try:
        losses = {}
        for graphed in (False, True):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1)).to(device)
            with graphstep.capture_stream() if graphed else contextlib.nullcontext():
                ddp = DDP(model)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

            def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                opt.zero_grad(set_to_none=False)
                loss = F.mse_loss(ddp(x).squeeze(-1), y)
                loss.backward()
                opt.step()
                return loss.detach()

            # PyTorch's CUDA-graph notes: 11 DDP-enabled eager iterations before the capture
            fn = graphstep.graph_step(step, warmup_steps=11, modules=[model]) if graphed else step
            g = torch.Generator().manual_seed(1)
            batches = [(torch.randn(16, 32, generator=g).to(device), torch.randn(16, generator=g).to(device))
                       for _ in range(16)]
            losses[graphed] = [fn(x, y).clone() for x, y in batches]
            if graphed:
                assert fn.state == "replayed"
            graphstep.close_all()
        assert all(torch.equal(a, b) for a, b in zip(losses[False], losses[True]))
    finally:
        graphstep.close_all()
        dist.destroy_process_group()
