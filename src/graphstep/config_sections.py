"""The sections of the configuration tree: one keyword-only dataclass per section.

Field names, values and defaults follow Megatron Bridge / Megatron Core (see
config.py for how overrides are parsed and type-checked, and
graphstep.validation for the rules). Every field carries its help text in
``metadata["help"]``; :func:`unsupported` declares a Megatron field that
graphstep does not implement (rule R18 if changed), :func:`refused` one whose
other values a numbered rule refuses, :func:`noop` a kernel hint accepted and
named once in the log. The sections only Megatron Bridge has (tokenizer,
comm_overlap, dist, mixed_precision, peft) are in config_bridge_sections.py;
the whole tree, :class:`graphstep.config.Config`, in config.py. Import these
names from ``graphstep.config``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError  # noqa: F401  (graphstep.config exports it from here)


def token_dispatcher(value: Any) -> Any:
    """The dispatcher graphstep runs for ``model.moe_token_dispatcher_type = value``: ``flex`` runs as
    ``alltoall``. Megatron's flex dispatcher sends each token to the ranks holding its experts and combines the
    results back, as its alltoall dispatcher does, through DeepEP or HybridEP kernels
    (``moe_flex_dispatcher_backend``); graphstep makes that exchange with torch's all-to-all."""
    return "alltoall" if value == "flex" else value


def opt(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field with its help text (mutable defaults are copied)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


def unsupported(default: Any, help: str) -> Any:
    """A Megatron field that graphstep does not implement (rule R18 if changed)."""
    return opt(default, help + " Not implemented by graphstep: only the default is accepted.", unsupported=True)


def noop(default: Any, help: str, instead: str) -> Any:
    """A Megatron/Transformer Engine performance hint with no effect on the numbers: accepted, logged once.

    ``instead`` says what graphstep does in its place (the log line and docs/config.md quote it).
    """
    return opt(default, help, noop=instead)


def refused(default: Any, help: str, rule: str, allowed: tuple[Any, ...] | None = None) -> Any:
    """A Megatron field whose other values ask for a feature graphstep lacks: rule ``rule`` refuses them.

    ``allowed`` lists the accepted values (default: only ``default``); strings compare case-insensitively.
    """
    return opt(default, help, rule=rule, allowed=allowed if allowed is not None else (default,))


# dtype spellings Bridge's recipes and overrides use for fp32 (torch.float32 on the command line too)
FP32 = (None, "fp32", "float32", "torch.float32")


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
    rotary_base: int | float = opt(10000, "RoPE base (an integer, or a float as Megatron Bridge writes it).")
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
        "the same local dispatch on one; flex (Megatron's DeepEP/HybridEP dispatcher) runs as alltoall (rule R23)."
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
    recompute_granularity: str | None = opt(
        None, "Activation recompute: null, full (whole layers, see recompute_method) or selective (recompute_modules).")
    recompute_modules: list[str] = opt(
        ["core_attn"], "Modules recomputed with selective recompute: core_attn, mlp, moe; null = [core_attn] "
        "(Megatron Core's default).", null_means=["core_attn"])
    cpu_offloading: bool = refused(False, "Offload activations/weights to the CPU.", "R36")

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

    # --- parallel layouts (parallel/) and what graphstep does not implement
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
        None, "Model chunks (virtual stages) per pipeline rank: rank r holds chunks r, r+pp, r+2pp, ... and runs "
        "an interleaved schedule (pipeline_schedule); null or 1 = one stage per rank (R28)."
    )
    pipeline_dtype: str | None = opt(
        None, "dtype of the activations sent between stages; null or the parameter dtype (stages send what "
        "they compute, R28)."
    )
    num_layers_in_first_pipeline_stage: int | None = opt(
        None, "Decoder layers on the first pipeline rank (split evenly over its virtual stages); null = an even "
        "split (R28)."
    )
    num_layers_in_last_pipeline_stage: int | None = opt(
        None, "Decoder layers on the last pipeline rank (split evenly over its virtual stages); null = an even "
        "split (R28)."
    )
    pipeline_schedule: str = opt(
        "1f1b", "Pipeline schedule (graphstep): 1f1b (torch's Schedule1F1B, Megatron's non-interleaved "
        "schedule; needs micro-batches >= stages; with virtual stages, ScheduleInterleaved1F1B), gpipe "
        "(ScheduleGPipe), interleaved_1f1b (ScheduleInterleaved1F1B) or interleaved_zero_bubble "
        "(ScheduleInterleavedZeroBubble); the interleaved ones need virtual stages and micro-batches per step a "
        "multiple of the stages (R28)."
    )
    context_parallel_size: int = opt(
        1, "Context-parallel ranks: each sequence is cut in 2 x this many chunks, each rank holds two (Megatron's "
        "load balancing) and attention all-gathers the keys and values (model.cp_comm_type; R30)."
    )
    expert_model_parallel_size: int = opt(
        1, "Expert-parallel ranks: each data-parallel rank holds num_moe_experts / this many experts, and MoE "
        "blocks exchange tokens as model.moe_token_dispatcher_type says (dropless; R31)."
    )
    expert_tensor_parallel_size: int | None = opt(
        None, "Tensor parallel inside the experts: 1 (each expert whole on a tensor-parallel rank, which runs the MoE "
        "blocks on its share of the tokens) or tensor_model_parallel_size (each expert split over the "
        "tensor-parallel ranks, which exchange their tokens); null means tensor_model_parallel_size, as in Megatron "
        "(R31).")
    sequence_parallel: bool = opt(
        False, "With tensor parallelism: norms, dropout and residuals run on sequence shards (DTensor "
        "SequenceParallel); set to false with tensor_model_parallel_size=1, as Megatron Bridge does."
    )
    fp8: str | None = opt(None, "FP8 format as Megatron Core's model config spells it (e4m3, hybrid): the same as "
                          "mixed_precision.fp8, which it sets when that is null.")
    variable_seq_lengths: bool = opt(False, "Samples of different lengths (needs data.seq_length_buckets with graphs).")

    # --- Megatron Bridge fields: vocabulary padding (acts), then what graphstep refuses and the kernel hints
    should_pad_vocab: bool = opt(
        False, "Pad model.vocab_size up to a multiple of make_vocab_size_divisible_by x tensor_model_parallel_size "
        "(Bridge: the tokenizer's vocabulary padded for the kernels; the padded rows are trained logits).")
    make_vocab_size_divisible_by: int = opt(128, "With should_pad_vocab: the multiple model.vocab_size is padded to.")
    recompute_method: str | None = opt(
        None, "With recompute_granularity=full: uniform (the layers in runs of recompute_num_layers, each run "
        "recomputed from its input) or block (the first recompute_num_layers layers of each stage, one by one); "
        "null = uniform.")
    recompute_num_layers: int | None = opt(None, "With recompute_granularity=full: layers per run (uniform) or "
                                           "layers recomputed (block); null = 1 (uniform) or every layer (block).")
    fine_grained_activation_offloading: bool = refused(False, "Offload chosen activations to the host.", "R36")
    offload_modules: list[str] | None = refused(
        None, "Modules whose activations fine-grained offloading moves to the host.", "R36", allowed=(None, []))
    cpu_offloading_num_layers: int = refused(0, "Layers whose activations are offloaded to the CPU.", "R36")
    cpu_offloading_weights: bool = refused(False, "Offload weights to the CPU too.", "R36")
    activation_offload_fraction: float | None = refused(None, "Fraction of activations offloaded.", "R36")
    delay_offload_until_cuda_graph: bool = noop(
        False, "Offloading: delay offloads until the CUDA graph.", "no offloading (R36 refuses it), so nothing to delay")
    min_offloaded_tensor_size: int | None = noop(
        None, "Offloading: smallest tensor offloaded.", "no offloading (R36 refuses it)")
    fine_grained_offloading_max_inflight_offloads: int | None = noop(
        None, "Offloading: offloads in flight.", "no offloading (R36 refuses it)")
    mtp_num_layers: int | None = refused(None, "Multi-token prediction layers.", "R37")
    mtp_hybrid_override_pattern: str | None = refused(None, "Layer pattern of the MTP block.", "R37")
    mtp_loss_scaling_factor: float | None = noop(
        None, "Weight of the multi-token-prediction loss.", "no MTP layers (R37 refuses mtp_num_layers), so no MTP loss")
    mtp_use_repeated_layer: bool = noop(False, "MTP: one layer repeated.", "no MTP layers (R37)")
    keep_mtp_spec_in_bf16: bool = noop(False, "MTP: keep the MTP block in bf16 under FP8.", "no MTP layers (R37)")
    mtp_eval_in_bf16: bool = noop(False, "MTP: evaluate in bf16.", "no MTP layers (R37)")
    fp8_param: bool | None = refused(None, "FP8 parameters.", "R32", allowed=(None, False))
    fp8_param_gather: bool = opt(False, "All-gather parameters in FP8: as mixed_precision.fp8_param_gather.")
    fp8_output_proj: bool = refused(False, "FP8 output projection.", "R32")
    quant_recipe: str | None = refused(None, "A quantisation recipe (FP8/FP4 per layer).", "R32")
    tp_only_amax_red: bool = noop(False, "FP8: reduce amax over tensor-parallel ranks only.", "no FP8 (R32)")
    moe_router_padding_for_fp8: bool = refused(False, "Pad each expert's tokens to FP8's alignment.", "R32")
    moe_router_padding_for_quantization: bool = refused(False, "Pad each expert's tokens to FP8/FP4 alignment.", "R32")
    moe_router_force_load_balancing: bool = unsupported(
        False, "Benchmarking: route tokens at random, evenly over the experts (changes the numbers).")
    moe_expert_rank_capacity_factor: float | None = unsupported(None, "Capacity factor per expert-parallel rank.")
    moe_mlp_glu_interleave_size: int | None = unsupported(None, "Interleaved GLU weight layout of the experts.")
    moe_paged_stash: bool = unsupported(False, "Paged stash of MoE activations.")
    moe_paged_stash_buffer_size_factor_cpu: float | None = noop(
        None, "Paged stash: host buffer size factor.", "nothing: read only with moe_paged_stash, which R18 refuses")
    moe_paged_stash_buffer_size_factor_cuda: float | None = noop(
        None, "Paged stash: device buffer size factor.", "nothing: read only with moe_paged_stash (R18)")
    moe_paged_stash_page_size: int | None = noop(None, "Paged stash: page size.",
                                                 "nothing: read only with moe_paged_stash (R18)")
    moe_router_dtype: str | None = refused(
        None, "dtype of the router logits; graphstep's router computes them in fp32 (null and fp32 accepted).",
        "R18", allowed=FP32)
    pipeline_model_parallel_layout: str | list[Any] | None = opt(
        None, "Megatron's explicit layer layout over the pipeline's pp x virtual stages, in data-flow order: a "
        "string such as \"Et*3|t*3|t*3|t*3L\" (E embedding, t decoder layer, L loss and output layer, | stage "
        "boundary, *n repeat, (...)*n group repeat) or a list of lists of embedding/decoder/loss; stage i runs on "
        "pipeline rank i mod pp. Sets the virtual stages; not with num_layers_in_first/last_pipeline_stage or "
        "account_for_*_in_pipeline_split (R28).")
    account_for_embedding_in_pipeline_split: bool = opt(
        False, "Count the embedding as one layer of the even split: the first stage holds one decoder layer fewer "
        "(R28).")
    account_for_loss_in_pipeline_split: bool = opt(
        False, "Count the loss (final norm, output layer) as one layer of the even split: the last stage holds one "
        "decoder layer fewer (R28).")
    calculate_per_token_loss: bool = unsupported(False, "Average the loss over all tokens of the step (not per micro-batch).")
    deterministic_mode: bool = unsupported(False, "Deterministic kernels throughout.")
    yarn_original_max_position_embeddings: int | None = unsupported(None, "YaRN RoPE scaling (graphstep: plain RoPE).")
    yarn_rotary_scaling_factor: float | None = unsupported(None, "YaRN RoPE scaling factor.")
    rotary_scaling_factor: float | None = unsupported(None, "Llama 3.1 RoPE frequency scaling.")
    yarn_beta_fast: float | None = noop(None, "YaRN: fast correction bound.", "nothing: read only with "
                                        "position_embedding_type=yarn, which R40 refuses")
    yarn_beta_slow: float | None = noop(None, "YaRN: slow correction bound.", "nothing: read only with YaRN (R40)")
    yarn_mscale: float | None = noop(None, "YaRN: attention scale.", "nothing: read only with YaRN (R40)")
    yarn_mscale_all_dim: float | None = noop(None, "YaRN: attention scale of all dimensions.",
                                             "nothing: read only with YaRN (R40)")
    yarn_correction_range_round_to_int: bool | None = noop(None, "YaRN: round the correction range.",
                                                           "nothing: read only with YaRN (R40)")
    multi_latent_attention: bool = refused(
        False, "DeepSeek's multi-latent attention (low-rank compressed keys and values).", "R40")
    q_lora_rank: int | None = noop(None, "MLA: rank of the query compression.",
                                   "nothing: read only with multi_latent_attention, which R40 refuses")
    kv_lora_rank: int | None = noop(None, "MLA: rank of the key/value compression.", "nothing: read only with MLA (R40)")
    qk_head_dim: int | None = noop(None, "MLA: query/key head width without RoPE.", "nothing: read only with MLA (R40)")
    qk_pos_emb_head_dim: int | None = noop(None, "MLA: query/key RoPE head width.", "nothing: read only with MLA (R40)")
    v_head_dim: int | None = noop(None, "MLA: value head width.", "nothing: read only with MLA (R40)")
    kd_config: dict[str, Any] | None = unsupported(None, "Bridge's knowledge distillation: the loss settings.")
    teacher: dict[str, Any] | None = unsupported(None, "Bridge's knowledge distillation: the teacher model.")
    hf_model_id: str | None = noop(
        None, "The Hugging Face model a Bridge provider was converted from (metadata).",
        "nothing: the model shape is the recipe's and the overrides'; model.hf_path loads a local checkpoint")
    hf_model_revision: str | None = noop(None, "Revision of hf_model_id (metadata).", "nothing (metadata)")
    init_model_with_meta_device: bool = noop(
        False, "Build the model on the meta device before initialising it.",
        "builds the model on its device and initialises it there (the same initial distribution)")
    # kernel and scheduling hints of Transformer Engine / Megatron Core: the same numbers without them
    transformer_impl: str = noop(
        "transformer_engine", "Layer implementation: transformer_engine or local (Megatron's kernels).",
        "its own PyTorch layers (SDPA attention, SwiGLU MLP, RMSNorm) whatever this says")
    attention_backend: str | None = noop(
        None, "Transformer Engine attention backend: flash, fused, unfused, local or auto.",
        "torch's scaled_dot_product_attention, which picks its own kernel")
    apply_rope_fusion: bool = noop(False, "Fused RoPE kernel.", "applies RoPE with plain tensor ops (captured in the graphs)")
    fused_single_qkv_rope: bool = noop(False, "RoPE fused into one QKV kernel.", "plain RoPE (as apply_rope_fusion)")
    bias_activation_fusion: bool = noop(False, "Fused bias + activation kernel.", "SwiGLU with plain ops (no biases)")
    cross_entropy_loss_fusion: bool = noop(False, "Fused cross-entropy kernel.", "torch's cross_entropy in fp32")
    cross_entropy_fusion_impl: str = noop(
        "native", "Fused cross-entropy implementation: native or te.", "torch's cross_entropy in fp32")
    gradient_accumulation_fusion: bool = noop(
        False, "Accumulate weight gradients into fp32 main_grad inside the GEMM.",
        "accumulates into its fp32 gradient buffers after each backward (the same sums)")
    masked_softmax_fusion: bool = noop(True, "Fused masked softmax.", "SDPA's causal attention")
    persist_layer_norm: bool = noop(False, "Persistent layer-norm kernel.", "RMSNorm with torch's kernels")
    use_fused_weighted_squared_relu: bool = noop(False, "Fused weighted squared-ReLU kernel.", "plain ops")
    use_transformer_engine_op_fuser: bool = noop(False, "Transformer Engine's operation fuser.", "plain ops")
    disable_parameter_transpose_cache: bool = noop(
        False, "Transformer Engine: do not cache transposed weights.", "no transpose cache (torch's GEMMs)")
    moe_grouped_gemm: bool = noop(False, "Experts as one grouped GEMM.", "its own expert kernels (models/moe.py)")
    moe_permute_fusion: bool = noop(False, "Fused token permutation.", "permutes with plain indexing ops")
    moe_router_fusion: bool = noop(False, "Fused router top-k and scores.", "the router with plain ops, in fp32")
    moe_shared_expert_overlap: bool = noop(
        False, "Overlap the shared expert with token dispatch.", "runs the shared expert after the dispatch")
    moe_a2a_overlap: bool = noop(False, "Overlap MoE all-to-all with computation (1F1B).", "no overlap")
    overlap_dispatch_backward_with_experts_wgrad: bool = noop(False, "Overlap dispatch backward with wgrad.", "no overlap")
    high_priority_a2a_comm_stream: bool = noop(False, "High-priority stream for MoE all-to-all.", "torch's streams")
    moe_flex_dispatcher_backend: str | None = noop(
        None, "Backend of the flex dispatcher: deepep or hybridep.",
        "nothing: flex runs as alltoall, over torch's all-to-all (R23)")
    moe_flex_dispatcher_num_sms: int | None = noop(None, "SMs of the flex dispatcher.", "nothing (flex runs as alltoall: R23)")
    moe_hybridep_num_sms: int | None = noop(None, "SMs of HybridEP.", "nothing (flex runs as alltoall: R23)")
    moe_hybridep_num_sms_preprocessing: int | None = noop(None, "SMs of HybridEP preprocessing.", "nothing (flex runs as alltoall: R23)")
    moe_hybridep_pad_uneven_dispatch_inputs: bool = noop(False, "HybridEP padding.", "nothing (flex runs as alltoall: R23)")
    moe_permute_fusion_into_hybridep: bool = noop(False, "Permutation fused into HybridEP.", "nothing (flex runs as alltoall: R23)")
    moe_deepep_num_sms: int | None = noop(None, "SMs of DeepEP.", "nothing (flex runs as alltoall: R23)")
    moe_pad_experts_for_cuda_graph_inference: bool = noop(
        False, "Inference: pad experts for CUDA graphs.", "nothing: graphstep trains (its MoE graphs are sync-free)")
    overlap_p2p_comm: bool = noop(False, "Overlap pipeline send/receive with computation.", "torch's pipeline schedule")
    batch_p2p_comm: bool = noop(True, "Batch pipeline send/receive.", "torch's pipeline schedule")
    cp_comm_type: str | list[str] | None = opt(
        None, "Context-parallel communication (Megatron Core's names, one or one per layer): all_gather (keys and "
        "values all-gathered inside attention; null means it too), a2a (Ulysses: heads exchanged for sequence by "
        "all-to-all, the same type for every layer); p2p and a2a+p2p are refused (R30).")


def expert_tensor_parallel(m: ModelConfig) -> int:
    """The tensor-parallel ranks each expert is split over: ``expert_tensor_parallel_size``, null meaning
    ``tensor_model_parallel_size`` (Megatron Core's ``ModelParallelConfig.__post_init__``)."""
    etp = m.expert_tensor_parallel_size
    return m.tensor_model_parallel_size if etp is None else etp


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
    manual_gc: bool = opt(
        False, "Manual garbage collection (Bridge's policy): Python's automatic collector is off for the run and "
        "collects only every manual_gc_interval iterations, outside every graph (and around evaluations with "
        "manual_gc_eval), so no collection lands inside a capture or a timed step.")
    manual_gc_interval: int = opt(0, "With manual_gc: collect every N iterations; 0 = only at the start (>= 0, R38).")
    manual_gc_eval: bool | int = opt(
        True, "With manual_gc: collect before each evaluation and collect its young objects after it (any true value).")
    empty_unused_memory_level: int = noop(
        0, "Empty torch's CUDA cache every iteration (1, 2).",
        "never empties the cache: the graphs' memory pools stay allocated for their replays")
    check_optimizer_step_success: bool = noop(
        True, "Check that the optimizer step succeeded (fp16 loss scaling).", "nothing: no loss scaling (bf16/fp32)")
    skip_sync_grad_norm_across_mp: bool = unsupported(
        False, "Skip the gradient-norm reduction over model-parallel ranks (changes clipping).")
    exit_duration_in_mins: int | None = unsupported(None, "Stop after this many minutes.")
    exit_interval: int | None = unsupported(None, "Stop after an iteration that is a multiple of this.")
    rampup_batch_size: list[int] | None = unsupported(None, "Batch-size ramp-up.")


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
    bf16: bool = noop(False, "Megatron's optimizer copy of the bf16 flag (Bridge sets it from mixed_precision).",
                      "keeps fp32 master weights of its parameters, whose dtype model.params_dtype (or "
                      "mixed_precision) chooses")
    finetune_lr: float | None = unsupported(None, "A learning rate for fine-tuning runs (use optimizer.lr).")
    use_precision_aware_optimizer: bool = noop(
        False, "Bridge's precision-aware optimizer: the dtypes below choose the optimizer's precisions.",
        "keeps master weights, main gradients and both Adam moments in fp32 either way (a dtype below other than "
        "fp32 is R34), so both values train the same")
    main_params_dtype: str | None = refused(None, "dtype of the master weights (fp32).", "R34", allowed=FP32)
    main_grads_dtype: str | None = refused(None, "dtype of the main gradients (fp32).", "R34", allowed=FP32)
    exp_avg_dtype: str | None = refused(None, "dtype of Adam's first moment (fp32).", "R34", allowed=FP32)
    exp_avg_sq_dtype: str | None = refused(None, "dtype of Adam's second moment (fp32).", "R34", allowed=FP32)
    optimizer_cpu_offload: bool = refused(False, "Run the optimizer on the host.", "R36")
    offload_optimizer_states: bool = refused(False, "Keep optimizer states on the host.", "R36")
    optimizer_offload_fraction: float = noop(1.0, "Fraction of the optimizer offloaded.", "no offloading (R36)")
    overlap_cpu_optimizer_d2h_h2d: bool = noop(False, "Overlap host optimizer copies.", "no offloading (R36)")
    overlap_param_gather: bool = noop(
        False, "Megatron's optimizer copy of ddp.overlap_param_gather.", "reads ddp.overlap_param_gather")
    overlap_param_gather_with_optimizer_step: bool = noop(
        False, "Overlap the parameter all-gather with the optimizer step.", "gathers after the step (FSDP2)")
    apply_wd_to_qk_layernorm: bool = unsupported(False, "Weight decay on the q/k layer-norm weights.")
    reuse_grad_buf_for_mxfp8_param_ag: bool = refused(False, "MXFP8 parameter all-gather.", "R32")


@dataclass(kw_only=True)
class SchedulerConfig:
    """The learning-rate schedule, computed on the device from the step tensor."""

    lr_warmup_iters: int = opt(20, "Linear warm-up iterations.")
    lr_decay_iters: int | None = opt(None, "Iterations of the decay; null = train.train_iters.")
    lr_decay_style: str = opt("cosine", "Decay after warm-up: cosine, linear or constant.")
    lr_warmup_init: float = refused(
        0.0, "Learning rate the warm-up starts from; graphstep's warm-up starts at 0.", "R18")
    start_weight_decay: float | None = opt(
        None, "Weight decay at the start (Megatron's weight-decay schedule); null or optimizer.weight_decay (R18).")
    end_weight_decay: float | None = opt(
        None, "Weight decay at the end; null or optimizer.weight_decay: graphstep's weight decay is constant (R18).")
    weight_decay_incr_style: str = refused("constant", "Weight-decay schedule: constant.", "R18")
    lr_wsd_decay_style: str = noop("exponential", "Decay shape of the warmup-stable-decay schedule.",
                                   "nothing: read only with lr_decay_style=WSD, which R40 refuses")
    lr_wsd_decay_iters: int | None = noop(None, "Decay iterations of the warmup-stable-decay schedule.",
                                          "nothing: read only with lr_decay_style=WSD (R40)")
    override_opt_param_scheduler: bool = noop(
        False, "Take the schedule from the config, not the checkpoint.",
        "always computes the schedule from the config and the step (a checkpoint stores only the step)")
    use_checkpoint_opt_param_scheduler: bool = unsupported(False, "Take the schedule from the checkpoint.")
    lr_warmup_fraction: float | None = unsupported(None, "Warm-up as a fraction of the decay (use lr_warmup_iters).")
    max_lr: float | None = refused(
        None, "Not a field of Bridge's SchedulerConfig (some recipes assign it; Bridge's scheduler never reads "
        "it): the peak rate is optimizer.lr.", "R39")
    min_lr: float | None = refused(
        None, "Not a field of Bridge's SchedulerConfig: the final rate is optimizer.min_lr.", "R39")


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
    packed_sequences: bool = opt(
        False, "sft: pack several examples into each row (first-fit over a shuffled order), with per-document "
        "causal attention and RoPE positions restarting per document (data/packing.py; R41 says what it runs "
        "with). Rows are packed_sequence_size tokens of Bridge's packed_sequence_specs, default "
        "model.seq_length.")
    # --- Bridge's dataset section (``dataset.*`` is this section)
    seq_length: int | None = opt(
        None, "Bridge's dataset.seq_length: null, or equal to model.seq_length (R38): graphstep's samples are "
        "model.seq_length tokens.")
    blend: list[Any] | None = opt(
        None, "Bridge's blend: [[prefix, ...], [weight, ...] or null]; sets data.data_path (a weighted blend) and "
        "data.dataset=indexed.")
    blend_per_split: list[Any] | None = unsupported(None, "One blend per split.")
    random_seed: int = opt(1234, "Bridge's dataset seed; graphstep's sample order comes from rng.seed, so only "
                           "rng.seed's value is accepted (R38).")
    seed: int | None = opt(None, "Bridge's other name of random_seed (null or rng.seed, R38).")
    num_workers: int = noop(2, "Data-loader worker processes.", "reads samples in the training process")
    data_sharding: bool = noop(True, "Shard the sampler's index over data-parallel ranks.",
                               "each data-parallel rank reads its own slice of every global batch")
    hf_dataset: Any = unsupported(None, "Bridge's SFT dataset downloaded from the Hugging Face hub (graphstep: "
                                  "data.dataset=sft with a local jsonl at data.data_path).")
    hf_validation_dataset: Any = unsupported(None, "The validation split of Bridge's Hugging Face SFT dataset.")
    preprocessing: Any = unsupported(None, "Bridge's SFT preprocessing (chat template, prompt/answer fields).")
    do_validation: bool = noop(True, "SFT: build the validation split.", "data.split decides the validation split")
    do_test: bool = noop(True, "SFT: build the test split.", "no test split is read (data.split's third part)")
    packed_sequence_specs: dict[str, Any] | None = opt(
        None, "Bridge's PackedSequenceSpecs of SFT packing (set one with dataset.packed_sequence_specs.NAME=VALUE): "
        "packed_sequence_size (> 0 turns packing on; the row width, at most model.seq_length), pad_seq_to_mult "
        "(each example padded to a multiple of it), pad_cu_seqlens (graphstep always pads cu_seqlens to a fixed "
        "count), tokenizer_model_name and num_tokenizer_workers (accepted, not read); the packed_*_path files of "
        "Bridge's offline packing are refused (R41): graphstep packs data.data_path when the run starts.")
    enable_offline_packing: bool = opt(
        False, "Bridge's switch of SFT packing with offline_packing_specs: the same as data.packed_sequences.")
    offline_packing_specs: dict[str, Any] | None = opt(
        None, "Bridge's newer name of packed_sequence_specs (the same fields; set one with "
        "dataset.offline_packing_specs.NAME=VALUE); entries set here win over packed_sequence_specs'.")
    pin_memory: bool = noop(True, "Pin loaded batches.", "pins batches on a GPU whatever this says")
    persistent_workers: bool = noop(False, "Keep data-loader workers alive.", "no workers (see num_workers)")
    dataloader_type: str | None = noop(None, "single, cyclic or external.", "its own sequential loader per rank")
    mmap_bin_files: bool = noop(True, "Memory-map the .bin files.", "memory-maps indexed data")
    num_dataset_builder_threads: int = noop(1, "Threads building the dataset index.", "builds it in one thread")
    fast_cache_load: bool = noop(False, "Bridge's index cache.", "builds its index at start")
    defer_npy_index_mmap: bool = noop(False, "Map the index lazily.", "builds its index at start")
    path_to_cache: str | None = noop(None, "Directory of the index cache.", "no index cache")
    create_attention_mask: bool = noop(
        False, "Build an attention-mask tensor per sample.", "causal attention without a mask tensor (the same numbers)")
    skip_getting_attention_mask_from_dataset: bool = noop(True, "Do not read masks from the dataset.", "no masks")
    reset_position_ids: bool = unsupported(False, "Restart position ids at each document.")
    reset_attention_mask: bool = unsupported(False, "Attention masks per document.")
    eod_mask_loss: bool = unsupported(False, "No loss on end-of-document tokens.")
    dataset_kwargs: dict[str, Any] | None = unsupported(None, "Extra arguments of Bridge's dataset class.")


@dataclass(kw_only=True)
class RNGConfig:
    """Seeds and the RNG tracker."""

    seed: int = opt(1234, "Base seed; ranks derive theirs from it as Megatron does.")
    te_rng_tracker: bool = opt(False, "Graph-safe RNG tracker (kept equal to model.use_te_rng_tracker).")
    data_parallel_random_init: bool = opt(False, "Different initial weights per data-parallel rank.")
    inference_rng_tracker: bool = noop(False, "Inference RNG tracker.", "nothing: graphstep trains")


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
        "backward, as soon as the bucket is complete (inside the full-iteration graph too); not with expert "
        "parallel (R31). FSDP2 reduce-scatters each layer during the backward on its own stream whatever this says, "
        "expert parallel or not."
    )
    overlap_param_gather: bool = opt(
        False, "FSDP2: each decoder layer prefetches the next layer's parameter all-gather explicitly before its "
        "forward (false: FSDP2's implicit prefetch); needs sharded data parallel (R26)."
    )
    check_for_large_grads: bool = unsupported(False, "Host-side check for unexpectedly large gradients.")
    num_distributed_optimizer_instances: int = unsupported(1, "Replicas of the distributed optimizer.")
    outer_dp_sharding_strategy: str = unsupported("no_shard", "Hybrid FSDP's outer sharding.")
    megatron_fsdp_main_params_dtype: str | None = refused(None, "FSDP master weights dtype (fp32).", "R34", allowed=FP32)
    megatron_fsdp_main_grads_dtype: str | None = refused(None, "FSDP main gradients dtype (fp32).", "R34", allowed=FP32)
    megatron_fsdp_grad_comm_dtype: str | None = refused(None, "FSDP gradient reduction dtype (fp32).", "R34",
                                                        allowed=FP32)
    reuse_grad_buf_for_mxfp8_param_ag: bool = refused(False, "MXFP8 parameter all-gather.", "R32")
    keep_fp8_transpose_cache: bool = noop(False, "FP8 transpose cache.", "torchao casts each FP8 operand where "
                                          "it is used; nothing is cached between steps")
    fsdp_double_buffer: bool = noop(False, "Megatron FSDP's double buffer.", "FSDP2's own buffers")
    fsdp_manual_registration: bool = noop(False, "Megatron FSDP's NCCL buffer registration.", "FSDP2's own buffers")
    nccl_ub: bool = noop(False, "NCCL user buffers.", "torch's NCCL buffers")
    suggested_communication_unit_size: int | None = noop(None, "Megatron FSDP's unit size.", "FSDP2 per layer")
    num_buckets: int | None = noop(None, "Number of all-reduce buckets.", "buckets of ddp.bucket_size elements")
    pad_buckets_for_high_nccl_busbw: bool = noop(False, "Pad buckets for NCCL bandwidth.", "unpadded buckets")
    fsdp_all_gather_in_start_param_sync: bool = noop(
        True, "Megatron FSDP: start the first all-gather in the parameter sync.", "FSDP2's own prefetch")
    megatron_fsdp_cuda_graph_mode: bool = noop(
        False, "Megatron FSDP's buffers laid out for CUDA graphs.",
        "FSDP2 with graphstep's graphs as R27 allows (its buffers need no special mode)")


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
    backend: str = opt(
        "inductor", "torch.compile backend (torchtitan's compile.backend): inductor; or aot_eager / eager, Dynamo's "
        "and AOTAutograd's tracing without Inductor's kernels (to find graph breaks and tracing failures quickly; "
        "compile.mode applies to inductor only)."
    )


@dataclass(kw_only=True)
class RerunStateMachineConfig:
    """Megatron's host-side loss checks."""

    check_for_nan_in_loss: bool = opt(True, "Host-side NaN check of the loss (syncs the host).")
    check_for_spiky_loss: bool = unsupported(False, "Spiky-loss detection.")
    rerun_mode: str = unsupported("disabled", "Megatron's rerun state machine (re-running suspicious steps).")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and resuming."""

    save: str | None = opt(None, "Directory to save checkpoints in; null = no saves.")
    load: str | None = opt(None, "Directory to resume from (its latest complete checkpoint).")
    save_interval: int | None = opt(None, "Save every N iterations (and at the end when save is set).")
    finetune: bool = opt(False, "Load weights only; start at iteration 0 with fresh optimizer state.")
    pretrained_checkpoint: str | None = opt(
        None, "Bridge's fine-tuning start point: a graphstep checkpoint folder (its newest intact checkpoint, or one "
        "iter_NNNNNNN folder) whose model weights are loaded before the adapters are added (peft=lora) and the "
        "optimizer copies them; a checkpoint in checkpoint.load resumes over it. Not with model.hf_path (R33).")
    ckpt_format: str = refused(
        "torch_dist", "Checkpoint format: torch_dist or fsdp_dtensor, both saved as graphstep's torch.distributed."
        "checkpoint (DCP) directories; torch (one file per rank) and torch_dcp are R18.", "R18",
        allowed=("torch_dist", "fsdp_dtensor"))
    fully_parallel_save: bool = noop(True, "Spread the save over data-parallel ranks.", "each rank writes its own "
                                     "shards with DCP")
    fully_parallel_load: bool = noop(False, "Spread the load over data-parallel ranks.", "each rank reads its "
                                     "shards with DCP")
    async_save: bool = noop(
        False, "Save in the background.", "saves synchronously after the step (the same files; the step waits)")
    async_strategy: str = noop("nvrx", "Background save backend.", "synchronous saves (see async_save)")
    ckpt_assume_constant_structure: bool = noop(False, "Reuse the save plan.", "DCP plans each save")
    dist_ckpt_strictness: str = noop(
        "assume_ok_unexpected", "How loading treats keys that do not match.",
        "loads strictly: a checkpoint whose keys differ is a one-line error naming them")
    most_recent_k: int = unsupported(-1, "Keep only the k latest checkpoints.")
    save_optim: bool = unsupported(True, "Save the optimizer state.")
    save_rng: bool = unsupported(True, "Save the RNG state.")
    load_optim: bool = unsupported(True, "Load the optimizer state (false: checkpoint.finetune=true loads weights "
                                   "only).")
    load_rng: bool = unsupported(True, "Load the RNG state.")


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
    wandb_entity: str | None = unsupported(None, "Weights & Biases entity (team).")
    log_throughput: bool = noop(
        False, "Show the throughput in the log line.", "shows tokens/s in every log line (TFLOP/s in TensorBoard "
        "with log_timers_to_tensorboard)")
    log_throughput_to_tensorboard: bool = noop(
        False, "Throughput to TensorBoard.", "writes it with log_timers_to_tensorboard")
    log_params_norm: bool = unsupported(False, "Log the parameter norm.")
    log_l2_norm_grad_to_tensorboard: bool = unsupported(False, "The gradient norm per parameter to TensorBoard.")
    log_progress: bool = unsupported(False, "Write progress.txt.")
    log_validation_ppl_to_tensorboard: bool = unsupported(False, "Validation perplexity to TensorBoard.")
    log_loss_scale_to_tensorboard: bool = noop(True, "The fp16 loss scale to TensorBoard.", "no loss scale (bf16/fp32)")
    log_world_size_to_tensorboard: bool = noop(False, "The world size to TensorBoard.", "logs the layout at start")
    timing_log_level: int = noop(0, "Megatron's timer detail.", "times whole steps (step_ms)")
    timing_log_option: str = noop("minmax", "Timers over ranks.", "rank 0's step time")
    tensorboard_queue_size: int = noop(1000, "TensorBoard writer queue.", "the writer's default")
    logging_level: int | None = noop(None, "Python logging level.", "INFO (-v: DEBUG)")
    filter_warnings: bool = noop(True, "Filter warnings.", "Python's warning filters")
    save_config_filepath: str | None = unsupported(None, "Write the resolved config here (graphstep config show "
                                                   "prints it).")


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
    nvtx_ranges: bool = noop(
        False, "NVTX ranges around Megatron's phases.", "marks its own phases with NVTX ranges whenever "
        "use_nsys_profiler is on")
