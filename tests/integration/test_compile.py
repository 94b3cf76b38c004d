"""torch.compile in the trainer (compile.*): rule R20, what is compiled, the compile-time line, equality.

The equality contract: compiled + graphed is bit-equal to compiled eager (the
same Inductor kernels, replayed); compiled differs from uncompiled by rounding.
The CPU replay backend cannot record compiled code (Dynamo runs the model
uncompiled under its recording mode), so on the CPU the graphed combinations
are refused (R20) and the bit-equality tests run on a GPU (marked ``cuda``).
Inductor's CPU backend needs a C++ compiler; without one the CPU training
tests skip, saying so.
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from helpers.runs import assert_same_run, eager, params_of, tiny_config
from graphstep.config import Config, ConfigError, apply_overrides
from graphstep.validation import ConfigValidationError, resolve_cuda_graph_settings, validate_config
from graphstep.parallel.compile import apply_compile
from graphstep.training.loop import train

needs_inductor_cpu = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("gcc") is None and shutil.which("clang++") is None,
    reason="Inductor's CPU backend needs a C++ compiler (g++, gcc or clang++), and none is on PATH",
)

GRAPH_OK = ["model.use_te_rng_tracker=true", "rerun_state_machine.check_for_nan_in_loss=false",
            "ddp.check_for_nan_in_grad=false"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from a clean Dynamo cache (no recompile limit carried over from another run)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def check(*overrides: str):
    cfg = apply_overrides(Config(), GRAPH_OK + list(overrides))
    return [v for v in validate_config(cfg, env={}, device_capability=(9, 0)) if v.rule == "R20"]


# --------------------------------------------------------------------------
# rule R20 (in the style of test_settings_rules.py: the message, the fix, and a clean variant)

R20_CASES = {
    "two-graph-owners": (("compile.enable=true", "compile.mode=reduce-overhead", "model.cuda_graph_impl=full_iteration",
                          "train.device=cuda"),
                         "two owners of the same kernels", "compile.mode=default",
                         ("compile.enable=true", "compile.mode=default", "model.cuda_graph_impl=full_iteration",
                          "train.device=cuda")),
    "max-autotune-per-layer": (("compile.enable=true", "compile.mode=max-autotune", "model.cuda_graph_impl=local",
                                "train.device=cuda"),
                               "compile.mode=max-autotune captures Inductor's own CUDA graphs",
                               "model.cuda_graph_impl=none",
                               ("compile.enable=true", "compile.mode=max-autotune", "train.device=cuda")),
    "unknown-component": (("compile.enable=true", "compile.components=[model,embedding]"),
                          "embedding is not a component", "compile.components=[model]",
                          ("compile.enable=true", "compile.components=[model]")),
    "loss-not-separable": (("compile.enable=true", "compile.components=[model,loss]"),
                           "compute the loss inside their forward", "compile.components=[model]",
                           ("compile.enable=true",)),
    "unknown-mode": (("compile.mode=fastest",), "compile.mode=fastest is not an Inductor mode",
                     "compile.mode=default", ("compile.mode=max-autotune-no-cudagraphs",)),
    "compile-inside-capture": (("compile.enable=true", "model.cuda_graph_impl=full_iteration", "train.device=cuda",
                                "model.cuda_graph_warmup_steps=0"),
                               "compiled inside the capture", "model.cuda_graph_warmup_steps=1",
                               ("compile.enable=true", "model.cuda_graph_impl=full_iteration", "train.device=cuda",
                                "model.cuda_graph_warmup_steps=1")),
    "replay-backend": (("compile.enable=true", "model.cuda_graph_impl=full_iteration", "train.device=cpu"),
                       "CPU replay backend", "compile.enable=false",
                       ("compile.enable=true", "model.cuda_graph_impl=none", "train.device=cpu")),
    "replay-backend-explicit": (("compile.enable=true", "model.cuda_graph_impl=local",
                                 "model.cuda_graph_backend=replay"), "Dynamo skips frames", "model.cuda_graph_impl=none",
                                ("compile.enable=false", "model.cuda_graph_impl=local",
                                 "model.cuda_graph_backend=replay")),
}


@pytest.mark.parametrize("name", list(R20_CASES))
def test_r20_reports_problem_and_fix(name):
    bad, message, fix, good = R20_CASES[name]
    found = check(*bad)
    assert found, f"{name}: expected an R20 violation"
    assert any(message in v.message for v in found), [v.message for v in found]
    assert any(fix in v.fix for v in found), [v.fix for v in found]
    assert all(v.fields and v.fix for v in found)
    assert check(*good) == [], f"{name}: the clean variant should have no R20 violation"


def test_compile_off_by_default_and_r20_is_listed():
    cfg = Config()
    assert (cfg.compile.enable, cfg.compile.components, cfg.compile.mode) == (False, ["model"], "default")
    with pytest.raises(ConfigValidationError, match="R20"):
        resolve_cuda_graph_settings(apply_overrides(Config(), ["compile.components=[loss]"]), env={})


@pytest.mark.skipif(torch.cuda.is_available(), reason="train.device=auto is the CPU only without a GPU")
def test_replay_backend_refused_at_build_when_device_is_auto():
    """The rule cannot see that train.device=auto means the CPU here: build_run refuses once the backend is known."""
    cfg = tiny_config("train.train_iters=4", "train.device=auto", "compile.enable=true",
                      "model.cuda_graph_impl=full_iteration")
    with pytest.raises(ConfigError, match="R20: compile.enable=true with graphs on the CPU replay backend"):
        train(cfg)


# --------------------------------------------------------------------------
# what is compiled


def _model_and_settings(*overrides: str):
    from graphstep.models import build_model

    cfg = tiny_config(*overrides)
    return build_model(cfg.model, "cpu"), resolve_cuda_graph_settings(cfg, env={})


def test_whole_model_compiled_without_per_layer_graphs():
    model, settings = _model_and_settings("model.cuda_graph_impl=full_iteration", "train.device=cuda")
    compiled = apply_compile(model, "default", settings)
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule) and compiled._orig_mod is model
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("modules, compiled_names", [("[attn]", {"attn"}), ("[attn,mlp]", {"attn", "mlp"})])
def test_per_layer_compiles_exactly_the_graphed_scopes(modules, compiled_names):
    model, settings = _model_and_settings("model.cuda_graph_impl=local", f"model.cuda_graph_modules={modules}",
                                          "train.device=cuda")
    assert apply_compile(model, "default", settings) is model
    patched = {(i, name) for i, layer in enumerate(model.layers) for name, block in layer.blocks.items()
               if "forward" in block.__dict__}
    assert patched == {(i, name) for i in range(len(model.layers)) for name in compiled_names}
    assert "forward" not in model.__dict__ and not any("forward" in layer.__dict__ for layer in model.layers)


# --------------------------------------------------------------------------
# training compiled on the CPU (no graphs)

CPU = ["train.train_iters=4", "model.num_layers=1"]


@pytest.fixture(scope="module")
def uncompiled_run():
    return train(eager(tiny_config(*CPU)), keep_model=True)


@pytest.mark.slow  # about 40 s: Inductor compiles the CPU kernels (twice: determinism)
@needs_inductor_cpu
def test_compiled_eager_is_deterministic_close_to_uncompiled_and_logs_compile_time(uncompiled_run, caplog):
    with caplog.at_level(logging.INFO, logger="graphstep"):
        compiled = train(eager(tiny_config(*CPU, "compile.enable=true")), keep_model=True)
    lines = [r.getMessage() for r in caplog.records if "compiled in" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("torch.compile of the model, mode=default: compiled in"), lines
    seconds = float(lines[0].split("compiled in ")[1].split(" s")[0])
    assert seconds > 0.0
    # compiled differs from uncompiled by rounding only
    for a, b in zip(compiled.rows, uncompiled_run.rows):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    for pa, pb in zip(params_of(compiled), params_of(uncompiled_run)):
        torch.testing.assert_close(pa, pb, rtol=1e-3, atol=1e-5)
    # and compiled eager is reproducible bit for bit: what a compiled graph must equal
    torch._dynamo.reset()
    again = train(eager(tiny_config(*CPU, "compile.enable=true")), keep_model=True)
    assert_same_run(compiled, again)


# --------------------------------------------------------------------------
# on a GPU: compiled + graphed equals compiled eager bit for bit (bf16)

GPU = ["train.device=cuda", "model.params_dtype=bf16", "train.train_iters=12", "compile.enable=true"]


@pytest.fixture(scope="module")
def compiled_eager_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch._dynamo.reset()
    return train(eager(tiny_config(*GPU)), keep_model=True)


@pytest.mark.parametrize("overrides", [
    ["model.cuda_graph_impl=full_iteration"],
    ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"],
], ids=["full_iteration", "full_iteration+optimizer"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_graphs_bf16_equal_compiled_eager(compiled_eager_gpu, overrides):
    graphed = train(tiny_config(*GPU, *overrides), keep_model=True)
    assert next(graphed.model.parameters()).dtype == torch.bfloat16
    assert [r["state"] for r in graphed.rows][3:5] == ["captured", "replayed"]
    assert_same_run(compiled_eager_gpu, graphed)


@pytest.mark.parametrize("overrides", [
    ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"],
    ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[]"],
    ["model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[attn,mlp]"],
], ids=["local[attn,mlp]", "local[]", "te[attn,mlp]"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_scopes_graphed_bf16_equal_the_same_compiled_scopes_eager(overrides, monkeypatch):
    """Per-layer graphs compile only the graphed scope modules (not the whole model, whose fused kernels
    differ by rounding): the reference is the same compiled program never captured."""
    reference, graphed = _never_captured_and_graphed([*GPU, *overrides], monkeypatch)
    assert_same_run(reference, graphed)


def _never_captured_and_graphed(overrides: list[str], monkeypatch) -> tuple:
    """The run of ``overrides`` with a warm-up longer than the run (the same compiled program, never captured)
    and as asked (captured at iteration 4, replayed after), each compiled afresh."""
    from graphstep.validation import values

    torch._dynamo.reset()
    with monkeypatch.context() as m:  # a warm-up longer than the run: V19 refuses it to users, this reference wants it
        m.setattr(values, "_NUMBERED", tuple(c for c in values._NUMBERED if c is not values._warmup_violations))
        reference = train(tiny_config(*overrides, "model.cuda_graph_warmup_steps=1000"), keep_model=True)
    assert {r["state"] for r in reference.rows} == {"eager"}
    torch._dynamo.reset()
    graphed = train(tiny_config(*overrides), keep_model=True)
    assert [r["state"] for r in graphed.rows][3:5] == ["captured", "replayed"]
    return reference, graphed


# --------------------------------------------------------------------------
# on a GPU: compiled layers over FSDP2 (one rank) inside graphs equal the same compiled layout eager

FSDP2_COMPILED = {
    # ZeRO-3: each decoder layer compiled in place (parallel/compile.py), FSDP2's hooks eager around it, the
    # gathers and frees inside the full-iteration graph with the optimizer's
    "zero3_full_iteration": ("optim_grads_params", ["model.cuda_graph_impl=full_iteration",
                                                    "optimizer.optimizer_cuda_graph=true"]),
    # ZeRO-2: the graphed scopes compiled, their graphs inside FSDP2's layers
    "zero2_local[attn,mlp]": ("optim_grads", ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"]),
}


@pytest.mark.parametrize("graphs", list(FSDP2_COMPILED))
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_layers_over_fsdp2_graphed_equal_the_same_compiled_layout_eager(graphs, monkeypatch):
    """compile.enable with graphs over FSDP2 (rule R27 takes it): the one-rank mesh the trainer makes for
    ddp.use_megatron_fsdp in one process; the reference is the same compiled layout never captured (a warm-up
    longer than the run), and the graphed run equals it bit for bit -- losses and final parameters."""
    strategy, settings = FSDP2_COMPILED[graphs]
    layout = [*GPU, "model.use_te_rng_tracker=true", "ddp.use_megatron_fsdp=true",
              f"ddp.data_parallel_sharding_strategy={strategy}"]
    assert [v for v in validate_config(apply_overrides(Config(), [*layout[1:], *settings]), env={},
                                       device_capability=(9, 0)) if v.rule in ("R20", "R27")] == []
    reference, graphed = _never_captured_and_graphed([*layout, *settings], monkeypatch)
    assert_same_run(reference, graphed)
    assert reference.losses[-1] < reference.losses[0]
