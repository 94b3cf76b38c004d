"""Model FLOPs of one training iteration, for TFLOP/s and MFU (the bench and the trainer's writers).

The standard count (Megatron's and nanoGPT's): 6 FLOPs per matrix parameter
per token for forward and backward, plus the attention score and value
products (causal: half), plus the output layer; MoE counts only the top-k
of the experts each token runs.
"""

from __future__ import annotations

import torch

from ..config import Config

# Dense bf16 tensor-core peak (TFLOP/s, no sparsity) of GPUs graphstep is measured on, for MFU.
BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0}


def peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak from the table above, or None (MFU is then not reported)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)


def flops_per_step(cfg: Config, model: torch.nn.Module) -> float:
    """Training FLOPs of one iteration: 6 x matmul params x tokens + attention + output layer."""
    m = cfg.model
    tokens = cfg.train.global_batch_size * m.seq_length
    embed = m.vocab_size * m.hidden_size
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2) - embed
    if m.num_moe_experts:  # only top-k of the experts run per token
        expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        matmul_params -= expert * (1 - m.moe_router_topk / m.num_moe_experts)
    attn = 12 * m.num_layers * m.num_attention_heads * (m.kv_channels or m.hidden_size // m.num_attention_heads)
    attn *= m.seq_length / 2  # causal
    per_token = 6 * matmul_params + attn + 6 * embed  # the output layer reads the (tied) embedding
    return per_token * tokens
