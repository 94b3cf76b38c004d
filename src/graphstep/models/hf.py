"""Hugging Face checkpoints: load a local Llama / Qwen2 / Qwen3 / Qwen3-MoE directory, and export back.

A directory holds ``config.json`` and ``model.safetensors`` (or shards listed
by ``model.safetensors.index.json``); nothing is downloaded, and
``transformers`` is not needed (``safetensors`` reads the weights).

Shape. :func:`config_from_hf` maps config.json onto ``ModelConfig`` fields:
layers, widths, heads, KV heads, ``head_dim``, ``rope_theta``,
``rms_norm_eps``, ``tie_word_embeddings``, vocabulary; ``qk_layernorm`` for
Qwen3, ``add_qkv_bias`` for Qwen2; for Qwen3-MoE the experts, top-k, expert
width, ``norm_topk_prob`` (false = ``moe_router_pre_softmax``; true is
graphstep's default softmax over the k chosen logits, the same weights) and
the sparse layers (``decoder_sparse_step`` / ``mlp_only_layers``, as far as
graphstep's ``moe_layer_freq`` -- MoE at layers ``i % freq == 0`` -- can say
them). What graphstep does not implement is refused, all problems at once:
RoPE scaling (Llama 3.1's ``rope_type=llama3``, YaRN), sliding-window
attention, biases other than Qwen2's q/k/v, activations other than SiLU.

Weights. Hugging Face keeps q, k, v and gate, up as separate matrices;
graphstep fuses them: ``linear_qkv`` = rows of q, then k, then v;
``linear_fc1`` = rows of gate, then up; experts are stacked into
``[E, 2*ffn, hidden]`` / ``[E, hidden, ffn]`` (the per-expert keys of Hub
checkpoints, or the stacked ``gate_up_proj``/``down_proj`` some writers use).
Loading is strict: a missing or unexpected weight, or a shape that differs,
is an error naming the key and the file.

:func:`export_hf` writes the inverse -- config.json and one
model.safetensors, experts per key as on the Hub -- which ``transformers``
loads with the same logits; a model fine-tuned with LoRA (converters/lora.py) is exported merged, each adapter
folded into its base weight (DoRA: rescaled by its magnitude). The model type follows the configuration: MoE
is ``qwen3_moe``, q/k norms ``qwen3``, q/k/v bias ``qwen2``, else ``llama``.
It writes into a new or empty folder only (``overwrite=True`` replaces the
two files of a folder that has them; a sharded folder is refused even so,
since its index would still name the old shards), each file through a
temporary file in the same folder and ``os.replace``, with the ordinary
file mode (0666 less the umask).

The rotary tables need no conversion: graphstep's :class:`Rotary` is the
rotate-half layout with ``cos``/``sin`` over the full head width, as in
``transformers``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from graphstep.errors import HFCheckpointError, HFExportError

from ..converters.lora import DoRALinear, LoRALinear, merged_state_dict

log = logging.getLogger("graphstep")

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
             "qwen3_moe": "Qwen3MoeForCausalLM"}
# Written by some tools, never weights of the model.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# --------------------------------------------------------------------------
# config.json <-> ModelConfig


def read_hf_config(path: str | Path) -> dict[str, Any]:
    file = Path(path) / "config.json"
    if not file.is_file():
        what = "no config.json (no such directory)" if not Path(path).is_dir() else "no config.json in this directory"
        raise HFCheckpointError(f"model.hf_path={path}: {what}; model.hf_path takes a local Hugging Face model "
                                "directory (config.json + model.safetensors)")
    try:
        data = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise HFCheckpointError(f"{file}: not UTF-8 text; config.json is a JSON object") from None
    except json.JSONDecodeError as exc:
        raise HFCheckpointError(f"{file}:{exc.lineno}:{exc.colno}: invalid JSON ({exc.msg}); correct config.json "
                                "or download it again") from None
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _rope_theta(hf: dict[str, Any], problems: list[str]) -> int:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        problems.append(f"rope_type={kind!r}: graphstep implements plain RoPE only (no scaling)")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if theta != int(theta):
        problems.append(f"rope_theta={theta}: graphstep's model.rotary_base is an integer")
    return int(theta)


def _moe_freq(hf: dict[str, Any], layers: int, problems: list[str]) -> int:
    """``moe_layer_freq`` with the same sparse layers as ``decoder_sparse_step`` / ``mlp_only_layers``."""
    step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or [])
    sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    for freq in range(1, layers + 1):
        if sparse == [i for i in range(layers) if i % freq == 0]:
            return freq
    problems.append(f"MoE layers {sparse} (decoder_sparse_step={step}, mlp_only_layers={sorted(dense)}): graphstep "
                    "places MoE layers at i % model.moe_layer_freq == 0 only")
    return 1


def config_from_hf(source: str | Path | dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` field values for a Hugging Face config (a directory or its parsed config.json)."""
    hf = source if isinstance(source, dict) else read_hf_config(source)
    where = "config.json" if isinstance(source, dict) else str(Path(source) / "config.json")
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        raise HFCheckpointError(f"{where}: model_type={kind!r}; graphstep loads {', '.join(SUPPORTED)} (a model "
                                "of another architecture cannot be loaded)")
    required = ["num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"]
    required += ["num_experts_per_tok", "moe_intermediate_size"] if kind == "qwen3_moe" else []
    missing = [key for key in required if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool)]
    if missing:
        raise HFCheckpointError(f"{where}: {', '.join(missing)} missing or not an integer; a {kind} config.json "
                                "sets them (download the model's config.json again)")
    problems: list[str] = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r}: graphstep's MLP is SwiGLU (silu)")
    if hf.get("attention_bias") and kind != "qwen2":
        problems.append("attention_bias=true: graphstep has a bias on q/k/v only (Qwen2), not on the output")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias=true: graphstep's MLP has no bias")
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or []):
        problems.append("sliding-window attention is not implemented by graphstep")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    layers = hf["num_hidden_layers"]
    out: dict[str, Any] = {
        "num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": hf["intermediate_size"],
        "num_attention_heads": heads, "num_query_groups": hf.get("num_key_value_heads") or heads,
        "kv_channels": hf.get("head_dim") or hidden // heads, "vocab_size": hf["vocab_size"],
        "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", False)),
        "layernorm_epsilon": float(hf.get("rms_norm_eps", 1e-6)), "rotary_base": _rope_theta(hf, problems),
        "normalization": "RMSNorm", "position_embedding_type": "rope",
        "qk_layernorm": kind in ("qwen3", "qwen3_moe"), "add_qkv_bias": kind == "qwen2",
        "num_moe_experts": None, "hybrid_override_pattern": None,
    }
    if kind == "qwen3_moe":
        out.update(
            num_moe_experts=hf.get("num_experts", hf.get("num_local_experts")),
            moe_router_topk=hf["num_experts_per_tok"], moe_ffn_hidden_size=hf["moe_intermediate_size"],
            moe_router_score_function="softmax", moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
            moe_layer_freq=_moe_freq(hf, layers, problems), moe_shared_expert_intermediate_size=None,
            moe_router_enable_expert_bias=False, moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)),
        )
    if problems:
        raise HFCheckpointError(f"{where}: graphstep cannot load this {kind} model as it is:\n  " + "\n  ".join(problems))
    return out


def apply_hf_config(model_cfg: Any, path: str | Path) -> dict[str, Any]:
    """Set ``model_cfg``'s shape from ``path``'s config.json; returns the fields that changed (old values)."""
    changed = {}
    for name, value in config_from_hf(path).items():
        if getattr(model_cfg, name) != value:
            changed[name] = getattr(model_cfg, name)
            setattr(model_cfg, name, value)
    return changed


def with_hf_shape(cfg: Any) -> Any:
    """``cfg`` itself without ``model.hf_path``; else a copy whose model shape is the checkpoint's."""
    if not cfg.model.hf_path:
        return cfg
    cfg = copy.deepcopy(cfg)
    changed = apply_hf_config(cfg.model, cfg.model.hf_path)
    if changed:
        log.info("model.hf_path=%s sets %s", cfg.model.hf_path,
                 ", ".join(f"model.{k}={getattr(cfg.model, k)!r}" for k in changed))
    return cfg


def hf_config_for(m: Any, model_type: str | None = None, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """config.json of a graphstep ``ModelConfig``."""
    kind = model_type or _model_type(m)
    heads = m.num_attention_heads
    out: dict[str, Any] = {
        "architectures": [SUPPORTED[kind]], "model_type": kind, "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size, "intermediate_size": m.ffn_hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": heads, "num_key_value_heads": m.num_query_groups or heads,
        "head_dim": m.kv_channels or m.hidden_size // heads, "hidden_act": "silu",
        "max_position_embeddings": m.seq_length, "rms_norm_eps": m.layernorm_epsilon,
        "rope_theta": float(m.rotary_base), "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rotary_base)},
        "tie_word_embeddings": m.share_embeddings_and_output_weights, "attention_dropout": 0.0,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if kind != "qwen2":
        out["attention_bias"] = False
    if kind == "llama":
        out["mlp_bias"] = False
    if kind in ("qwen2", "qwen3", "qwen3_moe"):
        out["use_sliding_window"] = False
    if kind == "qwen3_moe":
        out.update(
            num_experts=m.num_moe_experts, num_experts_per_tok=m.moe_router_topk,
            moe_intermediate_size=m.moe_ffn_hidden_size or m.ffn_hidden_size,
            norm_topk_prob=not m.moe_router_pre_softmax, decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(m.num_layers) if i % m.moe_layer_freq], router_aux_loss_coef=m.moe_aux_loss_coeff,
        )
    return out


def _model_type(m: Any) -> str:
    problems = []
    if m.hybrid_override_pattern:
        problems.append("hybrid (Mamba) models have no Hugging Face equivalent here")
    if m.num_moe_experts:
        if not m.qk_layernorm or m.add_qkv_bias:
            problems.append("an MoE model exports as qwen3_moe, which needs model.qk_layernorm=true and no q/k/v bias")
        if m.moe_router_score_function != "softmax" or m.moe_router_enable_expert_bias:
            problems.append("qwen3_moe routes with a softmax and no expert bias")
        if m.moe_shared_expert_intermediate_size:
            problems.append("qwen3_moe has no shared expert")
        kind = "qwen3_moe"
    elif m.qk_layernorm and m.add_qkv_bias:
        problems.append("q/k norms and a q/k/v bias together match no supported model type")
        kind = "qwen3"
    else:
        kind = "qwen3" if m.qk_layernorm else "qwen2" if m.add_qkv_bias else "llama"
    if problems:
        raise HFCheckpointError("cannot export to Hugging Face:\n  " + "\n  ".join(problems))
    return kind


# --------------------------------------------------------------------------
# weight names


def _layer_keys(i: int, kind: str, m: Any) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(graphstep key, the Hugging Face keys concatenated into it along dim 0) of layer ``i``'s blocks."""
    hf, gs = f"model.layers.{i}", f"layers.{i}.blocks"
    if kind == "attn":
        a = f"{gs}.attn.self_attention"
        yield f"{gs}.attn.input_layernorm.weight", (f"{hf}.input_layernorm.weight",)
        yield f"{a}.linear_qkv.weight", tuple(f"{hf}.self_attn.{p}_proj.weight" for p in "qkv")
        if m.add_qkv_bias:
            yield f"{a}.linear_qkv.bias", tuple(f"{hf}.self_attn.{p}_proj.bias" for p in "qkv")
        yield f"{a}.linear_proj.weight", (f"{hf}.self_attn.o_proj.weight",)
        if m.qk_layernorm:
            yield f"{a}.q_layernorm.weight", (f"{hf}.self_attn.q_norm.weight",)
            yield f"{a}.k_layernorm.weight", (f"{hf}.self_attn.k_norm.weight",)
    elif kind == "mlp":
        yield f"{gs}.mlp.pre_mlp_layernorm.weight", (f"{hf}.post_attention_layernorm.weight",)
        yield f"{gs}.mlp.mlp.linear_fc1.weight", (f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight")
        yield f"{gs}.mlp.mlp.linear_fc2.weight", (f"{hf}.mlp.down_proj.weight",)
    elif kind == "moe":
        yield f"{gs}.moe.router_stage.pre_mlp_layernorm.weight", (f"{hf}.post_attention_layernorm.weight",)
        yield f"{gs}.moe.router_stage.router.weight", (f"{hf}.mlp.gate.weight",)
    else:
        raise HFCheckpointError(f"layer {i}: a {kind!r} block has no Hugging Face equivalent")


def _expert_keys(i: int) -> tuple[str, str, str]:
    return (f"layers.{i}.blocks.moe.experts.experts.linear_fc1.weight",
            f"layers.{i}.blocks.moe.experts.experts.linear_fc2.weight", f"model.layers.{i}.mlp.experts")


def _kinds(m: Any) -> list[list[str]]:
    from .hybrid import layer_kinds

    return layer_kinds(m)


# --------------------------------------------------------------------------
# loading


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not file.is_file():
        raise HFCheckpointError(f"{file}: no such file (listed by model.safetensors.index.json)")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise HFCheckpointError(f"{file}: not a readable safetensors file ({' '.join(str(exc).split())}); "
                                "download it again (a git-lfs pointer or a truncated download looks like this)") from None


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.safetensors`` or of the shards its index lists."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise HFCheckpointError(f"{index}: not a safetensors index (a JSON object with a weight_map); "
                                    "download it again") from None
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise HFCheckpointError(f"{path}: no model.safetensors (nor model.safetensors.index.json); graphstep "
                                "reads safetensors checkpoints only")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(_load_safetensors(path / name))
    return tensors


def hf_to_graphstep(hf: dict[str, torch.Tensor], m: Any, where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """graphstep's state dict (parameters) from Hugging Face tensors; strict about names."""
    used: set[str] = set()

    def take(*keys: str) -> torch.Tensor:
        missing = [k for k in keys if k not in hf]
        if missing:
            raise HFCheckpointError(f"{where}: missing weight {missing[0]!r}" + (f" (and {len(missing) - 1} more)"
                                                                                  if len(missing) > 1 else ""))
        used.update(keys)
        return torch.cat([hf[k] for k in keys]) if len(keys) > 1 else hf[keys[0]]

    out = {"embedding.weight": take("model.embed_tokens.weight"), "final_layernorm.weight": take("model.norm.weight")}
    if not m.share_embeddings_and_output_weights:
        out["output_layer.weight"] = take("lm_head.weight")
    elif "lm_head.weight" in hf:
        used.add("lm_head.weight")  # a tied copy
    for i, kinds in enumerate(_kinds(m)):
        for kind in kinds:
            for gs, keys in _layer_keys(i, kind, m):
                out[gs] = take(*keys)
            if kind == "moe":
                fc1, fc2, prefix = _expert_keys(i)
                if f"{prefix}.gate_up_proj" in hf:  # stacked: [E, 2*ffn, hidden] and [E, hidden, ffn]
                    out[fc1], out[fc2] = take(f"{prefix}.gate_up_proj"), take(f"{prefix}.down_proj")
                else:
                    E = m.num_moe_experts
                    out[fc1] = torch.stack([take(f"{prefix}.{e}.gate_proj.weight", f"{prefix}.{e}.up_proj.weight")
                                            for e in range(E)])
                    out[fc2] = torch.stack([take(f"{prefix}.{e}.down_proj.weight") for e in range(E)])
    extra = sorted(k for k in hf if k not in used and not k.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise HFCheckpointError(f"{where}: {len(extra)} weight(s) graphstep's model does not have, e.g. {extra[:3]}; "
                                "is config.json the one of these weights?")
    return out


def load_hf(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(``ModelConfig`` overrides, graphstep state dict) of a local Hugging Face directory."""
    from ..config import ModelConfig

    overrides = config_from_hf(path)
    return overrides, hf_to_graphstep(read_safetensors(path), ModelConfig(**overrides), where=str(path))


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | Path, model_cfg: Any) -> None:
    """Copy the weights of ``path`` into ``model`` in place (any device and dtype); strict."""
    state = hf_to_graphstep(read_safetensors(path), model_cfg, where=str(path))
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(state))
    if missing:
        raise HFCheckpointError(f"{path}: no weights for {missing[:3]} of graphstep's model")
    for name, tensor in state.items():
        p = params[name]
        if p.shape != tensor.shape:
            raise HFCheckpointError(f"{path}: {name} has shape {tuple(tensor.shape)} in the checkpoint, "
                                    f"{tuple(p.shape)} in the model (model.* fields differ from config.json?)")
        p.copy_(tensor.to(device=p.device, dtype=p.dtype))
    log.info("initialised %d tensors from the Hugging Face checkpoint %s", len(state), path)


# --------------------------------------------------------------------------
# export


def graphstep_to_hf(state: dict[str, torch.Tensor], m: Any) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (Hub layout, experts per key) from graphstep's state dict."""
    out = {"model.embed_tokens.weight": state["embedding.weight"], "model.norm.weight": state["final_layernorm.weight"]}
    if not m.share_embeddings_and_output_weights:
        out["lm_head.weight"] = state["output_layer.weight"]
    for i, kinds in enumerate(_kinds(m)):
        for kind in kinds:
            for gs, keys in _layer_keys(i, kind, m):
                out.update(zip(keys, _split_rows(state[gs], keys, m)))
            if kind == "moe":
                fc1, fc2, prefix = _expert_keys(i)
                for e in range(state[fc1].shape[0]):
                    gate, up = state[fc1][e].chunk(2)
                    out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
                    out[f"{prefix}.{e}.down_proj.weight"] = state[fc2][e]
    return out


def export_hf(model: nn.Module, model_cfg: Any, path: str | Path, model_type: str | None = None, *,
              overwrite: bool = False) -> Path:
    """Write ``config.json`` + ``model.safetensors`` that ``transformers`` loads (``from_pretrained``).

    ``path`` must be a new or empty folder unless ``overwrite`` (then its config.json and
    model.safetensors are replaced, each atomically); anything else raises ``HFExportError``.
    """
    from safetensors.torch import save_file

    path = Path(path)
    _check_export_target(path, overwrite)
    dtype = next(model.parameters()).dtype
    config = hf_config_for(model_cfg, model_type, dtype)  # refuses what has no HF equivalent, before writing
    state = merged_state_dict(model)  # LoRA adapters (peft=lora) merged into their base weights
    tensors = {k: v.cpu().contiguous().clone() for k, v in graphstep_to_hf(state, model_cfg).items()}
    path.mkdir(parents=True, exist_ok=True)
    _replace_file(path / "model.safetensors", lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    _replace_file(path / "config.json", lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n"))
    log.info("exported %s (%d tensors, %s) to %s", config["model_type"], len(tensors), config["dtype"], path)
    return path


def export_peft_adapter(model: nn.Module, model_cfg: Any, path: str | Path, *,
                        base_model_name_or_path: str | None = None) -> Path:
    """Write a LoRA model's adapters in Hugging Face peft's format: ``adapter_config.json`` +
    ``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained`` loads over the base model
    (``export_hf`` of the same weights without adapters) with the same logits.

    A fused projection's adapter splits exactly: ``linear_qkv``'s update ``B A`` is q/k/v's ``B_q A``,
    ``B_k A``, ``B_v A`` (A shared, B's rows split as the weight's), ``linear_fc1``'s gate/up the same way.
    DoRA adapters (``peft=dora``) export as peft's ``use_dora=True``: the magnitude splits by rows as B does
    (each row's norm is its own), written as peft's ``lora_magnitude_vector``.
    ``path`` must be a new or empty folder; a model without adapters, or adapters peft cannot express
    (dropout after the adapter), raise ``HFExportError``."""
    from safetensors.torch import save_file

    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise HFExportError(f"{path}: not a new or empty folder; export the adapters into a new or empty folder")
    adapters = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    if not adapters:
        raise HFExportError("the model has no LoRA adapters to export (train with peft=lora), or export the whole "
                            "model with export_hf")
    first = next(iter(adapters.values()))
    if any(m.dropout > 0 and m.dropout_position == "post" for m in adapters.values()):
        raise HFExportError("peft.dropout_position=post has no peft equivalent (peft drops the adapter's input); "
                            "train with peft.dropout_position=pre or peft.dropout=0.0 to export the adapters")
    tensors: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    for module, keys in _adapter_parts(adapters, model_cfg):
        a, b = module.lora_A.weight.detach(), module.lora_B.weight.detach()
        parts = {".lora_B.weight": _split_rows(b, keys, model_cfg)}
        if isinstance(module, DoRALinear):
            parts[".lora_magnitude_vector"] = _split_rows(module.lora_magnitude.detach(), keys, model_cfg)
        for j, key in enumerate(keys):
            prefix = _PEFT_PREFIX + key.removesuffix(".weight")
            tensors[prefix + ".lora_A.weight"] = a.cpu().contiguous().clone()
            for suffix, split in parts.items():
                tensors[prefix + suffix] = split[j].cpu().contiguous().clone()
            targets.add(prefix.rsplit(".", 1)[-1])
    dim = first.lora_A.out_features
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": dim, "lora_alpha": first.alpha,
              "lora_dropout": first.dropout, "target_modules": sorted(targets), "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False,
              "use_dora": isinstance(first, DoRALinear),
              "init_lora_weights": True, "modules_to_save": None, "base_model_name_or_path": base_model_name_or_path}
    path.mkdir(parents=True, exist_ok=True)
    _replace_file(path / "adapter_model.safetensors",
                  lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    _replace_file(path / "adapter_config.json", lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n"))
    log.info("exported %d %s adapters (rank %d) in peft's format to %s", len(adapters),
             "DoRA" if config["use_dora"] else "LoRA", dim, path)
    return path


@torch.no_grad()
def load_peft_adapter(model: nn.Module, model_cfg: Any, path: str | Path) -> None:
    """``peft.adapter_path``: copy a Hugging Face peft adapter (``adapter_config.json`` +
    ``adapter_model.safetensors``) into ``model``'s LoRA/DoRA adapters, to continue training it.

    The inverse of :func:`export_peft_adapter`: q/k/v (gate/up) parts fuse back into ``linear_qkv``
    (``linear_fc1``) -- their B rows (and DoRA magnitudes) concatenated, their A shared, so the parts must hold
    the same A (as graphstep and Bridge export them; an adapter peft trained per module has an A each, which one
    fused adapter of rank r cannot hold). The adapter's r, lora_alpha and use_dora must be this run's peft.dim,
    peft.alpha and peft.scheme, and its modules this run's peft.target_modules; anything else -- a folder
    without the two files, a shape that differs, a module graphstep cannot map -- is an ``HFCheckpointError``
    of one line naming the field to set."""
    path = Path(path)
    where = f"peft.adapter_path={path}"
    config_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise HFCheckpointError(f"{where}: no adapter_config.json and adapter_model.safetensors there; name a folder "
                                "written by peft's save_pretrained or graphstep's export_peft_adapter")
    try:
        config = json.loads(config_file.read_bytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise HFCheckpointError(f"{config_file}: not a JSON object; write the adapter's config again") from None
    adapters = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    if not adapters or not isinstance(config, dict):
        raise HFCheckpointError(f"{where}: " + ("adapter_config.json is not a JSON object" if adapters else
                                                "the model has no adapters to load it into (set peft=lora)"))
    _check_adapter_config(config, next(iter(adapters.values())), where)
    tensors, used = _load_safetensors(weights), set()
    for module, keys in _adapter_parts(adapters, model_cfg):
        prefixes = [_PEFT_PREFIX + k.removesuffix(".weight") for k in keys]

        def take(suffix: str, like: torch.Tensor) -> list[torch.Tensor]:
            names = [p + suffix for p in prefixes]
            missing = [n for n in names if n not in tensors]
            if missing:
                target = _HF_TARGETS.get(_module_of(missing[0]), "?")
                raise HFCheckpointError(f"{where}: no {missing[0]} in adapter_model.safetensors, for this run's "
                                        f"{target} adapter; set peft.target_modules to the modules the adapter has "
                                        f"({', '.join(_adapter_targets(tensors))})")
            used.update(names)
            parts = [tensors[n] for n in names]
            whole = parts[0] if suffix == ".lora_A.weight" else torch.cat(parts)
            if whole.shape != like.shape:
                raise HFCheckpointError(f"{where}: {names[0].removeprefix(_PEFT_PREFIX)} has shape "
                                        f"{tuple(parts[0].shape)}, this run's adapter needs {tuple(like.shape)}"
                                        f"{' (in parts)' if len(parts) > 1 else ''}; is the model the adapter's "
                                        "base (model.* fields, model.hf_path)?")
            if suffix == ".lora_A.weight" and any(not torch.equal(parts[0], a) for a in parts[1:]):
                raise HFCheckpointError(f"{where}: {', '.join(k.rsplit('.', 2)[-2] for k in keys)} of "
                                        f"{prefixes[0].rsplit('.', 1)[0].removeprefix(_PEFT_PREFIX)} hold different "
                                        "lora_A matrices; graphstep's fused adapter shares one A (adapters exported "
                                        "by graphstep or Bridge do), so this adapter cannot be loaded exactly")
            return [whole.to(device=like.device, dtype=like.dtype)]

        module.lora_A.weight.copy_(take(".lora_A.weight", module.lora_A.weight)[0])
        module.lora_B.weight.copy_(take(".lora_B.weight", module.lora_B.weight)[0])
        if isinstance(module, DoRALinear):
            module.lora_magnitude.copy_(take(".lora_magnitude_vector", module.lora_magnitude)[0])
    extra = sorted(set(tensors) - used)
    if extra:
        name, module_name = extra[0].removeprefix(_PEFT_PREFIX), _module_of(extra[0])
        fix = (f"add {_HF_TARGETS[module_name]} to peft.target_modules" if module_name in _HF_TARGETS else
               "graphstep adapts the decoder layers' q/k/v/o and gate/up/down projections only")
        raise HFCheckpointError(f"{where}: {len(extra)} tensor(s) this run's adapters cannot take, e.g. {name}; {fix}")
    log.info("loaded the peft adapter %s into %d adapters", path, len(adapters))


def _module_of(key: str) -> str:
    """The Hugging Face module name of an adapter key (``...self_attn.q_proj.lora_A.weight`` -> ``q_proj``)."""
    return key.split(".lora_")[0].rsplit(".", 1)[-1]


def _adapter_targets(tensors: dict[str, torch.Tensor]) -> list[str]:
    """graphstep's target names of the modules an adapter file has weights for."""
    return sorted({_HF_TARGETS.get(_module_of(k), _module_of(k)) for k in tensors})


def _check_adapter_config(config: dict[str, Any], like: LoRALinear, where: str) -> None:
    """The adapter's config against this run's adapters: all problems in one line."""
    dora = isinstance(like, DoRALinear)
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type={config.get('peft_type')!r} (graphstep imports LoRA and DoRA adapters only)")
    if bool(config.get("use_dora")) != dora:
        problems.append(f"use_dora={bool(config.get('use_dora'))} (set peft={'lora' if dora else 'dora'})")
    if config.get("r") != like.lora_A.out_features:
        problems.append(f"r={config.get('r')!r} (set peft.dim={config.get('r')})")
    if config.get("lora_alpha") != like.alpha:
        problems.append(f"lora_alpha={config.get('lora_alpha')!r} (set peft.alpha={config.get('lora_alpha')})")
    for name, fine, why in (("use_rslora", False, "rank-stabilised scaling alpha/sqrt(r) is not implemented"),
                            ("bias", "none", "graphstep's adapters train no bias"),
                            ("fan_in_fan_out", False, "transposed (Conv1D) weights are not graphstep's layout"),
                            ("modules_to_save", None, "graphstep trains the adapters only"),
                            ("rank_pattern", {}, "per-module ranks are not implemented"),
                            ("alpha_pattern", {}, "per-module alphas are not implemented")):
        if config.get(name) not in (fine, None):
            problems.append(f"{name}={config.get(name)!r} ({why})")
    if problems:
        raise HFCheckpointError(f"{where}: adapter_config.json does not fit this run: {'; '.join(problems)}")


_PEFT_PREFIX = "base_model.model."  # peft's prefix of the wrapped model's keys
# Hugging Face module names -> graphstep's target names (Bridge's)
_HF_TARGETS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
               "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}


def _adapter_parts(adapters: dict[str, LoRALinear], m: Any) -> list[tuple[LoRALinear, tuple[str, ...]]]:
    """Each adapted module with the Hugging Face weight keys its rows split into (q, k, v; gate, up; or one)."""
    out, seen = [], set()
    for i, kinds in enumerate(_kinds(m)):
        for kind in kinds:
            for gs, keys in _layer_keys(i, kind, m):
                module = adapters.get(gs.removesuffix(".weight")) if gs.endswith(".weight") else None
                if module is not None:
                    out.append((module, keys))
                    seen.add(gs.removesuffix(".weight"))
    if seen != set(adapters):
        missing = ", ".join(sorted(set(adapters) - seen)[:3])
        raise HFExportError(f"adapters with no Hugging Face module to export to: {missing}")
    return out


def _split_rows(t: torch.Tensor, keys: tuple[str, ...], m: Any) -> tuple[torch.Tensor, ...]:
    """``t``'s rows split as a fused weight's: q, k, v (three keys) or gate, up (two)."""
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    hd = m.kv_channels or m.hidden_size // heads
    if len(keys) == 3:
        return tuple(t.split([heads * hd, groups * hd, groups * hd]))
    if len(keys) == 2:
        return tuple(t.chunk(2))
    return (t,)


def _check_export_target(path: Path, overwrite: bool) -> None:
    if path.exists() and not path.is_dir():
        raise HFExportError(f"{path}: is a file; export_hf writes a folder (config.json + model.safetensors): "
                            "name a new or empty folder")
    entries = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if not entries:
        return
    if (path / "model.safetensors.index.json").exists():
        raise HFExportError(f"{path}: holds a sharded checkpoint (model.safetensors.index.json), which loaders "
                            "would still read instead of the export; export into a new or empty folder")
    if not overwrite:
        shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
        raise HFExportError(f"{path}: the folder is not empty ({shown}); export into a new or empty folder, "
                            "or pass export_hf(..., overwrite=True) to replace its config.json and model.safetensors")


def _replace_file(target: Path, write: Any) -> None:
    """``write(tmp)`` into a temporary file beside ``target``, then ``os.replace`` it: ``target`` is either the old
    file or the whole new one. The new file gets the mode an ordinary new file has (0666 less the umask)."""
    tmp = target.with_name(f".{target.name}.tmp-{secrets.token_hex(3)}")
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
