"""Hugging Face (and mlx-lm) config and tensor mapping for Qwen 3.5 text models."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from turbospark_core.family import (
    MTP_HEADS,
    VISION_TOWERS,
    ConversionError,
    TensorTarget,
    drop_pattern,
    is_tied_head,
    rope_scaling,
    rope_theta,
    strip_language_model_prefix,
    text_config,
    tied_embeddings,
)

_MOE_TYPES = ("qwen3_5_moe",)
_DEFAULT_INTERVAL = 4
_DEFAULT_PARTIAL_ROTARY = 0.25


def _layer_types(cfg: Mapping[str, Any]) -> list[str]:
    if cfg.get("layer_types") is not None:
        return list(cfg["layer_types"])
    interval = cfg.get("full_attention_interval", _DEFAULT_INTERVAL)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
        msg = f"full_attention_interval={interval!r} must be a positive integer (and no layer_types given)"
        raise ConversionError(msg)
    layers = cfg["num_hidden_layers"]
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def _rope(cfg: Mapping[str, Any]) -> tuple[float, float, dict[str, Any] | None]:
    """(theta, partial rotary factor, rope_scaling for Rope.from_config or None)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", _DEFAULT_PARTIAL_ROTARY)))
    return rope_theta(cfg, params, 10000.0), partial, rope_scaling(params)


def _moe(cfg: Mapping[str, Any], model_type: str) -> dict[str, Any] | None:
    if model_type not in _MOE_TYPES:
        return None
    return {
        "num_experts": cfg["num_experts"],
        "top_k": cfg["num_experts_per_tok"],
        "moe_intermediate_size": cfg["moe_intermediate_size"],
        "shared_expert_intermediate_size": cfg["shared_expert_intermediate_size"],
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
    }


def _mtp(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The multi-token-prediction head's keys (none for a checkpoint without one)."""
    layers = cfg.get("mtp_num_hidden_layers")
    if not layers:
        return {}
    return {
        "mtp_num_hidden_layers": layers,
        "mtp_use_dedicated_embeddings": bool(cfg.get("mtp_use_dedicated_embeddings", False)),
    }


def arch_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The install's arch config from a Hugging Face (or mlx-lm) ``config.json``.

    Raises:
        ConversionError: The config describes something the flow cannot run
            (a layer kind, activation or head layout), named.
    """
    from turbospark_qwen.family import Args

    model_type = hf_config["model_type"]
    cfg = text_config(hf_config)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    theta, partial, scaling = _rope(cfg)
    arch = {
        "model_type": model_type,
        "hidden_size": cfg["hidden_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg.get("max_position_embeddings"),
        "intermediate_size": cfg.get("intermediate_size"),
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "hidden_act": cfg.get("hidden_act", "silu"),
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "rotary_dim": int(head_dim * partial),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "layer_types": _layer_types(cfg),
        "linear_num_key_heads": cfg.get("linear_num_key_heads"),
        "linear_num_value_heads": cfg.get("linear_num_value_heads"),
        "linear_key_head_dim": cfg.get("linear_key_head_dim"),
        "linear_value_head_dim": cfg.get("linear_value_head_dim"),
        "linear_conv_kernel_dim": cfg.get("linear_conv_kernel_dim"),
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "tie_word_embeddings": tied_embeddings(hf_config),
        "moe": _moe(cfg, model_type),
        **_mtp(cfg),
    }
    problems = Args.problems(arch)
    if problems:
        msg = f"{model_type} config cannot be served by the qwen family: {'; '.join(problems)}"
        raise ConversionError(msg)
    return arch


# ------------------------------------------------------------------ tensors

_DROP = drop_pattern(VISION_TOWERS)
_MTP = drop_pattern(MTP_HEADS)  # the head: kept (as ``mtp.*``) when the config declares MTP layers
_MLX_LM_PREFIX = "language_model."  # mlx-lm writes sanitized names: language_model.model.layers...
_KEEP_FLOAT32 = re.compile(r"\.linear_attn\.(A_log|norm\.weight)$")
_FUSED_EXPERTS = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# Qwen3.5 MoE releases store the head's experts one by one (Qwen3.6 fuses them, as the trunk does)
_PER_EXPERT = re.compile(r"^(mtp\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SWITCH_MLP = re.compile(r"^(model\.layers\.\d+\.mlp)\.switch_mlp\.(\w+)\.(weight|scales|biases)$")
_ZERO_CENTERED = re.compile(r"(input_layernorm|post_attention_layernorm|q_norm|k_norm)\.weight$|^model\.norm\.weight$")


def _head_name(arch: dict[str, Any], name: str) -> str | None:
    """The install name of an MTP head tensor (``mtp.*``), or ``None`` when the head is not kept.

    Kept from Hugging Face checkpoints (``mtp.*`` or ``model.mtp.*``) whose config
    declares MTP layers; mlx-lm directories (their norms already hold ``1 + w``) and
    configs without ``mtp_num_hidden_layers`` drop it.
    """
    if not arch.get("mtp_num_hidden_layers") or name.startswith(_MLX_LM_PREFIX):
        return None
    return name.removeprefix("model.")


def hf_target(arch: dict[str, Any], name: str) -> TensorTarget:
    """Where a Hugging Face / mlx-lm tensor goes (vision tower dropped; MTP head kept as ``mtp.*``)."""
    if _DROP.search(name):
        return TensorTarget.drop()
    if _MTP.search(name):
        head = _head_name(arch, name)
        if head is None:
            return TensorTarget.drop()
        m = _PER_EXPERT.match(head)
        if m:
            experts, index, proj = m.groups()
            return TensorTarget.to(f"{experts}.{proj}.weight", expert=int(index))
        return TensorTarget.to(head)
    name = strip_language_model_prefix(name)
    if is_tied_head(arch, name):
        return TensorTarget.drop()
    m = _SWITCH_MLP.match(name)
    if m:
        mlp, proj, leaf = m.groups()
        return TensorTarget.to(f"{mlp}.experts.{proj}.{leaf}")
    # State parameters stay float32 under --dtype, as in released checkpoints
    return TensorTarget.to(name, keep_dtype=bool(_KEEP_FLOAT32.search(name)))


def hf_transform(arch: dict[str, Any], name: str, data: Any) -> dict[str, Any] | None:
    """Split fused 3-D expert tensors; undo mlx-lm's ``1 + w`` on zero-centered norms."""
    if _DROP.search(name):
        return None
    if _MTP.search(name):
        head = _head_name(arch, name)
        m = None if head is None else _FUSED_EXPERTS.match(head)
        return None if m is None else _split_experts(arch, name, m.group(1), m.group(2), data)
    install = strip_language_model_prefix(name)
    m = _FUSED_EXPERTS.match(install)
    if m:
        return _split_experts(arch, name, m.group(1), m.group(2), data)
    if name.startswith(_MLX_LM_PREFIX) and _ZERO_CENTERED.search(install) and data.ndim == 1:
        # Exact in float32: the flow adds the 1 back in float32
        return {install: mx.array(data).astype(mx.float32) - 1.0}
    return None


def _split_experts(arch: dict[str, Any], name: str, base: str, proj: str, data: Any) -> dict[str, Any]:
    moe = arch.get("moe")
    if not moe:
        msg = f"fused expert tensor {name!r} in a checkpoint whose config declares no experts (num_experts)"
        raise ConversionError(msg)
    experts, inter = int(moe["num_experts"]), int(moe["moe_intermediate_size"])
    expected = (
        (experts, 2 * inter, arch["hidden_size"]) if proj == "gate_up_proj" else (experts, arch["hidden_size"], inter)
    )
    if tuple(data.shape) != expected:
        msg = f"fused expert tensor {name!r} has shape {tuple(data.shape)}, expected {expected} from the config"
        raise ConversionError(msg)
    if proj == "down_proj":
        return {f"{base}.down_proj.weight": data}
    return {f"{base}.gate_proj.weight": data[:, :inter], f"{base}.up_proj.weight": data[:, inter:]}
