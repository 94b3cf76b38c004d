"""The library API on models that are not graphstep's: a CNN, an MLP and a Hugging Face Llama."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphstep
from graphstep import CaptureError, ContractError
from helpers.launch import ROOT

EXAMPLES = ROOT / "examples"
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
DEVICES = [  # the CUDA cases run in scripts/gpu-check (CUDA graphs, bf16 for the HF Llama)
    pytest.param("cpu"),
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_plain_cnn_example_full_step_and_layers_equal_eager(device):
    results = _load_example("plain_loop").main(["--steps", "50", "--device", device])
    eager = results["none"][0]
    assert len(eager) == 50 and eager[-1] != eager[0]
    assert results["full"][0] == eager  # bit for bit, dropout on, 2 micro-batches accumulated
    assert results["layers"][0] == eager


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
@pytest.mark.parametrize("device", DEVICES)
def test_hf_llama_example_per_layer_and_full_step_equal_eager(device):
    results = _load_example("hf_llama").main(["--steps", "50", "--device", device])
    eager = results["eager"][0]
    assert len(eager) == 50
    assert results["per-layer"][0] == eager
    assert results["full-step"][0] == eager


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Dropout(0.1)) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x.sum(-1)


def _mlp_run(mode: str, steps: int = 50, micro_batches: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        total = torch.zeros(())
        for x, y in zip(xs, ys):
            loss = F.mse_loss(model(x), y)
            (loss / len(xs)).backward()
            total += loss.detach()
        opt.step()
        return total

    fn = step
    if mode == "full":
        fn = graphstep.graph_step(step, warmup_steps=2, device="cpu", modules=[model])
    elif mode == "layers":
        graphstep.graph_layers(model, "layers.*", warmup_steps=2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        xs, ys = torch.randn(micro_batches, 4, 8, generator=g), torch.randn(micro_batches, 4, generator=g)
        losses.append(fn(xs, ys).clone())
    graphstep.close_all()
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "layers"])
def test_mlp_gradient_accumulation_equals_eager(mode):
    ref_losses, ref_params = _mlp_run("eager")
    losses, params = _mlp_run(mode)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))


def _sync_step(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    scale = y.max().item()  # breaks capture
    return y / scale


def test_host_sync_names_the_line():
    step = graphstep.graph_step(_sync_step, warmup_steps=1, device="cpu")
    step(torch.ones(3))
    with pytest.raises(CaptureError) as info:
        step(torch.ones(3))
    assert info.value.where.lineno == _sync_step.__code__.co_firstlineno + 2
    assert info.value.where.filename == __file__


def test_input_that_changed_shape_is_named():
    step = graphstep.graph_step(lambda x, mask: x * mask, warmup_steps=0, device="cpu")
    step(torch.ones(2, 4), torch.ones(2, 4))
    with pytest.raises(ContractError, match=r"\[1\].*\(2, 4\).*\(2, 5\)"):
        step(torch.ones(2, 4), torch.ones(2, 5))


def test_replaced_parameter_is_an_error():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    graphed = graphstep.graph_step(step, warmup_steps=1, device="cpu", modules=[model])
    for _ in range(3):
        graphed(torch.randn(5, 4))
    model.weight = nn.Parameter(torch.zeros(1, 4))  # replaced, not updated in place
    with pytest.raises(ContractError, match="'weight' was replaced"):
        graphed(torch.randn(5, 4))


def test_non_capturable_optimizer_names_the_fix():
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters())  # default: reads its step counter on the host

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        opt.step()
        return x

    graphed = graphstep.graph_step(step, warmup_steps=1, device="cpu")
    graphed(torch.randn(2, 4))
    with pytest.raises(CaptureError, match="capturable=True") as info:
        graphed(torch.randn(2, 4))
    assert info.value.category == "optimizer"


def test_scope_maps():
    assert graphstep.parse_scope_map("attn -> model.layers.*.self_attn, mlp -> model.layers.*.mlp") == {
        "attn": "model.layers.*.self_attn", "mlp": "model.layers.*.mlp"}
    with pytest.raises(ValueError, match="expected 'scope -> module.name.pattern'"):
        graphstep.parse_scope_map("attn model.layers")
    assert set(graphstep.HF_SCOPE_MAPS) >= {"llama", "qwen2", "qwen3", "mistral", "mixtral"}
    with pytest.raises(ValueError, match="no submodule"):
        graphstep.graph_layers(MLP(), "decoder.*")
