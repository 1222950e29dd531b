"""Session slots: parked conversations (KV + recurrent state) with prefix reuse and LRU eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import attrs

from turbospark_core.errors import OptionError
from turbospark_core.kv_cache import Cache, KVCache, restore_caches, snapshot_caches

MAX_CHECKPOINTS = 4


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@attrs.define
class SequenceState:
    """One sequence's caches and the tokens they hold.

    Full-attention KV caches can be trimmed to any length; ring buffers and
    recurrent state cannot, so for those the state keeps checkpoints taken at
    turn boundaries and rewinds to the latest one at or before the point of
    divergence.
    """

    make_caches: Callable[[], list[Cache]]
    caches: list[Cache] = attrs.field(init=False)
    tokens: list[int] = attrs.field(init=False, factory=list)
    checkpoints: OrderedDict[int, list[dict[str, Any]]] = attrs.field(init=False, factory=OrderedDict)

    def __attrs_post_init__(self) -> None:
        self.caches = self.make_caches()

    @property
    def trimmable(self) -> bool:
        """Whether every layer's cache can be cut at any position."""
        return self._kv_caches() is not None

    def _kv_caches(self) -> list[KVCache] | None:
        """The caches, when every one is a full-attention KV cache (trimmable anywhere)."""
        kv = [c for c in self.caches if type(c) is KVCache]
        return kv if len(kv) == len(self.caches) else None

    def reset(self) -> None:
        """Forget everything (fresh caches)."""
        self.caches = self.make_caches()
        self.tokens = []
        self.checkpoints.clear()

    def rewind(self, n: int) -> int:
        """Keep at most the first ``n`` tokens cached; returns how many are kept."""
        if n >= len(self.tokens):
            return len(self.tokens)
        kv = self._kv_caches()
        if kv is not None:
            for cache in kv:
                cache.trim(cache.offset - n)
            kept = n
        else:
            kept = max((p for p in self.checkpoints if p <= n), default=0)
            if kept == 0:
                self.reset()
                return 0
            restore_caches(self.caches, self.checkpoints[kept])
        self.tokens = self.tokens[:kept]
        for p in [p for p in self.checkpoints if p > kept]:
            del self.checkpoints[p]
        return kept

    def checkpoint(self) -> None:
        """Remember the current position (only needed for untrimmable caches)."""
        if self.trimmable or not self.tokens:
            return
        self.checkpoints[len(self.tokens)] = snapshot_caches(self.caches)
        self.checkpoints.move_to_end(len(self.tokens))
        while len(self.checkpoints) > MAX_CHECKPOINTS:
            self.checkpoints.popitem(last=False)


@attrs.define
class SessionPool:
    """At most ``slots`` parked sequences, least recently used evicted first."""

    slots: int
    make_caches: Callable[[], list[Cache]]
    _states: OrderedDict[str, SequenceState] = attrs.Factory(OrderedDict)
    evictions: int = 0

    def __attrs_post_init__(self) -> None:
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            msg = f"session_slots={self.slots!r} is invalid; use a positive integer"
            raise OptionError(msg)

    def acquire(self, session_id: str) -> SequenceState:
        """The state parked for ``session_id`` (new if absent, evicting the LRU one)."""
        state = self._states.get(session_id)
        if state is None:
            while len(self._states) >= self.slots:
                self._states.popitem(last=False)
                self.evictions += 1
            state = SequenceState(self.make_caches)
            self._states[session_id] = state
        self._states.move_to_end(session_id)
        return state

    def peek(self, session_id: str) -> SequenceState | None:
        """The parked state, without touching the LRU order (``None`` if absent)."""
        return self._states.get(session_id)

    def drop(self, session_id: str) -> None:
        """Forget a session (no error if absent)."""
        self._states.pop(session_id, None)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._states

    def __len__(self) -> int:
        return len(self._states)
