"""Hugging Face / GGUF config and tensor-name mapping for the Llama-style family."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

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

_MOE_TYPES = ("qwen3_moe", "minimax_m2")
_IMPLIED_QKV_BIAS = ("qwen2",)


def _moe(cfg: Mapping[str, Any], model_type: str, layers: int) -> dict[str, Any] | None:
    if model_type not in _MOE_TYPES:
        return None
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if model_type == "minimax_m2":
        return {
            "num_experts": experts,
            "top_k": cfg["num_experts_per_tok"],
            "scoring": cfg.get("scoring_func", "sigmoid"),
            "norm_topk_prob": True,
            "sparse_layers": list(range(layers)),
        }
    step = cfg.get("decoder_sparse_step") or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    return {
        "num_experts": experts,
        "top_k": cfg["num_experts_per_tok"],
        "scoring": "softmax",
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
        "sparse_layers": [i for i in range(layers) if i not in dense and (i + 1) % step == 0],
    }


def _qk_norm(cfg: Mapping[str, Any], model_type: str) -> str | None:
    if model_type == "minimax_m2":
        return "full" if cfg.get("use_qk_norm", True) else None
    return "head" if model_type in ("qwen3", "qwen3_moe", "qwen3_vl") else None


def arch_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The install's arch config from a Hugging Face (or mlx-lm) config.json."""
    model_type = hf_config["model_type"]
    cfg = text_config(hf_config)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rotary_dim = cfg.get("rotary_dim") or int(head_dim * float(cfg.get("partial_rotary_factor", 1.0)))
    layers = cfg["num_hidden_layers"]
    return {
        "model_type": model_type,
        "hidden_size": cfg["hidden_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "rotary_dim": rotary_dim,
        "intermediate_size": cfg.get("intermediate_size"),
        "vocab_size": cfg["vocab_size"],
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": rope_theta(cfg, cfg.get("rope_parameters"), 10000.0),
        "rope_scaling": rope_scaling(cfg.get("rope_scaling") or cfg.get("rope_parameters")),
        "max_position_embeddings": cfg.get("max_position_embeddings"),
        "tie_word_embeddings": tied_embeddings(hf_config),
        "qk_norm": _qk_norm(cfg, model_type),
        "moe": _moe(cfg, model_type, layers),
        **_mrope(cfg),
    }


def _mrope(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen-VL's multimodal rope sections (``{"mrope": {...}}``), used only for image positions; else ``{}``."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    section = params.get("mrope_section") if isinstance(params, Mapping) else None
    if not section:
        return {}
    return {"mrope": {"section": list(section), "interleaved": bool(params.get("mrope_interleaved", False))}}


_DROP = drop_pattern(VISION_TOWERS + MTP_HEADS)
_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.(weight|scales|biases)$")
_STACKED = re.compile(
    r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.(?:switch_mlp|experts)\.(\w+)\.(weight|scales|biases)$"
)
_MINIMAX_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def hf_target(arch: dict[str, Any], name: str) -> TensorTarget:
    """Where a Hugging Face / mlx-lm tensor goes."""
    if _DROP.search(name):
        return TensorTarget.drop()
    name = strip_language_model_prefix(name)
    if is_tied_head(arch, name):
        return TensorTarget.drop()
    m = _EXPERT.match(name)
    if m:
        layer, expert, proj, leaf = m.groups()
        proj = _MINIMAX_PROJ.get(proj, proj)
        return TensorTarget.to(f"{layer}.mlp.experts.{proj}.{leaf}", expert=int(expert))
    m = _STACKED.match(name)
    if m:
        layer, proj, leaf = m.groups()
        return TensorTarget.to(f"{layer}.mlp.experts.{_MINIMAX_PROJ.get(proj, proj)}.{leaf}")
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return TensorTarget.to(name)


# ------------------------------------------------------------------ GGUF

_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_SCALING = ("linear", "yarn")


def arch_from_gguf(architecture: str, md: dict[str, Any], tensor_names: list[str] | None = None) -> dict[str, Any]:
    """The install's arch config from GGUF ``llama.*`` metadata (a file without ``output.weight`` ties the head)."""
    def get(key: str, default: Any = None) -> Any:
        return md.get(f"{architecture}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads)
    vocab = get("vocab_size") or len(md.get("tokenizer.ggml.tokens") or [])
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rotary_dim": int(get("rope.dimension_count") or head_dim),
        "intermediate_size": int(get("feed_forward_length")),
        "vocab_size": int(vocab),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": _gguf_rope_scaling(architecture, md),
        "max_position_embeddings": int(get("context_length") or 4096),
        "tie_word_embeddings": tensor_names is not None and "output.weight" not in tensor_names,
        "qk_norm": None,
        "moe": None,
    }


def _gguf_rope_scaling(architecture: str, md: dict[str, Any]) -> dict[str, Any] | None:
    kind = md.get(f"{architecture}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in _GGUF_SCALING:
        msg = f"GGUF rope scaling type {kind!r} is not supported (supported: {', '.join(_GGUF_SCALING)})"
        raise ConversionError(msg)
    factor = float(md[f"{architecture}.rope.scaling.factor"])
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
    original = md.get(f"{architecture}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def gguf_target(arch: dict[str, Any], name: str) -> TensorTarget:
    """Where a GGUF tensor goes; q/k rows are un-permuted to the Hugging Face rotary layout."""
    base, _, leaf = name.rpartition(".")
    if base == "rope_freqs":
        msg = (
            "GGUF tensor 'rope_freqs.weight' (precomputed Llama-3 rope frequencies) is not "
            "supported yet; convert the Hugging Face checkpoint instead"
        )
        raise ConversionError(msg)
    if base in _GGUF_TOP:
        return TensorTarget.to(f"{_GGUF_TOP[base]}.{leaf}")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if not m or m.group(2) not in _GGUF_LAYER:
        msg = f"GGUF tensor {name!r} has no place in a llama install; the file is not a plain llama model"
        raise ConversionError(msg)
    layer, kind = m.groups()
    heads = {"attn_q": arch["num_attention_heads"], "attn_k": arch["num_key_value_heads"]}.get(kind)
    return TensorTarget(name=f"model.layers.{layer}.{_GGUF_LAYER[kind]}.{leaf}", unpermute_heads=heads)
