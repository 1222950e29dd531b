"""GPTQ on one matrix: MLX's affine layout exactly, error below rounding's, stable factorization, refusals."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core.convert import gptq as gptq_mod
from turbospark_core.convert.gptq import DAMP, affine_params, gptq, inverse_cholesky
from turbospark_core.errors import ConversionError


def _rtn(w: np.ndarray, bits: int, group: int) -> tuple[mx.array, mx.array, mx.array]:
    return mx.quantize(mx.array(w), group_size=group, bits=bits)


def _correlated(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Inputs with correlated channels and a few massive ones (what real activations look like)."""
    x = rng.standard_normal((rows, cols)).astype(np.float32) @ rng.standard_normal((cols, cols)).astype(np.float32)
    x[:, :3] *= 20
    return x / np.sqrt(cols)


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_identity_hessian_is_round_to_nearest_bit_for_bit(bits: int, group: int) -> None:
    """With H = I no error moves between columns: the result is mx.quantize's, packed words included."""
    w = np.random.default_rng(bits * group).standard_normal((24, 256)).astype(np.float32)
    solved = gptq(w, np.eye(256), bits=bits, group_size=group)
    q, scales, biases = _rtn(w, bits, group)
    got = solved.quantized
    assert (got.bits, got.group_size, got.mode) == (bits, group, "affine")
    np.testing.assert_array_equal(got.weight, np.array(q))
    np.testing.assert_array_equal(got.scales, np.array(scales))
    np.testing.assert_array_equal(got.biases, np.array(biases))
    np.testing.assert_array_equal(solved.dequantized, np.array(mx.dequantize(q, scales, biases, group, bits)))
    assert solved.damp == DAMP


@pytest.mark.parametrize("bits", [3, 4])
def test_layer_error_strictly_below_round_to_nearest(bits: int) -> None:
    rng = np.random.default_rng(0)
    x = _correlated(rng, 1024, 128)
    w = rng.standard_normal((48, 128)).astype(np.float32)
    solved = gptq(w, x.T.astype(np.float64) @ x, bits=bits, group_size=32)
    q, scales, biases = _rtn(w, bits, 32)
    rtn = np.array(mx.dequantize(q, scales, biases, 32, bits))
    gptq_err = np.linalg.norm(x @ (w - solved.dequantized).T)
    rtn_err = np.linalg.norm(x @ (w - rtn).T)
    assert gptq_err < 0.8 * rtn_err
    # the packed words, scales and biases are what the dequantized values say (MLX reads them back exactly)
    got = solved.quantized
    back = mx.dequantize(mx.array(got.weight), mx.array(got.scales), mx.array(got.biases), 32, bits)
    np.testing.assert_array_equal(np.array(back), solved.dequantized)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_scales_are_exact_in_the_storage_dtype(dtype: mx.Dtype) -> None:
    """Scales and biases are rounded to the storage dtype before any column uses them."""
    rng = np.random.default_rng(1)
    x = _correlated(rng, 256, 64)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    solved = gptq(w, x.T.astype(np.float64) @ x, bits=4, group_size=32, scale_dtype=dtype)
    got = solved.quantized
    for a in (got.scales, got.biases):
        np.testing.assert_array_equal(np.array(mx.array(a).astype(dtype).astype(mx.float32)), a)
    back = mx.dequantize(
        mx.array(got.weight), mx.array(got.scales).astype(dtype), mx.array(got.biases).astype(dtype), 32, 4
    )
    np.testing.assert_allclose(np.array(back.astype(mx.float32)), solved.dequantized, rtol=1e-2, atol=1e-2)


def test_affine_params_are_mlx_s() -> None:
    w = np.random.default_rng(2).standard_normal((100, 64)).astype(np.float32)
    w[::7] = np.abs(w[::7])  # rows whose edge of larger magnitude is the maximum ...
    w[1::7] = -np.abs(w[1::7])  # ... and the minimum
    w[2] = 0.0  # a constant group
    for bits in (3, 4, 8):
        _, scales, biases = _rtn(w, bits, 64)
        s, b = affine_params(w, bits)
        np.testing.assert_array_equal(s, np.array(scales)[:, 0])
        np.testing.assert_array_equal(b, np.array(biases)[:, 0])


def test_deterministic() -> None:
    rng = np.random.default_rng(3)
    x = _correlated(rng, 512, 128)
    w = rng.standard_normal((32, 128)).astype(np.float32)
    h = x.T.astype(np.float64) @ x
    a, b = gptq(w, h, bits=4, group_size=64), gptq(w, h, bits=4, group_size=64)
    np.testing.assert_array_equal(a.quantized.weight, b.quantized.weight)
    np.testing.assert_array_equal(a.dequantized, b.dequantized)


def test_a_tiny_case_by_hand() -> None:
    """One row, 2-bit groups of 4, worked out by hand.

    Group 0 is ``[0.4, 1.2, 0, 3]``: MLX's grid spans 0..3 with the maximum exact (scale -1, bias 3), so the
    levels are 3, 2, 1, 0 for codes 0..3. ``H`` couples columns 0 and 1 (``h01 = 0.99``; unit diagonal, so
    10% damping adds 0.1). Column 0 rounds 0.4 to 0 (error ``d0 = 0.4``); the optimal change of column 1 given
    that error is ``+d0 * h01 / h11 = 0.4 * 0.99 / 1.1 = 0.36``, so column 1 becomes 1.56 and rounds to 2 where
    round-to-nearest gives 1. The other columns are uncoupled and exact; groups 1-3 are zeros (code 0).
    """
    w = np.zeros((1, 16), np.float32)
    w[0, :4] = [0.4, 1.2, 0.0, 3.0]
    h = np.eye(16)
    h[0, 1] = h[1, 0] = 0.99
    solved = gptq(w, h, bits=2, group_size=4)
    np.testing.assert_array_equal(solved.dequantized[0, :4], [0.0, 2.0, 0.0, 3.0])
    np.testing.assert_array_equal(solved.dequantized[0, 4:], 0.0)
    got = solved.quantized
    np.testing.assert_array_equal(got.scales[0], np.float32([-1.0, -1e-7, -1e-7, -1e-7]))  # -1e-7: constant groups
    np.testing.assert_array_equal(got.biases[0], [3.0, 0.0, 0.0, 0.0])
    assert got.weight.tolist() == [[3 | 1 << 2 | 3 << 4 | 0 << 6]]  # codes 3, 1, 3, 0, then zeros; 2 bits each
    # ... and it lowers the output error on H: d = (0.4, -0.8) against rounding's (0.4, 0.2)
    d_gptq, d_rtn = w - solved.dequantized, w - np.array([[0.0, 1.0, 0.0, 3.0] + [0.0] * 12], np.float32)
    assert np.isclose((d_gptq @ h @ d_gptq.T).item(), 0.1664) and np.isclose((d_rtn @ h @ d_rtn.T).item(), 0.3584)


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_codes_are_in_range_and_in_mlx_s_layout(bits: int) -> None:
    """Every weight is an integer code in [0, 2^bits) of its group's scale and bias, and MLX's own
    dequantization of the packed words reads back those values (the install's affine layout)."""
    rng = np.random.default_rng(bits)
    x = _correlated(rng, 512, 128)
    w = rng.standard_normal((16, 128)).astype(np.float32) * 0.05
    solved = gptq(w, x.T.astype(np.float64) @ x, bits=bits, group_size=64)
    got = solved.quantized
    assert got.weight.dtype == np.uint32 and got.weight.shape == (16, 128 * bits // 32)
    assert got.scales.shape == got.biases.shape == (16, 2)
    scales, biases = (np.repeat(a, 64, axis=1) for a in (got.scales, got.biases))
    codes = (solved.dequantized - biases) / scales
    np.testing.assert_allclose(codes, np.round(codes), atol=1e-3)
    assert codes.round().min() >= 0 and codes.round().max() <= 2**bits - 1
    back = mx.dequantize(mx.array(got.weight), mx.array(got.scales), mx.array(got.biases), 64, bits)
    np.testing.assert_array_equal(np.array(back), solved.dequantized)


# ------------------------------------------------------------------ the factorization


def test_inverse_cholesky_is_the_damped_inverse() -> None:
    x = _correlated(np.random.default_rng(4), 300, 40)
    h = x.T.astype(np.float64) @ x
    u, damp = inverse_cholesky(h, "m")
    assert damp == DAMP and np.allclose(u, np.triu(u))
    damped = h + DAMP * np.mean(np.diag(h)) * np.eye(40)
    np.testing.assert_allclose(u.T @ u, np.linalg.inv(damped), rtol=1e-6, atol=1e-10)


def test_rank_deficient_and_dead_channels_still_factor() -> None:
    """Fewer inputs than columns (H singular) and channels never activated: damping makes it factorable;
    a dead channel is rounded on its own (its column equals round-to-nearest's)."""
    rng = np.random.default_rng(5)
    x = _correlated(rng, 20, 64)  # rank 20 < 64
    x[:, 40] = 0.0
    w = rng.standard_normal((8, 64)).astype(np.float32)
    solved = gptq(w, x.T.astype(np.float64) @ x, bits=4, group_size=64)
    assert np.isfinite(solved.dequantized).all()
    u, _ = inverse_cholesky(x.T.astype(np.float64) @ x, "m")
    assert np.count_nonzero(u[40]) == 1 and np.count_nonzero(u[:, 40]) == 1


def test_failed_factorization_retries_with_more_damping() -> None:
    """An indefinite H (eigenvalue -2; mean diagonal 1) fails at 10% and 100% damping, factors at 1000%."""
    h = np.eye(32)
    h[0, 1] = h[1, 0] = 3.0
    u, damp = inverse_cholesky(h, "m")
    assert damp == pytest.approx(100 * DAMP) and np.isfinite(u).all()


def test_unfactorable_and_non_finite_hessians_are_refused(names) -> None:
    h = np.eye(16)
    h[0, 1] = h[1, 0] = 1e6  # eigenvalue -1e6: no damping up to MAX_DAMP lifts it
    with pytest.raises(ConversionError) as e:
        inverse_cholesky(h, "layers.3.mlp.down_proj")
    names(e, "layers.3.mlp.down_proj", "cannot be factored", f"{gptq_mod.MAX_DAMP}", "longer, more varied text")
    bad = np.eye(16)
    bad[2, 3] = np.inf
    with pytest.raises(ConversionError) as e:
        inverse_cholesky(bad, "layers.0.self_attn.q_proj")
    names(e, "layers.0.self_attn.q_proj", "not finite", "another text")


def test_shapes_that_do_not_fit_are_refused() -> None:
    w = np.zeros((4, 96), np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        gptq(w, np.eye(96), bits=4, group_size=64)  # 96 is not a multiple of 64
    with pytest.raises(ValueError, match="do not fit"):
        gptq(w, np.eye(64), bits=4, group_size=32)  # H of another width
