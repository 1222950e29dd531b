"""The full-attention KV cache: growth in steps, max_context refusal, trim."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core import native
from turbospark_core.cache_spec import CacheSpec
from turbospark_core.errors import ContextOverflowError
from turbospark_core.kv_cache import KVCache, _Rows, kv_group_size

SPEC = CacheSpec(n_kv_heads=2, head_dim=4, v_head_dim=3)


def _kv(n: int, start: int = 0) -> tuple[mx.array, mx.array]:
    """Keys/values whose entries encode their position, so content is checkable."""
    pos = np.arange(start, start + n, dtype=np.float32)
    k = np.broadcast_to(pos[None, None, :, None], (1, 2, n, 4)) + np.arange(4) / 10
    v = -np.broadcast_to(pos[None, None, :, None], (1, 2, n, 3))
    return mx.array(k.astype(np.float32)), mx.array(v.astype(np.float32))


def _positions(keys: mx.array) -> list[float]:
    return np.array(keys)[0, 0, :, 0].tolist()


def _write_all(cache: KVCache, sizes: list[int]) -> None:
    """Write chunks of ``sizes`` tokens, checking every fetch against everything written."""
    written_k, written_v = [], []
    start = 0
    for n in sizes:
        k, v = _kv(n, start)
        written_k.append(np.array(k))
        written_v.append(np.array(v))
        keys, values = cache.update_and_fetch(k, v)
        start += n
        assert cache.offset == start
        assert keys.shape == (1, 2, start, 4) and values.shape == (1, 2, start, 3)
        np.testing.assert_array_equal(np.array(keys), np.concatenate(written_k, axis=2))
        np.testing.assert_array_equal(np.array(values), np.concatenate(written_v, axis=2))


def test_growth_across_steps_keeps_earlier_content() -> None:
    # the runner's pattern: a prefill chunk, then one token per step across several steps
    cache = KVCache(SPEC, max_context=64, dtype=mx.float32, step=4)
    _write_all(cache, [6] + [1] * 11)
    assert cache.keys is not None and cache.keys.shape[2] == 20  # capacity in whole steps


def test_growth_from_a_full_step_by_chunks() -> None:
    cache = KVCache(SPEC, max_context=64, dtype=mx.float32, step=4)
    _write_all(cache, [4, 4, 1, 3, 8, 1])


def test_growth_from_a_partly_filled_step() -> None:
    cache = KVCache(SPEC, max_context=64, dtype=mx.float32, step=4)
    _write_all(cache, [2, 6, 3, 7])


def test_reserve_makes_room_once_for_a_prompt_and_keeps_content(cache_growths: list[tuple[int, int]]) -> None:
    """A prompt's room taken at once (whole steps, within max_context): its chunks write in place,
    the buffer is never grown (copied) while they do, and every fetch is what was written."""
    cache = KVCache(SPEC, max_context=64, dtype=mx.float32, step=4)
    cache.update_and_fetch(*_kv(3))  # a session's prefix
    cache.reserve(14)
    assert cache.keys is not None and cache.keys.shape[2] == 20  # 3 + 14 held, in whole steps
    cache_growths.clear()
    keys, _ = cache.update_and_fetch(*_kv(6, 3))
    keys, values = cache.update_and_fetch(*_kv(8, 9))
    assert cache.keys.shape[2] == 20 and not cache_growths
    want_k, want_v = (np.concatenate(parts, axis=2) for parts in zip(*[map(np.array, _kv(17))], strict=True))
    np.testing.assert_array_equal(np.array(keys), want_k)
    np.testing.assert_array_equal(np.array(values), want_v)
    cache.reserve(1000)
    assert cache.keys.shape[2] == 64  # never past max_context


def test_reserve_caches_reaches_full_layers_only() -> None:
    """Rings and recurrent state keep their fixed size; an exact-recent layer's quantized full cache grows."""
    from turbospark_core.kv_cache import ExactRecentKVCache, RingKVCache, reserve_caches

    full = KVCache(SPEC, max_context=64, dtype=mx.float32, step=4)
    ring = RingKVCache(CacheSpec(n_kv_heads=2, head_dim=4, v_head_dim=3, window=8), 64, mx.float32)
    wide = CacheSpec(n_kv_heads=2, head_dim=64, v_head_dim=64)  # quantized rows need groups of 32 or 64
    recent = ExactRecentKVCache(KVCache(wide, max_context=64, dtype=mx.float32, step=4, kv_bits=8), recent=4)
    reserve_caches([full, ring, recent], 10)
    assert full.keys is not None and full.keys.shape[2] == 12
    assert ring.keys is None
    assert recent.quantized._k is not None and recent.quantized._k.length == 12


def test_fetched_arrays_are_not_changed_by_later_updates() -> None:
    cache = KVCache(SPEC, max_context=64, dtype=mx.float32, step=4)
    first, _ = cache.update_and_fetch(*_kv(2))
    snapshot = np.array(first)
    for pos in range(2, 9):
        cache.update_and_fetch(*_kv(1, pos))
    np.testing.assert_array_equal(np.array(first), snapshot)


def test_stored_in_the_cache_dtype() -> None:
    cache = KVCache(SPEC, max_context=16, dtype=mx.float16, step=4)
    keys, values = cache.update_and_fetch(*_kv(3))
    assert keys.dtype == mx.float16 and values.dtype == mx.float16
    assert cache.state and all(a.dtype == mx.float16 for a in cache.state)


def test_capacity_never_exceeds_max_context() -> None:
    cache = KVCache(SPEC, max_context=10, dtype=mx.float32, step=256)
    cache.update_and_fetch(*_kv(10))
    assert cache.keys is not None and cache.keys.shape[2] == 10


def test_overflow_is_refused_with_a_clear_message() -> None:
    cache = KVCache(SPEC, max_context=8, dtype=mx.float32, step=4)
    cache.update_and_fetch(*_kv(6))
    with pytest.raises(ContextOverflowError) as err:
        cache.update_and_fetch(*_kv(3, 6))
    msg = str(err.value)
    assert "9 tokens" in msg and "max_context=8" in msg and "larger max_context" in msg
    assert isinstance(err.value, ValueError)
    assert cache.offset == 6  # the refused step left the cache as it was
    keys, _ = cache.update_and_fetch(*_kv(2, 6))
    assert _positions(keys) == list(range(8))


def test_trim_drops_the_last_tokens() -> None:
    cache = KVCache(SPEC, max_context=64, dtype=mx.float32, step=8)
    cache.update_and_fetch(*_kv(6))
    assert cache.trim(2) == 2 and cache.offset == 4
    keys, values = cache.update_and_fetch(*_kv(2, 100))  # overwrite positions 4, 5
    assert _positions(keys) == [0, 1, 2, 3, 100, 101]
    assert values.shape == (1, 2, 6, 3)
    assert cache.trim(100) == 6 and cache.offset == 0


def test_growth_after_trim_keeps_content() -> None:
    cache = KVCache(SPEC, max_context=64, dtype=mx.float32, step=4)
    cache.update_and_fetch(*_kv(4))
    cache.trim(3)
    keys, values = cache.update_and_fetch(*_kv(7, 1))
    assert _positions(keys) == list(range(8))
    assert values.shape == (1, 2, 8, 3)


# ------------------------------------------------------------ quantized KV


@pytest.mark.parametrize(("bits", "tol"), [(8, 1e-2), (4, 0.2)])
def test_quantized_cache_round_trips_within_its_precision(bits: int, tol: float) -> None:
    from turbospark_core.cache_spec import CacheSpec
    from turbospark_core.kv_cache import KVCache

    cache = KVCache(CacheSpec.full(2, 64), 600, mx.float32, kv_bits=bits)
    k = mx.random.normal((1, 2, 300, 64), key=mx.random.key(1))
    v = mx.random.normal((1, 2, 300, 64), key=mx.random.key(2))
    got_k, got_v = cache.update_and_fetch(k[:, :, :290], v[:, :, :290])
    for t in range(290, 300):  # crosses the 256-token growth step one token at a time
        got_k, got_v = cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert got_k.shape == k.shape and got_k.dtype == mx.float32
    assert float(mx.abs(got_k - k).max() / mx.abs(k).max()) < tol
    assert float(mx.abs(got_v - v).max() / mx.abs(v).max()) < tol
    packed = cache.state[0]
    assert packed.dtype == mx.uint32 and packed.shape[-1] == 64 * bits // 32


def test_quantized_ring_attends_like_the_float_ring() -> None:
    from turbospark_core.cache_spec import CacheSpec
    from turbospark_core.kv_cache import RingKVCache

    spec = CacheSpec.sliding(2, 32, window=8)
    q = mx.random.normal((1, 2, 30, 32), key=mx.random.key(3))
    k = mx.random.normal((1, 2, 30, 32), key=mx.random.key(4))
    v = mx.random.normal((1, 2, 30, 32), key=mx.random.key(5))
    outs = {}
    for bits in (None, 8):
        ring = RingKVCache(spec, 100, mx.float32, kv_bits=bits)
        parts, start = [], 0
        for n in (11, 1, 1, 5, 1, 1, 10):
            kk, vv = ring.update_and_fetch(k[:, :, start : start + n], v[:, :, start : start + n])
            parts.append(
                mx.fast.scaled_dot_product_attention(q[:, :, start : start + n], kk, vv, scale=0.2, mask=ring.mask(n))
            )
            start += n
        outs[bits] = mx.concatenate(parts, axis=2)
        assert ring.keys.shape[2] == 8  # memory stays flat at the window
    assert float(mx.abs(outs[8] - outs[None]).max()) < 2e-2


def test_kv_quant_refused_for_heads_no_group_divides(f32_install) -> None:
    import turbospark_core
    from turbospark_core.errors import OptionError

    with pytest.raises(OptionError, match="head_dim 16"):
        turbospark_core.open(f32_install, kv_quant="q4")


def test_causal_mask_without_cache() -> None:
    from turbospark_core.kv_cache import causal_mask

    assert causal_mask(1) is None and causal_mask(1, 4) is None
    assert causal_mask(5) == "causal" and causal_mask(4, 4) == "causal"
    m = np.array(causal_mask(6, 3))
    want = np.array([[0 <= i - j < 3 for j in range(6)] for i in range(6)])
    assert (m == want).all()


# --- keys-only layers (CacheSpec v_head_dim=0): a flow that reads its values from its keys ---------
KEYS_ONLY = CacheSpec(n_kv_heads=1, head_dim=64, v_head_dim=0)


def test_keys_only_spec_counts_and_stores_no_values() -> None:
    assert KEYS_ONLY.value_dim == 0 and SPEC.value_dim == 3 and CacheSpec(n_kv_heads=1, head_dim=8).value_dim == 8
    assert KEYS_ONLY.bytes_at(100, 2) == 100 * 64 * 2  # keys only
    cache = KVCache(KEYS_ONLY, max_context=512, dtype=mx.float32)
    rows = mx.array(np.random.default_rng(0).standard_normal((1, 1, 5, 64)).astype(np.float32))
    keys, values = cache.update_and_fetch(rows, rows[..., :0])
    assert values.shape == (1, 1, 5, 0) and np.array_equal(np.array(keys), np.array(rows))
    assert sum(a.nbytes for a in cache.state) == 256 * 64 * 4  # one growth step of keys, nothing else


@pytest.mark.parametrize("bits", [8, 4])
def test_keys_only_quantized_and_batched(bits: int) -> None:
    from turbospark_core.batch_cache import BatchCaches
    from turbospark_core.kv_cache import make_caches

    rng = np.random.default_rng(1)
    caches = [make_caches([KEYS_ONLY], 64, mx.float32, kv_bits=bits, kv_rotate=True)[0] for _ in range(2)]
    for n, cache in zip((3, 5), caches, strict=True):
        rows = mx.array(rng.standard_normal((1, 1, n, 64)).astype(np.float32))
        keys, values = cache.update_and_fetch(rows, rows[..., :0])
        assert values.shape[-1] == 0 and np.abs(np.array(keys) - np.array(rows)).max() < (0.05 if bits == 8 else 0.5)
    batch = BatchCaches(caches[:1])  # the template: one layer
    for cache in caches:
        batch.add_row([cache], cache.offset)
    step = mx.array(rng.standard_normal((2, 1, 1, 64)).astype(np.float32))
    keys, values = batch.caches[0].update_and_fetch(step, step[..., :0])
    assert keys.shape == (2, 1, 6, 64) and values.shape == (2, 1, 6, 0)
    batch.step_done(1)
    fresh = make_caches([KEYS_ONLY], 64, mx.float32, kv_bits=bits, kv_rotate=True)
    batch.export_row(0, fresh)
    assert fresh[0].offset == 4 and fresh[0].keys is not None


def test_q4_rows_use_group_32_and_shrink_quantization_error() -> None:
    """q4 KV rows quantize in groups of 32 (q8 keeps 64): half the groups' error on real-like rows."""
    assert kv_group_size(64, 4) == 32 and kv_group_size(64, 8) == 64 and kv_group_size(96) == 32
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, 2, 16, 64)).astype(np.float32))
    rows = _Rows.encode(x, 4, mx.float32)
    assert rows.parts[1].shape[-1] == 2  # two scales per 64-wide row
    err32 = float(mx.abs(rows.decode() - x).mean())
    w, s, b = mx.quantize(x, group_size=64, bits=4)
    err64 = float(mx.abs(mx.dequantize(w, s, b, group_size=64, bits=4) - x).mean())
    assert err32 < 0.9 * err64


def _windowed_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, t: int, window: int) -> np.ndarray:
    """Query ``t`` attending to keys ``(t - window, t]`` (float64)."""
    lo = max(0, t - window + 1)
    s = np.einsum("bhd,bhsd->bhs", q[:, :, t].astype(np.float64), k[:, :, lo : t + 1].astype(np.float64)) * 0.2
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhs,bhsd->bhd", p, v[:, :, lo : t + 1].astype(np.float64))


def test_ring_reads_its_prefix_unmasked_until_the_window_fills() -> None:
    """Below its window a ring is a prefix: one-token steps read ``[0, offset)`` with no mask and
    write no positions; a trim, a snapshot/restore and the window filling up keep every step's
    attention equal to a windowed reference."""
    from turbospark_core.kv_cache import RingKVCache

    window, total = 8, 30
    spec = CacheSpec.sliding(2, 16, window=window)
    q, k, v = (np.array(mx.random.normal((1, 2, total, 16), key=mx.random.key(s))) for s in (7, 8, 9))
    ring = RingKVCache(spec, 100, mx.float32)
    ring.update_and_fetch(mx.array(k[:, :, :3]), mx.array(v[:, :, :3]))
    t = 3
    snap = None
    while t < total:
        kk, vv = ring.update_and_fetch(mx.array(k[:, :, t : t + 1]), mx.array(v[:, :, t : t + 1]))
        mask = ring.mask(1)
        if t < window:
            assert mask is None and kk.shape[2] == t + 1  # the prefix, unmasked
            assert len(ring.state) == 2  # keys and values: no positions written
            np.testing.assert_array_equal(np.array(ring.fetched_positions()), np.arange(t + 1))
        else:
            assert mask is not None and kk.shape[2] == window
        out = mx.fast.scaled_dot_product_attention(mx.array(q[:, :, t : t + 1]), kk, vv, scale=0.2, mask=mask)
        np.testing.assert_allclose(np.array(out)[:, :, 0], _windowed_reference(q, k, v, t, window), atol=2e-5)
        if t == 5 and snap is None:  # rewind two tokens inside the prefix, then replay them
            snap = ring.snapshot()
            assert ring.trim(2) == 2 and ring.offset == 4
            np.testing.assert_array_equal(np.array(ring.positions)[:5], [0, 1, 2, 3, -1])
            ring.restore(snap)
            assert ring.offset == 6 and ring.mask(1) is None
            assert ring.trim(2) == 2
            t = 3
        t += 1
    # wrapped, the ring holds the last window of positions
    np.testing.assert_array_equal(np.sort(np.array(ring.positions)), np.arange(total - window, total))


@pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: {native.STATUS}")
@pytest.mark.parametrize("ring", [False, True])
def test_attend_in_one_op_equals_update_fetch_and_attention(ring: bool) -> None:
    """A float cache's one-op step (rows written in place) gives the bits of update_and_fetch + mask + attention,
    holds the same rows afterwards, and copies no buffer while decoding."""
    from turbospark_core.kv_cache import RingKVCache
    from turbospark_core.layers import attention, cached_attention

    spec = CacheSpec.sliding(2, 16, window=12) if ring else CacheSpec(n_kv_heads=2, head_dim=16)

    def make() -> KVCache | RingKVCache:
        return RingKVCache(spec, 100, mx.float32) if ring else KVCache(spec, 100, mx.float32, step=8)

    fused, parts = make(), make()
    total = 11  # a prefill of 4, then single tokens (the ring stays below its window)
    q, k, v = (mx.random.normal((1, 4, total, 16), key=mx.random.key(s)) for s in (11, 12, 13))
    k, v = k[:, :2], v[:, :2]
    copies = None
    for a, b in [(0, 4)] + [(t, t + 1) for t in range(4, total)]:
        got = cached_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], fused, scale=0.3, merge_heads=True)
        kk, vv = parts.update_and_fetch(k[:, :, a:b], v[:, :, a:b])
        want = attention(q[:, :, a:b], kk, vv, scale=0.3, mask=parts.mask(b - a), merge_heads=True)
        mx.eval(got, want, fused.state)
        np.testing.assert_array_equal(np.array(got), np.array(want))
        assert fused.offset == parts.offset == b
        if copies is None:
            copies = native.cache_attention_copies()
    assert native.cache_attention_copies() == copies  # written in place from the first decode step on
    ek, ev, _ = fused.export_rows()
    wk, wv, _ = parts.export_rows()
    assert ek is not None and ev is not None and wk is not None and wv is not None
    np.testing.assert_array_equal(np.array(ek.parts[0]), np.array(wk.parts[0]))
    np.testing.assert_array_equal(np.array(ev.parts[0]), np.array(wv.parts[0]))
