"""Per-layer scoped graphs on the CPU replay backend: equality with eager, gradients, contract, state."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from helpers.runs import assert_same_run, eager, tiny_config
from graphstep.cuda_graph.registry import get_backend
from graphstep.cuda_graph.errors import ContractError, GraphUsageError
from graphstep.cuda_graph.layers import LayerGraphs, model_links, select_modules
from graphstep.cuda_graph.rng import get_rng_tracker, initialize_rng_tracker
from graphstep.cuda_graph.scopes import scope_modules
from graphstep.cuda_graph.settings import GraphImpl
from graphstep.models import build_model
from graphstep.training.loop import train
from graphstep.training.optim import GradBuffers
from graphstep.training.step import TrainStep

# One long run per implementation (local and transformer_engine semantics, the attn and mlp scopes): equality
# that holds over many steps with dropout on. The other scopes are the same mechanism over other modules: 12 steps.
ITERS, SHORT = 100, 12
LONG = {("local", "[attn,mlp]"), ("transformer_engine", "[attn,mlp]")}


@pytest.fixture(scope="module")
def eager_runs():
    runs: dict[int, object] = {}

    def run(iters: int):
        if iters not in runs:
            runs[iters] = train(eager(tiny_config(f"train.train_iters={iters}")), keep_model=True)
        return runs[iters]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
@pytest.mark.parametrize("modules", ["[attn]", "[mlp]", "[attn,mlp]", "[]"])
def test_scoped_graphs_equal_eager_bit_for_bit(eager_runs, impl, modules):
    iters = ITERS if (impl, modules) in LONG else SHORT
    graphed = train(tiny_config(f"train.train_iters={iters}", f"model.cuda_graph_impl={impl}",
                                f"model.cuda_graph_modules={modules}"), keep_model=True)
    states = [r["state"] for r in graphed.rows]
    assert states[:5] == ["eager"] * 3 + ["captured", "replayed"] and set(states[5:]) == {"replayed"}
    assert len(graphed.rows) == iters
    assert_same_run(eager_runs(iters), graphed)


@pytest.mark.slow
def test_selective_recompute_with_layer_graphs():
    common = ["train.train_iters=12", "model.recompute_granularity=selective", "model.recompute_modules=[core_attn]",
              "model.attention_dropout=0.0"]
    base = train(eager(tiny_config(*common)))
    graphed = train(tiny_config(*common, "model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"))
    assert_same_run(base, graphed)


@pytest.mark.slow
def test_retain_backward_graph():
    common = ["train.train_iters=8"]
    base = train(eager(tiny_config(*common)))
    graphed = train(tiny_config(*common, "model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]",
                                "model.cuda_graph_retain_backward_graph=true"))
    assert_same_run(base, graphed)


def _model_and_step(seed: int = 5):
    cfg = tiny_config()
    initialize_rng_tracker(seed, "cpu")
    model = build_model(cfg.model, "cpu")
    model.train()
    grads = GradBuffers(model)
    return cfg, model, grads, TrainStep(model, grads)


def _batches(n: int, seq: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, 256, (2, seq + 1), generator=g)
        out.append({"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous(), "loss_mask": torch.ones(2, seq)})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("semantics", [GraphImpl.LOCAL, GraphImpl.TRANSFORMER_ENGINE])
def test_accumulated_parameter_gradients_equal_eager(semantics):
    def run(graphed: bool) -> torch.Tensor:
        _, model, grads, step = _model_and_step()  # each run seeds the RNG tracker afresh
        graphs = LayerGraphs(select_modules(model, ["attn", "mlp"]), get_backend("cpu"), semantics=semantics,
                             generators=get_rng_tracker().generators) if graphed else None
        seq = model.shape.seq_length
        for k in range(2):  # eager warm-up steps
            step(_batches(4, seq, k))
        if graphs is not None:
            graphs.capture()
        step(_batches(4, seq, 9))
        if graphs is not None:
            assert graphs.state == "replayed"
        return grads.flat.clone()

    ref, got = run(False), run(True)
    assert ref.abs().sum() > 0
    assert torch.equal(ref, got)  # 4 micro-batches accumulated in fp32, bit for bit


def test_replay_with_another_sequence_length_names_tensor_and_shapes():
    _, model, _, step = _model_and_step()
    graphs = LayerGraphs(select_modules(model, ["attn"]), get_backend("cpu"), generators=get_rng_tracker().generators)
    step(_batches(1, 32, 0))
    graphs.capture()
    with pytest.raises(ContractError, match=r"layer0\.attn.*\[0\].*\(2, 32, 64\).*\(2, 16, 64\)"):
        step(_batches(1, 16, 1))


def test_evaluation_runs_eagerly_and_equals_eager():
    def run(graphed: bool) -> torch.Tensor:
        _, model, _, step = _model_and_step()
        graphs = LayerGraphs(select_modules(model, []), get_backend("cpu"),
                             generators=get_rng_tracker().generators) if graphed else None
        step(_batches(1, 32, 0))
        if graphs is not None:
            graphs.capture()
        batch = _batches(1, 32, 3)[0]
        model.eval()
        with torch.no_grad():
            return model(batch["tokens"], batch["labels"])

    assert torch.equal(run(False), run(True))


def test_output_of_one_graph_is_the_input_buffer_of_the_next():
    _, model, _, step = _model_and_step()
    graphs = LayerGraphs(select_modules(model, ["attn", "mlp"]), get_backend("cpu"),
                         generators=get_rng_tracker().generators)
    step(_batches(1, 32, 0))
    graphs.capture()
    assert graphs.runs == []  # no runs given: every module replays its own graphs
    by_name = {g.name: g for g in graphs.graphs}
    attn0, mlp0, attn1 = by_name["layer0.attn"], by_name["layer0.mlp"], by_name["layer1.attn"]
    assert mlp0.static.leaves[0].data_ptr() == attn0.outputs[0].data_ptr()
    assert attn1.static.leaves[0].data_ptr() == mlp0.outputs[0].data_ptr()
    # the backward chain too: mlp0's input gradient is attn0's output-gradient buffer
    assert attn0.grad_out[0].data_ptr() == mlp0.grad_in[0].data_ptr()


@pytest.mark.parametrize("semantics", [GraphImpl.LOCAL, GraphImpl.TRANSFORMER_ENGINE])
def test_a_run_of_modules_replays_as_one_graph_equal_to_one_by_one_and_eager(semantics):
    """attn then mlp, mlp fed by attn alone, layer after layer: one run over the layers (one per layer where runs
    stay within layers), bit-equal to a graph per module and to eager; the gradient buffers of a run's outputs,
    all but the last absent in every backward, are filled by one kernel."""
    def run(mode: str) -> tuple[list[str], list[str], list[torch.Tensor], torch.Tensor]:
        _, model, grads, step = _model_and_step()
        picked = select_modules(model, ["mlp", "attn"])  # in the layer's order, whatever the scopes' order
        links = model_links(model, across_layers=mode == "across") if mode in ("across", "within") else None
        graphs = LayerGraphs(picked, get_backend("cpu"), semantics=semantics, generators=get_rng_tracker().generators,
                             links=links) if mode != "eager" else None
        seq, losses = model.shape.seq_length, []
        for k in range(5):
            if k == 2 and graphs is not None:
                graphs.capture()
            grads.zero()
            losses.append(step(_batches(2, seq, k))["loss"].detach().clone())
        if graphs is None:
            return [], [], losses, grads.flat.clone()
        if mode == "across":  # every output's gradient buffer is a view of one flat buffer: one fill per replay
            (run,) = graphs.runs
            assert [sorted(members) for _, members in run.graph.fill_groups] == [list(range(len(run.graph.outputs)))]
        return [g.name for g in graphs.graphs], [r.name for r in graphs.runs], losses, grads.flat.clone()

    (_, _, ref, ref_grads), (names, runs, got, got_grads), (names1, runs1, got1, got1_grads) = (
        run("eager"), run("within"), run("one by one"))
    _, across, got2, got2_grads = run("across")
    layers = range(len(runs))
    assert names == names1 == [f"layer{i}.{s}" for i in layers for s in ("attn", "mlp")] and len(runs) >= 2
    assert runs == [f"layer{i}.attn+mlp" for i in layers] and runs1 == []
    assert across == ["+".join(f"layer{i}.attn+mlp" for i in layers)]
    assert ref_grads.abs().sum() > 0
    for losses, grad in ((got, got_grads), (got1, got1_grads), (got2, got2_grads)):
        assert all(map(torch.equal, ref, losses)) and torch.equal(ref_grads, grad)


def test_whole_layers_replay_as_one_run_equal_to_eager():
    """``[]`` (each layer whole): the layers run one after the other, each on the one before's output: one run."""
    def run(graphed: bool) -> tuple[list[str], list[torch.Tensor], torch.Tensor]:
        _, model, grads, step = _model_and_step()
        graphs = LayerGraphs(select_modules(model, []), get_backend("cpu"), generators=get_rng_tracker().generators,
                             links=model_links(model)) if graphed else None
        losses = []
        for k in range(4):
            if k == 2 and graphs is not None:
                graphs.capture()
            grads.zero()
            losses.append(step(_batches(2, model.shape.seq_length, k))["loss"].detach().clone())
        return [r.name for r in graphs.runs] if graphs is not None else [], losses, grads.flat.clone()

    (_, ref, ref_grads), (runs, got, got_grads) = run(False), run(True)
    assert runs == ["layer0+layer1"] and ref_grads.abs().sum() > 0
    assert all(map(torch.equal, ref, got)) and torch.equal(ref_grads, got_grads)


def test_moe_partial_scopes_replay_attn_router_and_preprocess_as_one_run_equal_to_eager():
    """[attn,moe_router,moe_preprocess]: attn, the router stage and the preprocess stage run one after the other, each
    fed by the ones before (the expert GEMMs eager after them), and the combine stage before the next layer's attn:
    a run per layer, equal to the modules graphed one by one and to eager bit for bit (losses, every parameter's
    gradient)."""
    cfg = tiny_config(recipe="qwen3_moe_tiny")
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length), generator=g) for _ in range(5)]

    def run(mode: str) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
        initialize_rng_tracker(3, "cpu")
        model = build_model(cfg.model, "cpu")
        model.train()
        graphs = LayerGraphs(select_modules(model, ["attn", "moe_router", "moe_preprocess"]), get_backend("cpu"),
                             generators=get_rng_tracker().generators,
                             links=model_links(model) if mode == "runs" else None) if mode != "eager" else None
        losses = []
        for k, tokens in enumerate(data):
            if k == 2 and graphs is not None:
                graphs.capture()
            model.zero_grad(set_to_none=False)
            loss = model(tokens, tokens, torch.ones_like(tokens, dtype=torch.float))
            loss.backward()
            losses.append(loss.detach().clone())
        names = [r.name for r in graphs.runs] if graphs is not None else []
        if graphs is not None:
            graphs.close()
        return names, losses, [p.grad.clone() for p in model.parameters()]

    (_, ref, ref_grads), (runs, got, got_grads), (none, got1, got1_grads) = run("eager"), run("runs"), run("one")
    # layer i's combine stage, then layer i + 1's attn, router and preprocess stage: one run
    layers = range(1, cfg.model.num_layers)
    assert runs == ["layer0.attn+moe_router+moe_preprocess",
                    *(f"layer{i - 1}.moe_router1+layer{i}.attn+moe_router+moe_preprocess" for i in layers)]
    assert none == []
    assert all(map(torch.equal, ref, got)) and all(map(torch.equal, ref_grads, got_grads))
    assert all(map(torch.equal, ref, got1)) and all(map(torch.equal, ref_grads, got1_grads))
    assert sum(gr.abs().sum() for gr in ref_grads) > 0


def test_layers_name_what_they_call_one_after_the_other():
    cfg = tiny_config(recipe="qwen3_moe_tiny")
    layer = build_model(cfg.model, "cpu").graph_layers()[0]
    attn, moe = layer.blocks["attn"], layer.blocks["moe"]
    assert layer.graph_runs() == [[attn, moe], [attn, moe.router_stage, moe.preprocess_stage]]
    from graphstep.parallel.expert_parallel import AllGatherMoEBlock
    moe.__class__ = AllGatherMoEBlock  # expert parallel: the tokens' all-gather follows the router, eagerly
    assert layer.graph_runs() == [[attn, moe], [attn, moe.router_stage]]


def test_models_name_each_layers_last_module_and_the_next_ones_first_but_not_across_recomputed_runs():
    model = build_model(tiny_config("model.num_layers=3", recipe="qwen3_moe_tiny").model, "cpu")
    layers = model.graph_layers()
    moe = [layer.blocks["moe"] for layer in layers]
    pairs = [[a, b] for k in range(2) for a in (layers[k], moe[k], moe[k].combine_stage)
             for b in (layers[k + 1], layers[k + 1].blocks["attn"])]
    assert model.graph_runs() == pairs
    links = model_links(model)
    # between a layer's combine stage and the next layer's attn: the MoE block and the layer left, the next entered
    between = links[(id(moe[0].combine_stage), id(layers[1].blocks["attn"]))]
    assert [id(m) for m in between] == [id(m) for m in (moe[0], layers[0].blocks, layers[0], layers[1].blocks,
                                                        layers[1])]
    assert links[(id(layers[0].blocks["attn"]), id(moe[0].router_stage))] == (moe[0],)
    assert len(model_links(model, across_layers=False)) == len(links) - len(pairs)
    model.shape = replace(model.shape, recompute_layers=("block", 1))  # layer 0 recomputed alone, 1 and 2 kept
    assert model.graph_runs() == pairs[6:]
    model.shape = replace(model.shape, recompute_layers=("uniform", 3))  # one run of 3 layers, recomputed
    assert model.graph_runs() == []


class _Scale(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class _Pair(nn.Module):
    """attn = x * 2, mlp = y * (-0.0): the gradient that reaches attn's output is -0.0, element for element."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _Scale(2.0), _Scale(-0.0)

    def graph_scopes(self) -> dict:
        return {"attn": self.a, "mlp": self.b}

    def graph_runs(self) -> list[list[nn.Module]]:
        return [[self.a, self.b]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class _PairModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Pair()])

    def graph_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)


def test_a_runs_output_used_only_inside_it_gets_eagers_gradient_to_the_sign_of_zero():
    """attn's output feeds only mlp, inside the run: autograd brings it no gradient, so its buffer is filled before
    the backward replay and the run's own contribution added to it -- with -0.0, as ``v + (-0.0) == v`` for every v;
    a +0.0 fill would turn the -0.0 gradient eager computes into +0.0 (and the input gradient with it)."""
    def input_grad(graphed: bool) -> torch.Tensor:
        model = _PairModel()
        graphs = LayerGraphs(select_modules(model, ["attn", "mlp"]), get_backend("cpu"),
                             links=model_links(model)) if graphed else None
        for k in range(3):
            if k == 1 and graphs is not None:
                graphs.capture()
            x = torch.ones(4, requires_grad=True)
            model(x).sum().backward()
        if graphs is not None:
            assert [r.name for r in graphs.runs] == ["layer0.attn+mlp"] and graphs.state == "replayed"
        return x.grad

    eager_grad, graphed_grad = input_grad(False), input_grad(True)
    assert torch.equal(eager_grad, torch.zeros(4)) and bool(torch.signbit(eager_grad).all())  # -0.0 everywhere
    assert torch.equal(torch.signbit(graphed_grad), torch.signbit(eager_grad))


class _TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.5, -2.0, 0.5, 3.0]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * self.w, x * self.w * self.w


class _TwoOutputsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].f = _TwoOutputs()
        self.layers[0].graph_scopes = lambda: {"mlp": self.layers[0].f}

    def graph_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[0].f(x)


def test_an_output_without_a_gradient_gets_zeros_after_backwards_that_gave_it_one():
    """An output whose gradient comes and goes between steps: its buffer holds zeros in every backward that brings
    it none, also after one that brought it a gradient -- the input and parameter gradients are eager's."""
    def grads(graphed: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        model = _TwoOutputsModel()
        graphs = LayerGraphs(select_modules(model, ["mlp"]), get_backend("cpu")) if graphed else None
        out = []
        for k, both in enumerate([True, True, False, False, True, False, True]):
            if k == 1 and graphs is not None:
                graphs.capture()
            x = torch.ones(4, requires_grad=True)
            y, z = model(x)
            (y.sum() + (z * 3).sum() if both else y.sum()).backward()
            out.append((x.grad.clone(), model.layers[0].f.w.grad.clone()))
            model.zero_grad()
        if graphs is not None:
            assert graphs.state == "replayed"
        return out

    ref, got = grads(False), grads(True)
    assert ref[0][0].ne(ref[2][0]).any()  # the two kinds of step differ
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(ref, got))


def test_a_later_module_with_its_own_hook_is_not_chained_and_its_hook_runs():
    _, model, grads, step = _model_and_step()
    calls: list[int] = []
    model.graph_layers()[0].graph_scopes()["mlp"].register_forward_hook(lambda *_: calls.append(1))
    model.graph_layers()[1].graph_scopes()["attn"].register_forward_pre_hook(lambda *_: calls.append(2))
    graphs = LayerGraphs(select_modules(model, ["attn", "mlp"]), get_backend("cpu"),
                         generators=get_rng_tracker().generators, links=model_links(model))
    seq = model.shape.seq_length
    step(_batches(1, seq, 0))
    graphs.capture()
    # layer 0's mlp has a hook of its own: a graph of its own, and its forward hook would run after the whole run
    # it started; layer 1's attn may start one with a forward-pre hook (its call runs, before the replay)
    assert len(model.graph_layers()) == 2 and [r.name for r in graphs.runs] == ["layer1.attn+mlp"]
    before = list(calls)
    step(_batches(1, seq, 1))
    assert graphs.state == "replayed" and calls == before + [1, 2]


def test_a_hook_between_two_layers_ends_the_run_there_and_runs():
    """A layer's own hook (as FSDP2's) runs between its last module and the next layer's first: no run over it."""
    def run(hooked: bool) -> tuple[list[str], list[torch.Tensor], list[int]]:
        _, model, grads, step = _model_and_step()
        calls: list[int] = []
        if hooked:
            model.graph_layers()[1].register_forward_pre_hook(lambda *_: calls.append(1))
        graphs = LayerGraphs(select_modules(model, ["attn", "mlp"]), get_backend("cpu"),
                             generators=get_rng_tracker().generators, links=model_links(model))
        seq, losses = model.shape.seq_length, []
        for k in range(3):
            if k == 1:
                graphs.capture()
            losses.append(step(_batches(1, seq, k))["loss"].detach().clone())
        assert graphs.state == "replayed"
        return [r.name for r in graphs.runs], losses, calls

    (names, losses, calls), (names0, losses0, _) = run(True), run(False)
    assert names == ["layer0.attn+mlp", "layer1.attn+mlp"] and names0 == ["layer0.attn+mlp+layer1.attn+mlp"]
    assert calls == [1, 1, 1] and all(map(torch.equal, losses, losses0))


def test_a_later_module_called_on_other_tensors_than_its_run_fed_it_is_refused():
    _, model, grads, step = _model_and_step()
    graphs = LayerGraphs(select_modules(model, ["attn", "mlp"]), get_backend("cpu"),
                         generators=get_rng_tracker().generators, links=model_links(model))
    seq = model.shape.seq_length
    step(_batches(1, seq, 0))
    graphs.capture()
    step(_batches(1, seq, 1))
    mlp = model.graph_layers()[1].graph_scopes()["mlp"]
    mlp.register_forward_pre_hook(lambda module, args: (args[0] * 1,))  # eager work between attn and mlp
    with pytest.raises(ContractError, match=r"layer1\.mlp: called with other arguments .* layer0\.attn\+mlp\+layer1"):
        step(_batches(1, seq, 2))


class _Counting(nn.Module):
    """A block with state that forward mutates (like an MoE router's token counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x + torch.tanh(self.lin(x))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Counting(), _Counting()])

    def graph_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("semantics", [GraphImpl.LOCAL, GraphImpl.TRANSFORMER_ENGINE])
def test_capture_does_not_change_module_state_or_gradients(semantics):
    torch.manual_seed(0)
    model = _Stack()
    graphs = LayerGraphs(select_modules(model, []), get_backend("cpu"), semantics=semantics)
    x = torch.randn(4, 8, requires_grad=True)
    model(x).sum().backward()
    calls = [layer.calls.clone() for layer in model.layers]
    grads = [p.grad.clone() for p in model.parameters()]
    graphs.capture()
    assert all(torch.equal(a, layer.calls) for a, layer in zip(calls, model.layers))
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
    model(x).sum().backward()  # a replay: counts and gradients move exactly once more
    assert all(torch.equal(a + 1, layer.calls) for a, layer in zip(calls, model.layers))
    assert all(torch.allclose(2 * a, p.grad) for a, p in zip(grads, model.parameters()))


def _captured_stack(frozen_bias: bool = False) -> tuple[_Stack, LayerGraphs, torch.Tensor]:
    """A two-layer stack with whole-layer graphs, captured after one eager training call on ``x``."""
    torch.manual_seed(0)
    model = _Stack()
    for layer in model.layers:
        layer.lin.bias.requires_grad_(not frozen_bias)
    graphs = LayerGraphs(select_modules(model, []), get_backend("cpu"))
    x = torch.randn(4, 8, requires_grad=True)
    model(x).sum().backward()
    graphs.capture()
    return model, graphs, x


def test_forward_twice_before_backward_is_an_error():
    model, graphs, x = _captured_stack()
    model(x)
    with pytest.raises(GraphUsageError, match="before the backward"):
        model(x)


@pytest.mark.parametrize("moved", ["weight", "frozen bias", "buffer"])
def test_a_parameter_or_buffer_moved_after_capture_is_refused(moved):
    """The graphs read parameters and buffers where they were captured: one given new memory (``p.data = ...``,
    a buffer assigned anew; a frozen parameter too) is refused at the next replay, and a parameter updated in
    place replays as eager."""
    model, graphs, x = _captured_stack(frozen_bias=True)
    layer = model.layers[1]
    with torch.no_grad():
        layer.lin.weight.mul_(0.5)  # in place: the graphs read the new values
    out = model(x)
    out.sum().backward()
    assert torch.equal(out, graphs.graphs[-1].forward_fn(graphs.graphs[0].forward_fn(x)))
    if moved == "weight":
        layer.lin.weight.data = layer.lin.weight.data.clone()
    elif moved == "frozen bias":
        layer.lin.bias.data = layer.lin.bias.data.clone()
    else:
        layer.calls = layer.calls.clone()
    with pytest.raises(ContractError, match="layer1: a parameter's or buffer's memory moved after capture"):
        model(x)


def test_close_restores_the_modules():
    model, graphs, x = _captured_stack()
    graphs.close()
    graphs.close()
    assert "forward" not in model.layers[0].__dict__
    assert get_backend("cpu").live_graphs() == []


@pytest.mark.parametrize("impl", [GraphImpl.LOCAL, GraphImpl.TRANSFORMER_ENGINE])
def test_capture_order_is_the_execution_order(impl):
    """Graphs share one pool, so capture must follow replay order. The MoE scopes are listed
    router+combine, preprocess, but run router, preprocess, combine: capturing the combine before
    the preprocess let the combine's scratch overwrite the layout eager code still reads (seen on a GPU)."""
    cfg = tiny_config(recipe="qwen3_moe_tiny")
    initialize_rng_tracker(3, "cpu")
    model = build_model(cfg.model, "cpu")
    model.train()
    listed = [(f"layer{i}.{scope}{k or ''}", m) for i, layer in enumerate(model.graph_layers())
              for scope in ("moe_router", "moe_preprocess") for k, m in enumerate(scope_modules(layer, scope))]
    graphs = LayerGraphs(listed, get_backend("cpu", "replay"), semantics=impl)
    names = [g.name.split(".", 1)[1] for g in graphs.graphs[:3]]
    assert names == ["moe_router", "moe_router1", "moe_preprocess"]  # the listing order (select_modules: the layer's)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length))
    model(tokens, tokens, torch.ones_like(tokens, dtype=torch.float)).backward()
    order = graphs.capture_order()
    fwd = [graphs.graphs[i].name for kind, i in order if kind == "fwd"]
    assert fwd[:3] == ["layer0.moe_router", "layer0.moe_preprocess", "layer0.moe_router1"]
    graphs.close()


@pytest.mark.parametrize("capture", [True, False], ids=["captured", "warm_up_only"])
def test_nothing_outlives_close(capture):
    """A recorded warm-up output's backward hook is held by autograd (C++); it must not keep the
    engine, the modules or the parameters alive after close() -- seen on a GPU as memory growing by a
    model's parameters and gradient buffers with every per-layer run in one process."""
    import gc
    import weakref

    def run() -> tuple[weakref.ref, weakref.ref]:
        _, model, grads, step = _model_and_step()
        graphs = LayerGraphs(select_modules(model, ["attn", "mlp"]), get_backend("cpu"),
                             generators=get_rng_tracker().generators)
        step(_batches(2, model.shape.seq_length, 0))
        if capture:
            graphs.capture()
            step(_batches(2, model.shape.seq_length, 1))
        refs = weakref.ref(graphs), weakref.ref(next(model.parameters()))
        graphs.close()
        return refs

    refs = run()
    gc.collect()
    assert [r() is None for r in refs] == [True, True]


def test_gradient_buffers_of_one_dtype_share_one_aligned_flat_buffer():
    """The gradient buffers of a graph's plain contiguous outputs are views of one flat buffer per dtype, each
    starting 512 bytes apart at least (where the allocator would start a tensor of its own); a strided output
    and a dtype's only output get buffers of their own."""
    from graphstep.cuda_graph.graphed_module import _grouped_buffers

    outs = [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2, 150, dtype=torch.bfloat16),
            torch.zeros(4, 5).t(), torch.zeros(7), torch.zeros(1, dtype=torch.bfloat16)]
    buffers = [None] * len(outs)
    groups = _grouped_buffers(outs, [0, 1, 2, 3, 4], buffers)
    ((flat, members),) = groups
    assert members == [0, 1, 4] and flat.dtype == torch.bfloat16
    for i, b in enumerate(buffers):
        assert b.shape == outs[i].shape and b.dtype == outs[i].dtype
    base = flat.data_ptr()
    assert [(buffers[i].data_ptr() - base) % 512 for i in members] == [0, 0, 0]
    assert len({buffers[i].data_ptr() for i in members}) == 3
    assert all(buffers[i].untyped_storage().data_ptr() != base for i in (2, 3))
