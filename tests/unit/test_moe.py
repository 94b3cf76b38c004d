"""MoE block: equality with a plain per-expert loop, router math, statistics, bias, capture."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from graphstep.config import ModelConfig
from graphstep.cuda_graph.registry import get_backend
from graphstep.cuda_graph.errors import CaptureError
from graphstep.cuda_graph.rng import get_rng_tracker
from graphstep.models import build_model
from graphstep.models.moe import (
    MoEBlock,
    MoEShape,
    expert_capacity,
    moe_stats,
    reset_moe_stats,
    set_aux_loss_scale,
    update_expert_bias,
)
from graphstep.models.moe_dispatch import grouped_mm_works
from graphstep.models.moe_router import load_balancing_loss, topk_routing, z_loss
from graphstep.models.transformer import ModelShape
from graphstep.recipes import get_recipe

H, E, K, FFN = 32, 4, 2, 16


def make_cfg(**kw) -> ModelConfig:
    base = {"hidden_size": H, "ffn_hidden_size": 48, "num_attention_heads": 4, "seq_length": 8,
            "num_moe_experts": E, "moe_ffn_hidden_size": FFN, "moe_router_topk": K,
            "moe_router_load_balancing_type": "none"}
    base.update(kw)
    return ModelConfig(**base)


def make_block(gemm: str = "auto", dtype=torch.float32, seed: int = 0, **kw) -> MoEBlock:
    m = make_cfg(**kw)
    torch.manual_seed(seed)
    block = MoEBlock(ModelShape.from_config(m), MoEShape.from_config(m), gemm=gemm)
    with torch.no_grad():  # non-trivial norm weights and a router that spreads tokens
        block.router_stage.pre_mlp_layernorm.weight.uniform_(0.5, 1.5)
        block.router_stage.router.weight.normal_(0.0, 0.5)
    return block.to(dtype)


def ref_routing(logits, score_function):
    """Routing written out independently of the module: top-k, softmax or normalised sigmoid."""
    top, idx = torch.topk(logits, K, dim=-1)
    if score_function == "softmax":
        return torch.softmax(top, dim=-1), idx
    s = torch.sigmoid(top)
    return s / s.sum(-1, keepdim=True), idx


def ref_moe(block: MoEBlock, x: torch.Tensor, capacity: int | None = None):
    """The plain per-expert loop (eager, boolean masks, host syncs); returns (out, aux_loss)."""
    rs = block.router_stage
    normed = rs.pre_mlp_layernorm(x).reshape(-1, x.shape[-1])
    logits = normed.double() @ rs.router.weight.double().t() if x.dtype == torch.float64 else \
        normed.float() @ rs.router.weight.float().t()
    probs, idx = ref_routing(logits, block.moe.score_function)
    w1, w2 = block.experts.experts.linear_fc1.weight, block.experts.experts.linear_fc2.weight
    y = torch.zeros_like(normed)
    for e in range(block.moe.num_experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        p = probs[tok, slot]
        if capacity is not None:  # keep the `capacity` most probable tokens
            keep = torch.argsort(p, descending=True)[:capacity]
            tok, p = tok[keep], p[keep]
        gate, up = (normed[tok] @ w1[e].t()).chunk(2, dim=-1)
        y = y.index_add(0, tok, ((F.silu(gate) * up) @ w2[e].t()) * p[:, None].to(x.dtype))
    if rs.shared_experts is not None:
        y = y + rs.shared_experts(normed)
    scores = torch.softmax(logits, -1)
    ones = torch.ones(idx.numel(), dtype=scores.dtype, device=idx.device)
    counts = torch.zeros(E, dtype=scores.dtype, device=idx.device).index_add(0, idx.flatten(), ones)
    aux = (scores.sum(0) * counts).sum() * E / (K * normed.shape[0] ** 2)
    return x + y.view_as(x), aux


def grads(module, *tensors):
    named = [(n, p.grad.clone()) for n, p in module.named_parameters() if p.grad is not None]
    return dict(named), [t.grad.clone() for t in tensors]


# --------------------------------------------------------------------------
# equality with the reference


@pytest.mark.parametrize("gemm", ["tiled", "loop", "grouped_mm"])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_dropless_equals_per_expert_loop(gemm, score):
    if gemm == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm does not exist in this PyTorch")
    block = make_block(gemm, moe_router_score_function=score, moe_shared_expert_intermediate_size=24)
    ref = copy.deepcopy(block)
    x = torch.randn(2, 8, H, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    out = block(x)
    expect, _ = ref_moe(ref, xr)
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    (expect * w).sum().backward()
    (g, (gx,)), (gr, (gxr,)) = grads(block, x), grads(ref, xr)
    torch.testing.assert_close(gx, gxr, rtol=1e-5, atol=1e-6)
    assert g.keys() == gr.keys()
    for name in g:
        torch.testing.assert_close(g[name], gr[name], rtol=1e-5, atol=1e-6, msg=name)


def test_gemm_paths_agree_exactly_where_ops_match():
    """The loop and grouped_mm (CPU) paths run the same per-expert products: identical bits."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm does not exist in this PyTorch")
    x = torch.randn(2, 8, H)
    outs = [make_block(g)(x) for g in ("loop", "grouped_mm")]
    assert torch.equal(outs[0], outs[1])


def test_auto_gemm_on_cpu_is_the_padded_fallback():
    block = make_block()
    block(torch.randn(2, 8, H))
    assert block.gemm == "tiled" and block.sync_free
    assert not grouped_mm_works(torch.device("cpu"), torch.float32)
    sync = make_block(moe_sync_free=False)
    sync(torch.randn(2, 8, H))
    assert sync.gemm == "loop" and not sync.sync_free


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="model.moe_router_enable_expert_bias") as err:
        MoEShape.from_config(make_cfg(moe_router_enable_expert_bias=True, moe_router_topk=9))
    assert "model.moe_router_topk=9" in str(err.value)  # every problem at once
    with pytest.raises(ValueError, match="model.moe_pad_expert_input_to_capacity"):
        MoEShape.from_config(make_cfg(moe_pad_expert_input_to_capacity=True))


@pytest.mark.parametrize("pad", [True, False])
def test_drop_and_pad_equals_capacity_reference(pad):
    block = make_block(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=pad)
    x = torch.randn(2, 8, H)
    cap = expert_capacity(16, block.moe)
    assert cap == math.ceil(16 * K / E * 0.5) == 4
    out = block(x)
    expect, _ = ref_moe(block, x, capacity=cap)
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)
    # some tokens really were dropped (otherwise this is the dropless test again)
    dropless, _ = ref_moe(block, x)
    assert not torch.allclose(out, dropless)


def test_large_capacity_drops_nothing():
    block = make_block(moe_expert_capacity_factor=4.0, moe_pad_expert_input_to_capacity=True)
    x = torch.randn(2, 8, H)
    assert expert_capacity(16, block.moe) == 16  # clamped to the token count
    torch.testing.assert_close(block(x), ref_moe(block, x)[0], rtol=1e-6, atol=1e-6)


def test_gradients_match_finite_differences():
    """fp64 gradcheck of the router, expert and shared-expert weights (routing is locally constant).

    Not of the input: the pre-MLP RMSNorm computes in fp32 by design, too coarse
    for finite differences; the input gradient is checked against the
    autograd reference above.
    """
    block = make_block("tiled", dtype=torch.float64, moe_shared_expert_intermediate_size=8)
    names = ["router_stage.router.weight", "experts.experts.linear_fc1.weight", "experts.experts.linear_fc2.weight",
             "router_stage.shared_experts.linear_fc1.weight"]
    params = dict(block.named_parameters())
    x = torch.randn(1, 4, H, dtype=torch.float64)

    def fn(*ws):
        return functional_call(block, {**params, **dict(zip(names, ws))}, (x,))

    ws = [params[n].detach().clone().requires_grad_() for n in names]
    assert torch.autograd.gradcheck(fn, tuple(ws), eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)


# --------------------------------------------------------------------------
# router


def test_softmax_and_sigmoid_routing():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5], [0.0, 3.0, 1.0, 2.0]])
    p, idx = topk_routing(logits, 2, "softmax")
    assert idx.tolist() == [[0, 1], [1, 3]]
    torch.testing.assert_close(p[0], torch.softmax(torch.tensor([2.0, 1.0]), 0))
    full = torch.softmax(logits, -1)  # = Qwen3's softmax, top-k, renormalise
    torch.testing.assert_close(p[1], full[1, [1, 3]] / full[1, [1, 3]].sum())
    p, idx = topk_routing(logits, 2, "sigmoid")
    assert idx.tolist() == [[0, 1], [1, 3]]
    s = torch.sigmoid(torch.tensor([2.0, 1.0]))
    torch.testing.assert_close(p[0], s / s.sum())
    p1, _ = topk_routing(logits, 1, "sigmoid")  # top-1 sigmoid is not normalised
    torch.testing.assert_close(p1[:, 0], torch.sigmoid(torch.tensor([2.0, 3.0])))


def test_aux_loss_value_by_hand():
    logits = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.5], [1.0, 1.5, 0.0]])
    scores = torch.softmax(logits, -1)
    counts = torch.tensor([1.0, 2.0, 1.0])  # top-1 choices: 0, 1, 2, 1
    N, n_exp, k = 4, 3, 1
    by_hand = sum(sum(scores[n, e].item() for n in range(N)) * counts[e].item() for e in range(n_exp))
    by_hand *= n_exp / (k * N * N)
    assert load_balancing_loss(scores, counts, k).item() == pytest.approx(by_hand, rel=1e-6)
    # a perfectly balanced uniform router scores exactly 1
    assert load_balancing_loss(torch.full((6, 3), 1 / 3), torch.tensor([2.0, 2.0, 2.0]), 1).item() == pytest.approx(1.0)


def test_z_loss_value_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]])
    by_hand = (math.log(1 + 3) ** 2 + (1 + math.log(2)) ** 2) / 2
    assert z_loss(logits).item() == pytest.approx(by_hand, rel=1e-6)


def test_aux_and_z_loss_gradients_and_scale():
    """The autoscaler adds scale * d(coeff * aux) to the gradient (Megatron's MoEAuxLossAutoScaler)."""
    coeff, zc = 0.1, 0.01
    block = make_block("tiled", moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=coeff,
                       moe_z_loss_coeff=zc)
    ref = copy.deepcopy(block)
    set_aux_loss_scale(block, 0.25)
    x = torch.randn(2, 8, H)
    block(x).sum().backward()
    out, aux = ref_moe(ref, x)
    rs = ref.router_stage
    logits = rs.pre_mlp_layernorm(x).reshape(-1, H) @ rs.router.weight.t()
    zl = torch.logsumexp(logits, -1).square().mean()
    (out.sum() + 0.25 * (coeff * aux + zc * zl)).backward()
    g, gr = grads(block)[0], grads(ref)[0]
    for name in g:
        torch.testing.assert_close(g[name], gr[name], rtol=1e-5, atol=1e-6, msg=name)
    stats = moe_stats(block)
    assert stats["aux_loss"].item() == pytest.approx(aux.item(), rel=1e-5)
    assert stats["z_loss"].item() == pytest.approx(zl.item(), rel=1e-5)


# --------------------------------------------------------------------------
# statistics and expert bias


def test_stats_accumulate_and_reset():
    block = make_block(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
    x = torch.randn(2, 8, H)
    block(x).sum().backward()
    one = {k: v.clone() for k, v in moe_stats(block).items()}
    assert one["tokens_per_expert"].shape == (1, E) and one["tokens_per_expert"].sum().item() == 16 * K
    block(x).sum().backward()
    two = moe_stats(block)
    torch.testing.assert_close(two["aux_loss"], 2 * one["aux_loss"])
    torch.testing.assert_close(two["z_loss"], 2 * one["z_loss"])
    assert torch.equal(two["tokens_per_expert"], 2 * one["tokens_per_expert"])
    with torch.no_grad():  # evaluation does not count
        block(x)
    block.eval()
    block(x)
    assert torch.equal(moe_stats(block)["tokens_per_expert"], two["tokens_per_expert"])
    reset_moe_stats(block)
    assert all(v.abs().sum().item() == 0 for v in moe_stats(block).values())


def test_expert_bias_steers_selection_not_weights():
    block = make_block(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    router = block.router_stage.router
    x = torch.randn(2, 8, H)
    normed = block.router_stage.pre_mlp_layernorm(x).reshape(-1, H)
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    probs, idx = router(normed)
    assert (idx == 3).any(dim=1).all()  # everyone picks the biased expert
    s = torch.sigmoid(normed @ router.weight.t()).gather(1, idx)
    torch.testing.assert_close(probs, s / s.sum(-1, keepdim=True))  # weights from unbiased scores


def test_expert_bias_changes_only_in_update():
    rate = 0.01
    block = make_block(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                       moe_router_bias_update_rate=rate)
    router = block.router_stage.router
    x = torch.randn(2, 8, H)
    for _ in range(2):
        block(x).sum().backward()
    assert torch.equal(router.expert_bias, torch.zeros(E))
    counts = router.bias_tokens_per_expert.clone().double()
    update_expert_bias(block)
    torch.testing.assert_close(router.expert_bias, (torch.sign(counts.mean() - counts) * rate).float())
    assert router.bias_tokens_per_expert.sum().item() == 0  # consumed by the update
    assert moe_stats(block)["tokens_per_expert"].sum().item() == 2 * 16 * K  # logging counts untouched


def test_fp32_state_survives_bf16_cast():
    block = make_block(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True).to(torch.bfloat16)
    r = block.router_stage.router
    assert r.expert_bias.dtype == r.aux_loss_sum.dtype == r.aux_loss_scale.dtype == torch.float32
    assert r.tokens_per_expert.dtype == torch.int64


# --------------------------------------------------------------------------
# capture on the CPU replay backend


def _capture(block, x, w):
    backend = get_backend("cpu")
    graph = backend.new_graph("moe")
    with backend.capture(graph, get_rng_tracker().generators()):
        out = block(x)
        (out * w).sum().backward()
    return graph, out


@pytest.mark.parametrize("kw", [{}, {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True},
                                {"hidden_dropout": 0.1, "moe_shared_expert_intermediate_size": 8}])
def test_sync_free_block_captures_and_replays(kw):
    block = make_block(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, **kw)
    ref = copy.deepcopy(block)
    x = torch.randn(2, 8, H, requires_grad=True)
    w = torch.randn(2, 8, H)
    tracker = get_rng_tracker()
    for step in range(2):  # replays see fresh data through the static input
        with torch.no_grad():
            x.copy_(torch.randn(2, 8, H))
        # Gradients are created inside the capture: graph-owned, overwritten by each replay.
        rng = tracker.get_all_states()
        xr = x.detach().clone().requires_grad_()
        ref.zero_grad(set_to_none=True)
        expect = ref(xr)
        (expect * w).sum().backward()
        tracker.set_all_states(rng)
        if step == 0:
            graph, out = _capture(block, x, w)
        graph.replay()
        assert torch.equal(out, expect)
        assert torch.equal(x.grad, xr.grad)
        for (name, p), pr in zip(block.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, pr.grad), name
    # statistics accumulate on every replay, as in eager
    assert torch.equal(moe_stats(block)["tokens_per_expert"], moe_stats(ref)["tokens_per_expert"])


def test_sync_path_cannot_be_captured():
    block = make_block(moe_sync_free=False)
    assert not block.sync_free
    with pytest.raises(CaptureError, match="local_scalar_dense"):
        _capture(block, torch.randn(2, 8, H), torch.randn(2, 8, H))


# --------------------------------------------------------------------------
# models from recipes


def _train_step(cfg) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(cfg.model, "cpu")
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length))
    loss = model(tokens, torch.roll(tokens, -1, 1))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    return model


def test_qwen3_moe_tiny_trains_and_exposes_scopes():
    model = _train_step(get_recipe("qwen3_moe_tiny"))
    for layer in model.graph_layers():
        assert set(layer.graph_scopes()) == {"attn", "moe", "moe_router", "moe_preprocess"}
    assert moe_stats(model)["tokens_per_expert"].shape == (2, 8)


def test_moe_layer_freq_mixes_dense_layers():
    cfg = get_recipe("qwen3_moe_tiny")
    cfg.model.num_layers, cfg.model.moe_layer_freq = 4, 2
    model = _train_step(cfg)
    kinds = ["moe" in layer.graph_scopes() for layer in model.graph_layers()]
    assert kinds == [True, False, True, False]
    assert "mlp" in model.graph_layers()[1].graph_scopes()


def test_launch_bound_bench_builds():
    cfg = get_recipe("moe_launch_bound_bench")
    cfg.model.num_layers, cfg.model.seq_length = 1, 32  # the shape of one layer, quickly
    model = _train_step(cfg)  # a finite loss and finite gradients
    (layer,) = model.graph_layers()
    assert set(layer.graph_scopes()) == {"attn", "moe", "moe_router", "moe_preprocess"}
    tokens_per_expert = moe_stats(model)["tokens_per_expert"]
    assert tokens_per_expert.shape == (1, 64)  # one MoE layer of 64 experts
    assert tokens_per_expert.sum().item() == 2 * 32 * 4  # every token routed to its top-4, dropless


@pytest.mark.parametrize("name,billions", [("qwen3_30b_a3b", 30.5), ("gpt_oss_20b", 20.9)])
def test_real_shapes_count_parameters(name, billions):
    from graphstep.models.hybrid import build_layered_model

    cfg = get_recipe(name)
    with torch.device("meta"):
        model = build_layered_model(cfg.model)
    n = sum(p.numel() for p in model.parameters()) / 1e9
    assert n == pytest.approx(billions, rel=0.02)


# --------------------------------------------------------------------------
# GPU (scripts/gpu-check; never in CI)


def _cuda_capture(module, x, w):
    """Warm up on the capture stream, then capture forward+backward with graph-owned gradients."""
    backend = get_backend(x.device, "cuda")
    with backend.warmup():
        for _ in range(2):
            (module(x) * w).sum().backward()
    module.zero_grad(set_to_none=True)
    x.grad = None
    graph = backend.new_graph("cuda-test")
    with backend.capture(graph, get_rng_tracker().generators()):
        out = module(x)
        (out * w).sum().backward()
    return graph, out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sync_free_block_matches_and_captures():
    dev = torch.device("cuda")
    block = make_block(dtype=torch.bfloat16, moe_router_load_balancing_type="aux_loss",
                       moe_aux_loss_coeff=1e-2).to(dev)
    x = torch.randn(4, 64, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn_like(x)
    expect = block(x).detach()
    sm90 = torch.cuda.get_device_capability(dev) >= (9, 0)
    assert block.gemm == ("grouped_mm" if sm90 and hasattr(torch, "_grouped_mm") else "tiled")
    tiled = copy.deepcopy(block)
    tiled.gemm = "tiled"
    torch.testing.assert_close(tiled(x), expect, rtol=2e-2, atol=2e-2)
    ref = copy.deepcopy(block).float()
    torch.testing.assert_close(ref_moe(ref, x.detach().float())[0], expect.float(), rtol=5e-2, atol=5e-2)
    graph, out = _cuda_capture(block, x, w)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    eager = copy.deepcopy(block)
    xe = x.detach().clone().requires_grad_()
    ye = eager(xe)
    (ye * w).sum().backward()
    assert torch.equal(out, ye)
    torch.testing.assert_close(x.grad, xe.grad, rtol=1e-2, atol=1e-2)
