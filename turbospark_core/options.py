"""Open options, checked before anything is read (open step 2)."""

from __future__ import annotations

from typing import Any

import attrs

from turbospark_core.errors import OptionError, refuse_unknown
from turbospark_core.memory import parse_budget

KV_QUANT = (None, "q8", "q4")
RESIDENCY = ("resident", "auto", "streamed")  # MoE experts: every expert in memory, by budget, or an LRU of slots


def _expert_slots(value: Any) -> int | str:
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        msg = f"expert_slots={value!r} is invalid; use a positive integer or 'auto'"
        raise OptionError(msg)
    return value


def _positive(name: str, value: Any, unit: str = "tokens") -> int | None:
    if value is None and unit == "tokens":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        msg = f"{name}={value!r} is invalid; use a positive number of {unit}"
        raise OptionError(msg)
    return value


def _choice(name: str, choices: tuple[Any, ...]) -> Any:
    def check(value: Any) -> Any:
        if value not in choices:
            msg = f"{name}={value!r} is invalid; choose one of {', '.join(map(repr, choices))}"
            raise OptionError(msg)
        return value

    return check


@attrs.frozen(kw_only=True)
class OpenOptions:
    """What the caller asked of :func:`turbospark_core.open`."""

    max_context: int | None = attrs.field(default=None, converter=lambda v: _positive("max_context", v))
    expert_slots: int | str = attrs.field(default="auto", converter=_expert_slots)
    residency: str = attrs.field(default="auto", converter=_choice("residency", RESIDENCY))
    memory_budget: int = attrs.field(default=None, converter=parse_budget)
    kv_quant: str | None = attrs.field(default=None, converter=_choice("kv_quant", KV_QUANT))
    session_slots: int = attrs.field(default=1, converter=lambda v: _positive("session_slots", v, unit="slots"))
    ring_capacity: int | None = attrs.field(default=None, converter=lambda v: _positive("ring_capacity", v))
    warmup: bool = False

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> OpenOptions:
        """Build from ``open(**options)``, refusing unknown option names."""
        refuse_unknown(options, {a.name for a in attrs.fields(cls)}, "open")
        return cls(**options)
