"""Dense Llama-style recipes: a tiny one for CPUs and the real Llama 3 shapes."""

from __future__ import annotations

from ..config import Config


def graph_ready(cfg: Config) -> Config:
    """Settings every graphed recipe shares: the graph-safe RNG tracker on, and
    graphstep's device-side NaN check instead of the host-side ones (rule R6)."""
    cfg.model.use_te_rng_tracker = True
    cfg.rng.te_rng_tracker = True
    cfg.rerun_state_machine.check_for_nan_in_loss = False
    cfg.ddp.check_for_nan_in_grad = False
    cfg.train.check_for_nan_on_device = True
    return cfg


def llama3_tiny() -> Config:
    """A 4-layer Llama on byte tokens: trains in seconds on 2 CPU cores.

    The default of ``graphstep train``: full-iteration CUDA graph on a GPU,
    the CPU replay backend elsewhere.
    """
    cfg = graph_ready(Config())
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 4, 128, 352
    m.num_attention_heads, m.num_query_groups = 4, 2
    m.seq_length, m.vocab_size = 128, 256
    m.attention_dropout = m.hidden_dropout = 0.0
    m.cuda_graph_impl = "full_iteration"
    cfg.train.train_iters = 200
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 8, 16
    cfg.train.eval_interval, cfg.train.eval_iters = 100, 4
    cfg.optimizer.lr, cfg.optimizer.min_lr = 3e-3, 3e-4
    cfg.scheduler.lr_warmup_iters = 20
    cfg.logger.log_interval = 10
    return cfg


def launch_bound_bench(micro_batch: int) -> Config:
    """The launch-bound shape of the spec (section 6) that the bench recipes share: 8 layers, d=256,
    4 heads, seq 256, a 32k vocabulary, mock data, one micro-batch per step."""
    cfg = graph_ready(Config())
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 8, 256, 1024
    m.num_attention_heads, m.num_query_groups = 4, 4
    m.seq_length, m.vocab_size = 256, 32000
    cfg.data.dataset = "mock"
    cfg.train.micro_batch_size = cfg.train.global_batch_size = micro_batch
    cfg.train.train_iters = 50
    return cfg


def small_dense_bench() -> Config:
    """The launch-bound shape of the spec (section 6): 8 layers, d=256, seq 256, micro-batch 4."""
    return launch_bound_bench(4)


def gpt_124m_bench() -> Config:
    """A GPT-124M-class model for ``graphstep bench``: 12 layers, d=768, 12 heads, seq 1024, micro-batch 4.

    GPT-2 small's size (124M parameters with a 50k vocabulary) in graphstep's
    Llama-style block (SwiGLU of width 2048 has GPT-2's 4d MLP parameter count);
    between the launch-bound and the compute-bound shapes.
    """
    cfg = graph_ready(Config())
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 12, 768, 2048
    m.num_attention_heads, m.num_query_groups = 12, 12
    m.seq_length, m.vocab_size = 1024, 50304
    m.share_embeddings_and_output_weights = True
    cfg.data.dataset = "mock"
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 4, 4
    cfg.train.train_iters = 50
    return cfg


def _llama3(cfg: Config, layers: int, hidden: int, ffn: int, heads: int, groups: int, tie: bool) -> Config:
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = layers, hidden, ffn
    m.num_attention_heads, m.num_query_groups = heads, groups
    m.seq_length, m.vocab_size = 8192, 128256
    m.rotary_base = 500000
    m.share_embeddings_and_output_weights = tie
    m.init_method_std = 0.02
    cfg.data.dataset = "mock"
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, 512
    cfg.optimizer.lr, cfg.optimizer.min_lr = 3e-4, 3e-5
    cfg.scheduler.lr_warmup_iters = 2000
    return cfg


def llama32_1b() -> Config:
    """Llama 3.2 1B: 16 layers, d=2048, 32 heads / 8 KV heads, tied embeddings."""
    return _llama3(graph_ready(Config()), 16, 2048, 8192, 32, 8, True)


def llama3_8b() -> Config:
    """Llama 3 8B: 32 layers, d=4096, 32 heads / 8 KV heads."""
    return _llama3(graph_ready(Config()), 32, 4096, 14336, 32, 8, False)


def llama3_70b() -> Config:
    """Llama 3 70B: 80 layers, d=8192, SwiGLU 28672, 64 heads / 8 KV heads, vocabulary 128256, sequence 8192.

    Megatron Bridge's pre-training layout for it (``llama3_70b_pretrain_config``): 4 tensor-parallel ranks with
    sequence parallel x 4 pipeline stages of 5 virtual stages each (interleaved 1F1B, 4 layers a chunk) x 2
    context-parallel ranks -- 32 GPUs for one data-parallel replica -- micro-batch 1, global batch 512; graphstep's
    rules take it as written (context parallel over virtual stages with tensor parallel: R28, R30). Bridge also
    sets the distributed optimizer, overlapped gradient reduction and a bf16 pipeline dtype, which this recipe
    leaves to overrides: ``graphstep config validate --recipe llama3_70b`` says what the layout needs per GPU
    without them (more than an 80 GiB GPU holds), the smallest layout that fits, and that with
    ``ddp.use_distributed_optimizer=true`` (the optimizer state sharded over the 2 context-parallel ranks) the
    same layout fits on the same 32 GPUs.
    """
    cfg = _llama3(graph_ready(Config()), 80, 8192, 28672, 64, 8, False)
    m = cfg.model
    m.tensor_model_parallel_size, m.sequence_parallel = 4, True
    m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size = 4, 5
    m.context_parallel_size = 2
    return cfg


def dense_1b_bench() -> Config:
    """Llama 3.2 1B at sequence 2048, micro-batch 2, mock data: a compute-bound shape for ``graphstep bench``."""
    cfg = llama32_1b()
    cfg.model.seq_length = 2048
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 2, 2
    cfg.train.train_iters = 50
    return cfg


def llama3_8b_stack_bench() -> Config:
    """Llama 3 8B's real shapes in a 4-layer stack for ``graphstep bench``: d=4096, SwiGLU 14336, 32 heads /
    8 KV heads, vocabulary 128256, sequence 8192, micro-batch 1, bf16 parameters, mock data.

    The layers are the 8B model's, the depth is not: one H100 holds the stack with its fp32 master weights
    and Adam moments (about 1.9B parameters, the 128k-vocabulary embedding and output layer included), and
    the matmuls run at the sizes FP8 is meant for (the ``fp8_`` bench rows against the same rows in bf16).
    """
    cfg = llama3_8b()
    cfg.model.num_layers = 4
    cfg.model.params_dtype = "bf16"
    cfg.train.micro_batch_size = cfg.train.global_batch_size = 1
    cfg.train.train_iters = 50
    return cfg


def llama3_8b_share_bench() -> Config:
    """:func:`llama3_8b_stack_bench` with the output layer at its share of the 32-layer model: vocabulary 16384
    (128256 x 4 / 32, rounded up to a multiple of 128), so that the bf16 output layer holds 7% of the stack's
    linear FLOPs, as in Llama 3 8B, instead of 38%. The ``fp8_`` rows' speed-up on it is what FP8 gives the
    model's layers; the 128k-vocabulary stack's is diluted by an output layer 5x heavier than the model's."""
    cfg = llama3_8b_stack_bench()
    cfg.model.vocab_size = 16384
    return cfg


def llama3_8b_accum_bench() -> Config:
    """:func:`llama3_8b_share_bench` with 4 micro-batches per step (global batch 4, micro-batch 1): the gradients
    accumulated over the micro-batches and one optimizer step, as Megatron Bridge's Llama 3 8B pre-training recipe
    runs (a global batch of 512 in micro-batches of 1, so every rank accumulates many). The share bench's single
    micro-batch pays the whole optimizer step per sequence; here it is spread over four."""
    cfg = llama3_8b_share_bench()
    cfg.train.global_batch_size = 4
    return cfg
