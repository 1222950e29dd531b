"""Quantized matrices back to floats, for every layout an install may hold.

MLX's own groups (32/64/128, mxfp4) go through ``mx.dequantize``. The narrow
affine groups (:data:`~turbospark_core.tensor_index.NARROW_GROUPS`: GGUF
K-quants with 16-wide sub-blocks) share MLX's bit stream, which does not
depend on the group: ``mx.dequantize`` at group 32 with unit scales and zero
biases reads the raw integer codes exactly, and each narrow group's scale and
bias are applied to them in float32. Every code is an integer below 256 and
``scale * code`` is exact in float32 for the GGUF mappings, so the values are
those of the GGUF file's own dequantizer.

An affine matrix held without biases (``biases=None``) is symmetric: each
group's bias is ``-2^(bits-1)`` times its scale (:func:`symmetric_biases`).
"""

from __future__ import annotations

import mlx.core as mx

from turbospark_core.tensor_index import QuantSpec

_CODE_GROUP = 32


def dequantize(
    w: mx.array, scales: mx.array, biases: mx.array | None, quant: QuantSpec, dtype: mx.Dtype | None = None
) -> mx.array:
    """The float values of a quantized matrix ``[..., rows, words]``, in ``dtype`` when given.

    MLX's layouts: affine scales and biases are widened to ``dtype`` first (exact
    from float16 storage into float32), then ``mx.dequantize``. Narrow groups: codes,
    scales and biases in float32 (the result without ``dtype``), then one cast.
    """
    if biases is None and quant.mode == "affine":
        biases = symmetric_biases(scales, quant.bits)
    if quant.mlx_kernels:
        if dtype is not None and quant.mode == "affine":
            scales, biases = scales.astype(dtype), None if biases is None else biases.astype(dtype)
        out = mx.dequantize(
            w,
            scales,
            biases,
            group_size=quant.group_size,
            bits=quant.bits,
            mode=quant.mode,
        )
    else:
        codes = raw_codes(w, quant.bits)
        *lead, cols = codes.shape
        values = codes.reshape(*lead, cols // quant.group_size, quant.group_size)
        values = values * scales.astype(mx.float32)[..., None]
        if biases is not None:
            values = values + biases.astype(mx.float32)[..., None]
        out = values.reshape(*lead, cols)
    return out if dtype is None else out.astype(dtype)


def symmetric_biases(scales: mx.array, bits: int) -> mx.array:
    """The biases of a symmetric affine matrix: ``-2^(bits-1) * scale`` for each group (exact: a power of two)."""
    biases: mx.array = scales * -(2 ** (bits - 1))
    return biases


def is_symmetric(scales: mx.array, biases: mx.array, bits: int) -> bool:
    """Whether every bias is ``-2^(bits-1)`` times its scale (GGUF's Q8_0/Q4_0/Q5_0/Q6_K/Q3_K blocks).

    Such a matrix multiplies without its biases (:class:`~turbospark_core.layers.Linear`
    holds ``biases=None``): the kernels derive them, bit for bit, and never read them.
    """
    return bool(mx.array_equal(biases, symmetric_biases(scales, bits)).item())


def raw_codes(w: mx.array, bits: int) -> mx.array:
    """The integer codes of MLX's affine bit stream ``[..., rows, words]`` as float32 ``[..., rows, cols]``.

    Exact: ``mx.dequantize`` at group 32 with scale 1 and bias 0. A row whose
    length is not a multiple of 32 (16 values over, even bits only) is padded
    with zero words and cut back.
    """
    cols = w.shape[-1] * 32 // bits
    pad = -cols % _CODE_GROUP
    if pad:
        w = mx.concatenate([w, mx.zeros((*w.shape[:-1], pad * bits // 32), mx.uint32)], axis=-1)
    ones = mx.ones((*w.shape[:-1], (cols + pad) // _CODE_GROUP), mx.float32)
    codes = mx.dequantize(w, ones, mx.zeros_like(ones), group_size=_CODE_GROUP, bits=bits)
    return codes[..., :cols] if pad else codes
