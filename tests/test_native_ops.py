"""Native RoPE and decode attention: equal to mx.fast.rope / scaled_dot_product_attention within float32 rounding."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core import native

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: {native.STATUS}")


def _freqs(dims: int) -> mx.array:
    return mx.array((10000.0 ** (np.arange(0, dims, 2) / dims)).astype(np.float32))


def _want(x: mx.array, dims: int, scale: float, offset: int) -> np.ndarray:
    y = mx.fast.rope(x, dims, traditional=False, base=None, scale=scale, offset=offset, freqs=_freqs(dims))
    return np.array(y)


@needs_native
@pytest.mark.parametrize("dims", [64, 48])
@pytest.mark.parametrize("length", [1, 5])
def test_equals_mlx_rope_on_transposed_heads(dims: int, length: int) -> None:
    x = mx.random.normal((2, length, 3, 64), key=mx.random.key(1)).transpose(0, 2, 1, 3)  # strided, as families pass
    assert native.rope_supported(x, 37)
    got = native.rope(x, dims, 0.5, 37, _freqs(dims))
    np.testing.assert_allclose(np.array(got), _want(x, dims, 0.5, 37), rtol=0, atol=2e-6)


@needs_native
def test_offset_per_row_and_compiled() -> None:
    x = mx.random.normal((2, 4, 1, 32), key=mx.random.key(2))
    offsets = mx.array([3, 900], dtype=mx.int32)
    f = mx.compile(lambda a, o: native.rope(a, 32, 1.0, o, _freqs(32)))
    got = np.array(f(x, offsets))
    for row, off in enumerate((3, 900)):
        np.testing.assert_allclose(got[row : row + 1], _want(x[row : row + 1], 32, 1.0, off), rtol=0, atol=2e-5)


@needs_native
def test_bad_shapes_are_refused() -> None:
    x = mx.zeros((1, 2, 1, 16))
    assert not native.rope_supported(x.astype(mx.float16), 0)
    assert not native.rope_supported(mx.zeros((2, 1, 16)), 0)
    with pytest.raises(ValueError, match="dims must be even"):
        native.rope(x, 15, 1.0, 0, _freqs(16)[:7])
    with pytest.raises(ValueError, match="freqs must be float32"):
        native.rope(x, 16, 1.0, 0, _freqs(8))


@needs_native
@pytest.mark.parametrize(("heads", "kv_heads", "length"), [(9, 3, 300), (4, 4, 1), (8, 1, 17)])
def test_decode_attention_equals_mlx_on_cache_slices(heads: int, kv_heads: int, length: int) -> None:
    key = mx.random.key(3)
    kk, kv, kq = mx.random.split(key, 3)
    k = mx.random.normal((2, kv_heads, length + 40, 32), key=kk)[:, :, :length, :]  # a cache's slice: strided
    v = mx.random.normal((2, kv_heads, length + 40, 32), key=kv)[:, :, :length, :]
    q = mx.random.normal((2, 1, heads, 32), key=kq).transpose(0, 2, 1, 3)
    assert native.decode_attention_supported(q, k, v)
    got = native.decode_attention(q, k, v, 32**-0.5)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=32**-0.5)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=2e-6)


@needs_native
def test_decode_attention_refusals() -> None:
    q, k = mx.zeros((1, 4, 21, 16)), mx.zeros((1, 2, 20, 16))
    assert not native.decode_attention_supported(q, k, k)  # more queries than keys: MLX's kernel runs
    with pytest.raises(ValueError, match="more queries than keys"):
        native.decode_attention(q, k, k, 1.0)
    many = native.MAX_ATTENTION_QUERIES + 1
    long_q = long_k = mx.zeros((1, 1, many, 1))
    assert not native.decode_attention_supported(long_q, long_k, long_k)
    with pytest.raises(ValueError, match="1 to 65536 queries"):
        native.decode_attention(long_q, long_k, long_k, 1.0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        native.decode_attention(mx.zeros((1, 3, 1, 16)), k, k, 1.0)


@needs_native
def test_decode_attention_with_a_batch_mask() -> None:
    kk, kv, kq, km = mx.random.split(mx.random.key(4), 4)
    k, v = mx.random.normal((3, 2, 20, 16), key=kk), mx.random.normal((3, 2, 20, 16), key=kv)
    q = mx.random.normal((3, 4, 1, 16), key=kq)
    mask = mx.random.uniform(key=km, shape=(3, 1, 1, 20)) > 0.4
    mask[:, :, :, 0] = True  # every row sees a key
    assert native.decode_attention_supported(q, k, v, mask)
    got = native.decode_attention(q, k, v, 0.25, mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=2e-6)
    assert not native.decode_attention_supported(q, k, v, "sliding")


@needs_native
@pytest.mark.parametrize("head_dim", [64, 80, 256, 512])
def test_decode_attention_takes_a_ring_window_mask_at_every_head_size(head_dim: int) -> None:
    # a sliding layer's [L, T] mask (by absolute position) runs natively, not as MLX's composition
    kk, kv, kq = mx.random.split(mx.random.key(6), 3)
    k, v = mx.random.normal((1, 2, 40, head_dim), key=kk), mx.random.normal((1, 2, 40, head_dim), key=kv)
    q = mx.random.normal((1, 6, 1, head_dim), key=kq)
    positions = mx.concatenate([mx.arange(30, 40), mx.arange(10, 30), mx.full((10,), -1, mx.int32)])
    query = mx.array([[39]])
    mask = (positions[None, :] <= query) & (positions[None, :] > query - 24) & (positions[None, :] >= 0)
    assert native.decode_attention_supported(q, k, v, mask)
    got = native.decode_attention(q, k, v, head_dim**-0.5, mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5, mask=mask)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=3e-6)


@needs_native
@pytest.mark.parametrize(("length", "window"), [(300, None), (300, 64), (64, None)])
def test_prefill_attention_equals_mlx(length: int, window: int | None) -> None:
    # a whole prompt (or a chunk after cached keys): causal, or a sliding window's boolean mask
    kk, kv, kq = mx.random.split(mx.random.key(8), 3)
    k, v = mx.random.normal((1, 3, length + 20, 64), key=kk), mx.random.normal((1, 3, length + 20, 64), key=kv)
    q = mx.random.normal((1, 9, length, 64), key=kq)
    mask: mx.array | str = "causal"
    if window is not None:
        pos = mx.arange(length + 20)
        qpos = mx.arange(20, length + 20)[:, None]
        mask = (pos[None, :] <= qpos) & (pos[None, :] > qpos - window)
    assert native.decode_attention_supported(q, k, v, mask)
    got = native.decode_attention(q, k, v, 0.125, mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=3e-6)


@needs_native
def test_decode_attention_does_not_depend_on_padding() -> None:
    # a batch row's keys sit after masked padding columns: its result equals the row alone, bit for bit
    kk, kv, kq = mx.random.split(mx.random.key(7), 3)
    k, v = mx.random.normal((1, 2, 37, 64), key=kk), mx.random.normal((1, 2, 37, 64), key=kv)
    q = mx.random.normal((1, 4, 1, 64), key=kq)
    alone = native.decode_attention(q, k, v, 0.125)
    for pad in (1, 5, 16, 23):
        zeros = mx.zeros((1, 2, pad, 64))
        kp, vp = mx.concatenate([zeros, k], axis=2), mx.concatenate([zeros, v], axis=2)
        mask = (mx.arange(pad + 37) >= pad)[None, None, None, :]
        padded = native.decode_attention(q, kp, vp, 0.125, mask)
        assert np.array_equal(np.array(padded), np.array(alone)), pad


@needs_native
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("queries", [1, 3])
def test_a_row_is_the_same_alone_or_in_a_batch(head_dim: int, queries: int) -> None:
    # one kv head: a row alone splits its keys (scores) and value dims (sums) between the threads
    # where heads are 256 wide, else its queries; a batch of eight gives each row's queries to one
    # task; each query gets the same bits either way, and MLX's result within float32 rounding
    kk, kv, kq = mx.random.split(mx.random.key(11), 3)
    k, v = mx.random.normal((1, 1, 300, head_dim), key=kk), mx.random.normal((1, 1, 300, head_dim), key=kv)
    q = mx.random.normal((1, 4, queries, head_dim), key=kq)
    alone = native.decode_attention(q, k, v, 0.0625, "causal")
    batch = native.decode_attention(*(mx.repeat(a, 8, axis=0) for a in (q, k, v)), 0.0625, "causal")
    assert np.array_equal(np.array(alone), np.array(batch[:1]))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.0625, mask="causal")
    np.testing.assert_allclose(np.array(alone), np.array(want), rtol=0, atol=3e-6)


@needs_native
@pytest.mark.parametrize("mask", ["causal", "array"])
def test_a_few_queries_equal_mlx_and_each_query_alone(mask: str) -> None:
    kk, kv, kq = mx.random.split(mx.random.key(5), 3)
    k, v = mx.random.normal((2, 2, 12, 16), key=kk), mx.random.normal((2, 2, 12, 16), key=kv)
    q = mx.random.normal((2, 4, 3, 16), key=kq)
    m: mx.array | str = (
        "causal" if mask == "causal" else (mx.arange(12)[None, :] <= mx.arange(9, 12)[:, None])[None, None]
    )
    got = native.decode_attention(q, k, v, 0.25, m)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=m)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=2e-6)
    last = native.decode_attention(q[:, :, 2:], k, v, 0.25)  # the last query alone sees every key
    assert np.array_equal(np.array(got[:, :, 2:]), np.array(last))
    assert native.decode_attention_supported(  # a prefill chunk's queries run natively too
        mx.zeros((1, 4, 17, 16)), mx.zeros((1, 2, 40, 16)), mx.zeros((1, 2, 40, 16)), "causal"
    )


@needs_native
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_equals_mlx_on_contiguous_and_strided_rows(with_weight: bool) -> None:
    x = mx.random.normal((2, 5, 576), key=mx.random.key(7)) * 3
    w = mx.random.normal((576,), key=mx.random.key(8)) if with_weight else None
    for arr in (x, x.transpose(1, 0, 2), x[:, :, :200]):
        assert native.rms_norm_supported(arr, None if w is None else w[: arr.shape[-1]])
        weight = None if w is None else w[: arr.shape[-1]]
        want = np.array(mx.fast.rms_norm(arr, weight, 1e-5))
        np.testing.assert_allclose(np.array(native.rms_norm(arr, weight, 1e-5)), want, rtol=2e-6, atol=2e-6)
    f = mx.compile(lambda a: native.rms_norm(a, w, 1e-6))
    np.testing.assert_allclose(np.array(f(x)), np.array(mx.fast.rms_norm(x, w, 1e-6)), rtol=2e-6, atol=2e-6)


@needs_native
def test_silu_mul_equals_mlx_on_halves_of_a_fused_product() -> None:
    h = mx.random.normal((3, 4, 2 * 1531), key=mx.random.key(9)) * 6
    gate, up = mx.split(h, 2, axis=-1)  # strided views, as a fused gate/up projection hands them
    for g, u in ((gate, up), (gate.transpose(1, 0, 2), up.transpose(1, 0, 2))):
        assert native.gated_supported(g, u)
        want = np.array(g * mx.sigmoid(g) * u)
        np.testing.assert_allclose(np.array(native.silu_mul(g, u)), want, rtol=2e-6, atol=1e-6)
    edge = mx.array([-1e4, -100.0, -88.0, -20.0, -1e-8, 0.0, 1e-8, 20.0, 88.0, 100.0, 1e4])
    got = np.array(mx.compile(native.silu_mul)(edge, mx.ones_like(edge)))
    np.testing.assert_allclose(got, np.array(edge * mx.sigmoid(edge)), rtol=2e-6, atol=1e-30)


@needs_native
def test_rms_norm_and_silu_mul_refusals() -> None:
    x = mx.zeros((2, 8))
    assert not native.rms_norm_supported(x.astype(mx.float16), None)
    assert not native.rms_norm_supported(x, mx.ones((7,)))
    assert not native.gated_supported(x, mx.zeros((2, 7)))
    with pytest.raises(ValueError, match="rms_norm: the weight must be float32"):
        native.rms_norm(x, mx.ones((7,)), 1e-5)
    with pytest.raises(ValueError, match="silu_mul: gate and up must be float32 arrays of one shape"):
        native.silu_mul(x, mx.zeros((2, 7)))


@needs_native
def test_gelu_tanh_mul_equals_mlx() -> None:
    import mlx.nn as nn

    h = mx.random.normal((3, 2 * 1029), key=mx.random.key(10)) * 5
    gate, up = mx.split(h, 2, axis=-1)
    want = np.array(nn.gelu_approx(gate) * up)
    got = np.array(mx.compile(native.gelu_tanh_mul)(gate, up))
    # MLX's 1 + tanh(z) loses digits in the negative tail (sigmoid(2z) does not): compare at the output's scale
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-7 * np.abs(want).max())
    edge = mx.array([-1e4, -100.0, -10.0, -1e-3, 0.0, 1e-3, 10.0, 100.0, 1e4])
    got = np.array(native.gelu_tanh_mul(edge, mx.ones_like(edge)))
    np.testing.assert_allclose(got, np.array(nn.gelu_approx(edge)), atol=1e-30, rtol=2e-6)
    with pytest.raises(ValueError, match="gelu_tanh_mul: gate and up must be float32"):
        native.gelu_tanh_mul(edge, edge[:3])


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("head_dim", "group"), [(64, 32), (64, 64), (128, 32), (256, 64), (96, 32)])
def test_kv_rows_equal_mlx_dequantize_and_hadamard(bits: int, head_dim: int, group: int) -> None:
    # a quantized cache's fetched rows: a slice of the buffer along the token axis, read in place
    x = mx.random.normal((2, 3, 40, head_dim), key=mx.random.key(bits + head_dim))
    w, s, b = mx.quantize(x, group_size=group, bits=bits)
    w, s, b = w[:, :, 3:29], s[:, :, 3:29], b[:, :, 3:29]
    want = mx.dequantize(w, s, b, group_size=group, bits=bits)
    np.testing.assert_allclose(np.array(native.kv_rows(w, s, b, bits, False)), np.array(want), atol=1e-6, rtol=1e-6)
    if head_dim & (head_dim - 1) == 0:  # stored Hadamard-rotated: rotated back
        got = native.kv_rows(w, s, b, bits, True)
        np.testing.assert_allclose(np.array(got), np.array(mx.hadamard_transform(want)), atol=2e-6, rtol=1e-5)
    # symmetric rows (no biases): each bias is -2^(bits-1) * its scale
    sym = native.kv_rows(w, s, None, bits, False)
    np.testing.assert_array_equal(np.array(sym), np.array(native.kv_rows(w, s, s * -(2 ** (bits - 1)), bits, False)))


@needs_native
def test_kv_rows_refusals() -> None:
    from turbospark_core._native import _qmm

    w, s, b = mx.quantize(mx.random.normal((4, 96)), group_size=32, bits=4)
    with pytest.raises(ValueError, match="power-of-two"):
        _qmm.kv_rows(w, s, b, 4, True)
    with pytest.raises(ValueError, match="bits must be"):
        _qmm.kv_rows(w, s, b, 7, False)
    five = mx.concatenate([s, s[:, :2]], axis=1)  # 96 values do not split into 5 groups
    with pytest.raises(ValueError, match="one value per group"):
        _qmm.kv_rows(w, five, five, 4, False)


def _heads_reference(
    parts: list[mx.array], heads: int, kv_heads: int, dims: int, mscale: float, offset: mx.array,
    norms: tuple[mx.array, mx.array] | None, fast: bool,
) -> list[mx.array]:  # fmt: skip
    """What rope_heads stands for, composed: split, reshape, transpose, per-head norm, scale, RoPE.

    ``fast``: MLX's own mx.fast.rms_norm and mx.fast.rope; else the native rms_norm and rope ops.
    """
    if len(parts) == 1:
        d = parts[0].shape[-1] // (heads + 2 * kv_heads)
        parts = mx.split(parts[0], [heads * d, (heads + kv_heads) * d], axis=-1)
    B, L = parts[0].shape[:2]
    counts = (heads, kv_heads, kv_heads)
    q, k, v = (p.reshape(B, L, n, -1).transpose(0, 2, 1, 3) for p, n in zip(parts, counts, strict=True))
    out = []
    for x, w in ((q, None if norms is None else norms[0]), (k, None if norms is None else norms[1])):
        if w is not None:
            x = mx.fast.rms_norm(x, w, 1e-6) if fast else native.rms_norm(x, w, 1e-6)
        if mscale != 1.0:
            x = mx.concatenate([x[..., :dims] * mscale, x[..., dims:]], axis=-1)
        if fast:
            rows = [
                mx.fast.rope(x[b : b + 1], dims, traditional=False, base=None, scale=0.5, offset=o, freqs=_freqs(dims))
                for b, o in enumerate(np.broadcast_to(np.array(offset), (B,)).tolist())
            ]
            out.append(mx.concatenate(rows, axis=0))
        else:
            out.append(native.rope(x, dims, 0.5, offset, _freqs(dims)))
    return [*out, v]


@needs_native
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize(("dims", "mscale"), [(64, 1.0), (48, 1.25)])
@pytest.mark.parametrize(("length", "offsets"), [(1, [37]), (1, [3, 900]), (5, [0, 11])])
def test_rope_heads_equal_the_ops_they_replace(
    fused: bool, norm: bool, dims: int, mscale: float, length: int, offsets: list[int]
) -> None:
    heads, kv_heads, d = 6, 2, 64
    key = mx.random.split(mx.random.key(11), 3)
    x = mx.random.normal((2, length, (heads + 2 * kv_heads) * d), key=key[0]) * 3
    parts = [x] if fused else list(mx.split(x, [heads * d, (heads + kv_heads) * d], axis=-1))
    norms = (mx.random.normal((d,), key=key[1]), mx.random.normal((d,), key=key[2])) if norm else None
    offset = mx.array(offsets, dtype=mx.int32)
    assert native.rope_heads_supported(parts, heads, kv_heads, offset)
    got = native.rope_heads(
        parts, heads, kv_heads, dims=dims, scale=0.5, mscale=mscale, offset=offset, freqs=_freqs(dims), norms=norms,
        eps=1e-6,
    )  # fmt: skip
    # the same kernels as the native norm and RoPE ops: bit for bit
    for g, w in zip(got, _heads_reference(parts, heads, kv_heads, dims, mscale, offset, norms, False), strict=True):
        assert g.shape == w.shape
        assert np.array_equal(np.array(g), np.array(w))
    # MLX's own ops: float32 rounding (its sin/cos and norm's sum run another way)
    for g, w in zip(got, _heads_reference(parts, heads, kv_heads, dims, mscale, offset, norms, True), strict=True):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=0, atol=2e-5 * np.abs(np.array(w)).max())


@needs_native
def test_rope_heads_compiled_with_a_value_head_size_of_its_own() -> None:
    # q/k and v apart, v's heads wider; compiled as a decode step compiles it
    q, k, v = (mx.random.normal((1, 1, n), key=mx.random.key(n)) for n in (4 * 32, 2 * 32, 2 * 48))
    def heads(a: mx.array, b: mx.array, c: mx.array, o: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return native.rope_heads([a, b, c], 4, 2, dims=32, scale=1.0, mscale=1.0, offset=o, freqs=_freqs(32))

    step = mx.compile(heads)
    got = step(q, k, v, mx.array(7, dtype=mx.int32))
    assert [g.shape for g in got] == [(1, 4, 1, 32), (1, 2, 1, 32), (1, 2, 1, 48)]
    want = native.rope(q.reshape(1, 1, 4, 32).transpose(0, 2, 1, 3), 32, 1.0, 7, _freqs(32))
    assert np.array_equal(np.array(got[0]), np.array(want))
    assert np.array_equal(np.array(got[2]), np.array(v.reshape(1, 1, 2, 48).transpose(0, 2, 1, 3)))


@needs_native
def test_rope_heads_refusals() -> None:
    x = mx.zeros((1, 1, 8 * 16))
    assert not native.rope_heads_supported([x], 5, 2, 0)  # 128 does not split into 9 heads
    assert not native.rope_heads_supported([x.astype(mx.float16)], 4, 2, 0)
    assert not native.rope_heads_supported([x], 4, 2, mx.array([1, 2, 3]))  # 3 offsets for 1 row
    with pytest.raises(ValueError, match=r"rope_heads: the fused product's width must be \(heads \+ 2 kv_heads\)"):
        native.rope_heads([x], 5, 2, dims=16, scale=1.0, mscale=1.0, offset=0, freqs=_freqs(16))
    with pytest.raises(ValueError, match="rope_heads: dims must be even"):
        native.rope_heads([x], 4, 2, dims=18, scale=1.0, mscale=1.0, offset=0, freqs=_freqs(18))
    with pytest.raises(ValueError, match="rope_heads: a head norm's weight must be float32"):
        native.rope_heads(
            [x], 4, 2, dims=16, scale=1.0, mscale=1.0, offset=0, freqs=_freqs(16), norms=(mx.ones((8,)), mx.ones((8,)))
        )


@needs_native
@pytest.mark.parametrize(("length", "mask"), [(1, None), (3, "causal")])
def test_decode_attention_merges_heads_as_a_transpose_and_reshape_would(length: int, mask: str | None) -> None:
    kk, kv, kq = mx.random.split(mx.random.key(12), 3)
    k = mx.random.normal((2, 2, 30, 64), key=kk)[:, :, :20]
    v = mx.random.normal((2, 2, 30, 48), key=kv)[:, :, :20]
    q = mx.random.normal((2, 6, length, 64), key=kq)
    apart = native.decode_attention(q, k, v, 0.125, mask)
    merged = native.decode_attention(q, k, v, 0.125, mask, merge_heads=True)
    assert merged.shape == (2, length, 6 * 48)
    assert np.array_equal(np.array(merged), np.array(apart.transpose(0, 2, 1, 3).reshape(2, length, -1)))


@needs_native
def test_gated_activations_read_a_fused_product_in_place() -> None:
    h = mx.random.normal((3, 2, 2 * 1029), key=mx.random.key(13)) * 5
    gate, up = mx.split(h, 2, axis=-1)
    for fn in (native.silu_mul, native.gelu_tanh_mul):
        assert native.gated_supported(h)
        assert np.array_equal(np.array(mx.compile(fn)(h)), np.array(fn(gate, up)))
    assert not native.gated_supported(h[..., 1:])
    with pytest.raises(ValueError, match=r"silu_mul: a fused gate/up product must be float32 \[\.\.\., 2n\]"):
        native.silu_mul(h[..., 1:])


@needs_native
def test_rope_heads_take_only_float32_head_norms() -> None:
    x = mx.zeros((1, 1, 8 * 16))
    assert native.rope_heads_supported([x], 4, 2, 0, (mx.ones((16,)), mx.ones((16,))))
    assert not native.rope_heads_supported([x], 4, 2, 0, (mx.ones((16,), mx.float16), mx.ones((16,))))
    assert not native.rope_heads_supported([x], 4, 2, 0, (mx.ones((8,)), mx.ones((8,))))


def _normal(shape: tuple[int, ...], seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed))


@needs_native
@pytest.mark.parametrize("length", [1, 5])
def test_cache_attention_writes_the_rows_and_attends_as_decode_attention(length: int) -> None:
    """The rows land at ``offset`` and the attention has decode_attention's bits over the buffers' filled part;
    a buffer something else still holds is copied, never changed under it."""
    B, Hq, Hkv, D, Dv, S, offset = 2, 4, 2, 16, 8, 24, 7
    q, k, v = _normal((B, Hq, length, D), 1), _normal((B, Hkv, length, D), 2), _normal((B, Hkv, length, Dv), 3)
    k_buf, v_buf = _normal((B, Hkv, S, D), 4), _normal((B, Hkv, S, Dv), 5)
    mx.eval(q, k, v, k_buf, v_buf)
    k_before, v_before = np.array(k_buf), np.array(v_buf)
    copies = native.cache_attention_copies()
    out, k_new, v_new = native.cache_attention(q, k, v, k_buf, v_buf, offset, 0.25, merge_heads=True)
    mx.eval(out, k_new, v_new)
    assert native.cache_attention_copies() == copies + 2  # k_buf and v_buf are still held here
    np.testing.assert_array_equal(np.array(k_buf), k_before)
    np.testing.assert_array_equal(np.array(v_buf), v_before)
    end = offset + length
    want_k, want_v = k_before.copy(), v_before.copy()
    want_k[:, :, offset:end], want_v[:, :, offset:end] = np.array(k), np.array(v)
    np.testing.assert_array_equal(np.array(k_new), want_k)
    np.testing.assert_array_equal(np.array(v_new), want_v)
    mask = "causal" if length > 1 else None
    ref = native.decode_attention(q, k_new[:, :, :end], v_new[:, :, :end], 0.25, mask, merge_heads=True)
    np.testing.assert_array_equal(np.array(out), np.array(ref))



def _line_offset(a: mx.array) -> int:
    """Where ``a``'s data starts, in bytes past a 64-byte cache line (the view is dropped on return)."""
    return int(np.asarray(memoryview(a)).ctypes.data % 64)


@needs_native
def test_cache_buffers_move_onto_a_cache_line_once() -> None:
    """A buffer MLX allocated (off a cache line: every 64-byte load of a row would straddle two) is moved
    once onto a line, with its rows; the steps after take the moved buffer over in place; outputs start on a line."""
    B, Hq, Hkv, D, S = 1, 2, 1, 16, 12
    bufs = [_normal((B, Hkv, S, D), 6 + i) for i in range(2)]
    mx.eval(bufs)
    before = [np.array(b) for b in bufs]
    if all(_line_offset(b) == 0 for b in bufs):
        pytest.skip("this MLX allocates on cache lines itself: nothing to move")
    copies, moved = native.cache_attention_copies(), native.cache_attention_realigned()
    for offset in range(3):
        q, k, v = (_normal((B, h, 1, D), 10 * offset + i) for i, h in enumerate((Hq, Hkv, Hkv)))
        out, *bufs = native.cache_attention(q, k, v, bufs[0], bufs[1], offset, 0.25, merge_heads=True)
        mx.eval(out, bufs)
        assert [_line_offset(a) for a in (out, *bufs)] == [0, 0, 0]
        before[0][:, :, offset], before[1][:, :, offset] = np.array(k)[:, :, 0], np.array(v)[:, :, 0]
        np.testing.assert_array_equal(np.array(bufs[0]), before[0])
        np.testing.assert_array_equal(np.array(bufs[1]), before[1])
        assert native.cache_attention_realigned() == moved + 2  # in the first step only
    assert native.cache_attention_copies() == copies
@needs_native
def test_cache_attention_refusals() -> None:
    q, k = mx.zeros((1, 4, 2, 16)), mx.zeros((1, 2, 2, 16))
    buf = mx.zeros((1, 2, 8, 16))
    with pytest.raises(ValueError, match="room for the new rows"):
        native.cache_attention(q, k, k, buf, buf, 7, 1.0)
    with pytest.raises(ValueError, match="one new key and value row per query"):
        native.cache_attention(q, k[:, :, :1], k[:, :, :1], buf, buf, 0, 1.0)
    with pytest.raises(ValueError, match="hold rows like k and v"):
        native.cache_attention(q, k, k, mx.zeros((1, 2, 8, 8)), buf, 0, 1.0)
    with pytest.raises(ValueError, match="float32"):
        native.cache_attention(q.astype(mx.float16), k, k, buf, buf, 0, 1.0)
    assert not native.cache_attention_supported(q.astype(mx.float16), k, k, buf, buf)


def _matrix(rows: int, cols: int, seed: int, bits: int, group: int, symmetric: bool) -> native.QuantizedMatrix:
    from turbospark_core.tensor_index import QuantSpec

    w, scales, biases = mx.quantize(_normal((rows, cols), seed) * 0.2, group_size=group, bits=bits)
    return w, scales, None if symmetric else biases, QuantSpec(bits=bits, group_size=group, mode="affine")


def _layer_in_parts(
    x: mx.array, norms: list[mx.array | None], mats: list[native.QuantizedMatrix], k_buf: mx.array, v_buf: mx.array,
    heads: int, kv_heads: int, rope: object, eps: float, scale: float, offset: int, activation: str,
) -> tuple[mx.array, mx.array, mx.array]:
    """The ops a decoder layer's step is made of, one after another."""
    from turbospark_core.rope import Rope

    assert isinstance(rope, Rope)
    in_norm, mlp_norm, post_attn, post_mlp, q_norm, k_norm = norms
    np_ = len(mats) - 3
    o, gate_up, down = mats[np_:]
    if np_ == 1:
        proj = [native.quantized_matmul(x, *mats[0], prologue="rms_norm", prologue_weight=in_norm, eps=eps)]
    else:
        xn = native.rms_norm(x, in_norm, eps)
        proj = [native.quantized_matmul(xn, *m) for m in mats[:3]]
    head_norms = None if q_norm is None or k_norm is None else (q_norm, k_norm)
    q, k, v = native.rope_heads(
        proj, heads, kv_heads, dims=rope.dims, scale=rope.scale, mscale=rope.mscale, offset=offset,
        freqs=rope.freqs, norms=head_norms, eps=eps,
    )  # fmt: skip
    att, k_buf, v_buf = native.cache_attention(q, k, v, k_buf, v_buf, offset, scale, merge_heads=True)
    h = native.quantized_matmul(att, *o, x, post_norm=None if post_attn is None else (post_attn, eps))
    gu = native.quantized_matmul(h, *gate_up, prologue="rms_norm", prologue_weight=mlp_norm, eps=eps)
    post = None if post_mlp is None else (post_mlp, eps)
    return native.quantized_matmul(gu, *down, h, prologue=activation, post_norm=post), k_buf, v_buf


@needs_native
@pytest.mark.parametrize("length", [1, 3, 40])
@pytest.mark.parametrize("variant", ["llama", "gemma", "mixed-layouts", "q-k-v-apart"])
def test_decoder_layer_equals_its_ops(length: int, variant: str) -> None:
    """One op for a layer's step: the bits of its ops one after another, the rows written into the buffers at
    offset; buffers still held elsewhere are copied, never changed under their holder; the next layer's
    matrix (only read ahead) changes nothing. From 32 tokens on, the step's rows and its rest run apart."""
    from turbospark_core.rope import Rope

    B, hidden, heads, kv_heads, D, F, S, offset, eps = 2, 64, 4, 2, 16, 96, 48, 5, 1e-5
    gemma = variant == "gemma"
    layouts = [(4, 32, False), (8, 64, True), (4, 32, True), (6, 32, False)] if variant == "mixed-layouts" else [
        (4, 32, False)
    ] * 4  # fmt: skip
    shapes = [((heads + 2 * kv_heads) * D, hidden), (hidden, heads * D), (2 * F, hidden), (hidden, F)]
    mats = [_matrix(r, c, 10 + i, *layouts[i]) for i, (r, c) in enumerate(shapes)]
    projections = 3 if variant == "q-k-v-apart" else 1
    if projections == 3:  # Gemma 3's Q4_K_M layers: q, k and v of different layouts
        apart = [
            ((heads * D, hidden), (5, 32, False)), ((kv_heads * D, hidden), (4, 32, True)),
            ((kv_heads * D, hidden), (8, 32, False)),
        ]  # fmt: skip
        mats = [_matrix(r, c, 40 + i, *lay) for i, ((r, c), lay) in enumerate(apart)] + mats[1:]
    vec = [_normal((n,), 20 + i) * 0.3 + 1 for i, n in enumerate((hidden, hidden, hidden, hidden, D, D))]
    norms: list[mx.array | None] = vec if gemma else [vec[0], vec[1], None, None, None, None]
    rope = Rope.from_config(dims=D, theta=10000.0, scaling=None, max_positions=4096)
    x = _normal((B, length, hidden), 1)
    k_buf, v_buf = _normal((B, kv_heads, S, D), 2), _normal((B, kv_heads, S, D), 3)
    activation = "gelu_tanh_mul" if gemma else "silu_mul"
    mx.eval(x, k_buf, v_buf, *vec, *(a for m in mats for a in m[:3] if a is not None))
    k_before, v_before = np.array(k_buf), np.array(v_buf)
    args = dict(heads=heads, kv_heads=kv_heads, rope=rope, eps=eps, scale=D**-0.5, activation=activation)
    want = _layer_in_parts(x, norms, mats, k_buf, v_buf, offset=offset, **args)  # type: ignore[arg-type]
    mx.eval(want)
    copies, parts = native.cache_attention_copies(), native.decoder_layer_parts_run()
    for extra in ([], [mats[0]]):
        assert native.decoder_layer_supported(x)
        op = native.decoder_layer_op(norms, [*mats, *extra], projections=projections, **args)  # type: ignore[arg-type]
        got = op(x, k_buf, v_buf, offset, None, None)
        mx.eval(got)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.array(g), np.array(w))
    assert native.cache_attention_copies() == copies + 4  # both buffers, both calls: the test holds them
    ran = [now - before for now, before in zip(native.decoder_layer_parts_run(), parts, strict=True)]
    assert ran == ([0, 2, 2] if length >= 32 else [2, 0, 0])
    np.testing.assert_array_equal(np.array(k_buf), k_before)
    np.testing.assert_array_equal(np.array(v_buf), v_before)


@needs_native
def test_a_long_steps_rest_runs_only_where_its_output_is_read() -> None:
    """A prefill chunk reads only the caches: evaluating a 40-token step's buffers runs its rows alone (the
    last layer's attention, o and MLP skipped); its y, read afterwards, still has the bits of the whole op."""
    from turbospark_core.rope import Rope

    B, hidden, heads, kv_heads, D, F, S, L, eps = 1, 64, 4, 2, 16, 96, 64, 40, 1e-5
    shapes = [((heads + 2 * kv_heads) * D, hidden), (hidden, heads * D), (2 * F, hidden), (hidden, F)]
    mats = [_matrix(r, c, 70 + i, 4, 32, False) for i, (r, c) in enumerate(shapes)]
    norms: list[mx.array | None] = [_normal((hidden,), 80) + 1, _normal((hidden,), 81) + 1, None, None, None, None]
    rope = Rope.from_config(dims=D, theta=10000.0, scaling=None, max_positions=4096)
    args = dict(heads=heads, kv_heads=kv_heads, rope=rope, eps=eps, scale=D**-0.5, activation="silu_mul")
    op = native.decoder_layer_op(norms, mats, **args)  # type: ignore[arg-type]
    x = _normal((B, L, hidden), 82)
    k_buf, v_buf = mx.zeros((B, kv_heads, S, D)), mx.zeros((B, kv_heads, S, D))
    mx.eval(x, k_buf, v_buf)
    want = _layer_in_parts(x, norms, mats, k_buf, v_buf, offset=3, **args)  # type: ignore[arg-type]
    mx.eval(want)
    parts = native.decoder_layer_parts_run()
    y, k_new, v_new = op(x, k_buf, v_buf, 3, None, None)
    mx.eval(k_new, v_new)
    assert [a - b for a, b in zip(native.decoder_layer_parts_run(), parts, strict=True)] == [0, 1, 0]
    np.testing.assert_array_equal(np.array(k_new), np.array(want[1]))
    np.testing.assert_array_equal(np.array(v_new), np.array(want[2]))
    np.testing.assert_array_equal(np.array(y), np.array(want[0]))
    assert [a - b for a, b in zip(native.decoder_layer_parts_run(), parts, strict=True)] == [0, 1, 1]


@needs_native
@pytest.mark.parametrize("L", [2, 34])
def test_decoder_layer_rows_at_their_own_positions_under_a_mask(L: int) -> None:
    """A batch's rows: each rotated at its own positions, attending under the batch's mask (padding, holes),
    with the bits of the ops one after another (rope_heads per row, the rows written, decode_attention);
    also a batch's 34-token chunk (a batch's steps stay one op at any length)."""
    from turbospark_core.rope import Rope

    B, hidden, heads, kv_heads, D, F, column, eps = 2, 64, 4, 2, 16, 96, 6, 1e-5
    S = column + L + 2
    shapes = [((heads + 2 * kv_heads) * D, hidden), (hidden, heads * D), (2 * F, hidden), (hidden, F)]
    mats = [_matrix(r, c, 50 + i, 4, 32, False) for i, (r, c) in enumerate(shapes)]
    norms: list[mx.array | None] = [_normal((hidden,), 60) + 1, _normal((hidden,), 61) + 1, None, None, None, None]
    rope = Rope.from_config(dims=D, theta=10000.0, scaling=None, max_positions=4096)
    x = _normal((B, L, hidden), 62)
    k_buf, v_buf = _normal((B, kv_heads, S, D), 63), _normal((B, kv_heads, S, D), 64)
    positions = mx.array([6, 3], dtype=mx.int32)  # row 1: three columns of left padding
    cols = np.arange(column + L)
    col_pos = np.stack([cols, cols - 3])  # each column's position (row 1's first three: padding)
    col_pos[1, 4] = -1  # and a rewind hole
    query_pos = np.array(positions)[:, None] + np.arange(L)[None, :]
    visible = (col_pos[:, None, :] >= 0) & (col_pos[:, None, :] <= query_pos[:, :, None])
    mask = mx.array(visible[:, None])  # [B, 1, L, T]
    mx.eval(x, k_buf, v_buf, positions, mask)
    args = dict(heads=heads, kv_heads=kv_heads, rope=rope, eps=eps, scale=D**-0.5, activation="silu_mul")
    op = native.decoder_layer_op(norms, mats, **args)  # type: ignore[arg-type]
    got = op(x, k_buf, v_buf, column, positions, mask)
    # the ops one after another
    proj = native.quantized_matmul(x, *mats[0], prologue="rms_norm", prologue_weight=norms[0], eps=eps)
    q, k, v = native.rope_heads(
        [proj], heads, kv_heads, dims=rope.dims, scale=rope.scale, mscale=rope.mscale, offset=positions,
        freqs=rope.freqs,
    )  # fmt: skip
    k_all, v_all = np.array(k_buf), np.array(v_buf)
    k_all[:, :, column : column + L], v_all[:, :, column : column + L] = np.array(k), np.array(v)
    kk, vv = mx.array(k_all[:, :, : column + L]), mx.array(v_all[:, :, : column + L])
    att = native.decode_attention(q, kk, vv, D**-0.5, mask, merge_heads=True)
    h = native.quantized_matmul(att, *mats[1], x)
    gu = native.quantized_matmul(h, *mats[2], prologue="rms_norm", prologue_weight=norms[1], eps=eps)
    want = native.quantized_matmul(gu, *mats[3], h, prologue="silu_mul")
    np.testing.assert_array_equal(np.array(got[0]), np.array(want))
    np.testing.assert_array_equal(np.array(got[1]), k_all)
    np.testing.assert_array_equal(np.array(got[2]), v_all)


@needs_native
def test_decoder_layer_refusals() -> None:
    from turbospark_core.rope import Rope

    hidden, heads, kv_heads, D, F = 64, 4, 2, 16, 96
    shapes = [((heads + 2 * kv_heads) * D, hidden), (hidden, heads * D), (2 * F, hidden), (hidden, F)]
    mats = [_matrix(r, c, 10 + i, 4, 32, False) for i, (r, c) in enumerate(shapes)]
    norms: list[mx.array | None] = [mx.ones((hidden,)), mx.ones((hidden,)), None, None, None, None]
    rope = Rope.from_config(dims=D, theta=10000.0, scaling=None, max_positions=4096)
    x, buf = mx.zeros((1, 1, hidden)), mx.zeros((1, kv_heads, 8, D))
    args = dict(heads=heads, kv_heads=kv_heads, rope=rope, eps=1e-5, scale=0.25, activation="silu_mul")

    def make(**change: object) -> native.LayerStep:
        kw = {"norms": norms, "matrices": mats, **args, **change}
        return native.decoder_layer_op(**kw)  # type: ignore[arg-type]

    op = make()  # the arguments below each change one thing
    mx.eval(op(x, buf, buf, 7, None, None))
    with pytest.raises(ValueError, match="room for the new rows"):
        op(x, buf, buf, 8, None, None)
    with pytest.raises(ValueError, match="x must be float32"):
        op(x.astype(mx.float16), buf, buf, 0, None, None)
    with pytest.raises(ValueError, match="x must be float32"):
        op(mx.zeros((1, 1, 32)), buf, buf, 0, None, None)
    with pytest.raises(ValueError, match=r"cache buffers must be float32 \[B, kv_heads, S, head_dim\]"):
        op(x, mx.zeros((1, kv_heads, 8, 8)), buf, 0, None, None)
    with pytest.raises(ValueError, match="o has the wrong shape"):
        make(matrices=[mats[0], _matrix(2 * hidden, heads * D, 3, 4, 32, False), mats[2], mats[3]])
    with pytest.raises(ValueError, match="the input and MLP norms need weights"):
        make(norms=[None, *norms[1:]])
    with pytest.raises(ValueError, match="a norm's weight must be float32"):
        make(norms=[mx.ones((hidden,), mx.float16), *norms[1:]])
    with pytest.raises(ValueError, match="normalize both q and k heads or neither"):
        make(norms=[*norms[:4], mx.ones((D,)), None])
    with pytest.raises(ValueError, match="activation must be 'silu_mul' or 'gelu_tanh_mul'"):
        make(activation="relu")
    with pytest.raises(ValueError, match="pass the q/k/v, o, gate_up and down"):
        make(matrices=mats[:3])
    with pytest.raises(ValueError, match="projections must be 1"):
        make(projections=2)
    with pytest.raises(ValueError, match="k has the wrong shape"):
        q = _matrix(heads * D, hidden, 9, 4, 32, False)
        make(matrices=[q, q, q, *mats[1:]], projections=3)
    with pytest.raises(ValueError, match="positions and mask together"):
        op(x, buf, buf, 0, mx.array([0], mx.int32), None)
    with pytest.raises(ValueError, match="positions must be int32"):
        op(x, buf, buf, 0, mx.array([0.0]), mx.ones((1, 1, 1, 1), mx.bool_))
    with pytest.raises(ValueError, match="the mask must be boolean"):
        op(x, buf, buf, 0, mx.array([0], mx.int32), mx.ones((1, 1, 1, 3), mx.bool_))
    assert not native.decoder_layer_supported(x.astype(mx.float16))
    assert not native.decoder_layer_supported(mx.zeros((1, hidden)))


@needs_native
@pytest.mark.parametrize("length", [1, 17, 1000, 262144 + 5])
def test_argmax_equals_mlx(length: int) -> None:
    # mx.argmax's choice, whatever the row holds: the first of tied largest values, the first NaN,
    # index 0 where all are -inf; long rows are split between threads
    rng = np.random.default_rng(length)
    x = rng.standard_normal((8, length)).astype(np.float32)
    x[1] = np.round(x[1])  # many ties
    x[2, length // 2 :] = x[2].max()  # the largest value again later
    x[3, length // 3] = x[3, -1] = np.nan
    x[4, 0] = np.nan
    x[5] = -np.inf
    x[6, -1] = np.inf
    x[7] = 0.0
    x[7, length // 2 :] = -0.0
    got = native.argmax(mx.array(x))
    assert got.dtype == mx.uint32
    assert np.array_equal(np.array(got), np.array(mx.argmax(mx.array(x), axis=-1)))
    assert np.array_equal(np.array(native.argmax(mx.array(x[:1, None]))), [[np.argmax(x[0])]])  # [B, 1, V]
    assert native.argmax(mx.array(x[0])).item() == int(np.argmax(x[0]))  # one row: a scalar


@needs_native
def test_argmax_leaves_other_dtypes_to_mlx() -> None:
    x = mx.array([[1.0, 3.0, 2.0]], dtype=mx.bfloat16)
    assert native.argmax(x).tolist() == [1]
    with pytest.raises(ValueError):  # as mx.argmax refuses an empty axis
        native.argmax(mx.zeros((2, 0)))


@needs_native
def test_kv_place_lays_rows_out_with_zeros_elsewhere() -> None:
    """Runs of columns from their sources (a strided view among them) at their columns, several to a row
    and given in any order; zeros everywhere else."""
    batch = mx.random.normal((3, 2, 40, 16), key=mx.random.key(7))
    single = mx.random.normal((1, 2, 64, 16), key=mx.random.key(8))[:, :, :30]  # a single cache's slice
    moves = [(0, 0, 2, 5, 40, 9), (3, 0, 1, 39, 40, 43), (1, 1, 0, 0, 30, 14), (3, 0, 0, 3, 7, 44), (3, 0, 0, 0, 2, 2)]
    got = np.array(native.kv_place([batch, single], moves, 5, 48))
    want = np.zeros((5, 2, 48, 16), np.float32)
    sources = [np.array(batch), np.array(single)]
    for to, part, row, begin, end, dst in moves:
        want[to, :, dst : dst + end - begin] = sources[part][row, :, begin:end]
    assert np.array_equal(got, want)


@needs_native
@pytest.mark.parametrize("dtype", [mx.uint32, mx.bfloat16, mx.float16])
def test_kv_place_copies_other_dtypes_as_bits(dtype: mx.Dtype) -> None:
    """A quantized row's uint32 codes and 2-byte floats: the same layout, their bits copied, zeros elsewhere."""
    batch = (mx.random.uniform(shape=(2, 70, 3, 8), key=mx.random.key(3)) * 60000).astype(dtype).swapaxes(1, 2)
    moves = [(1, 0, 0, 4, 70, 0), (0, 0, 1, 0, 66, 30)]  # from a strided view
    got = native.kv_place([batch], moves, 2, 96)
    assert got.dtype == dtype
    want = mx.zeros((2, 3, 96, 8), dtype)
    want[1:2, :, 0:66] = batch[0:1, :, 4:70]
    want[0:1, :, 30:96] = batch[1:2, :, 0:66]
    assert mx.array_equal(got, want).item()


@needs_native
def test_kv_place_leaves_whole_pages_of_zeros_unwritten() -> None:
    """A long row beside a short one: the short row's padding (and the room to grow) is never written."""
    long, short = mx.random.normal((1, 2, 2000, 64)), mx.random.normal((1, 2, 40, 64))
    before = native.kv_place_unwritten()
    got = native.kv_place([long, short], [(0, 0, 0, 0, 2000, 0), (1, 1, 0, 0, 40, 1960)], 2, 2304)
    mx.eval(got)
    padding = (2 * 2304 * 2 - 2 * 2000 - 2 * 40) * 64 * 4  # bytes of zeros in the layout
    assert native.kv_place_unwritten() - before > padding * 0.9
    assert not np.array(got[1, :, :1960]).any() and not np.array(got[0, :, 2000:]).any()
    assert np.array_equal(np.array(got[1, :, 1960:2000]), np.array(short[0]))


@needs_native
def test_kv_place_refusals() -> None:
    buf = mx.zeros((2, 3, 8, 4))
    with pytest.raises(ValueError, match="past `rows`"):
        native.kv_place([buf], [(2, 0, 0, 0, 4, 0)], 2, 8)
    with pytest.raises(ValueError, match="not given"):
        native.kv_place([buf], [(0, 1, 0, 0, 4, 0)], 1, 8)
    with pytest.raises(ValueError, match="outside its buffer"):
        native.kv_place([buf], [(0, 0, 2, 0, 4, 0)], 1, 8)
    with pytest.raises(ValueError, match="outside its buffer"):
        native.kv_place([buf], [(0, 0, 0, 5, 9, 0)], 1, 8)
    with pytest.raises(ValueError, match="do not fit the capacity"):
        native.kv_place([buf], [(0, 0, 0, 0, 8, 1)], 1, 8)
    with pytest.raises(ValueError, match="write the same columns"):
        native.kv_place([buf], [(0, 0, 0, 0, 4, 2), (0, 0, 1, 0, 2, 5)], 1, 8)
    with pytest.raises(ValueError, match="same heads and dim"):
        native.kv_place([buf, mx.zeros((1, 2, 8, 4))], [(0, 0, 0, 0, 8, 0)], 1, 8)
    with pytest.raises(ValueError, match="one dtype"):
        native.kv_place([buf, buf.astype(mx.uint32)], [(0, 0, 0, 0, 8, 0)], 1, 8)
    with pytest.raises(ValueError, match="2- or 4-byte values"):
        native.kv_place([buf.astype(mx.uint8)], [(0, 0, 0, 0, 8, 0)], 1, 8)
    assert native.kv_place_supported(buf.astype(mx.float16), buf.astype(mx.float16))
    assert not native.kv_place_supported(buf, buf.astype(mx.uint32))
    assert not native.kv_place_supported(buf.astype(mx.uint8)) and not native.kv_place_supported(buf[0])
