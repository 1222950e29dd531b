"""Hugging Face / GGUF config and tensor-name mapping for Gemma 3 text models."""

from __future__ import annotations

import re
from typing import Any

from turbospark_core.family import (
    ConversionError,
    TensorTarget,
    drop_pattern,
    is_tied_head,
    rope_scaling,
    tied_embeddings,
)

# Transformers' defaults for Gemma 3 (Gemma3TextConfig.default_theta, sliding_window_pattern)
GLOBAL_THETA = 1_000_000.0
LOCAL_THETA = 10_000.0
SLIDING_PATTERN = 6
SLIDING, FULL = "sliding_attention", "full_attention"


def _layer_types(cfg: dict[str, Any], layers: int, pattern: int) -> list[str]:
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    # Every `pattern`-th layer is global (Gemma3TextConfig.__post_init__)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]


def _rope(cfg: dict[str, Any]) -> tuple[float, float, dict[str, Any] | None, dict[str, Any] | None]:
    """(global theta, local theta, global scaling, local scaling) from either config style."""
    params = cfg.get("rope_parameters") or {}
    full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
    global_theta = float(full.get("rope_theta") or cfg.get("rope_theta") or GLOBAL_THETA)
    local_theta = float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or LOCAL_THETA)
    if not set(full) - {"rope_theta"}:  # legacy configs: rope_scaling applies to the global layers only
        full = cfg.get("rope_scaling") or {}
    return global_theta, local_theta, rope_scaling(full), rope_scaling(local)


def arch_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The install's arch config from a Hugging Face ``gemma3_text`` config.json."""
    cfg = hf_config
    layers = cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    global_theta, local_theta, scaling, local_scaling = _rope(cfg)
    return {
        "model_type": cfg["model_type"],
        "hidden_size": cfg["hidden_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "intermediate_size": cfg["intermediate_size"],
        "vocab_size": cfg["vocab_size"],
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": cfg.get("max_position_embeddings") or 131072,
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or 256),
        "sliding_window": cfg.get("sliding_window") or 4096,
        "layer_types": _layer_types(cfg, layers, cfg.get("sliding_window_pattern") or SLIDING_PATTERN),
        "rope_theta": global_theta,
        "rope_local_base_freq": local_theta,
        "rope_scaling": scaling,
        "rope_local_scaling": local_scaling,
        "hidden_activation": cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping"),
        "use_bidirectional_attention": bool(cfg.get("use_bidirectional_attention")),
        "tie_word_embeddings": tied_embeddings(cfg, default=True),
        # Hugging Face stores w and the flow multiplies by (1 + w)
        "norm_adds_one": True,
    }


_DROP = drop_pattern()
_HF_NAME = re.compile(
    r"model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight"
    r"|model\.layers\.\d+\.(?:input_layernorm|post_attention_layernorm|pre_feedforward_layernorm"
    r"|post_feedforward_layernorm|self_attn\.[qk]_norm)\.weight"
    r"|model\.layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.(?:weight|bias|scales|biases)"
)


def hf_target(arch: dict[str, Any], name: str) -> TensorTarget:
    """Where a Hugging Face (or mlx-lm) Gemma 3 tensor goes: the same name, or dropped."""
    if _DROP.search(name) or is_tied_head(arch, name):
        return TensorTarget.drop()
    if not _HF_NAME.fullmatch(name):
        msg = f"tensor {name!r} has no place in a gemma3_text install; the checkpoint is not a Gemma 3 text model"
        raise ConversionError(msg)
    return TensorTarget.to(name)


# ------------------------------------------------------------------ GGUF

_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp's Gemma 3 27B (62 layers) scales queries by hidden/heads, the others by head_dim
_LAYERS_27B = 62


def arch_from_gguf(architecture: str, md: dict[str, Any]) -> dict[str, Any]:
    """The install's arch config from GGUF ``gemma3.*`` metadata (llama.cpp's conventions)."""

    def get(key: str, default: Any = None) -> Any:
        return md.get(f"{architecture}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    layers = int(get("block_count"))
    head_dim = int(get("attention.key_length") or hidden // heads)
    # llama.cpp fixes the pattern at 6 for gemma3; newer files may carry it (a period, or one flag per layer)
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == layers:
        layer_types = [SLIDING if swa else FULL for swa in pattern]
    else:
        layer_types = _layer_types({}, layers, pattern if isinstance(pattern, int) and pattern > 0 else SLIDING_PATTERN)
    return {
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "intermediate_size": int(get("feed_forward_length")),
        "vocab_size": int(get("vocab_size") or len(md.get("tokenizer.ggml.tokens") or [])),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length") or 131072),
        "query_pre_attn_scalar": float(hidden // heads if layers == _LAYERS_27B else head_dim),
        "sliding_window": int(get("attention.sliding_window") or 4096),
        "layer_types": layer_types,
        "rope_theta": float(get("rope.freq_base", GLOBAL_THETA)),
        "rope_local_base_freq": float(get("rope.freq_base_swa", LOCAL_THETA)),
        "rope_scaling": _gguf_rope_scaling(architecture, md),
        "rope_local_scaling": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": get("final_logit_softcapping"),
        "attn_logit_softcapping": get("attn_logit_softcapping"),
        "use_bidirectional_attention": False,
        "tie_word_embeddings": True,  # decided by whether output.weight exists
        # llama.cpp's converter stores Gemma norms as (1 + w) already
        "norm_adds_one": False,
    }


def _gguf_rope_scaling(architecture: str, md: dict[str, Any]) -> dict[str, Any] | None:
    kind = md.get(f"{architecture}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        msg = f"GGUF {architecture}.rope.scaling.type {kind!r} is not supported for Gemma 3 (supported: linear)"
        raise ConversionError(msg)
    return {"rope_type": "linear", "factor": float(md[f"{architecture}.rope.scaling.factor"])}


def gguf_target(arch: dict[str, Any], name: str) -> TensorTarget:
    """Where a GGUF Gemma 3 tensor goes (NEOX rope: rows need no unpermuting)."""
    base, _, leaf = name.rpartition(".")
    if base in _GGUF_TOP:
        return TensorTarget.to(f"{_GGUF_TOP[base]}.{leaf}")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if not m or m.group(2) not in _GGUF_LAYER:
        msg = f"GGUF tensor {name!r} has no place in a gemma3 install; the file is not a Gemma 3 text model"
        raise ConversionError(msg)
    layer, kind = m.groups()
    return TensorTarget.to(f"model.layers.{layer}.{_GGUF_LAYER[kind]}.{leaf}")
