"""Quantized matrices back to floats: MLX's layouts as ``mx.dequantize`` gives them, narrow groups exactly."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core.convert.gguf_reader import _pack
from turbospark_core.dequant import dequantize, raw_codes
from turbospark_core.tensor_index import QuantSpec

BITS = [2, 3, 4, 5, 6, 8]


def _codes(shape: tuple[int, ...], bits: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**bits, shape, dtype=np.uint8)


# 272 = 17 groups of 16: a row that is not whole groups of 32 (even bits only: odd ones would not fill words)
ROW_LENGTHS = [(bits, cols) for bits in BITS for cols in (32, 256, 272) if cols * bits % 32 == 0]


@pytest.mark.parametrize(("bits", "cols"), ROW_LENGTHS)
def test_raw_codes_read_the_bit_stream_exactly(bits: int, cols: int) -> None:
    codes = _codes((3, 5, cols), bits, seed=bits)  # with a leading (expert) axis
    words = mx.array(_pack(codes.reshape(3, 5, -1, 16), bits))
    got = raw_codes(words, bits)
    assert got.dtype == mx.float32 and got.shape == (3, 5, cols)
    assert np.array_equal(np.array(got), codes.astype(np.float32))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("scale_dtype", [np.float16, np.float32])
def test_narrow_groups_apply_each_scale_and_bias_in_float32(bits: int, scale_dtype: type) -> None:
    rng = np.random.default_rng(bits)
    codes = _codes((6, 64), bits, seed=bits + 1)
    scales = rng.uniform(-0.02, 0.02, (6, 4)).astype(scale_dtype)
    biases = rng.uniform(-0.5, 0.5, (6, 4)).astype(scale_dtype)
    words = mx.array(_pack(codes.reshape(6, 4, 16), bits))
    spec = QuantSpec(bits=bits, group_size=16)
    got = dequantize(words, mx.array(scales), mx.array(biases), spec)
    want = codes.reshape(6, 4, 16) * scales.astype(np.float32)[..., None] + biases.astype(np.float32)[..., None]
    want = want.reshape(6, 64)
    assert got.dtype == mx.float32
    assert np.array_equal(np.array(got), want)
    # in another dtype: one rounding, from the float32 values
    as_bf16 = dequantize(words, mx.array(scales), mx.array(biases), spec, mx.bfloat16)
    assert as_bf16.dtype == mx.bfloat16
    assert mx.array_equal(as_bf16, mx.array(want).astype(mx.bfloat16)).item()


@pytest.mark.parametrize(("bits", "group", "mode"), [(4, 32, "affine"), (8, 64, "affine"), (4, 32, "mxfp4")])
def test_mlx_layouts_are_what_mx_dequantize_gives(bits: int, group: int, mode: str) -> None:
    w = mx.random.normal((8, 128), key=mx.random.key(1))
    parts = mx.quantize(w, group_size=group, bits=bits, mode=mode)
    wq, scales = parts[0], parts[1]
    biases = parts[2] if mode == "affine" else None
    spec = QuantSpec(bits=bits, group_size=group, mode=mode)
    want = mx.dequantize(wq, scales, biases, group_size=group, bits=bits, mode=mode)
    assert mx.array_equal(dequantize(wq, scales, biases, spec), want).item()
    if mode == "affine":  # half scales widened first (exact), so the values come out in float32
        s16, b16 = scales.astype(mx.float16), biases.astype(mx.float16)
        half = dequantize(wq, s16, b16, spec, mx.float32)
        want_half = mx.dequantize(wq, s16.astype(mx.float32), b16.astype(mx.float32), group_size=group, bits=bits)
        assert half.dtype == mx.float32 and mx.array_equal(half, want_half).item()
