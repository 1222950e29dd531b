"""Quantized KV whose most recent tokens attention reads exact (:class:`ExactRecentKVCache`).

The reference is attention written out per query: each query ``q`` attends to the
quantized rows of positions ``<= q - recent`` and the unquantized rows above. Every
way of feeding the same tokens (one prefill, one token at a time, mixed chunks, a
trimmed verify block, a batch row) must read exactly those keys.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core.batch_cache import BatchCaches, BatchExactRecentKVCache
from turbospark_core.cache_spec import CacheSpec
from turbospark_core.kv_cache import (
    ExactRecentKVCache,
    KVCache,
    RingKVCache,
    RotatedKVCache,
    RotatedRingKVCache,
    _Rows,
    _wht,
    kv_recent_default,
    make_cache,
    make_caches,
    recent_split_mask,
)
from turbospark_core.layers import attention

FULL = CacheSpec(n_kv_heads=2, head_dim=64)
RING = CacheSpec(n_kv_heads=2, head_dim=64, window=12)
RECENT = 5
T = 40


def _rows(seed: int, n: int = T) -> mx.array:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 2, n, 64)).astype(np.float32)
    x[..., [3, 17]] *= 8.0  # outlier channels, as real keys have
    return mx.array(x)


Q, K, V = _rows(0), _rows(1), _rows(2)


def _cache(spec: CacheSpec = FULL, rotate: bool = True, slack: int = 0) -> ExactRecentKVCache:
    cache = make_cache(spec, 64, mx.float32, kv_bits=4, kv_rotate=rotate, ring_slack=slack, kv_recent=RECENT)
    assert isinstance(cache, ExactRecentKVCache)
    return cache


def _feed(cache: Any, chunks: list[int], start: int = 0, k: mx.array = K, v: mx.array = V) -> np.ndarray:
    """Attention outputs of the queries ``start ..`` fed in ``chunks`` (the native op: per-query results)."""
    outs = []
    for n in chunks:
        kk, vv = cache.update_and_fetch(k[:, :, start : start + n], v[:, :, start : start + n])
        outs.append(attention(Q[:, :, start : start + n], kk, vv, scale=0.125, mask=cache.mask(n)))
        start += n
    return np.array(mx.concatenate(outs, axis=2))


def _reference(spec: CacheSpec, rotate: bool, n: int = T) -> np.ndarray:
    """Per query: quantized rows below its recent window, exact rows within (and within a ring's window)."""

    def quantized(x: mx.array) -> mx.array:
        if not rotate:
            return _Rows.encode(x, 4, mx.float32).decode()
        return _wht(_Rows.encode(_wht(x), 4, mx.float32).decode())

    kq, vq = quantized(K), quantized(V)
    outs = []
    for q in range(n):
        low = 0 if spec.window is None else max(0, q - spec.window + 1)
        cut = max(low, q - RECENT + 1)
        kk = mx.concatenate([kq[:, :, low:cut], K[:, :, cut : q + 1]], axis=2)
        vv = mx.concatenate([vq[:, :, low:cut], V[:, :, cut : q + 1]], axis=2)
        outs.append(mx.fast.scaled_dot_product_attention(Q[:, :, q : q + 1], kk, vv, scale=0.125))
    return np.array(mx.concatenate(outs, axis=2))


@pytest.mark.parametrize("spec", [FULL, RING], ids=["full", "ring"])
@pytest.mark.parametrize("rotate", [True, False])
def test_every_chunking_reads_the_per_query_reference(spec: CacheSpec, rotate: bool) -> None:
    want = _reference(spec, rotate)
    whole = _feed(_cache(spec, rotate), [T])
    one_by_one = _feed(_cache(spec, rotate), [1] * T)
    mixed = _feed(_cache(spec, rotate), [11, 1, 1, 5, 1, 1, 20])
    np.testing.assert_allclose(whole, want, rtol=1e-5, atol=1e-5)  # float32 summation order
    # the same keys for every query; a ring hands its slots back in another order than a prefill
    # (a different float32 summation order)
    np.testing.assert_allclose(one_by_one, whole, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mixed, whole, rtol=1e-5, atol=1e-5)


def test_recent_window_brings_quantized_attention_closer_to_exact() -> None:
    exact = _feed(KVCache(FULL, 64, mx.float32), [T])
    plain = _feed(RotatedKVCache(FULL, 64, mx.float32, kv_bits=4), [T])
    recent = _feed(_cache(), [T])
    assert np.abs(recent - exact).mean() < 0.7 * np.abs(plain - exact).mean()


def _visible(mask: np.ndarray, held: np.ndarray, exact: np.ndarray) -> list[list[tuple[str, int]]]:
    """Per query: which copy (``q``/``e``) of which position it reads."""
    tags = [("q", int(p)) for p in held] + [("e", int(p)) for p in exact]
    return [sorted(t for t, m in zip(tags, row, strict=True) if m) for row in mask]


def test_split_mask_reads_each_position_once() -> None:
    held = np.arange(10)
    exact = np.array([7, 8, 9, -1, 5, 6])  # a ring: slots by position, one empty
    queries = np.array([[8], [9]])
    mask = np.array(recent_split_mask(mx.array(held[None]), mx.array(exact[None]), mx.array(queries), 3, None))
    seen = _visible(mask, held, exact)
    assert seen[0] == sorted([("q", p) for p in range(6)] + [("e", 6), ("e", 7), ("e", 8)])
    assert seen[1] == sorted([("q", p) for p in range(7)] + [("e", 7), ("e", 8), ("e", 9)])
    # the exact ring lost positions 5..7 (a rewind deeper than its spare slots): they are read quantized
    shallow = np.array([8, 9, -1, -1, -1, -1])
    mask = np.array(recent_split_mask(mx.array(held[None]), mx.array(shallow[None]), mx.array(queries), 3, None))
    seen = _visible(mask, held, shallow)
    assert seen[1] == sorted([("q", p) for p in range(8)] + [("e", 8), ("e", 9)])
    # a sliding layer's window bounds both parts
    mask = np.array(recent_split_mask(mx.array(held[None]), mx.array(exact[None]), mx.array(queries), 3, 5))
    assert _visible(mask, held, exact)[1] == [("e", 7), ("e", 8), ("e", 9), ("q", 5), ("q", 6)]


@pytest.mark.parametrize("spec", [FULL, RING], ids=["full", "ring"])
@pytest.mark.parametrize("kept", [0, 2, 4])
def test_a_trimmed_verify_block_equals_a_fresh_run(spec: CacheSpec, kept: int) -> None:
    """A verify block of four whose last ``4 - kept`` are rejected, trimmed within the slack: what
    follows reads exactly what a run that only ever saw the accepted tokens reads."""
    slack, first = 4, 17
    block_k = mx.concatenate([K[:, :, first : first + kept], K[:, :, ::-1][:, :, : slack - kept]], axis=2)
    block_v = mx.concatenate([V[:, :, first : first + kept], V[:, :, ::-1][:, :, : slack - kept]], axis=2)
    trimmed, fresh = _cache(spec, slack=slack), _cache(spec, slack=slack)
    _feed(trimmed, [first])
    _feed(fresh, [first + kept] if kept else [first])
    trimmed.update_and_fetch(block_k, block_v)
    assert trimmed.trim(slack - kept) == slack - kept
    assert trimmed.offset == fresh.offset == first + kept
    rest = [1, 3, 1, 1, 2]
    np.testing.assert_array_equal(_feed(trimmed, rest, first + kept), _feed(fresh, rest, first + kept))


def test_a_deep_trim_reads_the_lost_recent_keys_quantized() -> None:
    cache = _cache(slack=0)
    _feed(cache, [20])
    cache.trim(8)  # the exact ring (5 slots) held 15..19: none of 8..11, the next query's recent keys
    cache.update_and_fetch(K[:, :, 12:13], V[:, :, 12:13])
    mask = np.array(cache.mask(1))[0]
    assert mask.sum() == 13  # every position 0..12 read once
    exact_part = mask[cache.quantized.offset :]
    assert exact_part.sum() == 1  # only the new token is still exact; 8..11 come from the quantized rows


def test_snapshot_and_restore_replay_identically() -> None:
    for spec in (FULL, RING):
        cache = _cache(spec)
        _feed(cache, [15])
        snap = cache.snapshot()
        first = _feed(cache, [3, 1], 15)
        cache.restore(snap)
        np.testing.assert_array_equal(_feed(cache, [3, 1], 15), first)


def test_make_cache_wraps_quantized_caches_only() -> None:
    def kind(spec: CacheSpec, bits: int | None, recent: int, rotate: bool = True) -> tuple[type, ...]:
        cache = make_cache(spec, 64, mx.float32, kv_bits=bits, kv_rotate=rotate, kv_recent=recent)
        return (type(cache), type(cache.quantized)) if isinstance(cache, ExactRecentKVCache) else (type(cache),)

    assert kind(FULL, 4, 32) == (ExactRecentKVCache, RotatedKVCache)
    assert kind(RING, 4, 32) == (ExactRecentKVCache, RotatedRingKVCache)
    assert kind(FULL, 4, 32, rotate=False) == (ExactRecentKVCache, KVCache)
    assert kind(RING, 8, 32, rotate=False) == (ExactRecentKVCache, RingKVCache)
    assert kind(FULL, 4, 0) == (RotatedKVCache,)
    assert kind(FULL, None, 32) == (KVCache,)  # nothing quantized: nothing to keep exact
    assert kv_recent_default(4) == 32 and kv_recent_default(8) == 0 and kv_recent_default(None) == 0
    with pytest.raises(ValueError, match="recent >= 1"):
        ExactRecentKVCache(KVCache(FULL, 64, mx.float32, kv_bits=4), 0)


def test_exact_ring_holds_recent_plus_slack_and_state_counts_it() -> None:
    cache = _cache(slack=3)
    _feed(cache, [T])
    assert cache.exact.capacity == RECENT + 3
    exact_bytes = (RECENT + 3) * 2 * (64 + 64) * 4 + (RECENT + 3) * 4  # keys, values, positions
    assert sum(a.nbytes for a in cache.state) == sum(a.nbytes for a in cache.quantized.state) + exact_bytes


@pytest.mark.parametrize("spec", [FULL, RING], ids=["full", "ring"])
def test_batched_rows_join_step_rewind_and_leave_as_if_alone(spec: CacheSpec) -> None:
    """Two rows of different lengths in one batch: each step, rewind and export equals the row alone."""
    lengths = (14, 9)
    alone = [_cache(spec, slack=2) for _ in lengths]
    for cache, n in zip(alone, lengths, strict=True):
        cache.update_and_fetch(K[:, :, :n], V[:, :, :n])
    batch = BatchCaches(alone[:1])
    for cache, n in zip(alone, lengths, strict=True):
        batch.add_row([cache], n)
    layer = batch.caches[0]
    assert isinstance(layer, BatchExactRecentKVCache)

    def step(n: int) -> None:
        """``n`` tokens per row, batched and alone; each row's outputs must match."""
        starts = list(batch.rows.offsets)
        k = mx.concatenate([K[:, :, s : s + n] for s in starts])
        v = mx.concatenate([V[:, :, s : s + n] for s in starts])
        q = mx.concatenate([Q[:, :, s : s + n] for s in starts])
        kk, vv = layer.update_and_fetch(k, v)
        got = np.array(attention(q, kk, vv, scale=0.125, mask=layer.mask(n)))
        batch.step_done(n)
        for row, (cache, s) in enumerate(zip(alone, starts, strict=True)):
            ka, va = cache.update_and_fetch(K[:, :, s : s + n], V[:, :, s : s + n])
            want = np.array(attention(Q[:, :, s : s + n], ka, va, scale=0.125, mask=cache.mask(n)))
            np.testing.assert_allclose(got[row : row + 1], want, rtol=1e-5, atol=1e-6)

    for n in (1, 3, 1, 1):
        step(n)
    # row 1 rejects two of a three-token verify: rewind it in the batch and alone
    step(3)
    batch.truncate(1, batch.rows.offsets[1] - 2)
    alone[1].trim(2)
    for n in (1, 1, 2):
        step(n)
    # row 0 leaves: exported into fresh caches, it goes on as the row alone does
    fresh = [_cache(spec, slack=2)]
    batch.export_row(0, fresh)
    assert fresh[0].offset == alone[0].offset
    s = fresh[0].offset
    for cache in (fresh[0], alone[0]):
        cache.update_and_fetch(K[:, :, s : s + 2], V[:, :, s : s + 2])
    np.testing.assert_array_equal(np.array(fresh[0].mask(2)), np.array(alone[0].mask(2)))
    np.testing.assert_array_equal(_feed(fresh[0], [1], s + 2), _feed(alone[0], [1], s + 2))


def test_keys_only_layers_keep_recent_keys_exact() -> None:
    keys_only = CacheSpec(n_kv_heads=1, head_dim=64, v_head_dim=0)
    (cache,) = make_caches([keys_only], 64, mx.float32, kv_bits=8, kv_recent=3)
    assert isinstance(cache, ExactRecentKVCache)
    rows = K[:, :1, :6]
    keys, values = cache.update_and_fetch(rows, rows[..., :0])
    assert keys.shape == (1, 1, 6 + 6, 64) and values.shape == (1, 1, 6 + 6, 0)  # a prefill returns all it wrote
    np.testing.assert_array_equal(np.array(keys)[:, :, 6:], np.array(rows))
    assert np.array(cache.mask(6))[-1].tolist() == [True] * 3 + [False] * 6 + [True] * 3
