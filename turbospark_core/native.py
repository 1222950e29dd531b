"""Native CPU kernels for quantized matrices (an MLX custom primitive built at install).

With the extension, quantized weights stay quantized on the CPU and multiply
through :func:`quantized_matmul` (AVX-512, AVX2/FMA, NEON on arm64 or portable kernels, a thread
pool whose threads poll briefly for the next job and then sleep): row kernels for up to 16 rows
of x (decode, batched decode, verify), and from 17 rows a native GEMM over dequantized panels (AVX-512 and NEON;
``TURBOSPARK_QMM_GEMM=blas`` sends them through OpenBLAS's sgemm instead, as the
AVX2 and portable sets always do). The NEON set (every aarch64 CPU: Linux arm64, Apple
silicon on MLX's CPU device) has been checked for correctness under qemu's emulation only
(``tests/native_kernels``), never timed on arm64 hardware. Without the extension (not built,
built against another MLX, or
``TURBOSPARK_NATIVE=0``) the compute policy unpacks them as before;
:data:`STATUS` says which, for ``turbospark inspect`` and the runner's stats.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import mlx.core as mx  # before the extension: it finds libmlx because mlx loaded it

from turbospark_core import dequant
from turbospark_core.tensor_index import QuantSpec

if TYPE_CHECKING:
    from turbospark_core.rope import Rope

OFF_ENV = "TURBOSPARK_NATIVE"
OFF_WORDS = frozenset({"0", "off", "false", "no"})
"""The values of an environment switch that turn it off (here and in :mod:`turbospark_core.placement`)."""
BITS = frozenset({2, 3, 4, 5, 6, 8})
MLX_VERSION: str = mx.__version__  # type: ignore[attr-defined]  # the stubs omit it


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get(OFF_ENV, "1").lower() in OFF_WORDS:
        return None, f"native kernels off ({OFF_ENV}=0)"
    try:
        _qmm = importlib.import_module("turbospark_core._native._qmm")
    except ImportError as err:
        return None, f"native kernels missing (not built at install: {err}); reinstall with cmake and a C++ compiler"
    if _qmm.mlx_version() != MLX_VERSION:
        return None, (
            f"native kernels built for mlx {_qmm.mlx_version()} but mlx {MLX_VERSION} is installed; "
            f"reinstall turbospark to rebuild them"
        )
    _bind_blas(_qmm)
    how = {"native": "native GEMM", "blas": "dequantized panels through OpenBLAS"}.get(_qmm.gemm_path())
    gemm = f", {how} from {_qmm.gemm_min_rows()} rows" if how else ""
    return _qmm, f"native {_qmm.kernel()} kernels, {_qmm.threads()} threads{gemm}"


def _bind_blas(module: ModuleType) -> bool:
    from turbospark_core import blas

    path = blas.openblas_path()
    if path is None or not module.bind_blas(str(path), "scipy_"):
        return False
    blas.use_one_thread()  # panels run one per pool thread; no BLAS threads spinning beside them
    return True


_MODULE, STATUS = _load()


def _build_id(module: ModuleType | None) -> str:
    """Which build of the extension loaded (its file's size and modification time): a rebuild changes it."""
    try:
        st = os.stat(module.__file__) if module is not None and module.__file__ else None
    except OSError:
        st = None
    return "none" if st is None else f"{st.st_size}-{st.st_mtime_ns}"


BUILD = _build_id(_MODULE)


def available() -> bool:
    """Whether the native kernels loaded."""
    return _MODULE is not None


def supports(quant: QuantSpec) -> bool:
    """Whether the native kernels multiply matrices stored as ``quant`` (affine 2-8 bit, any group of 8k; mxfp4)."""
    if _MODULE is None:
        return False
    if quant.mode == "mxfp4":
        return (quant.bits, quant.group_size) == (4, 32)
    return quant.mode == "affine" and quant.bits in BITS and quant.group_size % 8 == 0


def keeps(quant: QuantSpec) -> bool:
    """Whether matrices stored as ``quant`` stay as stored here: the native kernels multiply them on the CPU."""
    return supports(quant) and mx.default_device() == mx.cpu


def place_on_huge_pages(
    arrays: list[mx.array], batch_bytes: int, budget_seconds: float, min_bytes: int = 0
) -> tuple[int, int, float]:
    """Move the evaluated ``arrays`` onto transparent huge pages (see :mod:`turbospark_core.placement`).

    Each buffer only these arrays read (an array and its views), dense, is copied once and its
    arrays read the copy, keeping their identity; the old buffers are freed, ``batch_bytes`` at a
    time handed back to the system. Nothing moves where fewer than ``min_bytes`` could. The largest
    go first; once ``budget_seconds`` (> 0) have passed no further buffer starts after the first.
    Returns the bytes moved, the bytes that could move, and the seconds taken; ``(0, 0, 0.0)``
    without the native module.
    """
    if _MODULE is None:
        return 0, 0, 0.0
    moved, movable, seconds = _MODULE.place_on_huge_pages(arrays, batch_bytes, budget_seconds, min_bytes)
    return int(moved), int(movable), float(seconds)


PROLOGUES = ("rms_norm", "silu_mul", "gelu_tanh_mul")
"""What :func:`quantized_matmul` can apply to its input first (``prologue=``)."""


def prologue_supported(x: mx.array, quant: QuantSpec, weight: mx.array | None = None) -> bool:
    """Whether :func:`quantized_matmul` folds a prologue into this product: float32 ``x`` and weight, native."""
    return keeps(quant) and x.dtype == mx.float32 and (weight is None or weight.dtype == mx.float32)


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    quant: QuantSpec,
    residual: mx.array | None = None,
    *,
    prologue: str = "",
    prologue_weight: mx.array | None = None,
    eps: float = 0.0,
    post_norm: tuple[mx.array | None, float] | None = None,
) -> mx.array:
    """``x @ dequantize(w).T`` (``+ residual`` when given): native on the CPU when supported, else MLX's own kernel.

    ``biases=None`` with an affine ``quant``: a symmetric matrix (each bias is
    ``-2^(bits-1)`` times its scale), whose biases the native kernels derive.
    A ``residual`` (the residual stream a projection adds to) is added as the
    product is written, one op instead of two, when ``x`` and it are float32
    of the product's shape; otherwise it is added after (the same result).
    ``prologue`` (one of :data:`PROLOGUES`; check :func:`prologue_supported`
    first): ``x`` goes through :func:`rms_norm` (``prologue_weight``, ``eps``)
    or, a fused gate/up product ``[..., 2K]``, through :func:`silu_mul` /
    :func:`gelu_tanh_mul` inside the product (the same kernels, one op fewer).
    ``post_norm`` (``(weight, eps)``; also :func:`prologue_supported`): each
    row of the product RMS-normalized before the residual is added
    (``residual + rms_norm(x @ W.T)``, a sandwich norm).
    """
    if prologue:
        assert prologue in PROLOGUES and prologue_supported(x, quant, prologue_weight), prologue
    post_weight, post_eps = post_norm if post_norm is not None else (None, 0.0)
    if post_norm is not None:
        assert prologue_supported(x, quant, post_weight), "post_norm"
    if _MODULE is not None and keeps(quant):
        fold = (
            residual is not None
            and x.dtype == residual.dtype == mx.float32
            and residual.shape == (*x.shape[:-1], w.shape[0])
        )
        out: mx.array = _MODULE.quantized_matmul(
            x, w, scales, biases, group_size=quant.group_size, bits=quant.bits, mode=quant.mode,
            residual=residual if fold else None, prologue=prologue, prologue_weight=prologue_weight, eps=eps,
            post_norm=post_norm is not None, post_weight=post_weight, post_eps=post_eps,
        )  # fmt: skip
        return out if fold or residual is None else residual + out
    if biases is None and quant.mode == "affine":
        biases = dequant.symmetric_biases(scales, quant.bits)
    y = mx.quantized_matmul(
        x, w, scales, biases, transpose=True, group_size=quant.group_size, bits=quant.bits, mode=quant.mode
    )
    return y if residual is None else residual + y


def gather_quantized_matmul(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, indices: mx.array, quant: QuantSpec
) -> mx.array:
    """Routed experts: ``mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True)``.

    Native on the CPU when supported (each element's rows of x times its
    expert's stored matrix; a sorted prefill's runs of one expert as one
    many-row product), else MLX's own kernel.
    """
    if _MODULE is not None and keeps(quant):
        out: mx.array = _MODULE.gather_quantized_matmul(
            x, w, scales, biases, indices.astype(mx.uint32), group_size=quant.group_size, bits=quant.bits,
            mode=quant.mode,
        )  # fmt: skip
        return out
    if biases is None and quant.mode == "affine":
        biases = dequant.symmetric_biases(scales, quant.bits)
    return mx.gather_qmm(
        x, w, scales, biases, rhs_indices=indices, transpose=True, group_size=quant.group_size, bits=quant.bits,
        mode=quant.mode,
    )  # fmt: skip


def rope_supported(x: mx.array, offset: int | mx.array) -> bool:
    """Whether :func:`rope` takes ``x`` at ``offset``: float32 ``[B, H, L, D]`` on the CPU, one offset or one a row."""
    if _MODULE is None or x.ndim != 4 or x.dtype != mx.float32 or mx.default_device() != mx.cpu:
        return False
    return isinstance(offset, int) or offset.size in (1, x.shape[0])


def rope(x: mx.array, dims: int, scale: float, offset: int | mx.array, freqs: mx.array) -> mx.array:
    """``mx.fast.rope(x, dims, traditional=False, base=None, scale=scale, offset=offset, freqs=freqs)`` as one op.

    On the CPU MLX builds RoPE from about ten small ops; this is one native op
    (rows of ``x`` read through their strides). Check :func:`rope_supported` first.
    """
    assert _MODULE is not None
    off = mx.array(offset, dtype=mx.int32) if isinstance(offset, int) else offset
    out: mx.array = _MODULE.rope(x, dims, scale, off, freqs)
    return out


MAX_ATTENTION_QUERIES = 65536  # queries per row and head the native attention takes (decode, verify, prefill)


def decode_attention_supported(
    q: mx.array, k: mx.array, v: mx.array, mask: mx.array | str | None = None
) -> bool:
    """Whether :func:`decode_attention` takes these: float32 queries (up to as many as keys), on the CPU.

    ``mask``: none, ``"causal"`` (queries are the last keys), or a boolean
    array that broadcasts to ``[B, H, L, T]`` (a ring's ``[L, T]`` window, a batch's rows).
    """
    if _MODULE is None or mx.default_device() != mx.cpu or q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return False
    if isinstance(mask, str):
        if mask != "causal":
            return False
    elif mask is not None and (mask.dtype != mx.bool_ or not 2 <= mask.ndim <= 4):
        return False
    if not 1 <= q.shape[2] <= min(MAX_ATTENTION_QUERIES, k.shape[2]):
        return False
    return q.dtype == k.dtype == v.dtype == mx.float32 and q.shape[1] % k.shape[1] == 0


def decode_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: mx.array | str | None = None,
    merge_heads: bool = False,
) -> mx.array:
    """``mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)`` as one op.

    On the CPU MLX composes attention from matmuls, a masked softmax with
    scalar exponentials and reshapes (more than half of a 2,000-token
    prefill); this reads the cache's keys and values in place, each query
    alone with vectorized exponentials (so a query's result does not depend
    on how many run together: decode, verify, batch rows and prefill chunks
    alike). ``merge_heads``: the result as ``[B, L, H * Dv]`` (what an output
    projection reads) instead of ``[B, H, L, Dv]``. Check :func:`decode_attention_supported` first.
    """
    assert _MODULE is not None
    causal = isinstance(mask, str)
    array_mask = None if isinstance(mask, str) else mask
    out: mx.array = _MODULE.decode_attention(q, k, v, scale, array_mask, causal, merge_heads)
    return out


def cache_attention_supported(q: mx.array, k: mx.array, v: mx.array, k_buf: mx.array, v_buf: mx.array) -> bool:
    """Whether :func:`cache_attention` takes these: float32 heads and buffers on the CPU, a new row per query."""
    # spelled out rather than looped: it runs for every layer of every decode step
    f32 = mx.float32
    if _MODULE is None or not (q.dtype == f32 and k.dtype == f32 and v.dtype == f32 and k_buf.dtype == f32):
        return False
    if v_buf.dtype != f32 or q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k_buf.ndim != 4 or v_buf.ndim != 4:
        return False
    heads, kv_heads, queries = q.shape[1], k.shape[1], q.shape[2]
    cpu = mx.default_device() == mx.cpu
    return cpu and 1 <= queries <= MAX_ATTENTION_QUERIES and kv_heads > 0 and heads % kv_heads == 0


def cache_attention(
    q: mx.array, k: mx.array, v: mx.array, k_buf: mx.array, v_buf: mx.array, offset: int, scale: float,
    merge_heads: bool = False,
) -> tuple[mx.array, mx.array, mx.array]:
    """A full cache's step as one op: ``k``/``v`` written into the buffers at ``offset``, ``q`` attending causally.

    The L new rows go to rows ``[offset, offset + L)`` of ``k_buf``/``v_buf``
    ``[B, H, S, D]`` (in place when nothing else holds the buffers), and the
    queries attend to the first ``offset + L`` rows as :func:`decode_attention`
    with ``"causal"`` does over them (the same bits). Returns the attention and
    the written buffers. Check :func:`cache_attention_supported` first.
    """
    assert _MODULE is not None
    out, keys, values = _MODULE.cache_attention(q, k, v, k_buf, v_buf, offset, scale, merge_heads)
    return out, keys, values


def cache_attention_copies() -> int:
    """How many buffers :func:`cache_attention` copied because MLX could not hand them over (0 in steady decoding)."""
    return int(_MODULE.cache_attention_copies()) if _MODULE is not None else 0


def decoder_layer_parts_run() -> tuple[int, int, int]:
    """How many :func:`decoder_layer_op` steps ran whole, as their rows and as the rest (steps of 32 tokens
    and more run apart: the rest only where its output is read)."""
    if _MODULE is None:
        return (0, 0, 0)
    whole, rows, rest = _MODULE.decoder_layer_parts_run()
    return int(whole), int(rows), int(rest)


def cache_attention_realigned() -> int:
    """How many buffers :func:`cache_attention` moved once onto a cache line (MLX allocated them off one)."""
    return int(_MODULE.cache_attention_realigned()) if _MODULE is not None else 0


QuantizedMatrix = tuple[mx.array, mx.array, mx.array | None, QuantSpec]
"""A matrix as :func:`quantized_matmul` takes it: ``(w, scales, biases, quant)``."""

LayerStep = Callable[
    [mx.array, mx.array, mx.array, int, mx.array | None, mx.array | None], tuple[mx.array, mx.array, mx.array]
]
"""A layer's step: ``(x, k_buf, v_buf, column, positions, mask) -> (y, k_buf, v_buf)`` (:func:`decoder_layer_op`)."""


def decoder_layer_supported(x: mx.array) -> bool:
    """Whether :func:`decoder_layer_op` takes this step: float32 ``x`` ``[B, L, hidden]`` on the CPU
    (float32 buffers too)."""
    if _MODULE is None or x.dtype != mx.float32 or mx.default_device() != mx.cpu:
        return False
    return x.ndim == 3 and 1 <= x.shape[1] <= MAX_ATTENTION_QUERIES


def decoder_layer_op(
    norms: Sequence[mx.array | None],
    matrices: Sequence[QuantizedMatrix],
    *,
    heads: int,
    kv_heads: int,
    rope: Rope,
    eps: float,
    scale: float,
    activation: str,
    projections: int = 1,
) -> LayerStep:
    """A pre-norm decoder layer's step as one op: ``op(x, k_buf, v_buf, column, positions, mask) -> (y, k_buf, v_buf)``.

    The layer's weights are checked and held once; a step then takes one
    call. ``norms``: the RMSNorm weights ``[input, mlp, post_attention,
    post_mlp, q_head, k_head]`` (``None`` where the layer has none; the
    first two are required). ``matrices``: the q/k/v projection
    (``projections=1``: one fused matrix; ``3``: q, k and v), the output,
    fused gate/up and down projections, each held natively; one more,
    optional: the next layer's first matrix, whose first rows are
    prefetched as this layer ends. A step writes its key and value rows into
    columns ``column..`` of the buffers (in place when nothing else holds
    them), as :func:`cache_attention` writes them, and attends causally to the
    first ``column + L`` columns; or, given ``positions`` (each row's first new
    token's, int32 ``[B]``) and ``mask`` (boolean ``[B, 1, L, column + L]``),
    rotates each row at its positions and attends under the mask (a batch's
    rows, as :func:`decode_attention` with the mask would). Each part is computed by the code
    of its own op (:func:`quantized_matmul` with its prologue, residual and
    post norm, :func:`rope_heads`, :func:`cache_attention`), so ``y`` is
    theirs bit for bit. Check :func:`decoder_layer_supported` for each step.
    """
    assert _MODULE is not None
    w, s, b, q = zip(*matrices, strict=True)
    op: LayerStep = _MODULE.DecoderLayerOp(
        list(norms), list(w), list(s), list(b), [m.group_size for m in q], [m.bits for m in q], [m.mode for m in q],
        projections, rope.freqs, heads=heads, kv_heads=kv_heads, dims=rope.dims, rope_scale=rope.scale,
        mscale=rope.mscale, eps=eps, scale=scale, activation=activation,
    )  # fmt: skip
    return op


def _cpu_float32(*arrays: mx.array) -> bool:
    return _MODULE is not None and mx.default_device() == mx.cpu and all(a.dtype == mx.float32 for a in arrays)


def argmax(x: mx.array) -> mx.array:
    """``mx.argmax(x, axis=-1)``: one native op for float32 on the CPU (long rows split over the threads).

    The same indices (uint32) as MLX's, whose single-threaded scan took 0.28 ms of a decode step
    over Gemma 3's 262144 logits; any other array goes to ``mx.argmax``.
    """
    if not _cpu_float32(x) or x.ndim == 0 or x.shape[-1] == 0:
        return mx.argmax(x, axis=-1)
    assert _MODULE is not None
    out: mx.array = _MODULE.argmax(x)
    return out


def rms_norm_supported(x: mx.array, weight: mx.array | None) -> bool:
    """Whether :func:`rms_norm` takes these: float32 on the CPU, a ``[D]`` weight or none."""
    held = [x] if weight is None else [x, weight]
    return _cpu_float32(*held) and x.ndim >= 1 and (weight is None or weight.shape == (x.shape[-1],))


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """``mx.fast.rms_norm(x, weight, eps)`` as one op (MLX composes three on the CPU).

    Check :func:`rms_norm_supported` first.
    """
    assert _MODULE is not None
    out: mx.array = _MODULE.rms_norm(x, weight, eps)
    return out


def gated_supported(gate: mx.array, up: mx.array | None = None) -> bool:
    """Whether :func:`silu_mul` and :func:`gelu_tanh_mul` take these: float32 arrays of one shape, on the CPU.

    ``up=None``: ``gate`` is a fused gate/up product ``[..., 2n]``.
    """
    if up is None:
        return _cpu_float32(gate) and gate.ndim >= 1 and gate.shape[-1] % 2 == 0
    return _cpu_float32(gate, up) and gate.shape == up.shape and gate.ndim >= 1


def silu_mul(gate: mx.array, up: mx.array | None = None) -> mx.array:
    """``gate * mx.sigmoid(gate) * up`` as one vectorized op (halves of a fused product read in place).

    ``up=None``: ``gate`` is the fused product ``[..., 2n]``, gate's half first
    (no split op). Check :func:`gated_supported` first.
    """
    assert _MODULE is not None
    out: mx.array = _MODULE.silu_mul(gate, up)
    return out


def gelu_tanh_mul(gate: mx.array, up: mx.array | None = None) -> mx.array:
    """``mlx.nn.gelu_approx(gate) * up`` as one vectorized op (``up=None`` as :func:`silu_mul`).

    Check :func:`gated_supported` first.
    """
    assert _MODULE is not None
    out: mx.array = _MODULE.gelu_tanh_mul(gate, up)
    return out


def rope_heads_supported(
    projections: list[mx.array],
    heads: int,
    kv_heads: int,
    offset: int | mx.array,
    norms: tuple[mx.array, mx.array] | None = None,
) -> bool:
    """Whether :func:`rope_heads` takes these: float32 ``[B, L, heads * D]`` projections on the CPU.

    ``projections``: the fused q/k/v product alone, or q, k and v; ``offset``
    one position, or one for each row; ``norms`` none or float32 ``[D]`` each.
    """
    held = [*projections, *(norms or ())]
    if len(projections) not in (1, 3) or not _cpu_float32(*held) or any(p.ndim != 3 for p in projections):
        return False
    counts = [heads + 2 * kv_heads] if len(projections) == 1 else [heads, kv_heads, kv_heads]
    if any(p.shape[-1] % n for p, n in zip(projections, counts, strict=True)):
        return False
    d = projections[0].shape[-1] // counts[0]
    if norms is not None and any(w.shape != (d,) for w in norms):
        return False
    return isinstance(offset, int) or offset.size in (1, projections[0].shape[0])


def rope_heads(
    projections: list[mx.array],
    heads: int,
    kv_heads: int,
    *,
    dims: int,
    scale: float,
    mscale: float,
    offset: int | mx.array,
    freqs: mx.array,
    norms: tuple[mx.array, mx.array] | None = None,
    eps: float = 0.0,
) -> tuple[mx.array, mx.array, mx.array]:
    """Attention's q, k, v heads ``[B, H, L, D]`` from its projections, rotated, as one op.

    ``projections``: the fused q/k/v product ``[B, L, (heads + 2 kv_heads) * D]``
    alone, or ``[q, k, v]`` apart. With ``norms`` (q's and k's ``[D]``
    weights) each q and k head is RMS-normalized first; then the first
    ``dims`` features of q and k are multiplied by ``mscale`` and rotated as
    :func:`rope` does. What MLX composes from a split, three reshapes, three
    transposes, two norms and two RoPEs. Check :func:`rope_heads_supported` first.
    """
    assert _MODULE is not None
    off = mx.array(offset, dtype=mx.int32) if isinstance(offset, int) else offset
    q_norm, k_norm = norms if norms is not None else (None, None)
    q, k, v = _MODULE.rope_heads(projections, heads, kv_heads, dims, scale, mscale, off, freqs, q_norm, k_norm, eps)
    return q, k, v


def kv_place_supported(*buffers: mx.array) -> bool:
    """Whether :func:`kv_place` takes these: ``[B, H, S, D]`` buffers on the CPU, of one dtype of 2 or 4 bytes
    (float32, float16, bfloat16, a quantized row's uint32 codes)."""
    if _MODULE is None or mx.default_device() != mx.cpu or not buffers:
        return False
    dtype = buffers[0].dtype
    return dtype.size in (2, 4) and all(b.ndim == 4 and b.dtype == dtype for b in buffers)


def kv_place(
    parts: Sequence[mx.array], moves: Sequence[tuple[int, int, int, int, int, int]], rows: int, capacity: int
) -> mx.array:
    """A batch cache buffer ``[rows, H, capacity, D]`` (the parts' dtype) laid out anew, one op.

    Each move ``(to, part, row, begin, end, dst)`` copies columns
    ``[begin, end)`` of row ``row`` of ``parts[part]`` to row ``to`` from
    column ``dst`` (a row's moves must not overlap); every other value is
    zero. Whole pages of those zeros are never written (the kernel maps them
    zero on first read and gives memory only on first write), so a batch's
    left padding and its room to grow cost no memory until used. Check
    :func:`kv_place_supported` first.
    """
    assert _MODULE is not None
    out: mx.array = _MODULE.kv_place(list(parts), [tuple(m) for m in moves], rows, capacity)
    return out


def kv_place_unwritten() -> int:
    """Bytes of :func:`kv_place`'s zeros left as unwritten pages in this process (tests read it)."""
    return 0 if _MODULE is None else int(_MODULE.kv_place_unwritten())


def kv_rows_supported(w: mx.array, scales: mx.array) -> bool:
    """Whether :func:`kv_rows` takes these: quantized KV rows on the CPU (groups a multiple of 8)."""
    if _MODULE is None or mx.default_device() != mx.cpu or w.ndim < 1 or scales.ndim != w.ndim:
        return False
    return w.dtype == mx.uint32 and scales.shape[-1] > 0


def kv_rows(w: mx.array, scales: mx.array, biases: mx.array | None, bits: int, rotated: bool) -> mx.array:
    """Quantized KV rows as float32 (``rotated``: then each row's normalized Hadamard transform), one op.

    ``mx.dequantize`` (and ``mx.hadamard_transform``) row by row, reading a
    cache buffer's slice in place. Check :func:`kv_rows_supported` first.
    """
    assert _MODULE is not None
    out: mx.array = _MODULE.kv_rows(w, scales, biases, bits, rotated)
    return out
