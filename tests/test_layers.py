"""Linear / Embedding / ExpertBank (dense and quantized) and the Experts protocol."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from turbospark_core import layers, native
from turbospark_core.layers import Embedding, ExpertBank, Experts, Linear
from turbospark_core.rope import Rope
from turbospark_core.tensor_index import QuantSpec

# (bits, group_size, mode): MLX's affine kernels and mxfp4
QUANTS = [(4, 64, "affine"), (8, 32, "affine"), (4, 32, "mxfp4")]
QUANT_IDS = [f"{m}-{b}bit-g{g}" for b, g, m in QUANTS]


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _normal(shape: tuple[int, ...], seed: int = 0) -> mx.array:
    return mx.array(_rng(seed).normal(size=shape).astype(np.float32))


def _quantized(
    w: mx.array, bits: int, group_size: int, mode: str, bias: mx.array | None = None
) -> tuple[Linear, mx.array]:
    """A quantized Linear made with mx.quantize, and its dequantized weight."""
    packed = mx.quantize(w, group_size=group_size, bits=bits, mode=mode)
    wq, scales = packed[0], packed[1]
    biases = packed[2] if len(packed) > 2 else None
    dense = mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits, mode=mode)
    spec = QuantSpec(bits=bits, group_size=group_size, mode=mode)
    return Linear(wq, bias, quant=spec, scales=scales, biases=biases), dense


def _np(a: mx.array | np.ndarray) -> np.ndarray:
    return np.array(a.astype(mx.float32)) if isinstance(a, mx.array) else np.asarray(a)


def _close(a: mx.array, b: np.ndarray | mx.array, atol: float = 1e-4) -> None:
    np.testing.assert_allclose(_np(a), _np(b), atol=atol, rtol=1e-4)


# ------------------------------------------------------------------ Linear


@pytest.mark.parametrize("with_bias", [False, True])
def test_dense_linear_is_x_times_w_transposed(with_bias: bool) -> None:
    w, x = _normal((48, 64), 1), _normal((2, 5, 64), 2)
    b = _normal((48,), 3) if with_bias else None
    lin = Linear(w, b)
    expected = np.array(x) @ np.array(w).T + (0 if b is None else np.array(b))
    assert lin.out_features == 48
    _close(lin(x), expected)


@pytest.mark.parametrize(("bits", "group_size", "mode"), QUANTS, ids=QUANT_IDS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_quantized_linear_matches_dequantized_matmul(bits: int, group_size: int, mode: str, with_bias: bool) -> None:
    w, x = _normal((48, 128), 4), _normal((3, 128), 5)
    b = _normal((48,), 6) if with_bias else None
    lin, dense = _quantized(w, bits, group_size, mode, b)
    assert lin.out_features == 48
    _close(lin(x), Linear(dense, b)(x))
    # and the quantization is real: the result is near, not equal to, the float weight's
    assert np.abs(np.array(lin(x) - Linear(w, b)(x))).max() > 0


# ------------------------------------------------------------------ Embedding


def test_dense_embedding_lookup_and_tied_head() -> None:
    table = _normal((40, 16), 7)
    emb = Embedding(Linear(table))
    ids = mx.array([[0, 5, 5, 39]])
    np.testing.assert_array_equal(np.array(emb(ids)), np.array(table)[[[0, 5, 5, 39]]])
    h = _normal((1, 2, 16), 8)
    _close(emb.as_linear(h), np.array(h) @ np.array(table).T)


@pytest.mark.parametrize(("bits", "group_size", "mode"), QUANTS, ids=QUANT_IDS)
def test_quantized_embedding_lookup_equals_dequantized_rows(bits: int, group_size: int, mode: str) -> None:
    table = _normal((40, 64), 9)
    lin, dense = _quantized(table, bits, group_size, mode)
    emb = Embedding(lin)
    ids = mx.array([[3, 0, 39, 3], [7, 7, 1, 2]])
    rows = emb(ids)
    assert rows.shape == (2, 4, 64)
    # mxfp4 dequantizes to bfloat16 (MLX's default for it); compare in float32
    assert rows.dtype == dense.dtype
    np.testing.assert_allclose(_np(rows), _np(dense)[np.array(ids)], atol=1e-6)
    h = _normal((1, 3, 64), 10)
    _close(emb.as_linear(h), np.array(h) @ _np(dense).T)


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("group_size", [16, 32, 64])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("width", [64, 576])
def test_quantized_embedding_rows_have_dequantizes_bits(
    bits: int, group_size: int, symmetric: bool, width: int
) -> None:
    """Rows of an affine table (one native op on the CPU) equal dequant.dequantize's of the same rows bit for bit:
    float16 scales, stored or derived (symmetric) biases, MLX groups and GGUF's narrow group of 16."""
    from turbospark_core import dequant

    w = mx.random.randint(0, 2**32, (40, width * bits // 32), key=mx.random.key(5)).astype(mx.uint32)
    scales = (mx.random.uniform(0.01, 0.1, (40, width // group_size), key=mx.random.key(6))).astype(mx.float16)
    biases = None if symmetric else (-(2 ** (bits - 1)) * scales + 0.01).astype(mx.float16)
    quant = QuantSpec(bits=bits, group_size=group_size, mode="affine")
    emb = Embedding(Linear(w, quant=quant, scales=scales, biases=biases), mx.float32)
    ids = mx.array([[3, 0, 39, 3], [7, 7, 1, 2]])
    want = dequant.dequantize(w[ids], scales[ids], None if biases is None else biases[ids], quant, mx.float32)
    got = emb(ids)
    assert got.dtype == mx.float32 and got.shape == (2, 4, width)
    np.testing.assert_array_equal(np.array(got), np.array(want))


# ------------------------------------------------------------------ ExpertBank


def _silu_glu(gate: mx.array, up: mx.array) -> mx.array:
    return gate * mx.sigmoid(gate) * up


def _expert_loop(
    x: np.ndarray, idx: np.ndarray, g: np.ndarray, u: np.ndarray, d: np.ndarray, biases: tuple | None
) -> np.ndarray:
    """One (token, chosen expert) at a time, in float64."""
    bg, bu, bd = biases or (np.zeros(g.shape[:2]), np.zeros(u.shape[:2]), np.zeros(d.shape[:2]))
    out = np.zeros((*idx.shape, d.shape[1]))
    for pos in np.ndindex(*idx.shape):
        e, h = idx[pos], x[pos[:-1]]
        gate, up = g[e] @ h + bg[e], u[e] @ h + bu[e]
        out[pos] = d[e] @ (gate / (1 + np.exp(-gate)) * up) + bd[e]
    return out


def _bank(
    experts: int, dim: int, hidden: int, quant: tuple[int, int, str] | None, with_bias: bool
) -> tuple[ExpertBank, list[np.ndarray], list[mx.array | None]]:
    """A bank of gate/up/down experts, the float weights it really holds, and its biases."""
    ws = [_normal((experts, hidden, dim), 11), _normal((experts, hidden, dim), 12), _normal((experts, dim, hidden), 13)]
    ws = [w * 0.2 for w in ws]
    bs = [_normal((experts, hidden), 14), _normal((experts, hidden), 15), _normal((experts, dim), 16)]
    bs = bs if with_bias else [None] * 3
    if quant is None:
        return ExpertBank(*(Linear(w, b) for w, b in zip(ws, bs, strict=True))), [np.array(w) for w in ws], bs
    made = [_quantized(w, *quant, bias=b) for w, b in zip(ws, bs, strict=True)]
    return ExpertBank(*(lin for lin, _ in made)), [_np(dense) for _, dense in made], bs


@pytest.mark.parametrize("quant", [None, (4, 64, "affine"), (8, 64, "affine")], ids=["dense", "q4", "q8"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_expert_bank_glu_equals_a_per_expert_loop(quant: tuple[int, int, str] | None, with_bias: bool) -> None:
    experts, dim, hidden, k = 4, 64, 128, 2
    bank, (g, u, d), bs = _bank(experts, dim, hidden, quant, with_bias)
    assert bank.num_experts == experts
    x = _normal((2, 3, dim), 17)
    idx = mx.array(_rng(18).integers(0, experts, size=(2, 3, k)))
    out = bank.glu(x, idx, _silu_glu)
    assert out.shape == (2, 3, k, dim)
    biases = tuple(np.array(b) for b in bs) if with_bias else None
    expected = _expert_loop(np.array(x, dtype=np.float64), np.array(idx), g, u, d, biases)
    _close(out, expected, atol=2e-4)


def test_expert_glu_sorted_path_is_bit_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    E, D, F = 8, 32, 16
    gate = Linear(mx.random.normal((E, F, D), key=mx.random.key(0)), mx.random.normal((E, F), key=mx.random.key(1)))
    up = Linear(mx.random.normal((E, F, D), key=mx.random.key(2)))
    down = Linear(mx.random.normal((E, D, F), key=mx.random.key(3)))
    bank = ExpertBank(gate, up, down)
    x = mx.random.normal((2, 40, D), key=mx.random.key(4))
    idx = mx.random.randint(0, E, (2, 40, 2), key=mx.random.key(5))

    def act(a: mx.array, b: mx.array) -> mx.array:
        return a * mx.sigmoid(a) * b

    monkeypatch.setattr(layers, "SORT_THRESHOLD", 10**9)
    unsorted = bank.glu(x, idx, act)
    monkeypatch.setattr(layers, "SORT_THRESHOLD", 1)
    assert mx.array_equal(bank.glu(x, idx, act), unsorted)


def test_the_resident_bank_is_an_experts() -> None:
    bank, _, _ = _bank(4, 64, 128, None, with_bias=False)
    assert isinstance(bank, Experts) and not isinstance(Linear(mx.zeros((2, 2))), Experts)


def test_a_quantized_linear_needs_its_scales() -> None:
    with pytest.raises(ValueError, match="needs its scales"):
        Linear(mx.zeros((4, 2), dtype=mx.uint32), quant=QuantSpec(bits=4, group_size=32, mode="affine"))


def test_fused_linears_equal_the_parts_and_refuse_mixed_layouts() -> None:
    from turbospark_core.layers import fuse_linears, fused_parts

    def quantized(n: int, seed: int, bits: int = 4) -> Linear:
        w, s, b = mx.quantize(mx.random.normal((n, 64), key=mx.random.key(seed)), group_size=32, bits=bits)
        return Linear(w, quant=QuantSpec(bits=bits, group_size=32), scales=s, biases=b)

    parts = [quantized(48, 1), quantized(16, 2), quantized(16, 3)]
    x = mx.random.normal((2, 64), key=mx.random.key(4))
    fused = fuse_linears(parts)
    assert fused is not None and fused.out_features == 80
    want = [np.array(p(x)) for p in parts]
    got = np.split(np.array(fused(x)), [48, 64], axis=-1)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6)
    for view, w in zip(fused_parts(fused, [48, 16, 16]), want, strict=True):
        np.testing.assert_array_equal(np.array(view(x)), w)
    assert fuse_linears([quantized(16, 5), quantized(16, 6, bits=8)]) is None  # other bits: kept apart
    assert fuse_linears([parts[0], Linear(mx.zeros((4, 64)))]) is None  # dense beside quantized


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_rms_norm_and_silu_mul_equal_mlx_whatever_the_path(dtype: mx.Dtype) -> None:
    # float32 on the CPU takes the native ops (when built), bfloat16 MLX's own: the same values either way
    x = (mx.random.normal((2, 3, 64), key=mx.random.key(4)) * 4).astype(dtype)
    w = mx.random.normal((64,), key=mx.random.key(5)).astype(dtype)
    tol = 2e-6 if dtype == mx.float32 else 2e-2
    want = mx.fast.rms_norm(x, w, 1e-5).astype(mx.float32)
    got = layers.rms_norm(x, w, 1e-5).astype(mx.float32)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=tol, atol=tol)
    g, u = x, x[::-1]
    want = (g * mx.sigmoid(g) * u).astype(mx.float32)
    np.testing.assert_allclose(np.array(layers.silu_mul(g, u).astype(mx.float32)), np.array(want), rtol=tol, atol=tol)
    want = (nn.gelu_approx(g) * u).astype(mx.float32)
    got = layers.gelu_tanh_mul(g, u).astype(mx.float32)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("quant", [*QUANTS, None], ids=[*QUANT_IDS, "dense"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_plus_adds_the_product_to_the_residual(quant: tuple[int, int, str] | None, with_bias: bool) -> None:
    w, bias = _normal((48, 64), 1), (_normal((48,), 2) if with_bias else None)
    linear = Linear(w, bias) if quant is None else _quantized(w, *quant, bias=bias)[0]
    x, r = _normal((2, 3, 64), 3), _normal((2, 3, 48), 4)
    # folded into a quantized product or added after, the same bits as the sum written out
    np.testing.assert_array_equal(np.array(layers.linear_plus(linear, x, r)), np.array(r + linear(x)))

    class Doubled(Linear):  # a subclass with its own product (a distributed rank's) keeps it
        def __call__(self, x: mx.array) -> mx.array:
            return super().__call__(x) * 2

    doubled = Doubled(linear.weight, bias, quant=linear.quant, scales=linear.scales, biases=linear.biases)
    np.testing.assert_array_equal(np.array(layers.linear_plus(doubled, x, r)), np.array(r + 2 * linear(x)))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
def test_rope_heads_merged_attention_and_fused_gates_whatever_the_path(dtype: mx.Dtype, norm: bool) -> None:
    # float32 on the CPU runs the native ops, bfloat16 the MLX composition they replace: the same values
    rope = Rope.from_config(dims=32, theta=10000.0, scaling=None, max_positions=4096)
    heads, kv_heads, d = 4, 2, 32
    x = (_normal((2, 3, (heads + 2 * kv_heads) * d), 5) * 2).astype(dtype)
    norms = (_normal((d,), 6).astype(dtype), _normal((d,), 7).astype(dtype)) if norm else None
    offset = mx.array([4, 9])
    got = layers.rope_heads(x, rope, heads=heads, kv_heads=kv_heads, offset=offset, norms=norms, eps=1e-6)
    q, k, v = (p.reshape(2, 3, n, d).transpose(0, 2, 1, 3) for p, n in zip(
        mx.split(x, [heads * d, (heads + kv_heads) * d], axis=-1), (heads, kv_heads, kv_heads), strict=True
    ))  # fmt: skip
    if norms is not None:
        q, k = mx.fast.rms_norm(q, norms[0], 1e-6), mx.fast.rms_norm(k, norms[1], 1e-6)
    want = [rope(q, offset), rope(k, offset), v]
    tol = 1e-5 if dtype == mx.float32 else 6e-2
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(_np(g), _np(w), rtol=tol, atol=tol * 4)
    cache_k = mx.concatenate([k, k[:, :, ::-1]], axis=2)
    merged = layers.attention(q, cache_k, cache_k, scale=d**-0.5, mask="causal", merge_heads=True)
    apart = mx.fast.scaled_dot_product_attention(q, cache_k, cache_k, scale=d**-0.5, mask="causal")
    assert merged.shape == (2, 3, heads * d)
    np.testing.assert_allclose(_np(merged), _np(apart.transpose(0, 2, 1, 3).reshape(2, 3, -1)), rtol=tol, atol=tol)
    gate, up = mx.split(x, 2, axis=-1)
    np.testing.assert_allclose(_np(layers.silu_mul(x)), _np(gate * mx.sigmoid(gate) * up), rtol=tol, atol=tol)
    np.testing.assert_allclose(
        _np(layers.gelu_tanh_mul(x)), _np(nn.gelu_approx(gate) * up), rtol=tol, atol=tol * 4
    )


@pytest.mark.parametrize("quant", [*QUANTS, None], ids=[*QUANT_IDS, "dense"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_normed_and_gated_products_equal_the_ops_written_out(
    quant: tuple[int, int, str] | None, with_bias: bool
) -> None:
    w, bias = _normal((48, 64), 8), (_normal((48,), 9) if with_bias else None)
    linear = Linear(w, bias) if quant is None else _quantized(w, *quant, bias=bias)[0]
    x, norm, r = _normal((2, 3, 64), 10) * 3, _normal((64,), 11), _normal((2, 3, 48), 12)
    # folded into a quantized product or run apart, the same bits as the ops one after another
    for weight in (norm, None):
        want = linear(layers.rms_norm(x, weight, 1e-5))
        np.testing.assert_array_equal(np.array(layers.linear_normed(linear, x, weight, 1e-5)), np.array(want))
    gate_up = _normal((2, 3, 128), 13) * 4
    for name, act in (("silu_mul", layers.silu_mul), ("gelu_tanh_mul", layers.gelu_tanh_mul)):
        h = act(gate_up)
        np.testing.assert_array_equal(np.array(layers.linear_gated(linear, gate_up, name)), np.array(linear(h)))
        got = layers.linear_gated(linear, gate_up, name, r)
        np.testing.assert_array_equal(np.array(got), np.array(r + linear(h)))
    with pytest.raises(ValueError, match="gated activation 'relu' is not one of"):
        layers.linear_gated(linear, gate_up, "relu")
    # a sandwich norm after the product, before the residual
    post = (_normal((48,), 18), 1e-6)
    got = layers.linear_plus(linear, x, r, post_norm=post)
    np.testing.assert_array_equal(np.array(got), np.array(r + layers.rms_norm(linear(x), *post)))
    got = layers.linear_gated(linear, gate_up, "gelu_tanh_mul", r, post_norm=post)
    want = r + layers.rms_norm(linear(layers.gelu_tanh_mul(gate_up)), *post)
    np.testing.assert_array_equal(np.array(got), np.array(want))


def test_a_wrapper_that_observes_its_inputs_sees_them_all() -> None:
    # calibration and diagnostics wrap a Linear to record what it multiplies: the fused forms call it as itself
    linear = _quantized(_normal((48, 64), 14), 4, 64, "affine")[0]
    seen: list[mx.array] = []

    class Observed:
        def __call__(self, x: mx.array) -> mx.array:
            seen.append(x)
            return linear(x)

    x, norm, r = _normal((1, 2, 64), 15), _normal((64,), 16), _normal((1, 2, 48), 17)
    observed: Any = Observed()
    np.testing.assert_array_equal(np.array(layers.linear_plus(observed, x, r)), np.array(r + linear(x)))
    np.testing.assert_array_equal(
        np.array(layers.linear_normed(observed, x, norm, 1e-5)), np.array(linear(layers.rms_norm(x, norm, 1e-5)))
    )
    gate_up = mx.concatenate([x, x], axis=-1)
    np.testing.assert_array_equal(
        np.array(layers.linear_gated(observed, gate_up, "silu_mul")), np.array(linear(layers.silu_mul(x, x)))
    )
    assert len(seen) == 3


# ------------------------------------------------------------------ FusedLayer


def _decoder_parts(
    hidden: int = 64, heads: int = 4, kv_heads: int = 2, d: int = 16, ffn: int = 96
) -> dict[str, Any]:
    return {
        "input_norm": _normal((hidden,), 30) * 0.2 + 1, "mlp_norm": _normal((hidden,), 31) * 0.2 + 1,
        "qkv": _quantized(_normal(((heads + 2 * kv_heads) * d, hidden), 32) * 0.2, 4, 32, "affine")[0],
        "o_proj": _quantized(_normal((hidden, heads * d), 33) * 0.2, 4, 32, "affine")[0],
        "gate_up": _quantized(_normal((2 * ffn, hidden), 34) * 0.2, 4, 32, "affine")[0],
        "down": _quantized(_normal((hidden, ffn), 35) * 0.2, 4, 32, "affine")[0],
        "heads": heads, "kv_heads": kv_heads, "scale": d**-0.5, "eps": 1e-5,
        "rope": Rope.from_config(dims=d, theta=10000.0, scaling=None, max_positions=4096),
    }  # fmt: skip


def _decoder_step_in_parts(p: dict[str, Any], x: mx.array, cache: Any) -> mx.array:
    """The layer written with the family-facing ops (what a flow runs without the fused layer)."""
    offset = cache.offset
    if isinstance(p["qkv"], Linear):
        proj: Any = layers.linear_normed(p["qkv"], x, p["input_norm"], p["eps"])
    else:  # q, k and v apart: the input normalized once
        normed = layers.rms_norm(x, p["input_norm"], p["eps"])
        proj = [m(normed) for m in p["qkv"]]
    q, k, v = layers.rope_heads(proj, p["rope"], heads=p["heads"], kv_heads=p["kv_heads"], offset=offset)
    h = layers.linear_plus(p["o_proj"], layers.cached_attention(q, k, v, cache, scale=p["scale"], merge_heads=True), x)
    return layers.linear_gated(p["down"], layers.linear_normed(p["gate_up"], h, p["mlp_norm"], p["eps"]), "silu_mul", h)


@pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: {native.STATUS}")
@pytest.mark.parametrize(("ring", "apart"), [(False, False), (True, False), (False, True)])
def test_fused_layer_steps_equal_the_parts_and_write_the_cache_in_place(ring: bool, apart: bool) -> None:
    from turbospark_core.cache_spec import CacheSpec
    from turbospark_core.kv_cache import KVCache, RingKVCache

    p = _decoder_parts()
    if apart:  # q, k and v held apart (layouts that do not fuse)
        w = mx.dequantize(p["qkv"].weight, p["qkv"].scales, p["qkv"].biases, group_size=32, bits=4)
        parts = zip(mx.split(w, [64, 96]), (5, 4, 8), strict=True)
        p["qkv"] = tuple(_quantized(part, b, 32, "affine")[0] for part, b in parts)
    fused = layers.fused_layer(**p)
    assert fused is not None
    spec = CacheSpec.sliding(2, 16, window=12) if ring else CacheSpec(n_kv_heads=2, head_dim=16)

    def make() -> KVCache | RingKVCache:
        return RingKVCache(spec, 100, mx.float32) if ring else KVCache(spec, 100, mx.float32, step=8)

    a, b = make(), make()
    xs = _normal((1, 11, 64), 36)
    copies = None
    # a prefill of 4 tokens, then single tokens (past the full cache's first growth; the ring below its window);
    # the ring's prefill goes through its parts (the fused layer declines it), its steps through the fused op
    for start, end in [(0, 4)] + [(t, t + 1) for t in range(4, 11)]:
        x = xs[:, start:end]
        got = fused(x, a)
        if got is None:
            assert ring and start == 0 and a.offset == 0  # declined: the cache untouched
            got = _decoder_step_in_parts(p, x, a)
        want = _decoder_step_in_parts(p, x, b)
        mx.eval(got, want, a.state, b.state)
        np.testing.assert_array_equal(np.array(got), np.array(want))
        assert a.offset == b.offset == end
        if copies is None:
            copies = native.cache_attention_copies()
    assert native.cache_attention_copies() == copies  # the buffers written in place


@pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: {native.STATUS}")
def test_fused_layer_reads_strided_weights_as_the_values_they_show() -> None:
    """Norms and matrices handed over as strided views (every other element of a stack) step as the originals."""
    from turbospark_core.cache_spec import CacheSpec
    from turbospark_core.kv_cache import KVCache

    def strided(a: mx.array) -> mx.array:
        return mx.stack([a, a], axis=-1)[..., 0]

    p = _decoder_parts()
    down = p["down"]
    views = {
        **p, "input_norm": strided(p["input_norm"]), "mlp_norm": strided(p["mlp_norm"]),
        "down": Linear(strided(down.weight), quant=down.quant, scales=strided(down.scales),
                       biases=strided(down.biases)),
    }  # fmt: skip
    fused = layers.fused_layer(**views)
    assert fused is not None
    spec = CacheSpec(n_kv_heads=2, head_dim=16)
    a, b = KVCache(spec, 100, mx.float32), KVCache(spec, 100, mx.float32)
    xs = _normal((1, 6, 64), 41)
    for start, end in [(0, 3), (3, 4), (4, 5), (5, 6)]:
        got, want = fused(xs[:, start:end], a), _decoder_step_in_parts(p, xs[:, start:end], b)
        assert got is not None
        mx.eval(got, want)
        np.testing.assert_array_equal(np.array(got), np.array(want))


@pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: {native.STATUS}")
def test_fused_layer_declines_what_it_cannot_run() -> None:
    from turbospark_core.cache_spec import CacheSpec
    from turbospark_core.kv_cache import KVCache

    p = _decoder_parts()
    dense = Linear(_normal((64, 96), 37))
    biased = _quantized(_normal((64, 96), 38), 4, 32, "affine", bias=_normal((64,), 39))[0]

    class Observed(Linear):  # a wrapper (diagnostics, a distributed rank): called as itself, never fused
        pass

    observed = Observed(p["down"].weight, quant=p["down"].quant, scales=p["down"].scales, biases=p["down"].biases)
    for down in (dense, biased, observed):
        assert layers.fused_layer(**{**p, "down": down}) is None
    assert layers.fused_layer(**{**p, "qkv": None}) is None  # the projections were not fused
    assert layers.fused_layer(**{**p, "activation": "relu"}) is None
    assert layers.fused_layer(**{**p, "input_norm": p["input_norm"].astype(mx.float16)}) is None
    fused = layers.fused_layer(**p)
    assert fused is not None
    spec = CacheSpec(n_kv_heads=2, head_dim=16)
    x = _normal((1, 1, 64), 40)
    quantized = KVCache(CacheSpec(n_kv_heads=2, head_dim=32), 100, mx.float32, kv_bits=8)
    quantized.update_and_fetch(mx.zeros((1, 2, 2, 32)), mx.zeros((1, 2, 2, 32)))
    assert fused(x, quantized) is None and quantized.offset == 2  # quantized rows: the parts run
    float_cache = KVCache(spec, 100, mx.float32)
    assert fused(x.astype(mx.bfloat16), float_cache) is None and float_cache.offset == 0


@pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: {native.STATUS}")
@pytest.mark.parametrize("lengths", [(4,), (4, 6)], ids=["one-row", "two-rows"])
def test_fused_layer_steps_batched_rows_as_their_parts(lengths: tuple[int, ...]) -> None:
    """A batch's rows (each at its own position, the shorter one left-padded, then a rewind hole) step through
    the fused op with the bits of the batched parts, the buffers written in place."""
    from turbospark_core.batch_cache import BatchCaches
    from turbospark_core.cache_spec import CacheSpec
    from turbospark_core.kv_cache import KVCache

    p = _decoder_parts()
    fused = layers.fused_layer(**p)
    assert fused is not None
    spec = CacheSpec(n_kv_heads=2, head_dim=16)
    xs = _normal((len(lengths), 12, 64), 41)

    def batch() -> BatchCaches:
        caches = BatchCaches([KVCache(spec, 100, mx.float32)])
        for row, n in enumerate(lengths):
            single = KVCache(spec, 100, mx.float32)
            mx.eval(_decoder_step_in_parts(p, xs[row : row + 1, :n], single), single.state)
            caches.add_row([single], n)
        return caches

    a, b = batch(), batch()
    copies = None
    for step in range(5):
        if step == 3:  # each row forgets its last token: a hole in every row's columns
            for caches in (a, b):
                for row in range(len(lengths)):
                    caches.truncate(row, caches.rows.offsets[row] - 1)
        x = mx.concatenate([xs[row : row + 1, o : o + 1] for row, o in enumerate(a.rows.offsets)])
        got = fused(x, a.caches[0])
        assert got is not None
        with layers.parts_only():
            assert fused(x, b.caches[0]) is None
        want = _decoder_step_in_parts(p, x, b.caches[0])
        a.step_done(1)
        b.step_done(1)
        mx.eval(got, want, a.step_state, b.state)
        np.testing.assert_array_equal(np.array(got), np.array(want))
        if copies is None:
            copies = native.cache_attention_copies()
    assert native.cache_attention_copies() == copies  # written in place
    assert a.caches[0].length == b.caches[0].length
    np.testing.assert_array_equal(np.array(a.caches[0].positions), np.array(b.caches[0].positions))
