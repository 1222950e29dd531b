"""DeepSeek's rotary embedding: interleaved pairs (2i, 2i+1) on the rope part only, with YaRN.

The core's :class:`~turbospark_core.family.Rope` rotates half-split pairs; DeepSeek
checkpoints rotate interleaved ones, and fold YaRN's ``mscale_all_dim`` into the
softmax scale, so the family builds its own (on ``mx.fast.rope``, traditional layout).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np


def yarn_mscale(factor: float, mscale: float) -> float:
    """m(f, k) = 0.1 k ln f + 1 (1 when f <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class LatentRope:
    """RoPE over ``dims`` features rotating pairs (2i, 2i+1), optionally YaRN-scaled.

    Attributes:
        att: The cos/sin factor (YaRN ``m(f, mscale) / m(f, mscale_all_dim)``).
        softmax_factor: What the softmax scale is multiplied by (``m(f, mscale_all_dim)^2``).
    """

    def __init__(self, dims: int, theta: float, scaling: dict[str, Any] | None) -> None:
        self.dims = dims
        inv = theta ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
        self.att = 1.0
        self.softmax_factor = 1.0
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "yarn":
            inv = _yarn_inv_freq(inv, dims, theta, scaling)
            factor = float(scaling["factor"])
            mscale, mscale_all = float(scaling.get("mscale") or 1.0), float(scaling.get("mscale_all_dim") or 0.0)
            self.att = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
            self.softmax_factor = yarn_mscale(factor, mscale_all) ** 2
        self._periods = mx.array((1.0 / inv).astype(np.float32))  # mx.fast.rope: angle = position / period

    def __call__(self, x: mx.array, offset: int | mx.array) -> mx.array:
        if self.att != 1.0:
            x = x * self.att
        return mx.fast.rope(x, self.dims, traditional=True, base=None, scale=1.0, offset=offset, freqs=self._periods)


def _yarn_inv_freq(inv: np.ndarray, dims: int, theta: float, s: dict[str, Any]) -> np.ndarray:
    factor = float(s["factor"])
    original = float(s.get("original_max_position_embeddings") or 4096)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def corr(rotations: float) -> float:
        return dims * math.log(original / (2 * math.pi * rotations)) / (2 * math.log(theta))

    low: float = max(math.floor(corr(beta_fast)), 0)
    high: float = min(math.ceil(corr(beta_slow)), dims - 1)
    if low == high:
        high += 0.001  # as every reference: no division by zero
    ramp = np.clip((np.arange(dims // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    return inv * (1 - ramp) + inv / factor * ramp
