"""A DFlash drafter's config: read from a z-lab-style checkpoint, checked with bounds, stored in its install.

A DFlash drafter (z-lab, "Block Diffusion for Flash Speculative Decoding")
is a few pre-norm decoder layers (q/k head norms, SwiGLU) that draft a whole block of tokens in one
forward, reading the hidden states of some TARGET layers. Its checkpoint
config is a decoder config with ``architectures: ["DFlashDraftModel"]``,
``block_size``, ``num_target_layers`` and ``dflash_config: {mask_token_id,
target_layer_ids}``. The install keeps a flat arch (``model_type`` is
:data:`DRAFTER_MODEL_TYPE`) and the manifest kind :data:`DFLASH_KIND`.
"""

from __future__ import annotations

from typing import Any

import attrs

from turbospark_core.arch_check import (
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_INTERMEDIATE,
    MAX_LAYERS,
    MAX_POSITIONS,
    float_problem,
    generic_problems,
    int_problem,
    int_problems,
    is_int,
)
from turbospark_core.manifest import DFLASH_KIND
from turbospark_core.rope import ROPE_TYPES

__all__ = ["DFLASH_KIND", "DFlashConfig", "arch_from_hf", "arch_problems", "default_target_layers"]

DRAFTER_MODEL_TYPE = "dflash"
ARCHITECTURE = "DFlashDraftModel"
MAX_BLOCK = 256  # tokens per block: far above the released 16, bounds the per-round forward
_REQUIRED = {
    "num_attention_heads": MAX_HEADS,
    "num_key_value_heads": MAX_HEADS,
    "head_dim": MAX_HEAD_DIM,
    "intermediate_size": MAX_INTERMEDIATE,
    "block_size": MAX_BLOCK,
}
_FULL_ATTENTION = "full_attention"
# The arch keys an install keeps (everything the flow reads, nothing else).
ARCH_KEYS = (
    "model_type",
    "hidden_size",
    "vocab_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "num_target_layers",
    "layer_types",
)


def default_target_layers(num_target_layers: int, num_layers: int) -> list[int]:
    """z-lab's (and vLLM's, SGLang's) choice when a config names no ``target_layer_ids``.

    ``[L // 2]`` for one drafter layer, else ``round(1 + i * (L - 4) / (n - 1))``
    for ``i = 0 .. n-1`` (L = 36, n = 5 give ``[1, 9, 17, 25, 33]``).
    """
    if num_layers == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_layers - 1)) for i in range(num_layers)]


def is_dflash_config(config: dict[str, Any]) -> bool:
    """Whether a checkpoint's ``config.json`` is a DFlash drafter's (by its architectures)."""
    archs = config.get("architectures")
    return isinstance(archs, list) and any(isinstance(a, str) and a.startswith("DFlash") for a in archs)


def arch_from_hf(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The install arch of a drafter checkpoint config, and the problems that refuse it (empty: fine).

    ``mask_token_id``, ``target_layer_ids`` are read from ``dflash_config`` or
    the top level (SGLang accepts both); ``target_layer_ids`` defaults as
    :func:`default_target_layers` says.
    """
    archs = config.get("architectures")
    if archs != [ARCHITECTURE]:
        return {}, [
            f"architectures is {archs!r:.80}; only {ARCHITECTURE!r} is supported "
            "(DFlash2DraftModel and other variants are not)"
        ]
    section = config.get("dflash_config") or {}
    if not isinstance(section, dict):
        return {}, [f"'dflash_config' must be an object (got {type(section).__name__})"]
    problems = []
    for key, value in (("target_hidden_size", config.get("target_hidden_size")),):
        if value is not None and value != config.get("hidden_size"):
            problems.append(f"{key}={value!r:.40} differs from hidden_size; such drafters are not supported")
    for key in ("attention_bias", "use_sliding_window"):
        if config.get(key):
            problems.append(f"{key!r} is set; DFlash drafters here have no biases and no sliding window")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act {act!r:.40} is not supported (silu only)")
    arch = {key: config.get(key) for key in ARCH_KEYS}
    arch["model_type"] = DRAFTER_MODEL_TYPE
    arch["mask_token_id"] = section.get("mask_token_id", config.get("mask_token_id"))
    arch["target_layer_ids"] = section.get("target_layer_ids", config.get("target_layer_ids"))
    if arch["target_layer_ids"] is None and is_int(arch["num_target_layers"]) and is_int(arch["num_hidden_layers"]):
        arch["target_layer_ids"] = default_target_layers(arch["num_target_layers"], arch["num_hidden_layers"])
    if arch["layer_types"] is None and is_int(arch["num_hidden_layers"]):
        arch["layer_types"] = [_FULL_ATTENTION] * arch["num_hidden_layers"]
    if arch["rms_norm_eps"] is None:
        arch["rms_norm_eps"] = 1e-6
    if arch["rope_theta"] is None:
        arch["rope_theta"] = 10000.0
    return arch, problems + arch_problems(arch)


def arch_problems(arch: dict[str, Any]) -> list[str]:
    """The bounded checks of a drafter arch (empty when valid): run at convert and at every open."""
    if arch.get("model_type") != DRAFTER_MODEL_TYPE:
        return [f"model_type is {arch.get('model_type')!r:.60}, not {DRAFTER_MODEL_TYPE!r}"]
    unknown = sorted(set(arch) - set(ARCH_KEYS), key=str)
    if unknown:
        return [f"unknown arch key(s) {', '.join(map(repr, unknown[:6]))}"]
    problems = generic_problems(arch)
    problems += int_problems(arch, _REQUIRED)
    problems += [p for p in (float_problem(arch, "rms_norm_eps", 1.0), float_problem(arch, "rope_theta", low=1.0)) if p]
    problems += [p for p in (int_problem(arch, "max_position_embeddings", MAX_POSITIONS, optional=True),) if p]
    problems += [p for p in (int_problem(arch, "num_target_layers", MAX_LAYERS, optional=True),) if p]
    if problems:
        return problems
    if arch["block_size"] < 2:
        problems.append(f"'block_size' must be at least 2 (one anchor and a mask slot), got {arch['block_size']}")
    mask = arch.get("mask_token_id")
    if not (is_int(mask) and 0 <= mask < arch["vocab_size"]):
        problems.append(f"'mask_token_id' must be a token id in [0, {arch['vocab_size']}) (got {mask!r:.40})")
    ids = arch.get("target_layer_ids")
    if not (
        isinstance(ids, list)
        and 0 < len(ids) <= MAX_LAYERS
        and all(is_int(i) and 0 <= i < MAX_LAYERS for i in ids)
        and len(set(ids)) == len(ids)
    ):
        problems.append(f"'target_layer_ids' must list distinct target layers in [0, {MAX_LAYERS}) (got {ids!r:.80})")
    bad_types = [t for t in arch["layer_types"] or () if t != _FULL_ATTENTION]
    if bad_types:
        problems.append(f"layer type {bad_types[0]!r:.40} is not supported; DFlash layers here are full_attention")
    if arch["head_dim"] % 2:
        problems.append(f"'head_dim' must be even (RoPE rotates pairs), got {arch['head_dim']}")
    rope = arch.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        problems.append(f"rope_scaling type {rope_type!r:.40} is not supported; supported: {', '.join(ROPE_TYPES)}")
    return problems


@attrs.frozen(kw_only=True)
class DFlashConfig:
    """A checked drafter arch, typed (build it with :meth:`from_arch`)."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]

    @classmethod
    def from_arch(cls, arch: dict[str, Any]) -> DFlashConfig:
        """Type an arch that :func:`arch_problems` passed."""
        return cls(
            hidden_size=int(arch["hidden_size"]),
            vocab_size=int(arch["vocab_size"]),
            num_layers=int(arch["num_hidden_layers"]),
            num_heads=int(arch["num_attention_heads"]),
            num_kv_heads=int(arch["num_key_value_heads"]),
            head_dim=int(arch["head_dim"]),
            intermediate_size=int(arch["intermediate_size"]),
            rms_norm_eps=float(arch["rms_norm_eps"]),
            rope_theta=float(arch["rope_theta"]),
            rope_scaling=arch.get("rope_scaling") or None,
            max_position_embeddings=int(arch.get("max_position_embeddings") or 4096),
            block_size=int(arch["block_size"]),
            mask_token_id=int(arch["mask_token_id"]),
            target_layer_ids=tuple(int(i) for i in arch["target_layer_ids"]),
        )

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a drafter install holds, with its logical shape (released names, no prefix)."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            "fc.weight": (h, len(self.target_layer_ids) * h),
            "hidden_norm.weight": (h,),
            "norm.weight": (h,),
        }
        for n in range(self.num_layers):
            p = f"layers.{n}"
            shapes |= {
                f"{p}.input_layernorm.weight": (h,),
                f"{p}.post_attention_layernorm.weight": (h,),
                f"{p}.self_attn.q_proj.weight": (self.num_heads * d, h),
                f"{p}.self_attn.k_proj.weight": (self.num_kv_heads * d, h),
                f"{p}.self_attn.v_proj.weight": (self.num_kv_heads * d, h),
                f"{p}.self_attn.o_proj.weight": (h, self.num_heads * d),
                f"{p}.self_attn.q_norm.weight": (d,),
                f"{p}.self_attn.k_norm.weight": (d,),
                f"{p}.mlp.gate_proj.weight": (i, h),
                f"{p}.mlp.up_proj.weight": (i, h),
                f"{p}.mlp.down_proj.weight": (h, i),
            }
        return shapes
