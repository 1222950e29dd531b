"""Hugging Face config and tensor-name mapping for the Gemma 4 text decoder (the tower: see vision_config)."""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx

from turbospark_core.family import (
    ConversionError,
    TensorTarget,
    drop_pattern,
    is_tied_head,
    strip_language_model_prefix,
    text_config,
    tied_embeddings,
)

# Transformers' Gemma4TextConfig defaults, for keys a config may omit
_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 9216,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "global_head_dim": 512,
    "num_global_key_value_heads": None,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "sliding_window": 512,
    "final_logit_softcapping": None,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "use_double_wide_mlp": False,
    "attention_bias": False,
}
_DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}
_SLIDING_PATTERN = 6  # transformers: five sliding layers, then one full


def _layer_types(cfg: dict[str, Any], layers: int) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % _SLIDING_PATTERN else "full_attention" for i in range(layers)]
    types = list(types)
    if types:
        types[-1] = "full_attention"  # transformers forces the last layer to full attention
    return types


def _rope(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    params = cfg.get("rope_parameters") or _DEFAULT_ROPE
    out = {}
    for kind in ("sliding_attention", "full_attention"):
        p = params.get(kind) or _DEFAULT_ROPE[kind]
        out[kind] = {
            "rope_type": p.get("rope_type", "default"),
            "rope_theta": float(p.get("rope_theta", _DEFAULT_ROPE[kind]["rope_theta"])),
            "partial_rotary_factor": float(p.get("partial_rotary_factor", 1.0)),
            "factor": float(p.get("factor", 1.0)),
        }
    return out


def _moe(cfg: dict[str, Any]) -> dict[str, Any] | None:
    if not cfg.get("enable_moe_block"):
        return None
    return {
        "num_experts": cfg.get("num_experts"),
        "top_k": cfg.get("top_k_experts"),
        "moe_intermediate_size": cfg.get("moe_intermediate_size"),
    }


def arch_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The install's arch config from a Hugging Face (or mlx-lm) ``config.json``.

    Raises:
        ConversionError: The config asks for bidirectional attention over all tokens.
    """
    cfg = {**_DEFAULTS, **text_config(hf_config)}
    if cfg.get("use_bidirectional_attention") == "all":
        msg = (
            "use_bidirectional_attention='all' (a non-causal encoder) is not supported; "
            "turbospark serves causal decoders"
        )
        raise ConversionError(msg)
    layers = cfg["num_hidden_layers"]
    return {
        "model_type": hf_config["model_type"],
        "hidden_size": cfg["hidden_size"],
        "num_hidden_layers": layers,
        "intermediate_size": cfg["intermediate_size"],
        "vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "head_dim": cfg["head_dim"],
        "global_head_dim": cfg["global_head_dim"],
        "num_global_key_value_heads": cfg["num_global_key_value_heads"],
        "layer_types": _layer_types(cfg, layers),
        "sliding_window": cfg["sliding_window"],
        "rope_parameters": _rope(cfg),
        "rms_norm_eps": float(cfg["rms_norm_eps"]),
        "hidden_activation": cfg["hidden_activation"],
        "final_logit_softcapping": cfg["final_logit_softcapping"],
        "hidden_size_per_layer_input": cfg["hidden_size_per_layer_input"] or 0,
        "vocab_size_per_layer_input": cfg["vocab_size_per_layer_input"],
        "num_kv_shared_layers": cfg["num_kv_shared_layers"] or 0,
        "attention_k_eq_v": bool(cfg["attention_k_eq_v"]),
        "use_double_wide_mlp": bool(cfg["use_double_wide_mlp"]),
        "moe": _moe(cfg),
        "tie_word_embeddings": tied_embeddings(hf_config, default=True),
        "pad_token_id": cfg.get("pad_token_id") or 0,  # image soft tokens read it in the per-layer inputs
    }


# ------------------------------------------------------------------ tensor names

_TOWERS = ("vision_tower", "embed_vision", "audio_tower", "embed_audio", "multi_modal_projector", "vision_embedder")
_DROP = drop_pattern(_TOWERS, extra=r"rotary_emb\.|\.(input|output)_(max|min)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_KV_PARTS = re.compile(r"^self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")
_MLX_EXPERTS = re.compile(r"^experts\.switch_glu\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")


def first_kv_shared_layer(arch: dict[str, Any]) -> int:
    """Index of the first layer that reuses an earlier layer's keys and values."""
    return int(arch["num_hidden_layers"]) - int(arch.get("num_kv_shared_layers") or 0)


def _unused_attention_part(arch: dict[str, Any], layer: int, rest: str) -> bool:
    """K/V tensors the flow never reads: on KV-shared layers, and v_proj where K = V."""
    m = _KV_PARTS.match(rest)
    if not m:
        return False
    if layer >= first_kv_shared_layer(arch):
        return True
    full = arch["layer_types"][layer] == "full_attention"
    return m.group(1) == "v_proj" and full and bool(arch.get("attention_k_eq_v"))


def hf_target(arch: dict[str, Any], name: str) -> TensorTarget:
    """Where a Hugging Face / mlx-lm tensor goes (vision/audio towers and unused K/V dropped)."""
    if _DROP.search(name):
        return TensorTarget.drop()
    name = strip_language_model_prefix(name)
    if is_tied_head(arch, name):
        return TensorTarget.drop()
    m = _LAYER.match(name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        if _unused_attention_part(arch, layer, rest):
            return TensorTarget.drop()
        mlx = _MLX_EXPERTS.match(rest)
        if mlx:
            return TensorTarget.to(f"model.layers.{layer}.experts.{mlx.group(1)}.{mlx.group(2)}")
        if rest == "experts.down_proj":  # Hugging Face stacks experts without a .weight leaf
            return TensorTarget.to(f"model.layers.{layer}.experts.down_proj.weight")
    return TensorTarget.to(name)


def hf_transform(arch: dict[str, Any], name: str, data: Any) -> dict[str, Any] | None:
    """Split Hugging Face's fused ``experts.gate_up_proj`` ``[E, 2I, D]`` into gate and up."""
    stripped = strip_language_model_prefix(name)
    m = _LAYER.match(stripped)
    if not m or m.group(2) != "experts.gate_up_proj":
        return None
    if not isinstance(data, mx.array) or data.ndim != 3 or data.shape[1] % 2:
        msg = f"{name!r}: expected a float [experts, 2 * moe_intermediate_size, hidden] tensor"
        raise ConversionError(msg)
    gate, up = mx.split(data, 2, axis=1)
    base = f"model.layers.{m.group(1)}.experts"
    return {f"{base}.gate_proj.weight": mx.contiguous(gate), f"{base}.up_proj.weight": mx.contiguous(up)}
