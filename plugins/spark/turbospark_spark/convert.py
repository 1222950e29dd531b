"""Hugging Face (and mlx-lm) config and tensor-name mapping for Spark 2.5."""

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

from turbospark_spark.family import FULL, SLIDING, Args

# Released checkpoints list every layer; mlx-lm's fallback is three sliding layers then one full
_DEFAULT_PATTERN = (SLIDING, SLIDING, SLIDING, FULL)

_LAYER = re.compile(
    r"^model\.layers\.\d+\."
    r"(self_attn\.(q_k_v_proj|g_proj|out_proj)|mlp\.(gate_proj|up_proj|down_proj))"
    r"\.(weight|bias|scales|biases)$"
    r"|^model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight$"
)
_DROP = drop_pattern()
_TOP = re.compile(r"^(model\.embedding|lm_head)\.(weight|scales|biases)$|^model\.norm\.weight$")


def _layer_types(cfg: dict[str, Any]) -> list[str]:
    kinds = cfg.get("layer_types")
    if kinds is not None:
        return list(kinds)
    return [_DEFAULT_PATTERN[i % len(_DEFAULT_PATTERN)] for i in range(cfg["num_hidden_layers"])]


def _rope(params: Any, head_dim: int) -> dict[str, Any] | None:
    """One layer type's rope: theta, rotary dims (head_dim x partial factor), scaling."""
    if not isinstance(params, dict):
        return None
    return {
        "rope_theta": float(params.get("rope_theta", 10000.0)),
        "rotary_dim": int(head_dim * float(params.get("partial_rotary_factor", 1.0))),
        "rope_scaling": rope_scaling(params),
    }


def arch_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The install's arch config from a Spark 2.5 ``config.json``.

    Raises:
        ConversionError: The config asks for something the flow does not
            implement (named: activation, gate mode, layer type, rotary dims...).
    """
    cfg = hf_config
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kinds = _layer_types(cfg)
    rope_params = cfg.get("rope_parameters") or {}
    arch = {
        "model_type": cfg["model_type"],
        "hidden_size": cfg["hidden_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "intermediate_size": cfg.get("intermediate_size"),
        "vocab_size": cfg["vocab_size"],
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": cfg.get("max_position_embeddings", 8192),
        "sliding_window": cfg.get("sliding_window"),
        "layer_types": kinds,
        "rope": {kind: _rope(rope_params.get(kind), head_dim) for kind in sorted(set(kinds))},
        "hidden_act": cfg.get("hidden_act", "gelu"),
        "gate_attn_act_mode": cfg.get("gate_attn_act_mode", "sigmoid"),
        "headwise_attn_output_gate": cfg.get("headwise_attn_output_gate", True),
        "tie_word_embeddings": tied_embeddings(cfg, default=True),
    }
    problems = Args.problems(arch)
    if problems:
        msg = f"{cfg['model_type']} config.json is not supported: " + "; ".join(problems)
        raise ConversionError(msg)
    return arch


def hf_target(arch: dict[str, Any], name: str) -> TensorTarget:
    """Where a Spark 2.5 Hugging Face / mlx-lm tensor goes (names are kept).

    Raises:
        ConversionError: A tensor the flow has no place for, named.
    """
    # Some MLX conversions rename the embedding
    name = name.replace("model.embed_tokens.", "model.embedding.", 1)
    if _DROP.search(name) or is_tied_head(arch, name):
        return TensorTarget.drop()
    if _LAYER.match(name) or _TOP.match(name):
        # The tiny head gate stays at source precision (never cast or quantized), as in mlx-lm
        return TensorTarget.to(name, keep_dtype=".self_attn.g_proj." in name)
    msg = (
        f"source tensor {name!r} has no place in a {arch['model_type']} install; the checkpoint is not plain Spark 2.5"
    )
    raise ConversionError(msg)
