"""Whole training steps of Hugging Face models as one graph, equal to eager bit for bit.

transformers checks on the host whether a batch holds packed sequences and,
while a stream captures, cannot: it then builds an explicit attention mask
(another SDPA kernel). graphstep records the eager answer during the warm-up
calls and the capture reuses it (cuda_graph/decisions.py), so the graph runs
the kernels eager runs.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import graphstep
from graphstep.cuda_graph import decisions

pytestmark = pytest.mark.slow

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
DEVICES = [
    pytest.param("cpu"),
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]


def _build(kind: str, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(attention_dropout=0.1, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    return model.to(device).train()


def _run(kind: str, device: str, graphed: bool, steps: int = 8):
    model = _build(kind, device)
    cuda = device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=cuda, fused=not cuda)

    def step(ids: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        total = torch.zeros((), device=device)
        for mb in ids.chunk(2):  # two micro-batches
            loss = model(input_ids=mb, labels=mb, use_cache=False).loss
            (loss / 2).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return total

    fn = graphstep.graph_step(step, warmup_steps=3, device=device, modules=[model]) if graphed else step
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (4, 32), generator=g).to(device)
        losses.append(fn(ids).clone())
    params = [p.detach().clone() for p in model.parameters()]
    graphstep.close_all()
    return losses, params


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_whole_step_graph_equals_eager(kind, device):
    ref_losses, ref_params = _run(kind, device, graphed=False)
    losses, params = _run(kind, device, graphed=True)
    for i, (a, b) in enumerate(zip(ref_losses, losses)):
        assert torch.equal(a, b), f"step {i}: {a.item()!r} != {b.item()!r}"
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))


def test_decisions_recorded_on_eager_calls_are_replayed_at_capture():
    log = decisions.DecisionLog()
    for _ in range(2):
        with log.recording():
            assert decisions.decide("packed", lambda: True) is True
    with log.replaying():
        assert decisions.decide("packed", lambda: pytest.fail("eager code must not run at capture")) is True
        assert decisions.decide("packed", lambda: True) is decisions.FOLLOW  # more than recorded
    assert log.unfrozen == ["packed"]
    assert decisions.decide("packed", lambda: True) is decisions.FOLLOW  # outside any graph


def test_decisions_that_changed_between_warmups_are_not_frozen():
    log = decisions.DecisionLog()
    for value in (True, False):
        with log.recording():
            decisions.decide("packed", lambda v=value: v)
    with log.replaying():
        assert decisions.decide("packed", lambda: True) is decisions.FOLLOW
    assert log.unfrozen == ["packed"]


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_capture_calls_the_attention_kernels_eager_calls(monkeypatch):
    """The captured step asks SDPA for what the eager steps asked (is_causal, no explicit mask)."""
    import torch.nn.functional as F

    calls: list[tuple[bool, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is None, bool(kwargs.get("is_causal"))))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = _build("llama", "cpu")

    def step(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids, use_cache=False).loss.detach()

    graphed = graphstep.graph_step(step, warmup_steps=2, device="cpu", backend="replay")
    ids = torch.randint(0, 128, (2, 16))
    graphed(ids)
    eager_calls = list(calls)
    graphed(ids)
    calls.clear()
    graphed(ids)  # the capture: the replay backend records the step, so the spy sees its calls
    assert eager_calls == [(True, True)] * 2  # two layers: no explicit mask, SDPA's causal kernel
    assert calls == eager_calls


def _capture_sensitive(padding_mask, q_length: int, kv_length: int) -> bool:
    """Like transformers 5.17's mask-skip check: never skips while a stream captures."""
    try:
        capturing = torch.cuda.is_current_stream_capturing()
    except Exception:  # a CPU build of torch (transformers guards it the same way)
        capturing = False
    if capturing:
        return False
    return padding_mask is None and q_length == kv_length


def test_mask_skip_decision_of_the_eager_calls_is_used_at_capture():
    from graphstep.integrations.transformers import _wrap_mask_skip

    ignore = _wrap_mask_skip(_capture_sensitive, key="mask-skip")
    seen: list[bool] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        seen.append(ignore(None, 4, 4))
        return x * 2

    graphed = graphstep.graph_step(step, warmup_steps=2, device="cpu", backend="replay")
    for _ in range(3):
        graphed(torch.ones(2))
    assert seen == [True, True, True]  # the capture (third call) answers as the eager calls did
    assert graphed.decisions.unfrozen == []


def test_mask_skip_with_an_attention_mask_is_never_frozen_and_said():
    from graphstep.integrations.transformers import _wrap_mask_skip

    ignore = _wrap_mask_skip(_capture_sensitive, key="mask-skip")
    seen: list[bool] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        seen.append(ignore(torch.ones(2, 4, dtype=torch.bool), 4, 4))
        return x * 2

    graphed = graphstep.graph_step(step, warmup_steps=1, device="cpu", backend="replay")
    for _ in range(2):
        graphed(torch.ones(2))
    assert seen == [False, False]  # transformers' own answer, also at capture
    assert graphed.decisions.unfrozen == ["mask-skip (an attention_mask was passed)"]
