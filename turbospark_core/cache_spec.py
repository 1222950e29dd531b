"""What cache a layer needs: the family's declaration, the core's allocation plan."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs


@attrs.frozen(kw_only=True)
class CacheSpec:
    """One layer's KV cache requirement.

    Attributes:
        n_kv_heads: Key/value heads.
        head_dim: Key head dimension.
        v_head_dim: Value head dimension (defaults to ``head_dim``); ``0``: the
            layer caches keys only (a flow that reads its values from the keys it
            fetched, as latent attention does), so values take no memory.
        window: Sliding window in tokens, or ``None`` for full attention.
    """

    n_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    window: int | None = None

    def bytes_at(self, tokens: int, itemsize: float, ring_capacity: int | None = None) -> int:
        """Bytes this layer's K and V take at ``tokens`` of context."""
        ring = None if self.window is None else max(self.window, ring_capacity or 0)
        held = tokens if ring is None else min(tokens, ring)
        return int(held * self.n_kv_heads * (self.head_dim + self.value_dim) * itemsize)

    @property
    def value_dim(self) -> int:
        """The value width the cache stores (``0``: keys only)."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @classmethod
    def full(cls, n_kv_heads: int, head_dim: int) -> CacheSpec:
        """A full-attention layer."""
        return cls(n_kv_heads=n_kv_heads, head_dim=head_dim)

    @classmethod
    def sliding(cls, n_kv_heads: int, head_dim: int, window: int) -> CacheSpec:
        """A sliding-window layer (ring buffer bounded by ``window``)."""
        return cls(n_kv_heads=n_kv_heads, head_dim=head_dim, window=window)


def _shapes(shapes: Mapping[str, Iterable[int]]) -> dict[str, tuple[int, ...]]:
    """The state shapes by name, each as a tuple (a plugin may give lists)."""
    return {name: tuple(shape) for name, shape in shapes.items()}


@attrs.frozen(kw_only=True)
class StateSpec:
    """A layer's fixed-size recurrent state (conv window, linear-attention state...).

    The core allocates it per sequence, evaluates it with each step, and
    snapshots/restores it for sessions, prefix reuse and speculative decoding.

    Attributes:
        shapes: Per-sequence shapes by name, without the batch axis
            (``{"conv": (3, 512), "recurrent": (8, 64, 64)}``).
        dtype: Storage dtype name (``"float32"``).
    """

    shapes: dict[str, tuple[int, ...]] = attrs.field(converter=_shapes)
    dtype: str = "float32"

    def bytes_at(self, tokens: int, itemsize: float, ring_capacity: int | None = None) -> int:
        """Bytes of one sequence's state (independent of the context length)."""
        del tokens, itemsize, ring_capacity
        size = 4 if self.dtype == "float32" else 2
        return sum(size * _prod(shape) for shape in self.shapes.values())


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out
