"""Session slots: parked conversations (KV + recurrent state) with prefix reuse and LRU eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from turbospark_core.errors import OptionError
from turbospark_core.kv_cache import (
    Cache,
    ExactRecentKVCache,
    KVCache,
    RingKVCache,
    restore_caches,
    snapshot_caches,
)

MAX_CHECKPOINTS = 4


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def copy_cache(src: Cache, dst: Cache) -> None:
    """Fill the fresh cache ``dst`` (``src``'s kind) with what ``src`` holds (no array shared that either writes)."""
    if isinstance(src, ExactRecentKVCache) and isinstance(dst, ExactRecentKVCache):
        copy_cache(src.quantized, dst.quantized)
        copy_cache(src.exact, dst.exact)
    elif isinstance(src, (KVCache, RingKVCache)) and isinstance(dst, (KVCache, RingKVCache)):
        keys, values, positions = src.export_rows()  # new arrays (slices or gathers): writes to dst stay in dst
        if keys is not None and values is not None:
            dst.load_rows(keys, values, positions, src.offset)
    else:
        dst.restore(src.snapshot())  # recurrent state: the snapshot copies its arrays


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

    def reusable(self, n: int) -> int:
        """How many tokens :meth:`rewind` to ``n`` would keep (nothing changes)."""
        if n >= len(self.tokens):
            return len(self.tokens)
        if self.trimmable:
            return n
        return max((p for p in self.checkpoints if p <= n), default=0)

    def fork(self, donor: SequenceState, n: int) -> int:
        """Become a copy of ``donor`` holding at most its first ``n`` tokens; returns how many it holds.

        The caches are copied (nothing written through one state reaches the
        other). Full-attention KV keeps any prefix; rings and recurrent state
        only the donor's whole state or one of its checkpoints (:meth:`rewind`).
        """
        self.caches = self.make_caches()
        for mine, theirs in zip(self.caches, donor.caches, strict=True):
            copy_cache(theirs, mine)
        self.tokens = list(donor.tokens)
        self.checkpoints = OrderedDict(donor.checkpoints)  # snapshots are only read (restore copies them)
        return self.rewind(n)

    def share_prefix(self, prompt: list[int], donors: Iterable[SequenceState], at_least: int = 1) -> int:
        """Fork the donor holding the longest reusable prefix of ``prompt`` when it beats this state's own.

        At most ``len(prompt) - 1`` tokens (a prompt's last token is always
        run), and only a prefix of ``at_least`` tokens or more. Returns the
        tokens copied (0 when this state keeps its own).
        """
        limit = len(prompt) - 1
        own = self.reusable(min(common_prefix(self.tokens, prompt), limit))
        best, chosen = max(own, at_least - 1), None
        for donor in donors:
            if donor is not self:
                n = donor.reusable(min(common_prefix(donor.tokens, prompt), limit))
                if n > best:
                    best, chosen = n, donor
        return 0 if chosen is None else self.fork(chosen, best)

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
