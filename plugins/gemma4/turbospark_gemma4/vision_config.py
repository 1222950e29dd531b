# Copyright 2026 the turbospark authors. Apache-2.0.
"""The Gemma 4 vision tower's config: read from a checkpoint's ``vision_config``, validated by key."""

from __future__ import annotations

from typing import Any, cast

import attrs

from turbospark_core.family import (
    MAX_FLOAT,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_INTERMEDIATE,
    MAX_LAYERS,
    ArchConfigError,
    TensorTarget,
    VisionSpec,
    bool_problem,
    float_problem,
    int_problems,
)

TOWER = "vision_tower"  # the encoder's tensors, under this name in a sidecar
PROJECTOR = "embed_vision"  # the projection into the text width
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
MAX_PATCH = 64  # pixels per patch side
MAX_POSITION_TABLE = 4096  # patches per image side the learned position table may cover
_INTS = {
    "hidden_size": MAX_HIDDEN, "intermediate_size": MAX_INTERMEDIATE, "num_hidden_layers": MAX_LAYERS,
    "num_attention_heads": MAX_HEADS, "num_key_value_heads": MAX_HEADS, "head_dim": MAX_HEAD_DIM,
    "patch_size": MAX_PATCH, "pooling_kernel_size": MAX_PATCH, "position_embedding_size": MAX_POSITION_TABLE,
    "text_hidden_size": MAX_HIDDEN,
}  # fmt: skip
_BOOLS = ("standardize", "use_clipped_linears")


@attrs.frozen(kw_only=True)
class VisionArgs:
    """The tower's shape: the keys of :func:`vision_arch_from_hf`'s result."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    rms_norm_eps: float
    rope_theta: float
    hidden_activation: str
    standardize: bool
    use_clipped_linears: bool
    text_hidden_size: int

    @classmethod
    def from_arch(cls, arch: dict[str, Any]) -> VisionArgs:
        """Build from a tower arch config, refusing (by key) what the tower cannot run.

        Raises:
            ArchConfigError: Every problem :meth:`problems` finds, joined.
        """
        problems = cls.problems(arch)
        if problems:
            raise ArchConfigError("gemma4 vision tower: " + "; ".join(problems))
        return cls(**{a.name: arch[a.name] for a in attrs.fields(cls)})

    @staticmethod
    def problems(arch: dict[str, Any]) -> list[str]:
        """What in ``arch`` the tower cannot run, each naming its key (empty when valid)."""
        missing = sorted({a.name for a in attrs.fields(VisionArgs)} - set(arch))
        out = [f"{key!r} is missing" for key in missing]
        if missing:
            return out
        out += int_problems(arch, _INTS)
        floats = (float_problem(arch, "rms_norm_eps", 1.0), float_problem(arch, "rope_theta", MAX_FLOAT))
        out += [p for p in floats if p]
        out += [p for key in _BOOLS if (p := bool_problem(arch, key))]
        if arch["hidden_activation"] not in ACTIVATIONS:
            out.append(f"hidden_activation={arch['hidden_activation']!r} is not one of {ACTIVATIONS}")
        if out:
            return out
        if arch["head_dim"] % 4:
            out.append(f"head_dim={arch['head_dim']} must be a multiple of 4 (two rotary halves, x and y)")
        if arch["num_attention_heads"] % arch["num_key_value_heads"]:
            out.append("num_attention_heads is not a multiple of num_key_value_heads")
        return out


def vision_arch_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The tower's arch config from a Gemma 4 ``config.json`` (its ``vision_config`` section).

    Raises:
        ArchConfigError: The checkpoint has no ``vision_config`` object.
    """
    vision = hf_config.get("vision_config")
    if not isinstance(vision, dict):
        msg = "gemma4 checkpoint has no 'vision_config' object: there is no vision tower to convert"
        raise ArchConfigError(msg)
    text = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), dict) else hf_config
    rope = vision.get("rope_parameters") or {}
    return {
        "hidden_size": vision.get("hidden_size"),
        "intermediate_size": vision.get("intermediate_size"),
        "num_hidden_layers": vision.get("num_hidden_layers"),
        "num_attention_heads": vision.get("num_attention_heads"),
        "num_key_value_heads": vision.get("num_key_value_heads", vision.get("num_attention_heads")),
        "head_dim": vision.get("head_dim"),
        "patch_size": vision.get("patch_size"),
        "pooling_kernel_size": vision.get("pooling_kernel_size"),
        "position_embedding_size": vision.get("position_embedding_size"),
        "rms_norm_eps": vision.get("rms_norm_eps", 1e-6),
        "rope_theta": rope.get("rope_theta", 100.0) if isinstance(rope, dict) else None,
        "hidden_activation": vision.get("hidden_activation", "gelu_pytorch_tanh"),
        "standardize": bool(vision.get("standardize", False)),
        "use_clipped_linears": bool(vision.get("use_clipped_linears", False)),
        "text_hidden_size": text.get("hidden_size") if isinstance(text, dict) else None,
    }



def vision_spec(hf_config: dict[str, Any]) -> VisionSpec | None:
    """What a vision sidecar records about a Gemma 4 checkpoint's tower (``None`` without a ``vision_config``).

    Raises:
        ArchConfigError: The tower config is one the tower cannot run (by key), or the text
            model asks for bidirectional attention inside images, which the flow does not do.
    """
    if hf_config.get("model_type") != "gemma4" or not isinstance(hf_config.get("vision_config"), dict):
        return None
    text = hf_config.get("text_config")
    mode = text.get("use_bidirectional_attention") if isinstance(text, dict) else None
    if mode is not None:
        msg = (f"text_config.use_bidirectional_attention={mode!r}: the gemma4 flow attends causally over "
               "image tokens; only null is served")  # fmt: skip
        raise ArchConfigError(msg)
    vision = {"model_type": "gemma4", **vision_arch_from_hf(hf_config)}
    problems = VisionArgs.problems(vision)
    if problems:
        raise ArchConfigError("gemma4 vision tower: " + "; ".join(problems))
    tokens = {name: hf_config.get(f"{name}_token_id") for name in ("image", "boi", "eoi")}
    missing = [f"{name}_token_id" for name, value in tokens.items() if not isinstance(value, int)]
    if missing:
        raise ArchConfigError(f"gemma4 config has no integer {missing[0]!r}: the image placeholders are unknown")
    return VisionSpec(vision=vision, tokens=cast(dict[str, int], tokens), hidden_size=int(vision["text_hidden_size"]))


_SIDECAR_PREFIXES = {f"{root}{part}.": f"{part}." for part in (TOWER, PROJECTOR) for root in ("model.", "")}


def vision_target(name: str) -> TensorTarget:
    """The tower's tensors (Hugging Face ``model.vision_tower.*`` / ``model.embed_vision.*``, or
    without ``model.``) keep their name under ``vision_tower.`` / ``embed_vision.``; the rest is dropped."""
    for prefix, target in _SIDECAR_PREFIXES.items():
        if name.startswith(prefix):
            return TensorTarget.to(target + name[len(prefix) :])
    return TensorTarget.drop()
