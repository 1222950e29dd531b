"""Rotated quantized KV: keys and values stored Hadamard-rotated per head, handed back unrotated."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core.cache_spec import CacheSpec
from turbospark_core.kv_cache import (
    KVCache,
    RingKVCache,
    RotatedKVCache,
    RotatedRingKVCache,
    kv_rotatable,
    make_cache,
)

SPEC = CacheSpec(n_kv_heads=2, head_dim=64)
RING = CacheSpec(n_kv_heads=2, head_dim=64, window=8)


def _outlier_rows(n: int, seed: int = 0, outlier: float = 10.0) -> mx.array:
    """Rows with a few large channels, as real keys have: what per-group quantization handles worst."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 2, n, 64)).astype(np.float32)
    x[..., [3, 17, 40]] *= outlier
    return mx.array(x)


def _rms(a: mx.array) -> float:
    return float(mx.sqrt(mx.mean(a * a)))


def _attend(cache: KVCache | RingKVCache, q: mx.array, k: mx.array, v: mx.array, chunks: list[int]) -> mx.array:
    outs, start = [], 0
    for n in chunks:
        kk, vv = cache.update_and_fetch(k[:, :, start : start + n], v[:, :, start : start + n])
        qq = q[:, :, start : start + n]
        outs.append(mx.fast.scaled_dot_product_attention(qq, kk, vv, scale=0.125, mask=cache.mask(n)))
        start += n
    return mx.concatenate(outs, axis=2)


def test_rotatable_sizes_are_powers_of_two() -> None:
    assert [d for d in (16, 32, 48, 64, 80, 96, 128, 256) if kv_rotatable(d)] == [16, 32, 64, 128, 256]
    assert not kv_rotatable(1) and not kv_rotatable(0)


def test_make_cache_rotates_only_quantized_power_of_two_heads() -> None:
    assert type(make_cache(SPEC, 64, mx.float32, kv_bits=4, kv_rotate=True)) is RotatedKVCache
    assert type(make_cache(RING, 64, mx.float32, kv_bits=4, kv_rotate=True)) is RotatedRingKVCache
    assert type(make_cache(SPEC, 64, mx.float32, kv_bits=4, kv_rotate=False)) is KVCache
    assert type(make_cache(SPEC, 64, mx.float32, kv_bits=None, kv_rotate=True)) is KVCache  # nothing to protect
    assert type(make_cache(RING, 64, mx.float32, kv_bits=None, kv_rotate=True)) is RingKVCache
    odd = CacheSpec(n_kv_heads=2, head_dim=96)
    assert type(make_cache(odd, 64, mx.float32, kv_bits=4, kv_rotate=True)) is KVCache
    odd_v = CacheSpec(n_kv_heads=2, head_dim=64, v_head_dim=96)
    assert type(make_cache(odd_v, 64, mx.float32, kv_bits=4, kv_rotate=True)) is KVCache


def test_rotated_cache_hands_back_unrotated_rows() -> None:
    """Unquantized, the rotation round-trips exactly (to float32 rounding): nothing but storage changes."""
    k, v = _outlier_rows(12), _outlier_rows(12, seed=1)
    cache = RotatedKVCache(SPEC, 64, mx.float32, kv_bits=None)
    kk, vv = cache.update_and_fetch(k, v)
    np.testing.assert_allclose(np.array(kk), np.array(k), atol=1e-4)
    np.testing.assert_allclose(np.array(vv), np.array(v), atol=1e-4)
    np.testing.assert_allclose(np.array(cache.keys)[:, :, :12], np.array(k), atol=1e-4)
    np.testing.assert_allclose(np.array(cache.values)[:, :, :12], np.array(v), atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_rotation_shrinks_quantization_error_of_outlier_keys(bits: int) -> None:
    k, v = _outlier_rows(40), _outlier_rows(40, seed=1)
    errs = {}
    for cls in (KVCache, RotatedKVCache):
        kk, vv = cls(SPEC, 64, mx.float32, kv_bits=bits).update_and_fetch(k, v)
        errs[cls] = _rms(kk - k), _rms(vv - v)
    assert errs[RotatedKVCache][0] < errs[KVCache][0] / 1.5
    assert errs[RotatedKVCache][1] < errs[KVCache][1] / 1.5


@pytest.mark.parametrize("bits", [4, 8])
def test_rotated_attention_matches_unquantized_within_quantization_tolerance(bits: int) -> None:
    """Full cache and ring, prefill then decode: rotated-KV outputs track unquantized ones, closer than unrotated."""
    q, k, v = _outlier_rows(30, seed=2, outlier=1.0), _outlier_rows(30), _outlier_rows(30, seed=1)
    chunks = [11, 1, 1, 5, 1, 1, 10]
    for spec, plain, rotated in ((SPEC, KVCache, RotatedKVCache), (RING, RingKVCache, RotatedRingKVCache)):
        ref = _attend(plain(spec, 64, mx.float32), q, k, v, chunks)
        unrot = _attend(plain(spec, 64, mx.float32, kv_bits=bits), q, k, v, chunks)
        rot = _attend(rotated(spec, 64, mx.float32, kv_bits=bits), q, k, v, chunks)
        err_rot, err_unrot = _rms(rot - ref), _rms(unrot - ref)
        scale = _rms(ref)
        assert err_rot < (0.01 if bits == 8 else 0.15) * scale, (spec, bits, err_rot, scale)
        assert err_rot < err_unrot, (spec, bits, err_rot, err_unrot)


def test_rotated_ring_snapshot_and_restore_replay_identically() -> None:
    k, v = _outlier_rows(20), _outlier_rows(20, seed=1)
    ring = RotatedRingKVCache(RING, 64, mx.float32, kv_bits=4)
    ring.update_and_fetch(k[:, :, :10], v[:, :, :10])
    snap = ring.snapshot()
    first = [np.array(a) for a in ring.update_and_fetch(k[:, :, 10:11], v[:, :, 10:11])]
    ring.restore(snap)
    again = [np.array(a) for a in ring.update_and_fetch(k[:, :, 10:11], v[:, :, 10:11])]
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
