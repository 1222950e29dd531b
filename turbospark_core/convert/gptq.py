"""GPTQ (Frantar et al. 2022): round a matrix to MLX's affine groups, compensating each column's error.

Round-to-nearest quantizes every weight on its own. GPTQ weighs the error by
what the matrix reads: with ``H = X^T X`` over calibration inputs ``X`` (the
rows of ``x`` that reached this linear), the output error of a quantized
``Q`` is ``tr((W - Q) H (W - Q)^T)``, and quantizing the columns in order while
moving each column's error onto the columns not yet quantized (weighted by
the rows of the upper Cholesky factor of ``H^-1``) keeps it far below
rounding's. Columns go in blocks (lazy batch updates: the columns past a
block get that block's error in one matrix product).

The layout is MLX's affine one, so the result is an ordinary quantized
matrix: each group of ``group_size`` columns shares a scale and bias per row,
chosen as MLX's ``mx.quantize`` chooses them (min/max with an exact edge) from
the group's values at the moment its first column is reached (so they include
the error already moved onto it), and rounded to the storage dtype before any
column of the group is rounded with them. With ``H`` the identity nothing
moves and the result is ``mx.quantize``'s, bit for bit.

Numerics: ``H`` and its factorization are float64; damping adds ``damp`` times
the mean of ``H``'s diagonal to it (:data:`DAMP`, 10%: the reference's 1%
fits a short calibration text too closely), and a factorization that fails is
retried with ten times the damping, up to :data:`MAX_DAMP`. Input channels the
calibration never activated (zero diagonal) are rounded on their own. The
column updates are float32, as in the reference implementation.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core.convert.gguf_reader import _pack
from turbospark_core.convert.records import AffineQuantized
from turbospark_core.errors import ConversionError

DAMP = 0.1  # of the mean diagonal of H (chosen on held-out calibration text, docs/rotation-quality.md)
MAX_DAMP = 10.0  # the last damping tried before a factorization failure is refused
BLOCK = 128  # columns per lazy batch update (a multiple of every group size)


@attrs.frozen(kw_only=True)
class Solved:
    """One matrix quantized by :func:`gptq`.

    Attributes:
        quantized: The packed matrix (numpy arrays; scales and biases float32
            holding values exact in ``scale_dtype``).
        dequantized: ``[rows, cols]`` float32, the values ``quantized`` stands for.
        damp: The relative damping the factorization needed (``DAMP`` unless it failed first).
    """

    quantized: AffineQuantized
    dequantized: np.ndarray = attrs.field(eq=False)
    damp: float


def affine_params(w: np.ndarray, bits: int, scale_dtype: mx.Dtype = mx.float32) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``w`` (``[rows, group]``), the scale and bias ``mx.quantize`` picks, rounded to ``scale_dtype``.

    MLX's rule: the step spans min to max, and the edge of larger magnitude is
    made exact (the bias), the step's sign pointing from it into the range.
    """
    levels = float(2**bits - 1)
    lo, hi = w.min(axis=-1), w.max(axis=-1)
    low_edge = np.abs(lo) > np.abs(hi)
    step = np.maximum((hi - lo) / np.float32(levels), np.float32(1e-7)).astype(np.float32)
    step = np.where(low_edge, step, -step)
    edge = np.where(low_edge, lo, hi)
    q0 = np.round(edge / step)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(q0 != 0, edge / q0, step).astype(np.float32)
    bias = np.where(q0 == 0, np.float32(0), edge).astype(np.float32)
    if scale_dtype != mx.float32:
        scale, bias = (np.array(mx.array(a).astype(scale_dtype).astype(mx.float32)) for a in (scale, bias))
    return scale, bias


def inverse_cholesky(h: np.ndarray, name: str, damp: float = DAMP) -> tuple[np.ndarray, float]:
    """The upper Cholesky factor ``U`` of ``(H + d I)^-1`` (``U^T U``), and the relative damping ``d`` used.

    A dead channel (zero diagonal) gets a unit diagonal, so it stays independent
    of the others. The damping is multiplied by 10 while a factorization fails.

    Raises:
        ConversionError: ``H`` is not finite, or no damping up to :data:`MAX_DAMP` makes it factorable.
    """
    h = np.array(h, dtype=np.float64)
    if not np.isfinite(h).all():
        msg = (
            f"--calibrate: the calibration inputs of {name!r} are not finite (an overflow in the float "
            f"model); calibrate with another text, or convert without --calibrate"
        )
        raise ConversionError(msg)
    diag = np.diag(h).copy()
    dead = diag <= 0
    h[dead, :] = 0.0
    h[:, dead] = 0.0
    h[dead, dead] = 1.0
    mean = float(np.mean(np.diag(h)))
    while damp <= MAX_DAMP:
        try:  # H = V V^T with V upper (the Cholesky factor of H reversed), so H^-1 = U^T U with U = V^-1
            upper = np.linalg.cholesky((h + damp * mean * np.eye(len(h)))[::-1, ::-1])[::-1, ::-1]
            return np.triu(np.linalg.inv(upper)), damp
        except np.linalg.LinAlgError:
            damp *= 10
    msg = (
        f"--calibrate: the calibration Hessian of {name!r} cannot be factored even with damping "
        f"{MAX_DAMP} x its mean diagonal; calibrate with a longer, more varied text"
    )
    raise ConversionError(msg)


def gptq(
    w: np.ndarray,
    h: np.ndarray,
    *,
    bits: int,
    group_size: int,
    scale_dtype: mx.Dtype = mx.float32,
    name: str = "matrix",
) -> Solved:
    """Quantize ``w`` (``[rows, cols]``) to MLX affine groups, minimizing the output error over inputs with ``H``.

    Args:
        w: The float matrix (``y = x w^T``).
        h: ``[cols, cols]`` ``X^T X`` of the calibration inputs (any positive scale).
        bits: 3, 4 or 8.
        group_size: Columns per group (divides ``cols`` and :data:`BLOCK`).
        scale_dtype: The storage dtype of the scales and biases.
        name: For error messages.
    """
    rows, cols = w.shape
    if cols % group_size or BLOCK % group_size or h.shape != (cols, cols):
        msg = f"gptq: {name!r} {w.shape} with H {h.shape} and group {group_size} do not fit"
        raise ValueError(msg)
    u, damp = inverse_cholesky(h, name)
    u = u.astype(np.float32)
    w = np.array(w, dtype=np.float32)  # updated in place as errors move right
    levels = np.float32(2**bits - 1)
    codes = np.empty((rows, cols), np.uint8)
    deq = np.empty((rows, cols), np.float32)
    scales = np.empty((rows, cols // group_size), np.float32)
    biases = np.empty_like(scales)
    for start in range(0, cols, BLOCK):
        stop = min(start + BLOCK, cols)
        err = np.empty((rows, stop - start), np.float32)
        for c in range(start, stop):
            g = c // group_size
            if c % group_size == 0:  # the group's parameters, from its values now
                scales[:, g], biases[:, g] = affine_params(w[:, c : c + group_size], bits, scale_dtype)
            s, b = scales[:, g], biases[:, g]
            col = w[:, c]
            code = np.clip(np.round((col - b) / s), 0, levels)
            codes[:, c] = code
            deq[:, c] = code * s + b
            e = (col - deq[:, c]) / u[c, c]
            w[:, c + 1 : stop] -= np.outer(e, u[c, c + 1 : stop])
            err[:, c - start] = e
        w[:, stop:] -= err @ u[start:stop, stop:]
    packed = _pack(codes.reshape(rows, cols // group_size, group_size), bits)
    quantized = AffineQuantized(weight=packed, scales=scales, biases=biases, bits=bits, group_size=group_size)
    return Solved(quantized=quantized, dequantized=deq, damp=damp)
