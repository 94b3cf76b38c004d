"""MoE and hybrid recipes: tiny ones for CPUs, real shapes, and a launch-bound benchmark.

Field values follow the Megatron Bridge providers of the same models where
graphstep implements the feature; what it does not implement is left out and
said in the recipe's docstring (never approximated silently).
"""

from __future__ import annotations

from ..config import Config
from .llama import graph_ready, launch_bound_bench


def _tiny_training(cfg: Config) -> Config:
    """Shared run settings of the tiny recipes: byte tokens, seconds on 2 CPU cores."""
    m = cfg.model
    m.seq_length, m.vocab_size = 64, 256
    m.attention_dropout = m.hidden_dropout = 0.0
    m.cuda_graph_impl = "full_iteration"
    cfg.train.train_iters = 100
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 4, 8
    cfg.train.eval_interval, cfg.train.eval_iters = 50, 2
    cfg.optimizer.lr, cfg.optimizer.min_lr = 3e-3, 3e-4
    cfg.scheduler.lr_warmup_iters = 10
    cfg.logger.log_interval = 10
    return cfg


def _tiny_moe(m) -> None:
    m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size = 8, 2, 64
    m.moe_router_load_balancing_type, m.moe_aux_loss_coeff = "aux_loss", 1e-2
    m.moe_sync_free = True


def qwen3_moe_tiny() -> Config:
    """A 2-layer Qwen3-MoE on byte tokens: 8 experts top-2, qk-layernorm; trains in seconds on 2 CPU cores.

    Dropless and sync-free, so the default full-iteration graph captures the
    whole step (the CPU replay backend without a GPU).
    """
    cfg = graph_ready(Config())
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 2, 64, 176
    m.num_attention_heads, m.num_query_groups, m.kv_channels = 4, 2, 16
    m.qk_layernorm = True
    _tiny_moe(m)
    return _tiny_training(cfg)


def nemotron_h_tiny() -> Config:
    """A 4-layer Nemotron-H style hybrid, pattern ``M-*E``: Mamba, MLP, attention, MoE.

    Nemotron-H's squared-ReLU MLP is SwiGLU here (graphstep's MLPBlock).
    """
    cfg = graph_ready(Config())
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 4, 64, 176
    m.num_attention_heads, m.num_query_groups = 4, 2
    m.hybrid_override_pattern = "M-*E"
    m.mamba_state_dim, m.mamba_head_dim, m.mamba_num_groups, m.mamba_chunk_size = 16, 16, 1, 32
    _tiny_moe(m)
    return _tiny_training(cfg)


def _scoped_moe_graphs(cfg: Config) -> Config:
    """Megatron Bridge's MoE perf setting: TE-style scoped graphs of attn + router + preprocess.

    graphstep's sync-free dropless path also allows ``cuda_graph_modules=[attn,moe]``
    or ``cuda_graph_impl=full_iteration``.
    """
    cfg.model.cuda_graph_impl = "transformer_engine"
    cfg.model.cuda_graph_modules = ["attn", "moe_router", "moe_preprocess"]
    cfg.data.dataset = "mock"
    return cfg


def qwen3_30b_a3b() -> Config:
    """Qwen3-30B-A3B: 48 layers, d=2048, 128 experts top-8 (width 768), 32 heads / 4 KV, head dim 128."""
    cfg = graph_ready(Config())
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 48, 2048, 6144
    m.num_attention_heads, m.num_query_groups, m.kv_channels = 32, 4, 128
    m.qk_layernorm = True
    m.seq_length, m.vocab_size = 4096, 151936
    m.rotary_base, m.layernorm_epsilon = 1000000, 1e-6
    m.share_embeddings_and_output_weights = False
    m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size = 128, 8, 768
    m.moe_router_score_function = "softmax"
    m.moe_router_load_balancing_type, m.moe_aux_loss_coeff = "aux_loss", 1e-3
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, 512
    cfg.optimizer.lr, cfg.optimizer.min_lr = 3e-4, 3e-5
    cfg.scheduler.lr_warmup_iters = 500
    return _scoped_moe_graphs(cfg)


def gpt_oss_20b() -> Config:
    """gpt-oss-20b shapes: 24 layers, d=2880, 32 experts top-4 (width 2880), 64 heads / 8 KV, head dim 64.

    Routing as the model card and Megatron Bridge's provider: softmax over the
    top-4 logits, no load-balancing loss. NOT implemented, and left out rather
    than approximated: attention sinks (learnable softmax), the alternating
    128-token sliding window, YaRN scaling, biases on the expert and output
    projections, and the clamped GLU activation (experts are plain SwiGLU).
    So this has the model's shapes and routing, not its exact function.
    """
    cfg = graph_ready(Config())
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 24, 2880, 2880
    m.num_attention_heads, m.num_query_groups, m.kv_channels = 64, 8, 64
    m.add_qkv_bias = True
    m.seq_length, m.vocab_size = 4096, 201088
    m.rotary_base = 150000
    m.share_embeddings_and_output_weights = False
    m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size = 32, 4, 2880
    m.moe_router_score_function = "softmax"
    m.moe_router_load_balancing_type, m.moe_aux_loss_coeff = "none", 0.0
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, 512
    cfg.optimizer.lr, cfg.optimizer.min_lr = 3e-4, 3e-5
    cfg.scheduler.lr_warmup_iters = 500
    return _scoped_moe_graphs(cfg)


def moe_launch_bound_bench() -> Config:
    """A launch-bound MoE: 8 layers, d=256, 64 small experts (width 128) top-4, seq 256, micro-batch 2.

    Many tiny expert GEMMs per step: the shape where host launch overhead
    dominates and graphs pay off. Mock data; the bench harness picks the graph mode.
    """
    cfg = launch_bound_bench(2)
    m = cfg.model
    m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size = 64, 4, 128
    m.moe_router_load_balancing_type, m.moe_aux_loss_coeff = "aux_loss", 1e-2
    m.moe_sync_free = True
    return cfg


def hybrid_launch_bound_bench() -> Config:
    """A launch-bound Nemotron-H style hybrid for ``graphstep bench``: pattern ``M-M*M-M*``, d=256, seq 256.

    Four Mamba-2 mixers (chunked SSD scan in PyTorch: many small kernels), two
    MLP and two attention layers; micro-batch 2, mock data.
    """
    cfg = launch_bound_bench(2)
    m = cfg.model
    m.hybrid_override_pattern = "M-M*M-M*"
    m.mamba_state_dim, m.mamba_head_dim, m.mamba_num_groups, m.mamba_chunk_size = 64, 32, 1, 64
    return cfg
