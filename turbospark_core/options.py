"""Open options (open step 2), checked once the path is an install and before its manifest is loaded.

:func:`turbospark_core.open` documents each option once; this module holds
their types and the checks behind its refusals.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import attrs

from turbospark_core.errors import OptionError, refuse_unknown
from turbospark_core.memory import parse_budget

Residency = Literal["resident", "auto", "streamed"]
KVQuant = Literal["q8", "q4"]
Distributed = Literal["tensor", "pipeline"]
ExpertSlots = int | Literal["auto"]

# routed MoE experts: every expert in memory, by budget, or an LRU of slots
RESIDENCY: tuple[Residency, ...] = ("resident", "auto", "streamed")
KV_QUANT: tuple[KVQuant | None, ...] = (None, "q8", "q4")
DISTRIBUTED: tuple[Distributed | None, ...] = (None, "tensor", "pipeline")

_C = TypeVar("_C")


def _expert_slots(value: object) -> ExpertSlots:
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        msg = f"expert_slots={value!r} is invalid; use a positive integer or 'auto'"
        raise OptionError(msg)
    return value


def _count(name: str, value: object, unit: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        msg = f"{name}={value!r} is invalid; use a positive number of {unit}"
        raise OptionError(msg)
    return value


def _max_context(value: object) -> int | None:
    return None if value is None else _count("max_context", value, "tokens")


def _ring_capacity(value: object) -> int | None:
    return None if value is None else _count("ring_capacity", value, "tokens")


def _session_slots(value: object) -> int:
    return _count("session_slots", value, "slots")


def _choice(name: str, value: object, choices: tuple[_C, ...]) -> _C:
    for choice in choices:
        if value == choice:
            return choice
    msg = f"{name}={value!r} is invalid; choose one of {', '.join(map(repr, choices))}"
    raise OptionError(msg)


def _steering(value: object) -> Any:
    """A path (str or Path), a :class:`~turbospark_core.steering.DirectionSet`, or ``None``; read at open step 14."""
    from pathlib import Path

    from turbospark_core.steering import DirectionSet

    if value is None or isinstance(value, (DirectionSet, Path)):
        return value
    if isinstance(value, str) and value:
        return Path(value)
    msg = f"steering={value!r} is invalid; pass a direction file path, a DirectionSet, or None"
    raise OptionError(msg)


def _directory(option: str, what: str, value: object) -> Any:
    """An option naming a directory: a Path (from str or Path) or ``None``; read after the open."""
    from pathlib import Path

    if value is None or isinstance(value, Path):
        return value
    if isinstance(value, str) and value:
        return Path(value)
    raise OptionError(f"{option}={value!r} is invalid; pass {what}, or None")


def _vision(value: object) -> Any:
    return _directory("vision", "a vision sidecar directory", value)


def _draft_model(value: object) -> Any:
    return _directory("draft_model", "the path of an install with the same vocabulary", value)


def _dflash(value: object) -> Any:
    return _directory("dflash", "the path of a DFlash drafter install (`turbospark convert`)", value)


MAX_DRAFT_TOKENS = 32


def _ngram(value: object) -> int | None:
    if value is None:
        return None
    n = _count("ngram", value, "tokens to draft by prompt lookup")
    if n > MAX_DRAFT_TOKENS:
        raise OptionError(f"ngram={n} is too large; draft at most {MAX_DRAFT_TOKENS} tokens per step")
    return n


def _mtp(value: object) -> int | str | None:
    """``None`` (off), ``"auto"`` (the install's MTP head if it has one), or a draft depth; opened at step 12."""
    if value is None:
        return None
    if value == "auto":
        return "auto"
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_DRAFT_TOKENS:
        return value
    msg = f"mtp={value!r} is invalid; pass a draft depth in [1, {MAX_DRAFT_TOKENS}], 'auto', or None"
    raise OptionError(msg)


def _num_draft_tokens(value: object) -> int | None:
    if value is None:
        return None
    n = _count("num_draft_tokens", value, "tokens per verify")
    if n > MAX_DRAFT_TOKENS:
        raise OptionError(f"num_draft_tokens={n} is too large; use at most {MAX_DRAFT_TOKENS}")
    return n


# The open options that each choose a speculative drafter (open step 12): at most one may be set.
# DFlash comes first: it is built first, and an unnamed MTP head (mtp="auto") yields to it.
DRAFTER_OPTIONS: tuple[str, ...] = ("dflash", "draft_model", "ngram", "mtp")


def _residency(value: object) -> Residency:
    return _choice("residency", value, RESIDENCY)


def _kv_quant(value: object) -> KVQuant | None:
    return _choice("kv_quant", value, KV_QUANT)


def _distributed(value: object) -> Distributed | None:
    return _choice("distributed", value, DISTRIBUTED)


def _kv_recent(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        msg = (
            f"kv_recent={value!r} is invalid; use a number of tokens >= 0 (0: every token quantized) "
            f"or None (the default for the kv_quant)"
        )
        raise OptionError(msg)
    return value


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        msg = f"{name}={value!r} is invalid; use True or False"
        raise OptionError(msg)
    return value


def _router_histogram(value: object) -> bool:
    return _flag("router_histogram", value)


def _ffn_histogram(value: object) -> bool:
    return _flag("ffn_histogram", value)


def _verify(value: object) -> bool:
    return _flag("verify", value)


@attrs.frozen(kw_only=True)
class OpenOptions:
    """What the caller asked of :func:`turbospark_core.open` (each option is documented there)."""

    max_context: int | None = attrs.field(default=None, converter=_max_context)
    expert_slots: ExpertSlots = attrs.field(default="auto", converter=_expert_slots)
    residency: Residency = attrs.field(default="auto", converter=_residency)
    memory_budget: int = attrs.field(default=None, converter=parse_budget)
    kv_quant: KVQuant | None = attrs.field(default=None, converter=_kv_quant)
    session_slots: int = attrs.field(default=1, converter=_session_slots)
    ring_capacity: int | None = attrs.field(default=None, converter=_ring_capacity)
    warmup: bool = False
    router_histogram: bool = attrs.field(default=False, converter=_router_histogram)
    ffn_histogram: bool = attrs.field(default=False, converter=_ffn_histogram)
    verify: bool = attrs.field(default=False, converter=_verify)
    steering: Any = attrs.field(default=None, converter=_steering)  # Path | DirectionSet | None
    kv_rotate: bool = True
    kv_recent: int | None = attrs.field(default=None, converter=_kv_recent)
    vision: Any = attrs.field(default=None, converter=_vision)  # Path | None
    draft_model: Any = attrs.field(default=None, converter=_draft_model)  # Path | None
    ngram: int | None = attrs.field(default=None, converter=_ngram)
    mtp: int | str | None = attrs.field(default=None, converter=_mtp)  # depth | "auto" | None
    num_draft_tokens: int | None = attrs.field(default=None, converter=_num_draft_tokens)
    dflash: Any = attrs.field(default=None, converter=_dflash)  # Path | None
    distributed: Distributed | None = attrs.field(default=None, converter=_distributed)

    def __attrs_post_init__(self) -> None:
        if self.kv_recent and self.kv_quant is None:
            msg = (
                f"kv_recent={self.kv_recent} keeps recent tokens unquantized beside quantized KV, but kv_quant "
                f"is None (nothing is quantized); pass kv_quant='q4' or 'q8', or leave kv_recent out"
            )
            raise OptionError(msg)
        named = self.drafters_named()
        if len(named) > 1:
            given = " and ".join(f"{n}={getattr(self, n)!r}" for n in named)
            msg = f"{given} name two speculative drafters; at most one drafter is open: keep one of them"
            raise OptionError(msg)
        if self.num_draft_tokens is not None and not named:
            msg = (
                f"num_draft_tokens={self.num_draft_tokens} names no drafter; "
                f"also pass one of {', '.join(DRAFTER_OPTIONS)}"
            )
            raise OptionError(msg)

    def drafters_named(self) -> list[str]:
        """The drafter options that are set (:data:`DRAFTER_OPTIONS` order).

        ``mtp="auto"`` beside ``dflash`` is not counted: the DFlash drafter is opened, alone.
        """
        named = [n for n in DRAFTER_OPTIONS if getattr(self, n, None) is not None]
        if "dflash" in named and self.mtp == "auto":
            named.remove("mtp")
        return named

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> OpenOptions:
        """Build from keyword options, refusing unknown option names first."""
        refuse_unknown(options, {a.name for a in attrs.fields(cls)}, "open")
        return cls(**options)
