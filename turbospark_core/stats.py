"""Startup and generation statistics."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import attrs

PHASES = (
    "manifest_index",
    "weights_mapping",
    "kv_scratch",
    "expert_setup",
    "family_state",
    "session_state",
)


@attrs.frozen(kw_only=True)
class StartupStats:
    """Milliseconds spent in each phase of opening an install."""

    manifest_index: float = 0.0
    weights_mapping: float = 0.0
    kv_scratch: float = 0.0
    expert_setup: float = 0.0
    family_state: float = 0.0
    session_state: float = 0.0
    total_open: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """Phase -> milliseconds."""
        return attrs.asdict(self)


@attrs.define
class PhaseTimer:
    """Collects per-phase wall-clock time into a :class:`StartupStats`."""

    _start: float = attrs.Factory(time.perf_counter)
    _ms: dict[str, float] = attrs.Factory(dict)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed block as phase ``name`` (accumulates)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._ms[name] = self._ms.get(name, 0.0) + (time.perf_counter() - t0) * 1e3

    def finish(self) -> StartupStats:
        """The stats, with ``total_open`` since the timer was made."""
        total = (time.perf_counter() - self._start) * 1e3
        return StartupStats(**{k: round(v, 3) for k, v in self._ms.items()}, total_open=round(total, 3))


@attrs.frozen(kw_only=True)
class GenerationStats:
    """Throughput of one generation, with mlx-lm's field names."""

    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str = "stop"
    reused_tokens: int = 0  # prompt tokens served from a session's cache
