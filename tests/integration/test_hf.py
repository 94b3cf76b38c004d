"""Hugging Face checkpoints: tiny models made here with `transformers` load with the same logits and round-trip."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from helpers.runs import assert_same_run, eager, tiny_config
from graphstep.config import ModelConfig
from graphstep.data import build_data
from graphstep.models import build_model
from graphstep.models.hf import HFCheckpointError, config_from_hf, export_hf, load_hf
from graphstep.models.moe_router import topk_routing
from graphstep.training.loop import train
from helpers.data import HF_COMMON, MODELS, make_hf, sft_overrides, write_sft

transformers = pytest.importorskip("transformers")

SEQ = 32


def graphstep_model(path, **fields):
    overrides, state = load_hf(path)
    cfg = ModelConfig(**{**overrides, "seq_length": SEQ, "params_dtype": "fp32", **fields})
    model = build_model(cfg).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(".router." in k for k in missing)  # only the routers' statistics buffers
    return model, cfg


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: (make_hf(name, root / name), root / name) for name in MODELS}


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_equal_transformers_and_round_trip_through_export(hf_dirs, name, tmp_path):
    hf_model, path = hf_dirs[name]
    model, cfg = graphstep_model(path)
    tokens = torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = hf_model(tokens).logits
        logits = model(tokens)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
    export_hf(model, cfg, tmp_path / "out")
    back = getattr(transformers, MODELS[name][1]).from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, logits, atol=1e-5, rtol=0)
    _, again = load_hf(tmp_path / "out")  # and the weights themselves come back unchanged
    _, first = load_hf(path)
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    assert config_from_hf(tmp_path / "out") == config_from_hf(path) | {"rotary_base": cfg.rotary_base}


def test_qwen3_moe_norm_topk_prob_false_needs_pre_softmax(hf_dirs):
    hf_model, path = hf_dirs["qwen3_moe_unnormalised"]
    assert config_from_hf(path)["moe_router_pre_softmax"] is True
    assert config_from_hf(path)["moe_layer_freq"] == 2  # mlp_only_layers=[1] of 3 layers = MoE at 0 and 2
    tokens = torch.randint(0, 300, (1, SEQ), generator=torch.Generator().manual_seed(2))
    model, _ = graphstep_model(path, moe_router_pre_softmax=False)
    with torch.no_grad():
        assert (model(tokens) - hf_model(tokens).logits).abs().max() > 1e-3  # renormalised weights differ


def test_router_semantics():
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(logits, dim=-1)
    top, idx = torch.topk(probs, 3, dim=-1)
    ours, ours_idx = topk_routing(logits, 3, "softmax")  # softmax over the top-k logits
    assert torch.equal(ours_idx, idx)
    torch.testing.assert_close(ours, top / top.sum(-1, keepdim=True))  # = HF's renormalised softmax-then-top-k
    pre, pre_idx = topk_routing(logits, 3, "softmax", pre_softmax=True)
    assert torch.equal(pre_idx, idx) and torch.equal(pre, top)  # = HF's norm_topk_prob=false


def test_rotary_is_transformers_rotate_half():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from graphstep.models.transformer import Rotary

    config = transformers.LlamaConfig(**HF_COMMON, rope_theta=50000.0)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(SEQ)[None])
    x = torch.randn(2, 4, SEQ, 16)
    expected, _ = apply_rotary_pos_emb(x, x, cos, sin)
    # graphstep builds its tables in fp64, transformers in fp32: equal to float32 rounding of the angles
    torch.testing.assert_close(Rotary(16, SEQ, 50000)(x), expected, atol=1e-5, rtol=0)


def test_unsupported_checkpoints_are_refused_with_every_reason(tmp_path):
    base = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 96,
            "num_attention_heads": 4, "vocab_size": 300}
    cases = [
        ({"model_type": "mistral"}, r"model_type='mistral'; graphstep loads llama, qwen2, qwen3, qwen3_moe"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "mlp_bias": True},
         r"mlp_bias=true.*\n.*rope_type='llama3'"),
        ({"model_type": "qwen2", "use_sliding_window": True}, r"sliding-window attention"),
        ({"model_type": "qwen3", "attention_bias": True}, r"attention_bias=true"),
        ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "decoder_sparse_step": 2}, r"MoE layers \[1, 3\] .* i % model.moe_layer_freq == 0"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ]
    for extra, message in cases:
        with pytest.raises(HFCheckpointError, match=message):
            config_from_hf(base | extra)
    (tmp_path / "config.json").write_text(json.dumps(base))
    with pytest.raises(HFCheckpointError, match=r"no model.safetensors"):
        load_hf(tmp_path)
    with pytest.raises(HFCheckpointError, match=r"no config.json"):
        load_hf(tmp_path / "nowhere")


def test_missing_and_foreign_weights_name_the_key(hf_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = hf_dirs["llama"]
    tensors = load_file(str(path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.weight"},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match=r"missing weight 'model.layers.1.self_attn.k_proj.weight'"):
        load_hf(tmp_path)
    save_file(tensors | {"model.layers.2.mlp.up_proj.weight": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match=r"1 weight\(s\) graphstep's model does not have.*layers.2.mlp.up_proj"):
        load_hf(tmp_path)


@pytest.mark.slow
def test_train_from_hf_directory_sft_graphed_equals_eager(hf_dirs, tmp_path):
    """model.hf_path sets the shape and the weights; SFT with the full-iteration graph equals eager."""
    hf_model, path = hf_dirs["qwen3_moe"]
    data = write_sft(tmp_path / "sft.jsonl", n=24)
    common = [*sft_overrides(data, "train.train_iters=6", "model.cuda_graph_warmup_steps=2"), f"model.hf_path={path}",
              "model.attention_dropout=0.0", "model.hidden_dropout=0.0", "optimizer.lr=0.001"]
    base = train(eager(tiny_config(*common)), keep_model=True)
    graphed = train(tiny_config(*common, "model.cuda_graph_impl=full_iteration"), keep_model=True)
    assert_same_run(base, graphed)
    assert [r["state"] for r in graphed.rows][2:4] == ["captured", "replayed"]
    assert sum(p.numel() for p in base.model.parameters()) == sum(p.numel() for p in hf_model.parameters())
    # iteration 1's loss is the Hugging Face model's loss on the same micro-batches
    cfg = tiny_config(*common)
    losses = []
    with torch.no_grad():
        for mb in build_data(cfg).next_step():
            nll = F.cross_entropy(hf_model(mb["tokens"]).logits.flatten(0, 1), mb["labels"].flatten(), reduction="none")
            losses.append((nll * mb["loss_mask"].flatten()).sum() / mb["loss_mask"].sum())
    assert base.rows[0]["loss"] == pytest.approx(float(torch.stack(losses).mean()), abs=1e-5)
