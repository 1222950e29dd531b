"""Hugging Face gpt-oss config and tensors -> the install's arch config and expert layout.

Released checkpoints keep the routed experts fused and transposed: per layer
``mlp.experts.gate_up_proj`` ``[E, hidden, 2 * I]`` with gate (even) and up
(odd) columns interleaved, ``down_proj`` ``[E, I, hidden]`` and their
``*_bias``; in MXFP4 checkpoints the core hands the matrices over already as
``[E, out, in]`` ``mxfp4`` quantized rows. The install stores the core's
expert layout: ``mlp.experts.{gate,up,down}_proj.{weight,bias}`` ``[E, out, in]``.
"""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx

from turbospark_core.family import (
    AffineQuantized,
    ConversionError,
    TensorTarget,
    drop_pattern,
    is_tied_head,
    rope_scaling,
    rope_theta,
    tied_embeddings,
)

# transformers' GptOssConfig default when config.json carries no rope parameters
_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or _DEFAULT_ROPE
    return rope_theta(cfg, params, 150000.0), rope_scaling(params)


def _layer_types(cfg: dict[str, Any], layers: int) -> list[str]:
    given = cfg.get("layer_types")
    if given is not None:
        return list(given)
    # transformers' default: sliding on even layers, full on odd ones
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]


def arch_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The install's arch config from a Hugging Face (or mlx-lm) gpt-oss ``config.json``."""
    cfg = hf_config
    heads = cfg["num_attention_heads"]
    layers = cfg["num_hidden_layers"]
    theta, scaling = _rope(cfg)
    return {
        "model_type": cfg["model_type"],
        "hidden_size": cfg["hidden_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "intermediate_size": cfg["intermediate_size"],
        "vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg.get("max_position_embeddings") or 131072,
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-5)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "sliding_window": cfg.get("sliding_window"),
        "layer_types": _layer_types(cfg, layers),
        "num_local_experts": cfg.get("num_local_experts") or cfg.get("num_experts"),
        "num_experts_per_tok": cfg["num_experts_per_tok"],
        "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
        "tie_word_embeddings": tied_embeddings(cfg),
    }


# ------------------------------------------------------------------ tensors

_DROP = drop_pattern()
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")
_INSTALLED_EXPERTS = re.compile(
    r"^model\.layers\.\d+\.mlp\.experts\.(gate_proj|up_proj|down_proj)\.(weight|bias|scales|biases)$"
)
# Everything else keeps its name; (mlx-lm quantized directories add .scales/.biases)
_KNOWN = re.compile(
    r"^((lm_head|model\.embed_tokens)\.(weight|scales|biases)|model\.norm\.weight"
    r"|model\.layers\.\d+\.(input_layernorm\.weight|post_attention_layernorm\.weight"
    r"|self_attn\.sinks|self_attn\.[qkvo]_proj\.(weight|bias|scales|biases)"
    r"|mlp\.router\.(weight|bias|scales|biases)))$"
)


def hf_target(arch: dict[str, Any], name: str) -> TensorTarget:
    """Where a Hugging Face / mlx-lm gpt-oss tensor goes (fused experts go through :func:`hf_transform`).

    Raises:
        ConversionError: A tensor with no place in a gpt-oss install, named.
    """
    if _DROP.search(name) or is_tied_head(arch, name):
        return TensorTarget.drop()
    if _KNOWN.match(name) or _INSTALLED_EXPERTS.match(name):
        return TensorTarget.to(name)
    msg = f"tensor {name!r} has no place in a gpt_oss install; the checkpoint is not a plain gpt-oss model"
    raise ConversionError(msg)


def _rows(data: Any, start: int) -> Any:
    """Every other row (axis -2) from ``start``: the gate (0) or up (1) half of a fused projection."""
    if isinstance(data, AffineQuantized):
        return data.take_rows(slice(start, None, 2))
    return data[..., start::2, :]


def _out_in(data: Any, name: str) -> Any:
    """A float ``[E, in, out]`` matrix as ``[E, out, in]``; an MXFP4 one already is."""
    if isinstance(data, AffineQuantized):
        return data
    if data.ndim != 3:
        msg = f"expert tensor {name!r} has shape {list(data.shape)}; expected [experts, in, out]"
        raise ConversionError(msg)
    return mx.swapaxes(data, -1, -2)


def hf_transform(arch: dict[str, Any], name: str, data: Any) -> dict[str, Any] | None:
    """Split the fused, interleaved expert tensors into the install's gate/up/down layout.

    Returns:
        Install name -> tensor for ``mlp.experts.gate_up_proj``/``down_proj``
        (and their ``_bias``), ``None`` for every other tensor.
    """
    m = _FUSED.match(name)
    if not m:
        return None
    prefix, proj, bias = m.groups()
    if bias:
        if proj == "down_proj":
            return {f"{prefix}.down_proj.bias": data}
        return {f"{prefix}.gate_proj.bias": data[..., 0::2], f"{prefix}.up_proj.bias": data[..., 1::2]}
    w = _out_in(data, name)
    if proj == "down_proj":
        return {f"{prefix}.down_proj.weight": w}
    return {f"{prefix}.gate_proj.weight": _rows(w, 0), f"{prefix}.up_proj.weight": _rows(w, 1)}
