"""Small datasets and models the tests write under their tmp_path: SFT JSONL files, Hugging Face checkpoints."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch


def write_sft(path: Path, n: int = 48, seed: int = 0) -> Path:
    """Examples whose lengths fall in three buckets: about half short, a third medium, the rest long."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        total = rng.choice([rng.randint(6, 16)] * 5 + [rng.randint(17, 32)] * 3 + [rng.randint(33, 64)] * 2)
        cut = rng.randint(1, total - 2)
        text = "".join(rng.choice("abcdefgh ") for _ in range(total - 1))  # + eod = total tokens
        lines.append(json.dumps({"prompt": text[:cut], "response": text[cut:], "id": i}))
    path.write_text("\n".join(lines) + "\n")
    return path


def sft_overrides(path: Path, *more: str) -> list[str]:
    return ["data.dataset=sft", f"data.data_path={path}", "data.split=100,0,0", "model.seq_length=64",
            "train.micro_batch_size=1", "train.global_batch_size=2", *more]


HF_COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_theta=50000.0)),
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    "qwen3_moe_unnormalised": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                               dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=False, num_hidden_layers=3, mlp_only_layers=[1])),
}


def make_hf(name: str, path, seed: int = 0):
    """A random `transformers` model, every parameter perturbed (norms and biases too), saved to ``path``."""
    import transformers

    config_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**HF_COMMON, **extra})).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_((1.0 if pname.endswith("norm.weight") else 0.0) + 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return model
