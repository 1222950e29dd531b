"""What cache a layer needs: the family's declaration, the core's allocation plan."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class CacheSpec:
    """One layer's KV cache requirement.

    Attributes:
        n_kv_heads: Key/value heads.
        head_dim: Key head dimension.
        v_head_dim: Value head dimension (defaults to ``head_dim``).
        window: Sliding window in tokens, or ``None`` for full attention.
    """

    n_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    window: int | None = None

    def bytes_at(self, tokens: int, itemsize: int) -> int:
        """Bytes this layer's K and V take at ``tokens`` of context."""
        held = tokens if self.window is None else min(tokens, self.window)
        v_dim = self.v_head_dim or self.head_dim
        return held * self.n_kv_heads * (self.head_dim + v_dim) * itemsize

    @classmethod
    def full(cls, n_kv_heads: int, head_dim: int) -> CacheSpec:
        """A full-attention layer."""
        return cls(n_kv_heads=n_kv_heads, head_dim=head_dim)
