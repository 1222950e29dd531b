"""Hugging Face checkpoint conventions that every family's converter shares.

Multimodal checkpoints nest the text decoder under a language-model prefix
and carry vision towers and multi-token-prediction (MTP) heads that a text
decoder never reads; most checkpoints serialize rotary ``inv_freq`` buffers;
configs describe rope either as ``rope_scaling`` (with ``rope_theta`` beside
it and a legacy ``type`` key) or as transformers 5's ``rope_parameters``
(``rope_theta`` inside). Each helper states one of these rules once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

#: Vision-tower modules of multimodal checkpoints (Qwen-VL's ``visual``, LLaVA/Gemma's ``vision_tower``)
VISION_TOWERS = ("visual", "vision_tower")
#: Multi-token-prediction heads (Qwen 3.5's ``mtp``)
MTP_HEADS = ("mtp",)

_ROTARY_BUFFER = r"rotary_emb\.inv_freq$"
_LANGUAGE_MODEL = ("model.language_model.", "language_model.model.", "language_model.")
# Rope keys that are not scaling parameters: theta, the rotary fraction, legacy names, multimodal sections
_NOT_SCALING = frozenset({"rope_theta", "partial_rotary_factor", "type", "mrope_section", "mrope_interleaved"})


def text_config(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text decoder's config: ``text_config`` of a multimodal config, else the config itself."""
    return hf_config.get("text_config") or hf_config


def tied_embeddings(hf_config: Mapping[str, Any], *, default: bool = False) -> bool:
    """Whether the output head reuses the input embedding (top-level key first, then ``text_config``'s)."""
    return bool(hf_config.get("tie_word_embeddings", text_config(hf_config).get("tie_word_embeddings", default)))


def is_tied_head(arch: Mapping[str, Any], name: str) -> bool:
    """Whether source tensor ``name`` is an ``lm_head`` the install drops because the embedding is reused."""
    return name.startswith("lm_head.") and bool(arch.get("tie_word_embeddings"))


def strip_language_model_prefix(name: str) -> str:
    """A multimodal checkpoint's text-decoder name as a plain decoder's.

    ``model.language_model.X``, ``language_model.model.X`` and ``language_model.X``
    become ``model.X``; a ``lm_head`` under the prefix becomes the top-level
    ``lm_head``. Other names are returned unchanged.
    """
    for prefix in _LANGUAGE_MODEL:
        if name.startswith(prefix):
            rest = name[len(prefix) :]
            return rest if rest.startswith("lm_head") else f"model.{rest}"
    return name


def drop_pattern(modules: tuple[str, ...] = (), *, extra: str | None = None) -> re.Pattern[str]:
    """Source names a text decoder never reads, for ``pattern.search(name)``.

    Args:
        modules: Top-level modules to drop whole, at the root or under
            ``model.`` (e.g. ``VISION_TOWERS + MTP_HEADS``).
        extra: A further regular expression of names to drop.

    Returns:
        A pattern matching those modules, serialized rotary ``inv_freq``
        buffers (the rope recomputes them) and ``extra``.
    """
    parts = [_ROTARY_BUFFER]
    if modules:
        parts.insert(0, rf"^(model\.)?({'|'.join(re.escape(m) for m in modules)})\.")
    if extra:
        parts.append(extra)
    return re.compile("|".join(parts))


def rope_theta(cfg: Mapping[str, Any], params: Mapping[str, Any] | None, default: float) -> float:
    """The rope base: the config's ``rope_theta``, else the one in its rope ``params``, else ``default``."""
    return float(cfg.get("rope_theta") or (params or {}).get("rope_theta") or default)


def rope_scaling(params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A ``rope_scaling``/``rope_parameters`` dict as the ``scaling`` :meth:`Rope.from_config` takes.

    The type is read from ``rope_type`` (or the legacy ``type``); theta, the
    partial rotary factor and multimodal sections are removed (multimodal rope
    on text-only positions is plain rope: every section shares one position).

    Returns:
        ``None`` for plain rope (no params, or type ``default``), else the
        scaling parameters with ``rope_type`` set.
    """
    params = params or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    scaling = {k: v for k, v in params.items() if k not in _NOT_SCALING}
    scaling["rope_type"] = rope_type
    return scaling
