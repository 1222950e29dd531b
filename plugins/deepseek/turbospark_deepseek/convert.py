"""Hugging Face config and tensor-name mapping for DeepSeek-V2 / V3 checkpoints.

Every config field whose behaviour the flow does not implement is refused here,
by name, with the fix; the install's arch config holds only what the flow reads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from turbospark_core.family import (
    ConversionError,
    TensorTarget,
    is_tied_head,
    rope_scaling,
    rope_theta,
    strip_language_model_prefix,
    text_config,
    tied_embeddings,
)

from turbospark_deepseek import REFUSED_MODEL_TYPES

# (scoring_func, topk_method) pairs the router implements
ROUTINGS = {
    ("softmax", "greedy"),
    ("softmax", "group_limited_greedy"),
    ("sigmoid", "noaux_tc"),
}
ROPE_KINDS = ("yarn",)


def refuse_model_type(model_type: str) -> None:
    """Raise for a claimed DeepSeek model type that has no flow here."""
    if model_type in REFUSED_MODEL_TYPES or model_type.startswith("deepseek_v4"):
        reason = REFUSED_MODEL_TYPES.get(model_type, f"{model_type} (deepseek_v4*) has no decode flow here")
        msg = f"model type {model_type!r} is refused: {reason}; serve deepseek_v2 or deepseek_v3 checkpoints"
        raise ConversionError(msg)


def _refuse(field: str, value: Any, why: str) -> None:
    raise ConversionError(f"DeepSeek config field {field}={value!r} is not supported: {why}")


def _check_fields(cfg: Mapping[str, Any]) -> None:
    """Refuse, by name, each field whose behaviour the flow does not implement."""
    if cfg.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", cfg["hidden_act"], "the MLPs are SwiGLU (silu) only")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            _refuse(key, cfg[key], "the flow has no projection biases; use a checkpoint without them")
    if cfg.get("rope_interleave", True) is not True:
        _refuse("rope_interleave", cfg["rope_interleave"], "DeepSeek checkpoints rotate interleaved pairs")
    quant = cfg.get("quantization_config")
    if isinstance(quant, Mapping) and quant.get("quant_method") == "fp8":
        _refuse(
            "quantization_config.quant_method", "fp8",
            "FP8 block-scaled weights have no kernel here; convert a bf16 copy (or an mlx-community one)",
        )  # fmt: skip
    if cfg.get("n_routed_experts"):
        scoring, method = cfg.get("scoring_func", "softmax"), cfg.get("topk_method", "greedy")
        if (scoring, method) not in ROUTINGS:
            _refuse("scoring_func/topk_method", (scoring, method), f"the router implements {sorted(ROUTINGS)}")
        if scoring == "softmax" and cfg.get("norm_topk_prob"):
            _refuse(
                "norm_topk_prob", True,
                "with softmax scoring DeepSeek's code and transformers/mlx-lm disagree on it "
                "(renormalise and drop routed_scaling_factor, or ignore it); every V2 release sets false",
            )  # fmt: skip


def _scaling(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    scaling = rope_scaling(cfg.get("rope_scaling") or cfg.get("rope_parameters"))
    if scaling is not None and scaling["rope_type"] not in ROPE_KINDS:
        _refuse("rope_scaling.type", scaling["rope_type"], f"DeepSeek flows implement {ROPE_KINDS} (or none)")
    return scaling


def _moe(cfg: Mapping[str, Any], layers: int) -> dict[str, Any] | None:
    experts = cfg.get("n_routed_experts")
    if not experts:
        return None
    first, freq = int(cfg.get("first_k_dense_replace") or 0), int(cfg.get("moe_layer_freq") or 1)
    return {
        "num_experts": experts,
        "top_k": cfg["num_experts_per_tok"],
        "scoring": cfg.get("scoring_func", "softmax"),
        "topk_method": cfg.get("topk_method", "greedy"),
        "n_group": cfg.get("n_group") or 1,
        "topk_group": cfg.get("topk_group") or 1,
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0),
        "n_shared_experts": cfg.get("n_shared_experts") or 0,
        "sparse_layers": [i for i in range(layers) if i >= first and i % freq == 0],
    }


def arch_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The install's arch config from a Hugging Face (or mlx-lm) DeepSeek config.json.

    A ``head_dim`` key is ignored (transformers writes the rope width there, not
    the attention head size); V3's MTP layers (``num_nextn_predict_layers``) are dropped.
    """
    model_type = hf_config["model_type"]
    refuse_model_type(model_type)
    cfg = text_config(hf_config)
    _check_fields(cfg)
    layers = cfg["num_hidden_layers"]
    return {
        "model_type": model_type,
        "hidden_size": cfg["hidden_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": cfg["num_attention_heads"],
        "vocab_size": cfg["vocab_size"],
        "intermediate_size": cfg["intermediate_size"],
        "moe_intermediate_size": cfg.get("moe_intermediate_size"),
        "q_lora_rank": cfg.get("q_lora_rank"),
        "kv_lora_rank": cfg["kv_lora_rank"],
        "qk_nope_head_dim": cfg["qk_nope_head_dim"],
        "qk_rope_head_dim": cfg["qk_rope_head_dim"],
        "v_head_dim": cfg["v_head_dim"],
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": rope_theta(cfg, cfg.get("rope_parameters"), 10000.0),
        "rope_scaling": _scaling(cfg),
        "max_position_embeddings": cfg.get("max_position_embeddings"),
        "tie_word_embeddings": tied_embeddings(hf_config),
        "moe": _moe(cfg, layers),
    }


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_PROJ = r"(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$"
_EXPERT = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(\d+)\." + _PROJ)
_STACKED = re.compile(r"^(model\.layers\.\d+)\.mlp\.switch_mlp\." + _PROJ)
_MLX_SPLIT = re.compile(r"\.self_attn\.(embed_q|unembed_out)\.")


def hf_target(arch: dict[str, Any], name: str) -> TensorTarget:
    """Where a Hugging Face / mlx-lm tensor goes (routed experts: one stacked tensor per projection)."""
    name = strip_language_model_prefix(name)
    if is_tied_head(arch, name) or name.endswith("rotary_emb.inv_freq"):
        return TensorTarget.drop()
    layer = _LAYER.match(name)
    if layer and int(layer.group(1)) >= arch["num_hidden_layers"]:
        return TensorTarget.drop()  # V3's MTP layers sit after the trunk; no drafter uses them yet
    if _MLX_SPLIT.search(name):
        msg = (
            f"tensor {name!r} is mlx-lm's split of kv_b_proj, which this converter does not rejoin; "
            f"convert the Hugging Face checkpoint instead"
        )
        raise ConversionError(msg)
    m = _EXPERT.match(name)
    if m:
        prefix, expert, proj, leaf = m.groups()
        return TensorTarget.to(f"{prefix}.mlp.experts.{proj}.{leaf}", expert=int(expert))
    m = _STACKED.match(name)
    if m:
        prefix, proj, leaf = m.groups()
        return TensorTarget.to(f"{prefix}.mlp.experts.{proj}.{leaf}")
    return TensorTarget.to(name)
