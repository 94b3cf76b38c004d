"""FP8 training on torchao's float8 and on graphstep's delayed scaling (mixed_precision.fp8, converters/fp8.py,
converters/fp8_delayed.py): graphed equals the same FP8 program run eagerly, bit for bit, amax histories and scales
included; delayed scaling's histories follow a step-by-step reference; the FP8 loss tracks bf16; Megatron Bridge's
presets and fields act or are refused by R32.

The CPU runs use the replay backend (``torch._scaled_mm`` runs on the CPU); the ``cuda`` ones run the same
comparison with CUDA graphs (scripts/gpu-check).
"""

from __future__ import annotations

import shutil
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import graphstep
from graphstep.converters import fp8, fp8_delayed
from graphstep.engines_compat import scaled_mm
from graphstep.validation import accepted_notes, validate_config

from helpers.runs import FP8_DEVICES as DEVICES, assert_same_run, eager, tiny_config

try:
    float8 = fp8.import_torchao()
except ImportError:  # the test extra installs torchao (pip install 'graphstep[test]')
    pytest.skip("torchao is not installed", allow_module_level=True)


# 3 decoder layers: with the preset's first and last layers in bf16, the middle one runs in FP8
BASE = ["model.num_layers=3", "train.train_iters=8", "checkpoint.save=null", "model.params_dtype=bf16"]
RECIPES = {
    "current_scaling_preset": ["mixed_precision=bf16_with_fp8_current_scaling_mixed"],
    "tensorwise_e4m3_all_layers": ["mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=tensorwise"],
    "rowwise": ["mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=rowwise"],
    "rowwise_with_gw_hp": ["mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=rowwise_with_gw_hp"],
    # Bridge's preset (hybrid, history 1024, max), with a short history so that it rolls over within the run
    "delayed_preset": ["mixed_precision=bf16_with_fp8_delayed_scaling_mixed", "mixed_precision.fp8_amax_history_len=3"],
}
GRAPHS = {
    "full_iteration+optimizer": ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"],
    "local[attn,mlp]": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"],
}


def _fp8_layers(model: nn.Module) -> list[str]:
    from torchao.float8.float8_linear import Float8Linear

    kinds = (Float8Linear, fp8_delayed.DelayedFloat8Linear)
    return sorted(name for name, m in model.named_modules() if isinstance(m, kinds))


def _scaling_state(model: nn.Module) -> list[torch.Tensor]:
    """Every delayed-scaling history and scale of ``model`` (empty for the torchao recipes)."""
    return [t.clone() for m in fp8_delayed.delayed_modules(model) for t in (m.fp8_amax_history, m.fp8_scale)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_fp8_graphed_equals_eager_fp8_bit_for_bit(recipe, device):
    overrides = [*BASE, *RECIPES[recipe], f"train.device={device}"]
    ref = train(eager(tiny_config(*overrides)))
    fp8_layers = _fp8_layers(ref.model)
    if recipe == "current_scaling_preset":  # Bridge's preset keeps the first and last decoder layers in bf16
        assert fp8_layers and all(name.startswith("layers.1.") for name in fp8_layers), fp8_layers
    else:
        assert {name.split(".")[1] for name in fp8_layers} == {"0", "1", "2"}, fp8_layers
    bf16 = train(eager(tiny_config(*BASE, f"train.device={device}")))
    assert ref.rows[-1]["loss"] != bf16.rows[-1]["loss"]  # the FP8 layers change the numbers
    state = _scaling_state(ref.model)
    assert bool(recipe.startswith("delayed")) == bool(state)
    if state:  # the scales moved off their start (1) within the run
        assert all(not torch.equal(scale, torch.ones(3, device=scale.device)) for scale in state[1::2])
    for name, graphs in GRAPHS.items():
        graphed = train(tiny_config(*overrides, *graphs))
        assert _fp8_layers(graphed.model) == fp8_layers, name
        assert_same_run(ref, graphed)
        after = _scaling_state(graphed.model)
        assert len(after) == len(state) and all(torch.equal(a, b) for a, b in zip(state, after)), name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8 tensor cores (compute capability 8.9+)")
@pytest.mark.parametrize("recipe", ["current_scaling_preset", "delayed_preset"])
def test_compiled_fp8_graphed_equals_compiled_fp8_eager_on_a_gpu(recipe):
    # FP8 is fast only compiled (its casts fused); the full-iteration graph must not change a bit -- delayed
    # scaling's histories and scales, updated by the compiled forward and backward, included
    overrides = [*BASE, *RECIPES[recipe], "train.device=cuda", "train.train_iters=12", "compile.enable=true"]
    torch._dynamo.reset()
    ref = train(eager(tiny_config(*overrides)))
    torch._dynamo.reset()
    graphed = train(tiny_config(*overrides, *GRAPHS["full_iteration+optimizer"]))
    assert [r["state"] for r in graphed.rows][3:5] == ["captured", "replayed"]
    assert_same_run(ref, graphed)
    state, after = _scaling_state(ref.model), _scaling_state(graphed.model)
    assert bool(state) == (recipe == "delayed_preset")
    assert len(state) == len(after) and all(torch.equal(a, b) for a, b in zip(state, after))
    torch._dynamo.reset()


@pytest.mark.slow
def test_fp8_loss_tracks_bf16_over_200_iterations_and_is_never_nan():
    overrides = [*BASE, "train.train_iters=200", "model.cuda_graph_impl=full_iteration"]
    bf16 = [r["loss"] for r in train(tiny_config(*overrides)).rows]
    fp8 = [r["loss"] for r in train(tiny_config(*overrides, "mixed_precision.fp8=hybrid")).rows]
    assert len(fp8) == len(bf16) == 200
    assert all(loss == loss for loss in fp8)  # never NaN
    tail_bf16, tail_fp8 = sum(bf16[-50:]) / 50, sum(fp8[-50:]) / 50
    assert tail_fp8 < 0.75 * fp8[0]  # it learns
    # the last 50 iterations' mean loss, this test run alone (2026-12-06, 1 and 2 threads alike): FP8 2.6057
    # against bf16 2.6146, 0.3% apart; one full-suite run the same day gave 2.614 against 2.685 (2.6%), which no
    # run of it alone or after other runs in the same process has reproduced since
    assert abs(tail_fp8 - tail_bf16) <= 0.03 * tail_bf16, (tail_fp8, tail_bf16)


def test_graph_step_over_a_model_the_user_converted_with_torchao():
    def run(graphed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.GELU(), nn.Linear(64, 32, bias=False))
        float8.convert_to_float8_training(model, config=float8.Float8LinearConfig.from_recipe_name("tensorwise"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=False)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            return loss.detach()

        fn = graphstep.graph_step(step, warmup_steps=1, device="cpu", modules=[model]) if graphed else step
        g = torch.Generator().manual_seed(1)
        out = [fn(torch.randn(16, 32, generator=g)).clone() for _ in range(6)]
        if graphed:
            assert fn.state == "replayed"
        graphstep.close_all()
        return out + [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def _reference_update(history: list[list[float]], scale: list[float], algo: str, scaled_max: list[float]) -> None:
    """Transformer Engine's amax_and_scale_update in numpy float32, in place: amax over the history (max) or its
    row 0 (most_recent); scale = scaled_max / amax where amax is finite and > 0; roll one row, zero row 0."""
    rows = np.array(history, dtype=np.float32)
    amax = rows.max(axis=0) if algo == "max" else rows[0]
    for i in range(3):
        if np.isfinite(amax[i]) and amax[i] > 0:
            scale[i] = np.float32(scaled_max[i]) / amax[i]
    rolled = np.roll(rows, -1, axis=0)
    rolled[0] = 0
    history[:] = rolled.tolist()


def _delayed_run(graphed: bool, algo: str, margin: int, length: int, fmt: str, observe: bool,
                 device: str = "cpu", compiled: Any = None, activation: bool = True) -> dict:
    """A two-layer bf16 model in delayed FP8, two micro-batches a step, the update at the end of the step;
    per step: every module's history and scale, the step's loss (and, with ``observe``, what hooks saw: the
    amaxes and the first layer's input and output). ``compiled``: the model runs under torch.compile with that
    backend; ``activation=False``: no GELU between the layers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.GELU() if activation else nn.Identity(),
                          nn.Linear(64, 32, bias=False))
    model.to(device, torch.bfloat16)
    fp8_delayed.convert(model, lambda m, name: type(m) is nn.Linear, history_len=length, fmt=fmt)
    mods = fp8_delayed.delayed_modules(model)
    scaling = fp8_delayed.DelayedScaling(mods, margin=margin, algo=algo)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    seen: list[dict] = []
    if observe:  # plain hooks, eager only: amax(x), amax(w), amax(grad_output) per module and micro-batch
        for i, m in enumerate(mods):
            def fwd(m, args, out, i=i):
                x = args[0].detach()
                seen[-1].setdefault(i, []).append(("x", x.abs().max().float(), x.clone()))
                w = m.weight.detach()
                seen[-1][i].append(("w", w.abs().max().float(), w.clone()))
                seen[-1][i].append(("out", None, out.detach().clone()))
                out.register_hook(lambda g: seen[-1][i].append(("g", g.abs().max().float(), None)))
            m.register_forward_hook(fwd)

    forward = torch.compile(model, backend=compiled) if compiled is not None else model

    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        total = torch.zeros((), device=device)
        for x in (a, b):
            loss = forward(x).float().pow(2).mean() * 100  # * 100: the gradients' amaxes are not tiny
            (loss / 2).backward()
            total += loss.detach()
        scaling.update()
        opt.step()
        return total

    fn = graphstep.graph_step(step, warmup_steps=1, device=device, modules=[model]) if graphed else step
    g = torch.Generator().manual_seed(1)
    states, losses = [], []
    for _ in range(6):
        seen.append({})
        losses.append(fn(*(torch.randn(16, 32, generator=g).to(device, torch.bfloat16) for _ in range(2))).clone())
        states.append([(m.fp8_amax_history.clone(), m.fp8_scale.clone()) for m in mods])
    if graphed:
        assert fn.state == "replayed"
        graphstep.close_all()
    weights = [p.detach().clone() for p in model.parameters()]
    return {"states": states, "seen": seen, "losses": losses, "weights": weights}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo,margin,length,fmt", [("max", 0, 3, "hybrid"), ("most_recent", 1, 2, "e4m3")])
def test_delayed_scaling_history_and_scales_follow_a_step_by_step_reference(algo, margin, length, fmt, device):
    run = _delayed_run(False, algo, margin, length, fmt, observe=True, device=device)
    # e4m3's largest value for the input and the weight; the gradient's: e5m2's (hybrid) or e4m3's
    scaled_max = [m * 2.0 ** -margin for m in (448.0, 448.0, 57344.0 if fmt == "hybrid" else 448.0)]
    histories = [[[0.0] * 3 for _ in range(length)] for _ in range(2)]
    scales = [[1.0] * 3 for _ in range(2)]
    for step, (seen, state) in enumerate(zip(run["seen"], run["states"])):
        for i in range(2):
            x_scale, w_scale = (torch.tensor(scales[i][k], dtype=torch.float32, device=device) for k in range(2))
            for kind, amax, value in seen[i]:
                if kind == "x":  # this step's input, cast with the scale the previous steps' history gave
                    x = value
                elif kind == "w":
                    x8 = fp8_delayed.cast_to_fp8(x, x_scale, torch.float8_e4m3fn)
                    w8 = fp8_delayed.cast_to_fp8(value, w_scale, torch.float8_e4m3fn)
                    expect = scaled_mm(x8, w8.t(), x_scale.reciprocal(), w_scale.reciprocal(), torch.bfloat16,
                                       fast_accum=True)  # as the forward (fast accumulation on a GPU)
                elif kind == "out":
                    assert torch.equal(value, expect), (step, i)
                if amax is not None:
                    column = {"x": 0, "w": 1, "g": 2}[kind]
                    histories[i][0][column] = max(histories[i][0][column], float(amax))  # a host read: eager only
            _reference_update(histories[i], scales[i], algo, scaled_max)
            history, scale = state[i]
            assert torch.equal(history.cpu(), torch.tensor(histories[i])), (step, i, history, histories[i])
            assert torch.equal(scale.cpu(), torch.tensor(scales[i])), (step, i, scale, scales[i])
    assert all(0 < s != 1.0 for s in scales[0])  # every scale moved


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_scaling_graphed_step_equals_eager_step_by_step(device):
    eager_run, graphed_run = (_delayed_run(graphed, "max", 0, 3, "hybrid", observe=False, device=device)
                              for graphed in (False, True))
    for eager_state, graphed_state in zip(eager_run["states"], graphed_run["states"]):
        for (h1, s1), (h2, s2) in zip(eager_state, graphed_state):
            assert torch.equal(h1, h2) and torch.equal(s1, s2)


# --------------------------------------------------------------------------
# delayed scaling under torch.compile (compile.enable): traced whole -- one graph, compiled once -- and its
# histories updated in the forward and, through AOTAutograd's backward mutation, in the backward as uncompiled


def _same_runs(a: dict, b: dict, losses: bool = True) -> None:
    """Every step's histories and scales, and the final weights, bit for bit (and the losses with ``losses``)."""
    for step, (state_a, state_b) in enumerate(zip(a["states"], b["states"], strict=True)):
        for (h1, s1), (h2, s2) in zip(state_a, state_b, strict=True):
            assert torch.equal(h1, h2) and torch.equal(s1, s2), (step, h1, h2, s1, s2)
    if losses:
        assert all(torch.equal(l1, l2) for l1, l2 in zip(a["losses"], b["losses"], strict=True))
    assert all(torch.equal(w1, w2) for w1, w2 in zip(a["weights"], b["weights"], strict=True))
    assert all(bool((scale != 1).all()) for _, scale in b["states"][-1])  # every scale moved off its start


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_scaling_compiled_is_one_graph_and_records_as_uncompiled(device):
    from torch._dynamo.testing import CompileCounterWithBackend

    # aot_eager: Dynamo's and AOTAutograd's tracing (the functionalized history updates, the backward's among
    # them) over the eager kernels, so the compiled program must equal the uncompiled one bit for bit
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = _delayed_run(False, "max", 0, 3, "hybrid", observe=False, device=device, compiled=counter)
    assert counter.frame_count == 1  # 6 steps x 2 micro-batches: no graph break, no recompile
    _same_runs(_delayed_run(False, "max", 0, 3, "hybrid", observe=False, device=device), compiled)
    torch._dynamo.reset()


@pytest.mark.slow  # about 20 s: Inductor compiles the CPU kernels
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                    reason="Inductor's CPU backend needs a C++ compiler")
def test_delayed_scaling_inductor_records_the_amaxes_of_uncompiled_delayed_scaling():
    # without the GELU nothing between the casts and matmuls rounds (Inductor's casts are exact, its amax a max),
    # so Inductor's program casts and records what the uncompiled one does: histories, scales and weights equal
    torch._dynamo.reset()
    eager_run = _delayed_run(False, "most_recent", 1, 2, "e4m3", observe=False, activation=False)
    compiled = _delayed_run(False, "most_recent", 1, 2, "e4m3", observe=False, activation=False, compiled="inductor")
    _same_runs(eager_run, compiled, losses=False)  # the loss's own sum may be reordered
    torch._dynamo.reset()


DELAYED_COMPILED = [*BASE, *RECIPES["delayed_preset"], "compile.enable=true", "model.hidden_dropout=0.0",
                    "model.attention_dropout=0.0"]


def test_the_trainer_compiles_delayed_scaling_without_graph_breaks_as_it_runs_uncompiled():
    from torch._dynamo.utils import counters

    # compile.backend=aot_eager: the trainer's path (the whole model compiled, the end-of-step update eager
    # around it) with the eager kernels, equal to the uncompiled run bit for bit, histories and scales included
    overrides = [*DELAYED_COMPILED, "train.train_iters=3", "model.num_layers=1"]
    uncompiled = train(eager(tiny_config(*overrides, "compile.enable=false")))
    torch._dynamo.reset()
    counters.clear()
    compiled = train(eager(tiny_config(*overrides, "compile.backend=aot_eager")))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert _fp8_layers(compiled.model) == _fp8_layers(uncompiled.model) != []
    assert_same_run(uncompiled, compiled)
    state, after = _scaling_state(uncompiled.model), _scaling_state(compiled.model)
    assert len(state) == len(after) and all(torch.equal(a, b) for a, b in zip(state, after))
    torch._dynamo.reset()


def train(cfg):
    from graphstep.training.loop import train as run

    return run(cfg, keep_model=True)


# --------------------------------------------------------------------------
# the FP8 bench rows (graphstep bench, scripts/gpu-check): they resolve and validate on the bench shapes


@pytest.mark.parametrize("recipe", ["small_dense_bench", "dense_1b_bench", "llama3_8b_stack_bench",
                                    "llama3_8b_share_bench", "llama3_8b_accum_bench"])
def test_fp8_bench_rows_resolve_validate_and_face_their_bf16_rows(recipe):
    from graphstep.bench.harness import peer_of
    from graphstep.bench.run import FP8_ROWS, plan_row
    from graphstep.recipes import get_recipe

    base = get_recipe(recipe)
    for name in FP8_ROWS:
        plan = plan_row(base, name)
        assert plan.graphstep and plan.refusal is None, name
        mp, compiled = plan.cfg.mixed_precision, name.startswith("compile+")
        assert plan.cfg.compile.enable is compiled, name
        if "fp8_" not in name:
            assert mp.fp8 is None, name
            continue
        assert (mp.fp8, mp.fp8_recipe) == ("hybrid", "delayed" if "fp8_delayed_" in name else "tensorwise"), name
        # on an H100 (compute capability 9.0), as the bench runs it: train.device=cuda, the CUDA graph backend
        cfg = plan.cfg
        cfg.train.device = "cuda"
        found = validate_config(cfg, env={}, device_capability=(9, 0))
        assert found == [], (name, [str(v) for v in found])
        peer = peer_of(name, set(FP8_ROWS))
        assert peer == name.replace("fp8_delayed_", "").replace("fp8_", ""), name
        peer_cfg = plan_row(base, peer).cfg
        assert (peer_cfg.model.cuda_graph_impl, peer_cfg.model.cuda_graph_modules, peer_cfg.compile.enable) == \
            (cfg.model.cuda_graph_impl, cfg.model.cuda_graph_modules, cfg.compile.enable), name


def test_the_llama3_8b_stack_bench_has_the_8b_layer_shapes():
    from graphstep.recipes import get_recipe

    m, t = (cfg := get_recipe("llama3_8b_stack_bench")).model, cfg.train
    assert (m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups, m.vocab_size) == \
        (4096, 14336, 32, 8, 128256)
    assert 2 <= m.num_layers <= 4 and m.seq_length == 8192 and m.params_dtype == "bf16"
    assert t.micro_batch_size == t.global_batch_size == 1


def test_the_llama3_8b_share_bench_gives_the_output_layer_the_32_layer_models_share():
    from graphstep.recipes import get_recipe

    def output_share(m, layers):
        head = m.kv_channels or m.hidden_size // m.num_attention_heads
        q, kv = m.num_attention_heads * head, 2 * m.num_query_groups * head
        layer = m.hidden_size * (q + kv) + q * m.hidden_size + 3 * m.hidden_size * m.ffn_hidden_size
        output = m.hidden_size * m.vocab_size
        return output / (layers * layer + output)

    stack, share, full = (get_recipe(r).model for r in ("llama3_8b_stack_bench", "llama3_8b_share_bench", "llama3_8b"))
    assert (share.num_layers, share.hidden_size, share.ffn_hidden_size, share.seq_length, share.vocab_size) == \
        (stack.num_layers, stack.hidden_size, stack.ffn_hidden_size, stack.seq_length, 16384)
    assert share.vocab_size % 128 == 0
    assert abs(output_share(share, share.num_layers) - output_share(full, full.num_layers)) < 0.005  # both 7%
    assert output_share(stack, stack.num_layers) > 0.35


def test_the_llama3_8b_accum_bench_is_the_share_bench_over_4_micro_batches():
    from graphstep.bench.run import plan_row
    from graphstep.recipes import get_recipe

    share, accum = get_recipe("llama3_8b_share_bench"), get_recipe("llama3_8b_accum_bench")
    assert accum.model == share.model
    assert (accum.train.micro_batch_size, accum.train.global_batch_size) == (1, 4)
    plan = plan_row(accum, "compile+fp8_delayed_full_iteration")
    assert plan.cfg.train.global_batch_size == 4 and plan.layout is not None and plan.layout.ranks == 1


# --------------------------------------------------------------------------
# what acts and what R32 refuses


def _rules(*overrides: str, capability=None) -> list[tuple[str, str]]:
    return [(v.rule, v.message) for v in validate_config(tiny_config(*overrides), device_capability=capability)]


def test_the_current_scaling_preset_sets_bridge_fields_and_a_field_you_set_wins():
    from graphstep.validation import resolve_cuda_graph_settings

    cfg = tiny_config("mixed_precision=bf16_with_fp8_current_scaling_mixed", "mixed_precision.num_layers_at_end_in_bf16=0")
    resolve_cuda_graph_settings(cfg)
    mp = cfg.mixed_precision
    assert (mp.fp8, mp.fp8_recipe, mp.first_last_layers_bf16, mp.num_layers_at_start_in_bf16) == \
        ("hybrid", "tensorwise", True, 1)
    assert mp.num_layers_at_end_in_bf16 == 0 and cfg.model.params_dtype == "bf16"
    assert any("fp8_param_gather=true: nothing to gather" in n for n in accepted_notes(cfg))
    alias = tiny_config("model.fp8=e4m3")
    resolve_cuda_graph_settings(alias)
    assert alias.mixed_precision.fp8 == "e4m3"


def test_the_delayed_scaling_preset_sets_bridge_fields():
    from graphstep.validation import resolve_cuda_graph_settings

    cfg = tiny_config("mixed_precision=bf16_with_fp8_delayed_scaling_mixed", "mixed_precision.fp8_margin=2")
    resolve_cuda_graph_settings(cfg)
    mp = cfg.mixed_precision
    assert (mp.fp8, mp.fp8_recipe, mp.fp8_amax_history_len, mp.fp8_amax_compute_algo, mp.fp8_margin) == \
        ("hybrid", "delayed", 1024, "max", 2)
    assert mp.first_last_layers_bf16 is False and cfg.model.params_dtype == "bf16"
    assert not _rules("mixed_precision=bf16_with_fp8_delayed_scaling_mixed")
    # compiled as a whole model (R20 still keeps compiled graphs off the CPU replay backend)
    compiled = _rules("mixed_precision=bf16_with_fp8_delayed_scaling_mixed", "compile.enable=true")
    assert [rule for rule, _ in compiled] == ["R20"], compiled
    plan = fp8.plan_from(mp, 2)
    assert (plan.recipe, plan.history_len, plan.amax_algo, plan.margin) == ("delayed", 1024, "max", 2)


REFUSED = {
    "subchannel_preset": (["mixed_precision=bf16_with_fp8_subchannel_scaling_mixed"], "blockwise"),
    "mxfp8_preset": (["mixed_precision=bf16_with_mxfp8_mixed"], "Blackwell"),
    "nvfp4_preset": (["mixed_precision=bf16_with_nvfp4_mixed"], "Blackwell"),
    "model_variant_preset": (["mixed_precision=nemotron_h_bf16_with_fp8_current_scaling_mixed"], "model-specific"),
    "delayed_history_len": (["mixed_precision=bf16_with_fp8_delayed_scaling_mixed",
                             "mixed_precision.fp8_amax_history_len=0"], "at least 1"),
    "delayed_margin": (["mixed_precision.fp8=hybrid", "mixed_precision.fp8_recipe=delayed",
                        "mixed_precision.fp8_margin=-1"], "0 or more"),
    "delayed_algo": (["mixed_precision.fp8=hybrid", "mixed_precision.fp8_recipe=delayed",
                      "mixed_precision.fp8_amax_compute_algo=mean"], "not an amax algorithm"),
    "delayed_compiled_over_fsdp2": (["mixed_precision=bf16_with_fp8_delayed_scaling_mixed", "compile.enable=true",
                                    "ddp.use_megatron_fsdp=true"], "each decoder layer compiled apart"),
    "delayed_fsdp2_fp8_gather": (["mixed_precision=bf16_with_fp8_delayed_scaling_mixed", "ddp.use_megatron_fsdp=true"],
                                 "FP8 parameter all-gather is implemented for fp8_recipe=tensorwise"),
    "delayed_fsdp2_per_layer": (["mixed_precision=bf16_with_fp8_delayed_scaling_mixed", "ddp.use_megatron_fsdp=true",
                                 "ddp.data_parallel_sharding_strategy=optim_grads", "model.cuda_graph_impl=local",
                                 "model.cuda_graph_modules=[attn,mlp]"], "per-layer graphs"),
    "blockwise_recipe": (["mixed_precision.fp8=hybrid", "mixed_precision.fp8_recipe=blockwise"], "blockwise"),
    "unknown_format": (["mixed_precision.fp8=e5m2"], "not an FP8 format"),
    "rowwise_hybrid": (["mixed_precision.fp8=hybrid", "mixed_precision.fp8_recipe=rowwise"], "cast the gradients"),
    "tensor_parallel": (["mixed_precision.fp8=hybrid", "model.tensor_model_parallel_size=2"], "tensor parallel"),
    "pipeline": (["mixed_precision.fp8=hybrid", "model.pipeline_model_parallel_size=2"], "pipeline stages"),
    "fsdp2_per_layer": (["mixed_precision.fp8=hybrid", "ddp.use_megatron_fsdp=true",
                         "ddp.data_parallel_sharding_strategy=optim_grads", "model.cuda_graph_impl=local",
                         "model.cuda_graph_modules=[attn,mlp]"], "per-layer graphs"),
    "fsdp2_rowwise": (["mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=rowwise", "ddp.use_megatron_fsdp=true"],
                      "not yet with fp8_recipe=rowwise"),
    "compile_per_layer": (["mixed_precision.fp8=hybrid", "compile.enable=true", "model.cuda_graph_impl=local",
                           "model.cuda_graph_modules=[attn,mlp]"], "torch.compile of per-layer graphs"),
    "param_gather_sharded_rowwise": (["mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=rowwise",
                                      "mixed_precision.fp8_param_gather=true", "ddp.use_distributed_optimizer=true"],
                                     "FP8 parameter all-gather is implemented for fp8_recipe=tensorwise"),
    "fp8_wgrad_off": (["mixed_precision.fp8=hybrid", "mixed_precision.fp8_wgrad=false"], "not implemented"),
    "fp8_params": (["mixed_precision.fp8=hybrid", "mixed_precision.fp8_param=true"], "not implemented"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_r32_refuses_what_graphstep_does_not_implement(case):
    overrides, words = REFUSED[case]
    found = [message for rule, message in _rules(*overrides) if rule == "R32"]
    assert any(words in message for message in found), (found, _rules(*overrides))


def test_fp8_needs_fp8_tensor_cores_on_a_gpu():
    assert any(rule == "R32" and "compute capability 8.0" in m
               for rule, m in _rules("mixed_precision.fp8=hybrid", capability=(8, 0)))
    assert not _rules("mixed_precision.fp8=hybrid", capability=(9, 0))
    assert not _rules("mixed_precision=bf16_with_fp8_current_scaling_mixed")


def test_fp8_on_fsdp2_is_accepted_for_tensorwise_with_whole_step_graphs_and_says_it_gathers_in_fp8():
    from graphstep.validation import resolve_cuda_graph_settings

    # the runs: tests/distributed/test_fp8_data_parallel.py
    for sharding in (["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"],
                     ["ddp.use_distributed_optimizer=true"]):
        overrides = ["mixed_precision=bf16_with_fp8_current_scaling_mixed", *sharding,
                     "model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"]
        assert not _rules(*overrides), _rules(*overrides)
        cfg = tiny_config(*overrides)
        resolve_cuda_graph_settings(cfg)  # the preset sets fp8_param_gather=true
        assert any("all-gathers the decoder layers' FP8 weights in FP8" in n for n in accepted_notes(cfg))


def test_fp8_without_torchao_is_v21(monkeypatch):
    from graphstep.validation import values

    monkeypatch.setattr(values, "_installed", lambda module: module != "torchao")
    found = [(rule, m) for rule, m in _rules("mixed_precision.fp8=hybrid") if rule == "V21"]
    assert found and "torchao" in found[0][1], found
    assert not _rules("mixed_precision=bf16_with_fp8_delayed_scaling_mixed")  # graphstep's own FP8 linear


@pytest.mark.parametrize("recipe", ["current_scaling_preset", "delayed_preset"])
def test_fp8_resume_from_a_checkpoint_is_exact(recipe, tmp_path):
    # Float8Linear keeps nn.Linear's parameters: the checkpoint is the bf16 one, the resumed FP8 run continues exactly;
    # delayed scaling's histories and scales are module buffers, saved and loaded with the parameters
    fp8_run = [*BASE, *RECIPES[recipe], "model.cuda_graph_impl=full_iteration", "model.cuda_graph_warmup_steps=1"]
    whole = train(tiny_config(*fp8_run))
    ckpt = tmp_path / "ckpt"
    train(tiny_config(*fp8_run, "train.train_iters=4", f"checkpoint.save={ckpt}", "checkpoint.save_interval=4"))
    resumed = train(tiny_config(*fp8_run, f"checkpoint.load={ckpt}"))
    assert [r["iteration"] for r in resumed.rows] == [5, 6, 7, 8]
    assert [r["loss"] for r in resumed.rows] == [r["loss"] for r in whole.rows[4:]]
    assert all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), resumed.model.parameters()))
    state, after = _scaling_state(whole.model), _scaling_state(resumed.model)
    assert len(state) == len(after) and all(torch.equal(a, b) for a, b in zip(state, after))
