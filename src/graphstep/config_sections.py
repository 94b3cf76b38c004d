"""The sections of the configuration tree: one keyword-only dataclass per section.

Field names, values and defaults follow Megatron Bridge / Megatron Core (see
config.py for how overrides are parsed and type-checked, and
graphstep.validation for the rules). Every field carries its help text in
``metadata["help"]``; :func:`unsupported` declares a Megatron field that
graphstep does not implement (rule R18 if changed). Import these names from
``graphstep.config``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration key or value that graphstep cannot use."""


def opt(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field with its help text (mutable defaults are copied)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


def unsupported(default: Any, help: str) -> Any:
    """A Megatron field that graphstep does not implement (rule R18 if changed)."""
    return opt(default, help + " Not implemented by graphstep: only the default is accepted.", unsupported=True)


@dataclass(kw_only=True)
class ModelConfig:
    """The model shape, precision, recompute and CUDA-graph settings."""

    # --- architecture ------------------------------------------------------
    num_layers: int = opt(2, "Number of decoder layers.")
    hidden_size: int = opt(64, "Model width.")
    ffn_hidden_size: int = opt(176, "Width of the dense SwiGLU MLP.")
    num_attention_heads: int = opt(4, "Query heads.")
    num_query_groups: int | None = opt(None, "Key/value heads for grouped-query attention; null = num_attention_heads.")
    kv_channels: int | None = opt(None, "Width of one attention head; null = hidden_size / num_attention_heads.")
    seq_length: int = opt(128, "Sequence length of every training sample (static for graphs).")
    vocab_size: int = opt(256, "Vocabulary size.")
    share_embeddings_and_output_weights: bool = opt(True, "Tie the input embedding and the output layer.")
    normalization: str = opt("RMSNorm", "Normalization layer; graphstep implements RMSNorm.")
    layernorm_epsilon: float = opt(1e-5, "Epsilon of RMSNorm.")
    position_embedding_type: str = opt("rope", "Position embedding; graphstep implements rope.")
    rotary_base: int = opt(10000, "RoPE base.")
    qk_layernorm: bool = opt(False, "RMSNorm on queries and keys per head (Qwen3).")
    add_qkv_bias: bool = opt(False, "Bias on the query/key/value projection (Qwen2).")
    attention_dropout: float = opt(0.0, "Dropout on attention probabilities.")
    hidden_dropout: float = opt(0.0, "Dropout on the attention and MLP outputs before the residual add.")
    init_method_std: float = opt(0.02, "Standard deviation of the normal weight initialisation.")
    params_dtype: str = opt("auto", "Parameter dtype: auto (bf16 on a GPU, fp32 on the CPU), bf16 or fp32.")
    hf_path: str | None = opt(
        None, "Initialise from a local Hugging Face directory (config.json + safetensors; llama, qwen2, qwen3, "
        "qwen3_moe): its config.json sets the model shape, its weights the initial parameters."
    )

    # --- mixture of experts ------------------------------------------------
    num_moe_experts: int | None = opt(None, "Experts per MoE layer; null = dense model.")
    moe_layer_freq: int = opt(1, "Every n-th layer is MoE (1 = all layers).")
    moe_ffn_hidden_size: int | None = opt(None, "Width of one expert; null = ffn_hidden_size.")
    moe_router_topk: int = opt(2, "Experts per token.")
    moe_router_score_function: str = opt("softmax", "Router score function: softmax or sigmoid.")
    moe_router_pre_softmax: bool = opt(
        False, "softmax: the softmax over all experts comes before the top-k, and the k weights are not "
        "renormalised (Hugging Face norm_topk_prob=false); false = softmax over the k chosen logits."
    )
    moe_router_load_balancing_type: str = opt("aux_loss", "Load balancing: aux_loss or none.")
    moe_aux_loss_coeff: float = opt(0.0, "Coefficient of the load-balancing loss.")
    moe_z_loss_coeff: float | None = opt(None, "Coefficient of the router z-loss; null = off.")
    moe_router_enable_expert_bias: bool = opt(False, "Aux-loss-free balancing with a per-expert bias.")
    moe_router_bias_update_rate: float = opt(1e-3, "Update rate of the expert bias.")
    moe_shared_expert_intermediate_size: int | None = opt(None, "Width of the shared expert; null = none.")
    moe_expert_capacity_factor: float | None = opt(None, "Capacity factor; null = dropless.")
    moe_pad_expert_input_to_capacity: bool = opt(False, "Pad every expert's input to its capacity (drop-and-pad).")
    moe_token_dispatcher_type: str = opt(
        "allgather", "Token dispatcher: allgather (sync-free, capturable whole) or alltoall (Megatron's all-to-all: "
        "reads split sizes on the host, graph [attn,moe_router,moe_preprocess]; R11) across expert-parallel ranks, "
        "the same local dispatch on one; flex is not implemented (rule R23)."
    )
    moe_sync_free: bool = opt(True, "Dropless MoE keeps group sizes on the device (no host sync; capturable).")

    # --- hybrid (Mamba) ----------------------------------------------------
    hybrid_override_pattern: str | None = opt(
        None, "Layer pattern for hybrid models: M = Mamba, * = attention, - = MLP, E = MoE (Nemotron-H)."
    )
    mamba_state_dim: int = opt(16, "SSM state size.")
    mamba_head_dim: int = opt(16, "Mamba head width.")
    mamba_num_groups: int = opt(1, "Groups of B/C projections.")
    mamba_chunk_size: int = opt(32, "Chunk length of the SSD scan.")

    # --- recompute and offloading -----------------------------------------
    recompute_granularity: str | None = opt(None, "Activation recompute: null, full or selective.")
    recompute_modules: list[str] = opt(
        ["core_attn"], "Modules recomputed with selective recompute: core_attn, mlp, moe; null = [core_attn] "
        "(Megatron Core's default).", null_means=["core_attn"])
    cpu_offloading: bool = opt(False, "Offload activations/weights to the CPU.")

    # --- CUDA graphs ---------------------------------------------------------
    cuda_graph_impl: str = opt("none", "Capture mechanism: none, local, transformer_engine or full_iteration.")
    cuda_graph_scope: list[str] | str | None = opt(
        None,
        "Legacy coverage: list of full_iteration, attn, mlp, moe, moe_router, moe_preprocess, mamba; "
        "a comma string; or full. Migrated into cuda_graph_impl/cuda_graph_modules.",
    )
    cuda_graph_modules: list[str] | str = opt(
        [], "Per-layer coverage: attn, mlp, moe, moe_router, moe_preprocess, mamba; [] or full = whole layer."
    )
    cuda_graph_warmup_steps: int = opt(3, "Eager iterations before capture, counted from the start or resume iteration.")
    cuda_graph_use_single_mempool: bool = opt(True, "Full-iteration, evaluation and optimizer graphs share one pool.")
    cuda_graph_retain_backward_graph: bool = opt(False, "Capture backward with retain_graph=True.")
    cuda_graph_backend: str = opt(
        "auto", "auto (CUDA graphs on a GPU, the CPU replay backend elsewhere), cuda, or replay (a dry run on any device)."
    )
    cuda_graph_on_failure: str = opt("raise", "When a capture fails: raise, or eager (continue without graphs).")
    use_te_rng_tracker: bool = opt(False, "Graph-safe RNG tracker (required with CUDA graphs).")
    enable_cuda_graph: bool = opt(False, "Deprecated: = cuda_graph_impl=local.")
    external_cuda_graph: bool = opt(False, "Deprecated: = cuda_graph_impl=transformer_engine.")

    # --- parallel layouts (training/parallel.py, training/pipeline.py) and what graphstep does not implement
    tensor_model_parallel_size: int = opt(
        1, "Tensor-parallel ranks: DTensor colwise/rowwise sharding of attention, MLP and the vocabulary over the "
        "tp dimension of the device mesh; world size = pipeline x data-parallel x tensor-parallel ranks (rules R25-R29)."
    )
    pipeline_model_parallel_size: int = opt(
        1, "Pipeline stages: the decoder layers split over consecutive ranks (torch.distributed.pipelining), the "
        "embedding on the first stage, the output layer and loss on the last; world size = pipeline x data-parallel "
        "x tensor-parallel ranks (rules R28-R29)."
    )
    virtual_pipeline_model_parallel_size: int | None = opt(
        None, "Model chunks per pipeline rank (interleaved 1F1B); only null or 1 is accepted (R28)."
    )
    pipeline_dtype: str | None = opt(
        None, "dtype of the activations sent between stages; null or the parameter dtype (stages send what "
        "they compute, R28)."
    )
    num_layers_in_first_pipeline_stage: int | None = opt(
        None, "Decoder layers on the first stage; null = an even split (R28)."
    )
    num_layers_in_last_pipeline_stage: int | None = opt(
        None, "Decoder layers on the last stage; null = an even split (R28)."
    )
    pipeline_schedule: str = opt(
        "1f1b", "Pipeline schedule (graphstep): 1f1b (torch's Schedule1F1B, Megatron's non-interleaved "
        "schedule; needs micro-batches >= stages) or gpipe (ScheduleGPipe)."
    )
    context_parallel_size: int = opt(1, "Context parallelism; only 1 is accepted (R30).")
    expert_model_parallel_size: int = opt(
        1, "Expert-parallel ranks: each data-parallel rank holds num_moe_experts / this many experts, and MoE "
        "blocks exchange tokens as model.moe_token_dispatcher_type says (dropless; R31)."
    )
    expert_tensor_parallel_size: int | None = opt(None, "Tensor parallel inside experts; only null or 1 (R31).")
    sequence_parallel: bool = opt(
        False, "With tensor parallelism: norms, dropout and residuals run on sequence shards (DTensor "
        "SequenceParallel); needs tensor_model_parallel_size > 1 (R25)."
    )
    fp8: str | None = unsupported(None, "FP8 training.")
    variable_seq_lengths: bool = opt(False, "Samples of different lengths (needs data.seq_length_buckets with graphs).")


@dataclass(kw_only=True)
class TrainConfig:
    """Iterations, batch sizes, evaluation and run-time behaviour."""

    train_iters: int = opt(300, "Training iterations.")
    micro_batch_size: int = opt(4, "Samples per micro-batch per data-parallel rank (static for graphs).")
    global_batch_size: int = opt(8, "Samples per iteration over all ranks; = micro_batch_size x micro-batches x ranks.")
    eval_interval: int | None = opt(None, "Evaluate every N iterations; null = only at the end when eval_iters > 0.")
    eval_iters: int = opt(0, "Micro-batches per evaluation.")
    check_for_nan_on_device: bool = opt(
        True, "Graph-safe NaN/Inf detection: a device-side flag of the loss and gradient norm, read on logging steps."
    )
    skip_step_on_nan: bool = opt(False, "Skip the optimizer update in-graph when the loss or gradients are not finite.")
    device: str = opt("auto", "auto (cuda when available, else cpu), cuda, cpu.")
    exit_signal_handler: bool = opt(True, "Stop cleanly after the current step on SIGINT/SIGTERM.")
    manual_gc: bool = unsupported(False, "Manual garbage collection.")


@dataclass(kw_only=True)
class OptimizerConfig:
    """AdamW with fp32 master weights."""

    optimizer: str = opt("adam", "Optimizer: adam (AdamW with decoupled weight decay).")
    lr: float = opt(3e-3, "Peak learning rate.")
    min_lr: float = opt(3e-4, "Learning rate at the end of the decay.")
    weight_decay: float = opt(0.1, "Decoupled weight decay.")
    adam_beta1: float = opt(0.9, "Adam beta1.")
    adam_beta2: float = opt(0.95, "Adam beta2.")
    adam_eps: float = opt(1e-8, "Adam epsilon.")
    clip_grad: float = opt(1.0, "Clip the global gradient norm to this value; 0 = off.")
    optimizer_cuda_graph: bool = opt(False, "Capture clipping, the LR schedule and the optimizer step too.")
    use_distributed_optimizer: bool = opt(
        False, "Megatron keeps this flag in both the optimizer and the ddp section: either turns on "
        "ddp.use_distributed_optimizer (optimizer state sharded with FSDP2)."
    )
    fp16: bool = unsupported(False, "fp16 with loss scaling.")


@dataclass(kw_only=True)
class SchedulerConfig:
    """The learning-rate schedule, computed on the device from the step tensor."""

    lr_warmup_iters: int = opt(20, "Linear warm-up iterations.")
    lr_decay_iters: int | None = opt(None, "Iterations of the decay; null = train.train_iters.")
    lr_decay_style: str = opt("cosine", "Decay after warm-up: cosine, linear or constant.")


@dataclass(kw_only=True)
class DataConfig:
    """Where the training samples come from."""

    dataset: str = opt(
        "corpus", "corpus (embedded Python standard-library source, byte tokens), mock, indexed (Megatron "
        ".bin/.idx at data.data_path) or sft (prompt/response jsonl at data.data_path)."
    )
    data_path: list[str] | str | None = opt(
        None, "indexed: a dataset prefix, a list of prefixes, or a weighted blend '0.7 pathA 0.3 pathB'; "
        "sft: the jsonl file."
    )
    tokenizer: str = opt("byte", "byte, or the path of a Hugging Face tokenizer.json (or the directory holding it).")
    seq_length_buckets: list[int] | None = opt(
        None, "Pad each step to the smallest bucket holding its longest sample (one graph per bucket); "
        "every bucket <= model.seq_length."
    )
    sft_truncate: bool = opt(
        False, "sft: cut examples longer than the padded width instead of stopping with an error naming file:line."
    )
    split: str = opt("98,2,0", "Train/validation/test split of the documents.")
    corpus_max_bytes: int = opt(4_000_000, "Byte cap of the embedded standard-library corpus.")
    packed_sequences: bool = unsupported(False, "Packed sequences with per-document attention masks.")


@dataclass(kw_only=True)
class RNGConfig:
    """Seeds and the RNG tracker."""

    seed: int = opt(1234, "Base seed; ranks derive theirs from it as Megatron does.")
    te_rng_tracker: bool = opt(False, "Graph-safe RNG tracker (kept equal to model.use_te_rng_tracker).")
    data_parallel_random_init: bool = opt(False, "Different initial weights per data-parallel rank.")


@dataclass(kw_only=True)
class DDPConfig:
    """Data-parallel gradient reduction."""

    check_for_nan_in_grad: bool = opt(True, "Host-side NaN check of gradients (syncs the host).")
    grad_reduce_in_fp32: bool = opt(True, "Reduce gradients in fp32 (graphstep's buffers are fp32).")
    bucket_size: int | None = opt(None, "Elements per all-reduce bucket; null = 40M.")
    average_in_collective: bool = opt(False, "Average inside the collective instead of pre-scaling.")
    use_megatron_fsdp: bool = opt(
        False, "Shard parameters, gradients and optimizer state over the data-parallel ranks with torch's FSDP2 "
        "(fully_shard per decoder layer and on the model), as data_parallel_sharding_strategy says."
    )
    data_parallel_sharding_strategy: str = opt(
        "no_shard", "With use_megatron_fsdp: optim_grads_params (ZeRO-3: parameters resharded after forward and "
        "all-gathered again for backward), optim_grads (ZeRO-2: parameters kept from forward to backward), or "
        "no_shard (replicated data parallel); optim (ZeRO-1) is not implemented (R26)."
    )
    use_distributed_optimizer: bool = opt(
        False, "Shard the optimizer state and fp32 main parameters over the data-parallel ranks; graphstep does "
        "this with FSDP2 as use_megatron_fsdp=true with optim_grads (gradients reduce-scattered, parameters "
        "all-gathered before use)."
    )
    overlap_grad_reduce: bool = opt(
        False, "Replicated data parallel: each gradient bucket's all-reduce starts during the last micro-batch's "
        "backward, as soon as the bucket is complete (inside the full-iteration graph too). FSDP2 reduce-scatters "
        "each layer during the backward on its own stream whatever this says."
    )
    overlap_param_gather: bool = opt(
        False, "FSDP2: each decoder layer prefetches the next layer's parameter all-gather explicitly before its "
        "forward (false: FSDP2's implicit prefetch); needs sharded data parallel (R26)."
    )


@dataclass(kw_only=True)
class CompileConfig:
    """torch.compile (Inductor) inside the trainer's graphs (torchtitan's compile section)."""

    enable: bool = opt(False, "Compile the components below with torch.compile; graphs then capture Inductor's kernels.")
    components: list[str] = opt(
        ["model"], "What to compile: model (the whole model with cuda_graph_impl none or full_iteration; the graphed "
        "scope modules with local/transformer_engine). loss is refused: graphstep's models compute the loss inside "
        "their forward, so model already compiles it."
    )
    mode: str = opt(
        "default", "Inductor mode: default or max-autotune-no-cudagraphs; reduce-overhead and max-autotune use "
        "Inductor's own CUDA graphs and need model.cuda_graph_impl=none."
    )


@dataclass(kw_only=True)
class RerunStateMachineConfig:
    """Megatron's host-side loss checks."""

    check_for_nan_in_loss: bool = opt(True, "Host-side NaN check of the loss (syncs the host).")
    check_for_spiky_loss: bool = unsupported(False, "Spiky-loss detection.")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and resuming."""

    save: str | None = opt(None, "Directory to save checkpoints in; null = no saves.")
    load: str | None = opt(None, "Directory to resume from (its latest complete checkpoint).")
    save_interval: int | None = opt(None, "Save every N iterations (and at the end when save is set).")
    finetune: bool = opt(False, "Load weights only; start at iteration 0 with fresh optimizer state.")


@dataclass(kw_only=True)
class LoggerConfig:
    """Logging and metrics."""

    log_interval: int = opt(10, "Iterations between log lines (and reads of graph-owned losses).")
    metrics_path: str | None = opt("runs/metrics.jsonl", "JSONL file with one object per iteration; null = none.")
    progress_bar: bool = opt(True, "Show a progress bar on a terminal.")
    tensorboard_dir: str | None = opt(
        None, "Write TensorBoard event files (and profiler traces) here; null = none. Needs graphstep[tensorboard].")
    tensorboard_log_interval: int = opt(
        1, "Write every N-th iteration's metrics row to TensorBoard/W&B (rows are read on logging steps only).")
    log_timers_to_tensorboard: bool = opt(False, "Also write step time and tokens/s to TensorBoard/W&B.")
    log_memory_to_tensorboard: bool = opt(False, "Also write peak device memory (host RSS on the CPU).")
    wandb_project: str | None = opt(None, "Weights & Biases project; null = no W&B. Needs graphstep[wandb].")
    wandb_exp_name: str | None = opt(None, "Weights & Biases run name.")
    wandb_save_dir: str | None = opt(
        None, "Directory of the W&B run files; offline (WANDB_MODE=offline) unless WANDB_MODE is set.")


@dataclass(kw_only=True)
class ProfilingConfig:
    """PyTorch profiler traces, nsys ranges and CUDA memory snapshots (Megatron Bridge's fields)."""

    use_pytorch_profiler: bool = opt(False, "Trace iterations profile_step_start..profile_step_end (inclusive).")
    use_nsys_profiler: bool = opt(
        False, "cudaProfilerStart/Stop around those iterations, with NVTX ranges (run under nsys --capture-range).")
    profile_step_start: int = opt(10, "First profiled iteration.")
    profile_step_end: int = opt(12, "Last profiled iteration.")
    profile_ranks: list[int] = opt([0], "Global ranks that profile.")
    record_shapes: bool = opt(False, "Record operator input shapes in the PyTorch profiler trace.")
    record_memory_history: bool = opt(False, "Record CUDA allocator history over the profiled iterations.")
    memory_snapshot_path: str = opt("snapshot.pickle", "Where the memory history snapshot is written.")


@dataclass(kw_only=True)
class Config:
    """The whole configuration of a graphstep run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rng: RNGConfig = field(default_factory=RNGConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    rerun_state_machine: RerunStateMachineConfig = field(default_factory=RerunStateMachineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)
