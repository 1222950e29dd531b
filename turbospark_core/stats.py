"""Startup and generation statistics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import attrs

PHASES = (
    "manifest_index",
    "tokenizer",
    "weights_mapping",
    "expert_setup",
    "family_state",
    "session_state",
    "steering",
    "warmup",
    "drafter",
)


@attrs.frozen(kw_only=True)
class StartupStats:
    """Milliseconds spent in each phase of opening an install.

    :func:`~turbospark_core.loader.open_install` says which steps each phase
    times. There is no KV/scratch phase: nothing is allocated for it at open.
    """

    manifest_index: float = 0.0
    tokenizer: float = 0.0
    weights_mapping: float = 0.0
    expert_setup: float = 0.0
    family_state: float = 0.0
    session_state: float = 0.0
    steering: float = 0.0
    warmup: float = 0.0
    drafter: float = 0.0
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
class ExpertStats:
    """MoE expert residency counters (streamed: slot hits and misses, bytes and time spent loading).

    Attributes:
        residency: ``"resident"`` or ``"streamed"``.
        slots: Experts held per routed layer.
        hits: Routed experts found in a slot (one per distinct expert, layer and batch).
        misses: Routed experts loaded from ``experts.bin``.
        bytes_read: Bytes read from ``experts.bin`` for misses.
        load_ms: Time spent loading misses (read + unpack into slots).
        tokens: Token rows routed through the first routed layer.
    """

    residency: str
    slots: int
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    load_ms: float = 0.0
    tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Hits over lookups (1.0 when nothing was looked up)."""
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 1.0

    @property
    def load_ms_per_token(self) -> float:
        """Loading time per routed token."""
        return self.load_ms / self.tokens if self.tokens else 0.0

    def since(self, before: ExpertStats) -> ExpertStats:
        """The counters accumulated after ``before`` was taken."""
        return attrs.evolve(
            self,
            hits=self.hits - before.hits,
            misses=self.misses - before.misses,
            bytes_read=self.bytes_read - before.bytes_read,
            load_ms=self.load_ms - before.load_ms,
            tokens=self.tokens - before.tokens,
        )

    def summary(self) -> str:
        """One line for ``--verbose`` and ``inspect --stats``."""
        if self.residency != "streamed":
            return f"experts: {self.residency}"
        return (
            f"experts: streamed, {self.slots} slots/layer | hits {self.hits}, misses {self.misses} "
            f"(hit rate {self.hit_rate:.1%}) | read {self.bytes_read / 1e6:.1f} MB, "
            f"load {self.load_ms:.1f} ms ({self.load_ms_per_token:.2f} ms/token)"
        )


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
    experts: ExpertStats | None = None  # MoE installs: expert counters over this generation
    draft_tokens: int = 0  # speculative decoding: tokens the drafter proposed
    accepted_tokens: int = 0  # ... and the target kept
    verify_steps: int = 0  # ... in this many verify forwards (a plain step with no draft counts too)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verify forward: accepted drafts + the target's own token (DFlash's tau; 0 unset)."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0
