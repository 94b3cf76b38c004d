"""Mamba-2 mixer: chunked SSD vs a per-timestep recurrence, capture, hybrid models."""

from __future__ import annotations

import copy

import pytest
import torch

from graphstep.config import ModelConfig
from graphstep.cuda_graph.registry import get_backend
from graphstep.cuda_graph.rng import get_rng_tracker
from graphstep.models import build_model, mamba
from graphstep.models.hybrid import layer_kinds
from graphstep.models.mamba import MambaBlock, MambaShape, segsum, ssd_chunked
from graphstep.models.transformer import ModelShape
from graphstep.recipes import get_recipe


def ssd_sequential(x, a, B, C, chunk=None):
    """The selective SSM one timestep at a time: s_t = exp(a_t) s_{t-1} + x_t B_t^T, y_t = s_t C_t."""
    b, length, h, p = x.shape
    state = x.new_zeros(b, h, p, B.shape[-1])
    ys = []
    for t in range(length):
        state = state * torch.exp(a[:, t])[..., None, None] + x[:, t, :, :, None] * B[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(ys, dim=1)


def random_ssm(length, b=2, h=3, p=4, n=5, dtype=torch.float64):
    g = torch.Generator().manual_seed(length)
    x = torch.randn(b, length, h, p, generator=g, dtype=dtype)
    a = -torch.rand(b, length, h, generator=g, dtype=dtype)  # dt * A < 0: decays
    B = torch.randn(b, length, h, n, generator=g, dtype=dtype)
    C = torch.randn(b, length, h, n, generator=g, dtype=dtype)
    return x, a, B, C


def test_segsum():
    x = torch.tensor([1.0, 2.0, 3.0])
    s = segsum(x)
    assert s[2, 0].item() == 5.0 and s[2, 2].item() == 0.0 and s[1, 0].item() == 2.0
    assert torch.isinf(s[0, 1]) and s[0, 1] < 0


@pytest.mark.parametrize("length,chunk", [(16, 4), (16, 16), (20, 8), (7, 3), (1, 4), (5, 1)])
def test_chunked_scan_equals_recurrence(length, chunk):
    x, a, B, C = random_ssm(length)
    torch.testing.assert_close(ssd_chunked(x, a, B, C, chunk), ssd_sequential(x, a, B, C), rtol=1e-10, atol=1e-10)


def test_chunked_scan_fp32():
    x, a, B, C = random_ssm(24, dtype=torch.float32)
    torch.testing.assert_close(ssd_chunked(x, a, B, C, 8), ssd_sequential(x, a, B, C), rtol=1e-5, atol=1e-5)


def make_cfg(**kw) -> ModelConfig:
    base = {"hidden_size": 32, "num_attention_heads": 4, "seq_length": 24, "mamba_state_dim": 8,
            "mamba_head_dim": 16, "mamba_num_groups": 2, "mamba_chunk_size": 8}
    base.update(kw)
    return ModelConfig(**base)


def make_block(dtype=torch.float64, **kw) -> MambaBlock:
    m = make_cfg(**kw)
    torch.manual_seed(0)
    return MambaBlock(ModelShape.from_config(m), MambaShape.from_config(m)).to(dtype)


@pytest.mark.slow
def test_mixer_equals_sequential_mixer(monkeypatch):
    block = make_block()
    x = torch.randn(2, 21, 32, dtype=torch.float64)  # not a multiple of the chunk
    out = block(x)
    monkeypatch.setattr(mamba, "ssd_chunked", ssd_sequential)
    torch.testing.assert_close(out, block(x), rtol=1e-10, atol=1e-10)


def test_block_is_invariant_to_chunk_size():
    x = torch.randn(1, 24, 32, dtype=torch.float64)
    outs = [make_block(mamba_chunk_size=c)(x) for c in (1, 5, 8, 24)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-10, atol=1e-10)


def test_block_is_causal():
    block = make_block()
    x = torch.randn(1, 24, 32, dtype=torch.float64)
    y = x.clone()
    y[:, 15:] += 1.0
    torch.testing.assert_close(block(x)[:, :15], block(y)[:, :15], rtol=1e-12, atol=1e-12)


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="model.mamba_head_dim"):
        MambaShape.from_config(make_cfg(mamba_head_dim=24))
    with pytest.raises(ValueError, match="model.mamba_num_groups"):
        MambaShape.from_config(make_cfg(mamba_num_groups=3))


def test_block_captures_and_replays_without_host_sync():
    block = make_block(torch.float32, hidden_dropout=0.1)
    ref = copy.deepcopy(block)
    x = torch.randn(2, 24, 32, requires_grad=True)
    tracker = get_rng_tracker()
    backend = get_backend("cpu")
    graph = backend.new_graph("mamba")
    with backend.capture(graph, tracker.generators()):
        out = block(x)
        out.square().sum().backward()
    for _ in range(2):
        with torch.no_grad():
            x.copy_(torch.randn(2, 24, 32))
        rng = tracker.get_all_states()
        xr = x.detach().clone().requires_grad_()
        ref.zero_grad(set_to_none=True)
        expect = ref(xr)
        expect.square().sum().backward()
        tracker.set_all_states(rng)
        graph.replay()
        assert torch.equal(out, expect)
        assert torch.equal(x.grad, xr.grad)
        for (name, p), pr in zip(block.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, pr.grad), name


# --------------------------------------------------------------------------
# hybrid models


def test_nemotron_h_tiny_trains_and_exposes_scopes():
    cfg = get_recipe("nemotron_h_tiny")
    torch.manual_seed(0)
    model = build_model(cfg.model, "cpu")
    tokens = torch.randint(0, 256, (2, cfg.model.seq_length))
    loss = model(tokens, torch.roll(tokens, -1, 1))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    scopes = [set(layer.graph_scopes()) for layer in model.graph_layers()]
    assert scopes == [{"mamba"}, {"mlp"}, {"attn"}, {"moe", "moe_router", "moe_preprocess"}]
    mixer = model.graph_layers()[0].blocks["mamba"].mixer
    assert torch.all(mixer.D == 1.0) and torch.all(mixer.A_log > 0)  # Mamba's own init, not zeros


def test_pattern_errors_name_the_field():
    with pytest.raises(ValueError, match="hybrid_override_pattern"):
        layer_kinds(ModelConfig(num_layers=3, hybrid_override_pattern="M*"))
    with pytest.raises(ValueError, match="unknown symbols"):
        layer_kinds(ModelConfig(num_layers=2, hybrid_override_pattern="MX"))
    assert layer_kinds(ModelConfig(num_layers=4, hybrid_override_pattern="M*-E", num_moe_experts=4)) == [
        ["mamba"], ["attn"], ["mlp"], ["moe"]]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_block_captures():
    dev = torch.device("cuda")
    block = make_block(torch.bfloat16).to(dev)
    x = torch.randn(2, 64, 32, device=dev, dtype=torch.bfloat16, requires_grad=True)
    backend = get_backend(dev, "cuda")
    with backend.warmup():
        block(x).float().square().sum().backward()
    block.zero_grad(set_to_none=True)
    graph = backend.new_graph("mamba")
    with backend.capture(graph, ()):
        out = block(x)
        out.float().square().sum().backward()
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    expect = copy.deepcopy(block)(x.detach())
    assert torch.equal(out, expect)
