"""Typed, bounded checks of arch config values: the core's generic keys and helpers for families.

An install's arch config is untrusted JSON: any key may hold any JSON value
(a string, a list, ``1e308``, ``Infinity``, ``2**31``). Every value a flow
sizes a loop, a buffer or a float computation from is checked here for its
type and a bounded range before anything reads it, so a hostile manifest is
refused by name with an :class:`~turbospark_core.errors.ArchConfigError`
instead of escaping as ``TypeError``/``OverflowError`` or hanging.

The core checks the generic keys (:func:`generic_problems`); families check
their own with the same helpers (:func:`int_problem`, :func:`float_problem`,
:func:`rope_scaling_problems`, :func:`choice_list_problem`,
:func:`section_problem`), exported by :mod:`turbospark_core.family`.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Collection, Mapping
from typing import Any, TypeGuard

# Upper bounds: far above any released model, far below what would hang a loop or overflow a size.
MAX_LAYERS = 1024
MAX_HIDDEN = 1 << 18
MAX_HEADS = 4096
MAX_HEAD_DIM = 8192
MAX_INTERMEDIATE = 1 << 20
MAX_POSITIONS = 1 << 28
MAX_EXPERTS = 1 << 16
MAX_FLOAT = 1e15
MAX_VOCAB = 1 << 24

# Required: every flow sizes its layers, embeddings and head from these.
REQUIRED_INTS = {"num_hidden_layers": MAX_LAYERS, "hidden_size": MAX_HIDDEN, "vocab_size": MAX_VOCAB}
# Checked when present and not null (families decide which they need).
OPTIONAL_INTS = {
    "num_attention_heads": MAX_HEADS,
    "num_key_value_heads": MAX_HEADS,
    "head_dim": MAX_HEAD_DIM,
    "global_head_dim": MAX_HEAD_DIM,
    "rotary_dim": MAX_HEAD_DIM,
    "intermediate_size": MAX_INTERMEDIATE,
    "moe_intermediate_size": MAX_INTERMEDIATE,
    "max_position_embeddings": MAX_POSITIONS,
    "sliding_window": MAX_POSITIONS,
    "num_local_experts": MAX_EXPERTS,
    "num_experts_per_tok": MAX_EXPERTS,
}
OPTIONAL_FLOATS = {"rms_norm_eps": 1.0}
# RoPE bases: above 1 (a base of 1 rotates nothing, and YaRN divides by its log)
ROPE_BASES = {"rope_theta": MAX_FLOAT, "rope_local_base_freq": MAX_FLOAT}
# rope_scaling keys: finite and positive (divisors, logs), or finite and not negative (multipliers)
_SCALING_POSITIVE = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                     "original_max_position_embeddings")  # fmt: skip
_SCALING_NON_NEGATIVE = ("mscale", "mscale_all_dim", "attention_factor")
_SCALING_NEEDS = {
    "linear": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def is_int(value: object) -> TypeGuard[int]:
    """A JSON integer (``bool`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """A finite JSON number (``bool``, ``NaN`` and ``Infinity`` are not)."""
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def int_problem(
    arch: dict[str, Any], key: str, high: int, *, low: int = 1, optional: bool = False, where: str = ""
) -> str | None:
    """The problem with integer ``arch[key]`` (None when it is in ``[low, high]``, or absent and optional).

    ``where`` prefixes the key in the message (e.g. ``"moe."`` for a section's key).
    """
    value = arch.get(key)
    if value is None and optional:
        return None
    if is_int(value) and low <= value <= high:
        return None
    return f"'{where}{key}' must be an integer in [{low}, {high}] (got {_show(value)})"


def int_problems(
    arch: dict[str, Any], bounds: Mapping[str, int], *, low: int = 1, optional: bool = False, where: str = ""
) -> list[str]:
    """:func:`int_problem` for each ``key: high`` of ``bounds``."""
    return [
        p
        for key, high in bounds.items()
        if (p := int_problem(arch, key, high, low=low, optional=optional, where=where))
    ]


def float_problem(
    arch: dict[str, Any],
    key: str,
    high: float = MAX_FLOAT,
    *,
    low: float = 0.0,
    optional: bool = False,
    where: str = "",
) -> str | None:
    """The problem with number ``arch[key]`` (None when finite, ``low < value <= high``, or absent and optional)."""
    value = arch.get(key)
    if value is None and optional:
        return None
    if is_number(value) and low < value <= high:
        return None
    return f"'{where}{key}' must be a finite number in ({low:g}, {high:g}] (got {_show(value)})"


def float_problems(
    arch: dict[str, Any], bounds: Mapping[str, float], *, low: float = 0.0, optional: bool = False, where: str = ""
) -> list[str]:
    """:func:`float_problem` for each ``key: high`` of ``bounds``."""
    return [
        p
        for key, high in bounds.items()
        if (p := float_problem(arch, key, high, low=low, optional=optional, where=where))
    ]


def bool_problem(arch: dict[str, Any], key: str, *, optional: bool = False, where: str = "") -> str | None:
    """The problem with boolean ``arch[key]`` (None when true/false, or absent and optional)."""
    value = arch.get(key)
    if isinstance(value, bool) or (value is None and optional):
        return None
    return f"'{where}{key}' must be true or false (got {_show(value)})"


def index_list_problem(arch: dict[str, Any], key: str, length: int, *, where: str = "") -> str | None:
    """The problem with ``arch[key]``: a list of distinct integers in ``[0, length)``."""
    value = arch.get(key)
    if (
        isinstance(value, list)
        and len(value) <= length
        and all(is_int(i) and 0 <= i < length for i in value)
        and len(set(value)) == len(value)
    ):
        return None
    return f"'{where}{key}' must list distinct integers in [0, {length}) (got {_show(value)})"


def keys_problem(section: dict[str, Any], allowed: Collection[str], where: str) -> str | None:
    """The problem with an object that has keys outside ``allowed`` (None when it has none)."""
    unknown = sorted(set(section) - set(allowed), key=str)
    if not unknown:
        return None
    return f"{where} has unknown key(s) {_show(unknown)}; known: {', '.join(sorted(allowed))}"


def choice_list_problem(arch: dict[str, Any], key: str, length: object, choices: tuple[str, ...]) -> str | None:
    """The problem with ``arch[key]``: a list of ``length`` entries, each one of ``choices``."""
    value = arch.get(key)
    if isinstance(value, (list, tuple)) and is_int(length) and len(value) == length:
        bad = [v for v in value if not isinstance(v, str) or v not in choices]
        if not bad:
            return None
        return f"{key!r} has {_show(bad[0])}, which is not one of {choices}"
    return f"{key!r} must list {_show(length)} entries from {choices} (got {_show(value)})"


def section_problem(arch: dict[str, Any], key: str) -> str | None:
    """The problem with an optional object ``arch[key]`` (None when absent, null, false or an object)."""
    value = arch.get(key)
    if value is None or value is False or isinstance(value, dict):
        return None
    return f"{key!r} must be an object or null (got {_show(value)})"


def rope_scaling_problems(value: object, where: str = "rope_scaling") -> list[str]:
    """The problems with a Hugging Face ``rope_scaling`` value: null, or an object of finite numbers."""
    if value is None:
        return []
    if not isinstance(value, dict):
        return [f"{where} must be an object or null (got {_show(value)})"]
    kind = value.get("rope_type", value.get("type", "default"))
    if not isinstance(kind, str):
        return [f"{where} rope_type must be a string (got {_show(kind)})"]
    out = [f"{where} needs {k!r} for rope_type {kind!r}" for k in _SCALING_NEEDS.get(kind, ()) if value.get(k) is None]
    out += [
        f"{where} {k!r} must be a finite positive number (got {_show(value[k])})"
        for k in _SCALING_POSITIVE
        if value.get(k) is not None and not (is_number(value[k]) and 0 < value[k] <= MAX_FLOAT)
    ]
    out += [
        f"{where} {k!r} must be a finite number >= 0 (got {_show(value[k])})"
        for k in _SCALING_NON_NEGATIVE
        if value.get(k) is not None and not (is_number(value[k]) and 0 <= value[k] <= MAX_FLOAT)
    ]
    if "truncate" in value and not isinstance(value["truncate"], bool):
        out.append(f"{where} 'truncate' must be true or false (got {_show(value['truncate'])})")
    if not out and kind == "llama3" and value["low_freq_factor"] == value["high_freq_factor"]:
        out.append(f"{where} low_freq_factor and high_freq_factor must differ (both {value['low_freq_factor']!r})")
    return out


def generic_problems(arch: dict[str, Any]) -> list[str]:
    """The core's checks of the generic keys (types, bounds, consistency); empty when valid."""
    out = [p for key, high in REQUIRED_INTS.items() if (p := int_problem(arch, key, high))]
    out += [p for key, high in OPTIONAL_INTS.items() if (p := int_problem(arch, key, high, optional=True))]
    out += [p for key, high in OPTIONAL_FLOATS.items() if (p := float_problem(arch, key, high, optional=True))]
    out += float_problems(arch, ROPE_BASES, low=1.0, optional=True)
    out += rope_scaling_problems(arch.get("rope_scaling"))
    out += [p for key in ("moe", "rope_parameters", "rope") if (p := section_problem(arch, key))]
    layer_types = arch.get("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types)
    ):
        out.append(f"'layer_types' must be a list of strings (got {_show(layer_types)})")
    if not out:
        out += _consistency_problems(arch)
    return out


def _consistency_problems(arch: dict[str, Any]) -> list[str]:
    out = []
    heads, kv_heads = arch.get("num_attention_heads"), arch.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        out.append(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim, rotary = arch.get("head_dim"), arch.get("rotary_dim")
    if rotary is not None and head_dim is not None and (rotary > head_dim or rotary % 2):
        out.append(f"rotary_dim={rotary} must be even and at most head_dim={head_dim}")
    layer_types = arch.get("layer_types")
    if layer_types is not None and len(layer_types) != arch["num_hidden_layers"]:
        out.append(f"'layer_types' has {len(layer_types)} entries, num_hidden_layers is {arch['num_hidden_layers']}")
    return out


_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict, _REPR.maxlevel = 60, 60, 6, 4, 3


def _show(value: object) -> str:
    """A bounded ``repr`` (a hostile value may be megabytes, or an integer of thousands of digits)."""
    if is_int(value) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    return _REPR.repr(value)
