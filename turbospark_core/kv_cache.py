"""The KV cache: preallocated in steps, bounded by max_context."""

from __future__ import annotations

import mlx.core as mx

from typing import Any

from turbospark_core.cache_spec import CacheSpec, StateSpec
from turbospark_core.errors import ContextOverflowError


def _refuse_overflow(end: int, max_context: int) -> None:
    if end > max_context:
        msg = (
            f"context of {end} tokens exceeds max_context={max_context}; "
            f"shorten the prompt or max_tokens, or open with a larger max_context"
        )
        raise ContextOverflowError(msg)


class KVCache:
    """Keys and values of one full-attention layer, grown ``step`` tokens at a time.

    Args:
        spec: The layer's cache requirement.
        max_context: The most tokens this cache may hold.
        dtype: Storage dtype of keys and values.
        step: Growth granularity in tokens.
    """

    def __init__(
        self, spec: CacheSpec, max_context: int, dtype: mx.Dtype, step: int = 256
    ) -> None:
        self.spec = spec
        self.max_context = max_context
        self.dtype = dtype
        self.step = step
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def _grow(self, batch: int, needed: int) -> None:
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if needed <= capacity:
            return
        new_cap = min(self.max_context, ((needed + self.step - 1) // self.step) * self.step)
        v_dim = self.spec.v_head_dim or self.spec.head_dim
        k_new = mx.zeros((batch, self.spec.n_kv_heads, new_cap - self.offset, self.spec.head_dim), self.dtype)
        v_new = mx.zeros((batch, self.spec.n_kv_heads, new_cap - self.offset, v_dim), self.dtype)
        if self.keys is None or self.values is None:
            self.keys, self.values = k_new, v_new
        else:
            self.keys = mx.concatenate([self.keys[..., : self.offset, :], k_new], axis=2)
            self.values = mx.concatenate([self.values[..., : self.offset, :], v_new], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` ``[B, H, L, D]`` and return all cached so far."""
        n = keys.shape[2]
        end = self.offset + n
        _refuse_overflow(end, self.max_context)
        self._grow(keys.shape[0], end)
        assert self.keys is not None and self.values is not None
        self.keys[..., self.offset : end, :] = keys.astype(self.dtype)
        self.values[..., self.offset : end, :] = values.astype(self.dtype)
        self.offset = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens; returns how many were dropped."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    def mask(self, n_queries: int) -> mx.array | str | None:
        """The attention mask for the ``n_queries`` tokens just added."""
        return "causal" if n_queries > 1 else None

    def snapshot(self) -> dict[str, Any]:
        """A checkpoint of this cache (append-only: the offset is enough)."""
        return {"offset": self.offset}

    def restore(self, snap: dict[str, Any]) -> None:
        """Return to a checkpoint taken by :meth:`snapshot` on this cache."""
        self.offset = snap["offset"]

    @property
    def state(self) -> list[mx.array]:
        """Arrays to evaluate together with the step's output."""
        return [] if self.keys is None or self.values is None else [self.keys, self.values]


class RingKVCache:
    """Keys and values of one sliding-window layer, in a ring bounded by its capacity.

    Memory stays flat as the context grows: at most ``capacity`` (default: the
    window) tokens are kept. A multi-token update returns the kept tokens plus
    the new ones in order (so a prefill chunk sees its whole window), then
    keeps only the last ``capacity``. Each slot remembers its absolute position,
    so :meth:`mask` is exact for any capacity >= window.
    """

    def __init__(
        self, spec: CacheSpec, max_context: int, dtype: mx.Dtype, capacity: int | None = None
    ) -> None:
        if spec.window is None or spec.window <= 0:
            raise ValueError("RingKVCache needs a CacheSpec with a positive window")
        self.spec = spec
        self.window = spec.window
        self.capacity = max(capacity or spec.window, spec.window)
        self.max_context = max_context
        self.dtype = dtype
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.positions: mx.array | None = None  # absolute position held by each slot
        self.offset = 0
        self._fetched_positions: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Add ``keys``/``values`` ``[B, H, L, D]``; return what the new queries may attend to."""
        n = keys.shape[2]
        _refuse_overflow(self.offset + n, self.max_context)
        keys, values = keys.astype(self.dtype), values.astype(self.dtype)
        new_pos = mx.arange(self.offset, self.offset + n)
        self.offset += n
        if n == 1 and self.keys is not None and self.keys.shape[2] == self.capacity:
            slot = (self.offset - 1) % self.capacity
            self.keys[..., slot : slot + 1, :] = keys
            self.values[..., slot : slot + 1, :] = values
            self.positions[slot : slot + 1] = new_pos
            self._fetched_positions = self.positions
            return self.keys, self.values
        k_all, v_all, p_all = self._ordered_with(keys, values, new_pos)
        self._fetched_positions = p_all
        self._keep_last(k_all, v_all, p_all)
        return k_all, v_all

    def _ordered_with(self, keys: mx.array, values: mx.array, pos: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if self.keys is None:
            return keys, values, pos
        order = mx.argsort(self.positions)
        kept = self.positions[order] >= 0
        n_kept = int(kept.sum().item())
        order = order[order.size - n_kept :] if n_kept else order[:0]
        return (
            mx.concatenate([self.keys[..., order, :], keys], axis=2),
            mx.concatenate([self.values[..., order, :], values], axis=2),
            mx.concatenate([self.positions[order], pos]),
        )

    def _keep_last(self, k_all: mx.array, v_all: mx.array, p_all: mx.array) -> None:
        total = k_all.shape[2]
        if total >= self.capacity:
            self.keys = k_all[..., total - self.capacity :, :]
            self.values = v_all[..., total - self.capacity :, :]
            self.positions = p_all[total - self.capacity :]
            # the ring's next write goes to the slot of the oldest token
            shift = self.offset % self.capacity
            self.keys, self.values, self.positions = (
                mx.roll(self.keys, shift, axis=2),
                mx.roll(self.values, shift, axis=2),
                mx.roll(self.positions, shift),
            )
            return
        pad = self.capacity - total
        B, H, _, D = k_all.shape
        Dv = v_all.shape[-1]
        self.keys = mx.concatenate([k_all, mx.zeros((B, H, pad, D), self.dtype)], axis=2)
        self.values = mx.concatenate([v_all, mx.zeros((B, H, pad, Dv), self.dtype)], axis=2)
        self.positions = mx.concatenate([p_all, mx.full((pad,), -1, mx.int32)]).astype(mx.int32)

    def snapshot(self) -> dict[str, Any]:
        """A checkpoint of this ring (copies: later writes overwrite slots)."""
        arrays = {n: getattr(self, n) for n in ("keys", "values", "positions", "_fetched_positions")}
        return {"offset": self.offset, **{n: None if a is None else mx.array(a) for n, a in arrays.items()}}

    def restore(self, snap: dict[str, Any]) -> None:
        """Return to a checkpoint taken by :meth:`snapshot` on this cache."""
        self.offset = snap["offset"]
        for name in ("keys", "values", "positions", "_fetched_positions"):
            setattr(self, name, None if snap[name] is None else mx.array(snap[name]))

    def mask(self, n_queries: int) -> mx.array:
        """Boolean ``[L, S]`` mask: causal and within the window, by absolute position."""
        q = mx.arange(self.offset - n_queries, self.offset)[:, None]
        k = self._fetched_positions[None, :]
        return (k <= q) & (k > q - self.window) & (k >= 0)

    @property
    def state(self) -> list[mx.array]:
        """Arrays to evaluate together with the step's output."""
        return [] if self.keys is None else [self.keys, self.values, self.positions]


class RecurrentState:
    """A layer's recurrent state (declared by a :class:`StateSpec`), held by the core.

    Families read a named array with :meth:`get` (zeros before the first
    write), compute the next state, and :meth:`set` it; ``offset`` counts the
    tokens consumed so far.
    """

    def __init__(self, spec: StateSpec, max_context: int) -> None:
        self.spec = spec
        self.max_context = max_context
        self.dtype = getattr(mx, spec.dtype)
        self.arrays: dict[str, mx.array] = {}
        self.offset = 0

    def get(self, name: str, batch: int) -> mx.array:
        """The state ``name`` for ``batch`` rows (zeros when not yet written)."""
        arr = self.arrays.get(name)
        if arr is None:
            return mx.zeros((batch, *self.spec.shapes[name]), self.dtype)
        return arr

    def set(self, name: str, value: mx.array) -> None:
        """Store the new state ``name``."""
        self.arrays[name] = value.astype(self.dtype)

    def advance(self, n: int) -> None:
        """Count ``n`` consumed tokens (refusing a context overflow)."""
        _refuse_overflow(self.offset + n, self.max_context)
        self.offset += n

    def snapshot(self) -> dict[str, Any]:
        """A checkpoint of the state."""
        return {"offset": self.offset, "arrays": {n: mx.array(a) for n, a in self.arrays.items()}}

    def restore(self, snap: dict[str, Any]) -> None:
        """Return to a checkpoint taken by :meth:`snapshot` on this state."""
        self.offset = snap["offset"]
        self.arrays = {n: mx.array(a) for n, a in snap["arrays"].items()}

    def mask(self, n_queries: int) -> None:
        """Recurrent layers need no attention mask."""
        return None

    @property
    def state(self) -> list[mx.array]:
        """Arrays to evaluate together with the step's output."""
        return list(self.arrays.values())


Cache = KVCache | RingKVCache | RecurrentState


def make_cache(
    spec: CacheSpec | StateSpec, max_context: int, dtype: mx.Dtype, ring_capacity: int | None = None
) -> Cache:
    """The cache object a layer's spec asks for."""
    if isinstance(spec, StateSpec):
        return RecurrentState(spec, max_context)
    if spec.window is None:
        return KVCache(spec, max_context, dtype)
    return RingKVCache(spec, max_context, dtype, capacity=ring_capacity)


def make_caches(
    specs: list[CacheSpec | StateSpec], max_context: int, dtype: mx.Dtype, ring_capacity: int | None = None
) -> list[Cache]:
    """One cache per layer, as the family's layout asks."""
    return [make_cache(spec, max_context, dtype, ring_capacity) for spec in specs]


def snapshot_caches(caches: list[Cache]) -> list[dict[str, Any]]:
    """Checkpoint every layer's cache (KV offsets, ring copies, recurrent state)."""
    return [c.snapshot() for c in caches]


def restore_caches(caches: list[Cache], snaps: list[dict[str, Any]]) -> None:
    """Restore every layer's cache from :func:`snapshot_caches`."""
    for cache, snap in zip(caches, snaps, strict=True):
        cache.restore(snap)


def check_room(caches: list[KVCache], extra: int) -> None:
    """Refuse, before any compute, a step that would overflow the context."""
    if not caches:
        return
    cache = caches[0]
    if cache.offset + extra > cache.max_context:
        msg = (
            f"context of {cache.offset + extra} tokens exceeds "
            f"max_context={cache.max_context}; shorten the prompt or max_tokens, "
            f"or open with a larger max_context"
        )
        raise ContextOverflowError(msg)
