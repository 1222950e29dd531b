"""The KV cache: preallocated in steps, bounded by max_context."""

from __future__ import annotations

import mlx.core as mx

from turbospark_core.cache_spec import CacheSpec
from turbospark_core.errors import ContextOverflowError


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
        k_new = mx.zeros((batch, self.spec.n_kv_heads, new_cap - capacity, self.spec.head_dim), self.dtype)
        v_new = mx.zeros((batch, self.spec.n_kv_heads, new_cap - capacity, v_dim), self.dtype)
        if self.keys is None or self.values is None:
            self.keys, self.values = k_new, v_new
        else:
            self.keys = mx.concatenate([self.keys[..., : self.offset, :], k_new], axis=2)
            self.values = mx.concatenate([self.values[..., : self.offset, :], v_new], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` ``[B, H, L, D]`` and return all cached so far."""
        n = keys.shape[2]
        end = self.offset + n
        if end > self.max_context:
            msg = (
                f"context of {end} tokens exceeds max_context={self.max_context}; "
                f"shorten the prompt or max_tokens, or open with a larger max_context"
            )
            raise ContextOverflowError(msg)
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

    @property
    def state(self) -> list[mx.array]:
        """Arrays to evaluate together with the step's output."""
        return [] if self.keys is None or self.values is None else [self.keys, self.values]


def make_caches(specs: list[CacheSpec], max_context: int, dtype: mx.Dtype) -> list[KVCache]:
    """One cache per layer, as the family's layout asks."""
    return [KVCache(spec, max_context, dtype) for spec in specs]


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
