"""The sections only Megatron Bridge's ConfigContainer has: tokenizer, comm_overlap, dist, mixed_precision, peft.

Each field acts through graphstep's own fields (the normalisation maps it), is a
no-op named once in the log, or is refused by a numbered rule -- declared with
the helpers of config_sections.py. Import these names from ``graphstep.config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config_sections import noop, opt, refused, unsupported


@dataclass(kw_only=True)
class TokenizerConfig:
    """Bridge's tokenizer section, mapped onto data.tokenizer (the tokenizer loader)."""

    tokenizer_type: str | None = opt(
        None, "NullTokenizer (token ids as they are: mock or pre-tokenized data; vocab_size ids), "
        "HuggingFaceTokenizer (tokenizer_model: a local directory or tokenizer.json, which becomes data.tokenizer), "
        "or null (data.tokenizer decides); other tokenizers are R38.")
    tokenizer_model: str | None = opt(None, "HuggingFaceTokenizer: the tokenizer's local path (sets data.tokenizer).")
    vocab_size: int | None = opt(None, "NullTokenizer: ids 0..vocab_size-1; at most model.vocab_size (R38).")
    hf_tokenizer_kwargs: dict[str, Any] | None = noop(
        None, "Extra arguments of the Hugging Face tokenizer.", "loads tokenizer.json with the tokenizers library")
    use_tokenizer_vocab_size: bool = noop(False, "Take the model's vocabulary from the tokenizer.",
                                          "model.vocab_size is the recipe's (V9 checks it holds every id)")
    make_vocab_size_divisible_by: int = noop(128, "The tokenizer's padding multiple.", "model.should_pad_vocab "
                                             "with model.make_vocab_size_divisible_by")
    tensor_model_parallel_size: int = noop(1, "The tokenizer's copy of the layout.", "model.tensor_model_parallel_size")
    rank: int = noop(0, "The tokenizer's copy of the rank.", "the process's rank")
    null_tokenizer_eod_id: int | None = noop(None, "NullTokenizer's end-of-document id.", "no document masks")


@dataclass(kw_only=True)
class CommOverlapConfig:
    """Bridge's comm_overlap section: how Megatron overlaps communication with computation.

    Scheduling only -- the same numbers either way; graphstep's DTensor/FSDP2 collectives run as torch
    schedules them. Two fields act: they set their ddp counterparts, as in Bridge.
    """

    tp_comm_overlap: bool = noop(False, "Transformer Engine userbuffer overlap of tensor-parallel GEMMs.",
                                 "DTensor's collectives, not overlapped with the GEMMs")
    tp_comm_overlap_cfg: str | dict[str, Any] | None = noop(None, "Userbuffer settings.", "no userbuffers")
    tp_comm_bootstrap_backend: str | None = noop(None, "Userbuffer bootstrap.", "no userbuffers")
    overlap_moe_expert_parallel_comm: bool = noop(False, "Overlap expert-parallel all-to-all.", "no overlap")
    delay_wgrad_compute: bool = noop(False, "Delay weight-gradient GEMMs for overlap.", "autograd's order")
    defer_embedding_wgrad_compute: bool = noop(False, "Defer the embedding's weight gradient.", "autograd's order")
    wgrad_deferral_limit: int | None = noop(None, "Deferral limit.", "autograd's order")
    overlap_param_gather_with_optimizer_step: bool | None = noop(None, "Overlap gathers with the step.", "no overlap")
    align_param_gather: bool | None = noop(None, "Align parameter gathers over pipeline stages.", "no alignment")
    overlap_p2p_comm: bool | None = noop(None, "Pipeline send/receive overlap.", "torch's pipeline schedule")
    batch_p2p_comm: bool | None = noop(None, "Batched pipeline send/receive.", "torch's pipeline schedule")
    overlap_grad_reduce: bool | None = opt(None, "Set: the value of ddp.overlap_grad_reduce (Bridge's override).")
    overlap_param_gather: bool | None = opt(None, "Set: the value of ddp.overlap_param_gather (Bridge's override).")
    bucket_size: int | None = opt(None, "Set: the value of ddp.bucket_size (Bridge's override).")


@dataclass(kw_only=True)
class DistConfig:
    """Bridge's dist section: how the process group starts (graphstep joins torchrun's, training/distributed.py)."""

    distributed_backend: str = refused("nccl", "Collective backend: nccl (gloo on the CPU, chosen by graphstep).",
                                       "R18", allowed=("nccl", "gloo"))
    distributed_timeout_minutes: int = noop(10, "Timeout of collectives.", "torch's default process-group timeout")
    align_grad_reduce: bool = noop(True, "Align gradient reductions over pipeline stages.", "torch's schedule")
    use_megatron_fsdp: bool = noop(False, "Bridge's start-up copy of ddp.use_megatron_fsdp.", "reads ddp.use_megatron_fsdp")
    use_torch_fsdp2: bool = unsupported(
        False, "torch's FSDP2 through Bridge's start-up path (graphstep's FSDP2: ddp.use_megatron_fsdp=true).")
    use_tp_pp_dp_mapping: bool = unsupported(False, "Order ranks tensor-pipeline-data (graphstep: its mesh order).")
    use_gloo_process_groups: bool = noop(True, "Extra gloo groups.", "gloo only on the CPU")
    enable_megatron_core_experimental: bool = noop(False, "Megatron Core's experimental features.", "nothing")
    high_priority_stream_groups: list[str] | None = noop(None, "High-priority communication streams.", "torch's streams")
    nccl_communicator_config_path: str | None = noop(None, "NCCL communicator settings.", "NCCL's environment")
    lazy_init: bool = noop(False, "Initialise lazily.", "joins torchrun's group at start")
    external_gpu_device_mapping: bool = noop(False, "Device mapping done outside.", "LOCAL_RANK picks the device")


# Bridge's named precision recipes (``mixed_precision=NAME``; hyphens allowed, as in Bridge)
PRECISION_PRESETS = ("bf16_mixed", "fp16_mixed", "bf16_with_fp8_delayed_scaling_mixed",
                     "fp16_with_fp8_delayed_scaling_mixed", "bf16_with_mxfp8_mixed", "fp16_with_mxfp8_mixed",
                     "bf16_with_fp8_current_scaling_mixed", "nemotron_h_bf16_with_fp8_current_scaling_mixed",
                     "nanov2_bf16_with_fp8_current_scaling_mixed", "fp16_with_fp8_current_scaling_mixed",
                     "bf16_with_fp8_subchannel_scaling_mixed", "fp16_with_fp8_subchannel_scaling_mixed",
                     "bf16_with_nvfp4_mixed", "nemotron_3_super_bf16_with_nvfp4_mixed")


@dataclass(kw_only=True)
class MixedPrecisionConfig:
    """Bridge's mixed_precision: a preset name (``mixed_precision=bf16_mixed``) or these fields.

    bf16 acts (bf16 parameters, fp32 master weights and gradient reduction: graphstep's bf16 training);
    FP8 acts with current (tensorwise) scaling -- and torchao's rowwise scalings -- on torchao's float8
    training (converters/fp8.py), and with delayed scaling (an amax history) on graphstep's own FP8 linear
    (converters/fp8_delayed.py); blockwise, MXFP8 and FP4 are R32; fp16 with loss scaling is R18.
    """

    preset: str | None = opt(
        None, "Bridge's preset name, written mixed_precision=NAME: bf16_mixed (acts: model.params_dtype=bf16 "
        "unless you set it); bf16_with_fp8_current_scaling_mixed and bf16_with_fp8_delayed_scaling_mixed (act: "
        "bf16 and the FP8 fields as Bridge sets them, each unless you set it); the other fp8/mxfp8/nvfp4 presets "
        "are R32, the fp16 ones R18.")
    bf16: bool = opt(False, "bf16 training: model.params_dtype=bf16 unless you set it.")
    fp16: bool = refused(False, "fp16 with loss scaling.", "R18")
    fp32: bool = opt(False, "fp32 training: model.params_dtype=fp32 unless you set it.")
    params_dtype: str | None = opt(None, "Set: model.params_dtype (bf16/bfloat16/torch.bfloat16 or fp32 spellings).")
    pipeline_dtype: str | None = noop(None, "dtype sent between stages.", "sends the parameter dtype (model.pipeline_dtype)")
    autocast_enabled: bool = unsupported(False, "torch.autocast around the forward.")
    autocast_dtype: str | None = noop(None, "autocast's dtype.", "no autocast (autocast_enabled is R18)")
    grad_reduce_in_fp32: bool = opt(True, "Set to false: ddp.grad_reduce_in_fp32=false (as Bridge copies it; R22 "
                                    "with more than one data-parallel rank).")
    fp8: str | None = opt(None, "FP8 training of the decoder layers' linear layers (torchao float8): e4m3 "
                          "(gradients too) or hybrid (e4m3 forward, e5m2 gradients); null: no FP8 (R32).")
    fp8_recipe: str = opt("tensorwise", "FP8 scaling with fp8 set: tensorwise (current scaling, Bridge's); "
                          "delayed (an amax history per tensor: fp8_amax_history_len, fp8_amax_compute_algo, "
                          "fp8_margin); rowwise or rowwise_with_gw_hp (torchao's, a graphstep extension); "
                          "blockwise and mxfp8 are R32.")
    fp8_param: bool | None = refused(None, "FP8 parameters.", "R32", allowed=(None, False))
    fp8_param_gather: bool = opt(False, "FP8 parameter all-gather: with FSDP2 (use_megatron_fsdp or the distributed "
                                 "optimizer) and fp8_recipe=tensorwise, torchao's FP8 all-gather of the weights (R32 "
                                 "for the other recipes); nothing to do where the ranks hold whole replicas.")
    fp8_dot_product_attention: bool = refused(False, "FP8 attention.", "R32")
    fp8_multi_head_attention: bool = refused(False, "FP8 multi-head attention.", "R32")
    fp8_wgrad: bool = refused(True, "FP8 weight gradients (false: not implemented; fp8_recipe=rowwise_with_gw_hp "
                              "keeps the weight-gradient matmul in bf16).", "R32")
    fp8_margin: int = opt(0, "With fp8_recipe=delayed: scale = fp8_max / amax / 2**fp8_margin (an integer >= 0); "
                          "the other recipes have no margin and do not read it.")
    fp8_amax_history_len: int = opt(1, "With fp8_recipe=delayed: steps of amax history per tensor (>= 1); the other "
                                    "recipes read each tensor's own amax and do not read it.")
    fp8_amax_compute_algo: str = opt("most_recent", "With fp8_recipe=delayed: the amax a scale comes from, max (over "
                                     "the history) or most_recent (the last step's); the other recipes do not read "
                                     "it.")
    first_last_layers_bf16: bool = opt(False, "With fp8: keep num_layers_at_start_in_bf16 leading and "
                                       "num_layers_at_end_in_bf16 trailing decoder layers in bf16.")
    num_layers_at_start_in_bf16: int = opt(0, "With fp8 and first_last_layers_bf16: leading decoder layers in bf16.")
    num_layers_at_end_in_bf16: int = opt(0, "With fp8 and first_last_layers_bf16: trailing decoder layers in bf16.")
    reuse_grad_buf_for_mxfp8_param_ag: bool = refused(False, "MXFP8 parameter all-gather.", "R32")
    fp4: str | None = refused(None, "FP4 format.", "R32")
    fp4_recipe: str = noop("nvfp4", "FP4 recipe.", "nothing: read only with fp4 (R32)")
    fp4_param: bool | None = refused(None, "FP4 parameters.", "R32", allowed=(None, False))
    fp4_param_gather: bool = refused(False, "FP4 parameter all-gather.", "R32")
    loss_scale: float | None = refused(None, "fp16 static loss scale.", "R18")
    initial_loss_scale: float | None = noop(4294967296.0, "fp16 initial loss scale.", "no loss scaling (fp16: R18)")
    min_loss_scale: float = noop(1.0, "fp16 minimum loss scale.", "no loss scaling (fp16: R18)")
    loss_scale_window: float = noop(1000.0, "fp16 loss-scale window.", "no loss scaling (fp16: R18)")
    hysteresis: int = noop(2, "fp16 loss-scale hysteresis.", "no loss scaling (fp16: R18)")


@dataclass(kw_only=True)
class PeftConfig:
    """Bridge's peft section: ``peft=lora`` (or ``peft=dora``) fine-tunes adapters on the frozen model
    (converters/lora.py).

    ``peft=null`` (Bridge's pre-training default) trains every weight. The fields below act with
    ``peft=lora`` and ``peft=dora``, their defaults Bridge's ``LoRA`` defaults (``DoRA``'s alpha default is 64, set
    when alpha is not given); ``lora_dtype`` and the expert all-to-all adapters are R33, as is a field set without
    a scheme.
    """

    scheme: str | None = opt(None, "The scheme, written peft=NAME: lora (LoRA), dora (DoRA: LoRA plus a trained "
                             "magnitude per output row), or null (no adapters).")
    target_modules: list[str] = opt(["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                                    "With peft=lora: the decoder layers' linear layers that get adapters, by "
                                    "Bridge's names (linear_qkv, linear_proj, linear_fc1, linear_fc2).")
    dim: int = opt(32, "With peft=lora: the adapters' rank.")
    alpha: float = opt(32, "With peft=lora: the adapters' scaling numerator (the update is scaled by alpha/dim); "
                       "peft=dora without alpha takes Bridge's DoRA default, 64.")
    dropout: float = opt(0.0, "With peft=lora: adapter dropout probability (drawn from the RNG tracker).")
    dropout_position: str = opt("pre", "With peft=lora: adapter dropout on the adapter's input (pre) or its "
                                "output (post); peft=dora: pre only.")
    lora_A_init_method: str = opt("xavier", "With peft=lora: initialisation of A: xavier (Xavier-uniform) or "
                                  "uniform (Kaiming-uniform, nn.Linear's default).")
    lora_B_init_method: str = opt("zero", "With peft=lora: initialisation of B: zero (the adapted model starts "
                                  "as the base model).")
    adapter_path: str | None = opt(None, "graphstep's own field (Bridge has none): a Hugging Face peft adapter folder "
                                   "(adapter_config.json + adapter_model.safetensors) loaded into the adapters to "
                                   "continue training it; its r, lora_alpha, use_dora and modules must be this "
                                   "run's peft.dim, peft.alpha, peft.scheme and peft.target_modules.")
    lora_dtype: str | None = refused(None, "dtype of the adapter weights (null: the model's params_dtype).", "R33")
    a2a_experimental: bool = refused(False, "Experimental all-to-all adapters for expert layers.", "R33")
