"""Rotary position embeddings: default, linear, llama3 and YaRN scaling on mx.fast.rope."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np

from turbospark_core import native
from turbospark_core.errors import ArchConfigError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class Rope:
    """RoPE over the first ``dims`` features of each head (Hugging Face half-split layout).

    Build it with :meth:`from_config`.
    """

    def __init__(self, dims: int, freqs: mx.array, scale: float = 1.0, mscale: float = 1.0) -> None:
        self.dims = dims
        self._freqs = freqs
        self.scale = scale
        self.mscale = mscale

    @property
    def freqs(self) -> mx.array:
        """The periods ``[dims / 2]`` (angle = position * scale / period), as ``mx.fast.rope`` takes them."""
        return self._freqs

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if self.mscale != 1.0:
            x = _scale_rotated(x, self.dims, self.mscale)
        if native.rope_supported(x, offset):  # one op on the CPU instead of MLX's composed fallback
            return native.rope(x, self.dims, self.scale, offset, self._freqs)
        return mx.fast.rope(
            x,
            self.dims,
            traditional=False,
            base=None,
            scale=self.scale,
            offset=offset,
            freqs=self._freqs,
        )

    @classmethod
    def from_config(
        cls, *, dims: int, theta: float, scaling: dict[str, Any] | None, max_positions: int
    ) -> Rope:
        """Build from ``rope_theta`` and a Hugging Face ``rope_scaling`` dict.

        Raises:
            ArchConfigError: An unknown ``rope_type`` (naming it), or bad dims.
        """
        if dims <= 0 or dims % 2:
            msg = f"rotary dims must be a positive even number, got {dims}; check head_dim/rotary_dim"
            raise ArchConfigError(msg)
        inv = 1.0 / (theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "default" or scaling is None:
            return cls(dims, _freqs(inv))
        if rope_type == "linear":
            return cls(dims, _freqs(inv), scale=1.0 / float(scaling["factor"]))
        if rope_type == "llama3":
            return cls(dims, _freqs(_llama3(inv, scaling)))
        if rope_type == "yarn":
            inv, mscale = _yarn(inv, dims, theta, scaling, max_positions)
            return cls(dims, _freqs(inv), mscale=mscale)
        msg = f"rope_scaling type {rope_type!r} is not implemented; supported: {', '.join(ROPE_TYPES)}"
        raise ArchConfigError(msg)


def _freqs(inv: np.ndarray) -> mx.array:
    # mx.fast.rope takes periods: angle = position / freqs
    return mx.array((1.0 / inv).astype(np.float32))


def _scale_rotated(x: mx.array, dims: int, factor: float) -> mx.array:
    if dims == x.shape[-1]:
        return x * factor
    return mx.concatenate([x[..., :dims] * factor, x[..., dims:]], axis=-1)


def _llama3(inv: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    inv: np.ndarray, dims: int, theta: float, s: dict[str, Any], max_positions: int
) -> tuple[np.ndarray, float]:
    factor = float(s["factor"])
    original = float(s.get("original_max_position_embeddings") or max_positions)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dims * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dims // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (inv / factor) * (1 - extrapolation) + inv * extrapolation
    attention = s.get("attention_factor")
    if attention is None:
        if "mscale" in s and "mscale_all_dim" in s:
            attention = _yarn_mscale(factor, float(s["mscale"])) / _yarn_mscale(
                factor, float(s["mscale_all_dim"])
            )
        else:
            attention = _yarn_mscale(factor)
    return inv, float(attention)
