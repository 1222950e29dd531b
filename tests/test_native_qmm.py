"""Native quantized matmul: equal to MLX's own kernel, in eager, compiled and async use; fallback when off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core import native
from turbospark_core.tensor_index import QuantSpec

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: {native.STATUS}")


def _case(n: int, k: int, m: int, bits: int, group: int, dtype: mx.Dtype, seed: int = 0):
    key = mx.random.key(seed)
    kw, kx = mx.random.split(key)
    w, s, b = mx.quantize(mx.random.normal((n, k), key=kw).astype(dtype), group_size=group, bits=bits)
    x = mx.random.normal((m, k), key=kx)
    return x, w, s, b


def _reference(x, w, s, b, group: int, bits: int) -> np.ndarray:
    s, b = s.astype(mx.float32), b.astype(mx.float32)
    y = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group, bits=bits)
    return np.array(y)


def _close(got: mx.array, want: np.ndarray) -> None:
    # float32 rounding: the sums run in another order than MLX's
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.array(got), want, rtol=0, atol=2e-6 * scale * np.sqrt(want.shape[-1]) + 1e-6)


@needs_native
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 3, 7, 16, 40])
def test_equals_mlx_quantized_matmul(bits: int, group: int, m: int) -> None:
    x, w, s, b = _case(72, 256, m, bits, group, mx.float16)
    got = native.quantized_matmul(x, w, s, b, QuantSpec(bits=bits, group_size=group))
    assert got.shape == (m, 72) and got.dtype == mx.float32
    _close(got, _reference(x, w, s, b, group, bits))


@needs_native
@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 64), (8, 32), (8, 128)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 9])
def test_row_tails_and_wide_rows(bits: int, group: int, m: int) -> None:
    # 75 weight rows: blocks of 4 or 2 rows and their tails; 1152 columns: more than 16 groups per row
    x, w, s, b = _case(75, 1152, m, bits, group, mx.float16, seed=3)
    got = native.quantized_matmul(x, w, s, b, QuantSpec(bits=bits, group_size=group))
    _close(got, _reference(x, w, s, b, group, bits))


@needs_native
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("m", [2, 3, 5, 8, 13, 16])
def test_a_row_of_x_gets_the_same_result_in_any_tile(bits: int, m: int) -> None:
    # batched decode and verify: a row's product does not depend on the rows beside it, bit for bit
    x, w, s, b = _case(75, 576, m, bits, 32, mx.float16, seed=5)
    spec = QuantSpec(bits=bits, group_size=32)
    together = np.array(native.quantized_matmul(x, w, s, b, spec))
    for i in range(m):
        alone = np.array(native.quantized_matmul(x[i : i + 1], w, s, b, spec))
        np.testing.assert_array_equal(together[i : i + 1], alone)


def _narrow_case(n: int, k: int, m: int, bits: int, scale_dtype: type, seed: int = 0):
    """A group-16 matrix (GGUF K-quant sub-blocks; mx.quantize refuses the group) and its unpacked fallback."""
    from turbospark_core.convert.gguf_reader import _pack
    from turbospark_core.dequant import dequantize

    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2**bits, (n, k // 16, 16), dtype=np.uint8)
    s = mx.array(rng.uniform(-0.05, 0.05, (n, k // 16)).astype(scale_dtype))
    b = mx.array(rng.uniform(-0.5, 0.5, (n, k // 16)).astype(scale_dtype))
    w = mx.array(_pack(codes, bits))
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
    spec = QuantSpec(bits=bits, group_size=16)
    return x, w, s, b, spec, np.array(x @ dequantize(w, s, b, spec, mx.float32).T)


@needs_native
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("m", [*range(1, 17), 17, 33])
def test_group_16_equals_the_unpacked_fallback(bits: int, m: int) -> None:
    # 75 weight rows (row tails); 1280 columns: 80 groups of 16, more than 16 groups per row
    x, w, s, b, spec, want = _narrow_case(75, 1280, m, bits, np.float32, seed=bits * 100 + m)
    got = native.quantized_matmul(x, w, s, b, spec)
    assert got.shape == (m, 75) and got.dtype == mx.float32
    _close(got, want)


@needs_native
@pytest.mark.parametrize("bits", [2, 4, 6, 8])
@pytest.mark.parametrize("m", [1, 5])
def test_group_16_rows_of_odd_group_counts_and_half_scales(bits: int, m: int) -> None:
    # 272 columns: 17 groups of 16, not whole groups of 32 (even bits only: odd ones would not fill words)
    x, w, s, b, spec, want = _narrow_case(40, 272, m, bits, np.float16, seed=bits)
    _close(native.quantized_matmul(x, w, s, b, spec), want)


@needs_native
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("m", [1, 8, 40])
def test_symmetric_matrices_need_no_biases(bits: int, m: int) -> None:
    from turbospark_core._native import _qmm

    # GGUF's Q8_0/Q4_0/Q5_0/Q6_K/Q3_K blocks: every bias is -2^(bits-1) * its scale, so the kernels derive it
    x, w, s, _ = _case(70, 640, m, bits, 32, mx.float16, seed=9)
    b = s * -(2 ** (bits - 1))
    with_biases = np.array(_qmm.quantized_matmul(x, w, s, b, group_size=32, bits=bits))
    without = np.array(_qmm.quantized_matmul(x, w, s, None, group_size=32, bits=bits))
    np.testing.assert_array_equal(without, with_biases)


@needs_native
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_scale_dtypes_and_batched_input(dtype: mx.Dtype) -> None:
    x, w, s, b = _case(40, 128, 6, 4, 32, dtype)
    x3 = x.reshape(2, 3, 128)
    got = native.quantized_matmul(x3, w, s, b, QuantSpec(bits=4, group_size=32))
    assert got.shape == (2, 3, 40)
    _close(got.reshape(6, 40), _reference(x, w, s, b, 32, 4))


@needs_native
@pytest.mark.parametrize("path", ["native", "blas"])
@pytest.mark.parametrize(
    ("n", "k", "m", "bits", "group"),
    [
        (1000, 512, 33, 4, 64),
        (75, 576, 17, 5, 32),
        (130, 1152, 50, 8, 32),
        (64, 640, 255, 6, 32),
        (70, 96, 23, 3, 32),
        (33, 128, 19, 2, 128),
    ],
)
def test_large_m_products(path: str, n: int, k: int, m: int, bits: int, group: int) -> None:
    from turbospark_core._native import _qmm

    # more activation rows than the row kernels take: panels of weight rows (and their tails) through
    # the native GEMM (rows of x in tiles of 6 and the rest) or through sgemm
    if path == "blas" and not _qmm.has_blas():
        pytest.skip("no BLAS bound for the panel path")
    if path == "native" and _qmm.kernel() not in {"avx512", "neon"}:
        pytest.skip("the native GEMM is AVX-512's and NEON's")
    x, w, s, b = _case(n, k, m, bits, group, mx.float16)
    before = _qmm.gemm_path()
    _qmm.set_gemm_path(path)
    try:
        assert _qmm.gemm_path() == path
        got = native.quantized_matmul(x, w, s, b, QuantSpec(bits=bits, group_size=group))
        _close(got, _reference(x, w, s, b, group, bits))
    finally:
        _qmm.set_gemm_path(before)


@needs_native
def test_non_contiguous_input_and_half_activations() -> None:
    x, w, s, b = _case(24, 64, 8, 8, 32, mx.float16)
    xt = mx.array(np.array(x).T.copy()).T  # a transposed view
    _close(native.quantized_matmul(xt, w, s, b, QuantSpec(bits=8, group_size=32)), _reference(x, w, s, b, 32, 8))
    got = native.quantized_matmul(x.astype(mx.bfloat16), w, s, b, QuantSpec(bits=8, group_size=32))
    assert got.dtype == mx.bfloat16


@needs_native
def test_compiled_and_async() -> None:
    x, w, s, b = _case(48, 128, 1, 4, 32, mx.float16)
    spec = QuantSpec(bits=4, group_size=32)
    want = _reference(x, w, s, b, 32, 4)
    step = mx.compile(lambda v: mx.maximum(native.quantized_matmul(v, w, s, b, spec), 0.0))
    _close(step(x), np.maximum(want, 0.0))
    y = native.quantized_matmul(x, w, s, b, spec) * 2.0
    mx.async_eval(y)
    _close(y, want * 2.0)


@needs_native
def test_odd_shapes_are_refused() -> None:
    from turbospark_core._native import _qmm

    x, w, s, b = _case(16, 64, 1, 4, 32, mx.float32)
    with pytest.raises(ValueError, match="last dimension"):
        _qmm.quantized_matmul(x[:, :32], w, s, b, group_size=32, bits=4)
    with pytest.raises(ValueError, match="bits"):
        _qmm.quantized_matmul(x, w, s, b, group_size=32, bits=7)
    with pytest.raises(ValueError, match="scales"):
        _qmm.quantized_matmul(x, w, s[:, :1], b[:, :1], group_size=32, bits=4)


@needs_native
@pytest.mark.parametrize("m", [1, 5, 20])
def test_mxfp4_equals_mlx(m: int) -> None:
    # gpt-oss's experts: e2m1 codes times uint8 power-of-two scales (the lookup tables are e2m1 values times the scale)
    spec = QuantSpec(bits=4, group_size=32, mode="mxfp4")
    assert native.supports(spec)
    w, s = mx.quantize(mx.random.normal((75, 640)) * 4, group_size=32, bits=4, mode="mxfp4")
    x = mx.random.normal((m, 640))
    dense = mx.dequantize(w, s, None, group_size=32, bits=4, mode="mxfp4").astype(mx.float32)
    _close(native.quantized_matmul(x, w, s, None, spec), np.array(x @ dense.T))


@needs_native
@pytest.mark.parametrize(
    ("mode", "bits", "group"), [("affine", 4, 32), ("affine", 8, 64), ("affine", 6, 16), ("mxfp4", 4, 32)]
)
def test_gathered_experts_equal_mlx(mode: str, bits: int, group: int) -> None:
    # routed experts: each token's rows times its chosen experts' matrices (decode: broadcast x over k choices;
    # a prefill's sorted path: runs of one expert as one many-row product)
    spec = QuantSpec(bits=bits, group_size=group, mode=mode)
    w = mx.random.normal((6, 40, 128), key=mx.random.key(bits))
    if mode == "mxfp4":
        (wq, s), b = mx.quantize(w, group_size=32, bits=4, mode="mxfp4"), None
        dense = mx.dequantize(wq, s, None, group_size=32, bits=4, mode="mxfp4").astype(mx.float32)
    else:
        from turbospark_core.dequant import dequantize

        wq, s, b = mx.quantize(w, group_size=max(group, 32), bits=bits)
        if group == 16:  # a narrow group: scales per 16 values
            s, b = mx.repeat(s, 2, axis=-1), mx.repeat(b, 2, axis=-1)
        dense = dequantize(wq, s, b, spec, mx.float32)
    x = mx.random.normal((5, 1, 1, 128))
    idx = mx.array(np.random.default_rng(0).integers(0, 6, (5, 3)).astype(np.uint32))
    want = mx.stack([mx.stack([x[t, 0, 0] @ dense[int(e)].T for e in idx[t].tolist()]) for t in range(5)])
    got = native.gather_quantized_matmul(x, wq, s, b, idx, spec)
    assert got.shape == (5, 3, 1, 40)
    _close(got[:, :, 0], np.array(want))
    rows = mx.random.normal((40, 1, 128))
    order = mx.array(np.sort(np.random.default_rng(1).integers(0, 6, 40)).astype(np.uint32))
    want = mx.stack([rows[p, 0] @ dense[int(e)].T for p, e in enumerate(order.tolist())])
    _close(native.gather_quantized_matmul(rows, wq, s, b, order, spec)[:, 0], np.array(want))


_CHILD = """
import os, sys
os.environ.update({env!r})
from turbospark_core import native
import mlx.core as mx
from turbospark_core.tensor_index import QuantSpec
from turbospark_core.compute import ComputePolicy
w, s, b = mx.quantize(mx.random.normal((32, 64)), group_size=32, bits=4)
x = mx.random.normal((2, 64))
y = native.quantized_matmul(x, w, s, b, QuantSpec(bits=4, group_size=32))
ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=32, bits=4)
policy = ComputePolicy.choose(unpacked_bytes=1, stored_bytes=1, budget=10)
print(native.available(), policy.native, mx.allclose(y, ref, rtol=1e-5, atol=1e-5).item())
print(native.STATUS)
print(policy.reason)
"""


@pytest.mark.parametrize("env", [{"TURBOSPARK_NATIVE": "0"}, {"TURBOSPARK_NATIVE_SCALAR": "1"}])
def test_fallbacks_in_a_fresh_process(env: dict[str, str]) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD.format(env=env)], capture_output=True, text=True, check=True, timeout=120
    ).stdout.splitlines()
    if "TURBOSPARK_NATIVE" in env:
        assert out[0] == "False False True"
        assert "TURBOSPARK_NATIVE=0" in out[1] and "TURBOSPARK_NATIVE=0" in out[2]
    elif native.available():
        assert out[0] == "True True True"
        assert "native scalar kernels" in out[1]


KERNEL_SETS = {"avx2": {"TURBOSPARK_NATIVE_NO_AVX512": "1"}, "scalar": {"TURBOSPARK_NATIVE_SCALAR": "1"}}


@needs_native
@pytest.mark.parametrize("kernels", sorted(KERNEL_SETS))
def test_every_kernel_set_equals_mlx(kernels: str) -> None:
    """The kernel sets this CPU does not pick by default pass the same equality tests, in a fresh process."""
    env = {**os.environ, **KERNEL_SETS[kernels]}
    tests = [
        "tests/test_native_qmm.py::test_equals_mlx_quantized_matmul",
        "tests/test_native_qmm.py::test_row_tails_and_wide_rows",
        "tests/test_native_qmm.py::test_a_row_of_x_gets_the_same_result_in_any_tile",
        "tests/test_native_qmm.py::test_group_16_equals_the_unpacked_fallback",
        "tests/test_native_qmm.py::test_group_16_rows_of_odd_group_counts_and_half_scales",
        "tests/test_native_qmm.py::test_a_residual_is_added_as_the_product_is_written",
        "tests/test_native_qmm.py::test_a_prologue_equals_the_op_it_stands_for",
        "tests/test_native_qmm.py::test_a_post_norm_equals_the_norm_after_the_product",
        "tests/test_native_ops.py",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        capture_output=True, text=True, env=env, timeout=300, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 3, 40])
def test_a_residual_is_added_as_the_product_is_written(bits: int, m: int) -> None:
    # row kernels (few rows) and the many-row paths alike: the same bits as the product plus the residual
    x, w, s, b = _case(200, 256, m, bits, 32, mx.float16, seed=5)
    r = mx.random.normal((m, 200), key=mx.random.key(6))
    spec = QuantSpec(bits=bits, group_size=32)
    want = np.array(r + native.quantized_matmul(x, w, s, b, spec))
    assert np.array_equal(np.array(native.quantized_matmul(x, w, s, b, spec, residual=r)), want)
    step = mx.compile(lambda a, res: native.quantized_matmul(a, w, s, b, spec, residual=res))
    assert np.array_equal(np.array(step(x, r)), want)
    # a residual the product cannot take in place (half precision, broadcast) is added after: the same sum
    half = native.quantized_matmul(x.astype(mx.float16), w, s, b, spec, residual=r.astype(mx.float16))
    np.testing.assert_allclose(np.array(half), want, rtol=2e-3, atol=2e-2 * np.abs(want).max())
    row = native.quantized_matmul(x, w, s, b, spec, residual=r[:1])
    assert np.array_equal(np.array(row), np.array(r[:1] + native.quantized_matmul(x, w, s, b, spec)))


@needs_native
def test_a_residual_of_another_shape_is_refused() -> None:
    from turbospark_core._native import _qmm

    x, w, s, b = _case(16, 64, 2, 4, 32, mx.float32)
    with pytest.raises(ValueError, match="a residual needs float32 x and a float32 residual of the product's shape"):
        _qmm.quantized_matmul(x, w, s, b, group_size=32, bits=4, residual=mx.zeros((1, 16)))


@needs_native
@pytest.mark.parametrize("prologue", ["rms_norm", "rms_norm-unweighted", "silu_mul", "gelu_tanh_mul"])
@pytest.mark.parametrize("m", [1, 3, 40])
def test_a_prologue_equals_the_op_it_stands_for(prologue: str, m: int) -> None:
    # the norm or gated activation inside the product runs the same kernels as the op before it: bit for bit
    x, w, s, b = _case(200, 256, m, 4, 32, mx.float16, seed=7)
    spec = QuantSpec(bits=4, group_size=32)
    r = mx.random.normal((m, 200), key=mx.random.key(8))
    if prologue.startswith("rms_norm"):
        weight = None if prologue.endswith("unweighted") else mx.random.normal((256,), key=mx.random.key(9))
        x_in, before = x * 3, native.rms_norm(x * 3, weight, 1e-5)
        kwargs = {"prologue": "rms_norm", "prologue_weight": weight, "eps": 1e-5}
    else:
        x_in = mx.random.normal((m, 512), key=mx.random.key(10)) * 4  # a fused gate/up product
        before = native.silu_mul(x_in) if prologue == "silu_mul" else native.gelu_tanh_mul(x_in)
        kwargs = {"prologue": prologue}
    assert native.prologue_supported(x_in, spec, kwargs.get("prologue_weight"))
    want = native.quantized_matmul(before, w, s, b, spec)
    assert np.array_equal(np.array(native.quantized_matmul(x_in, w, s, b, spec, **kwargs)), np.array(want))
    step = mx.compile(lambda a, res: native.quantized_matmul(a, w, s, b, spec, res, **kwargs))
    assert np.array_equal(np.array(step(x_in, r)), np.array(r + want))


@needs_native
def test_prologue_refusals() -> None:
    from turbospark_core._native import _qmm

    x, w, s, b = _case(16, 64, 2, 4, 32, mx.float32)
    assert not native.prologue_supported(x.astype(mx.float16), QuantSpec(bits=4, group_size=32))
    assert not native.prologue_supported(x, QuantSpec(bits=4, group_size=32), mx.ones((64,), mx.float16))
    with pytest.raises(ValueError, match="twice them: a fused gate/up input"):
        _qmm.quantized_matmul(x, w, s, b, group_size=32, bits=4, prologue="silu_mul")
    with pytest.raises(ValueError, match="prologue must be"):
        _qmm.quantized_matmul(x, w, s, b, group_size=32, bits=4, prologue="relu")
    with pytest.raises(ValueError, match=r"the rms_norm prologue's weight must be float32 \[K\]"):
        _qmm.quantized_matmul(x, w, s, b, group_size=32, bits=4, prologue="rms_norm", prologue_weight=mx.ones((8,)))
    with pytest.raises(ValueError, match="only the rms_norm prologue takes a weight"):
        _qmm.quantized_matmul(
            mx.concatenate([x, x], axis=-1), w, s, b, group_size=32, bits=4, prologue="silu_mul",
            prologue_weight=mx.ones((64,)),
        )  # fmt: skip


@needs_native
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("m", [1, 3, 40])
def test_a_post_norm_equals_the_norm_after_the_product(weighted: bool, m: int) -> None:
    # each row of the product normalized by the rms_norm kernel, then the residual added: bit for bit
    x, w, s, b = _case(200, 256, m, 4, 32, mx.float16, seed=11)
    spec = QuantSpec(bits=4, group_size=32)
    weight = mx.random.normal((200,), key=mx.random.key(12)) if weighted else None
    r = mx.random.normal((m, 200), key=mx.random.key(13))
    normed = native.rms_norm(native.quantized_matmul(x, w, s, b, spec), weight, 1e-6)
    got = native.quantized_matmul(x, w, s, b, spec, post_norm=(weight, 1e-6))
    assert np.array_equal(np.array(got), np.array(normed))
    step = mx.compile(lambda a, res: native.quantized_matmul(a, w, s, b, spec, res, post_norm=(weight, 1e-6)))
    assert np.array_equal(np.array(step(x, r)), np.array(r + normed))
    gate_up = mx.random.normal((m, 512), key=mx.random.key(14))  # with a prologue too: down of a GeGLU
    both = native.quantized_matmul(gate_up, w, s, b, spec, r, prologue="gelu_tanh_mul", post_norm=(weight, 1e-6))
    want = r + native.rms_norm(native.quantized_matmul(native.gelu_tanh_mul(gate_up), w, s, b, spec), weight, 1e-6)
    assert np.array_equal(np.array(both), np.array(want))


@needs_native
def test_post_norm_refusals() -> None:
    from turbospark_core._native import _qmm

    x, w, s, b = _case(16, 64, 2, 4, 32, mx.float32)
    with pytest.raises(ValueError, match=r"the post norm's weight must be float32 \[N\]"):
        _qmm.quantized_matmul(x, w, s, b, group_size=32, bits=4, post_norm=True, post_weight=mx.ones((64,)))
    with pytest.raises(ValueError, match="a post_weight needs post_norm"):
        _qmm.quantized_matmul(x, w, s, b, group_size=32, bits=4, post_weight=mx.ones((16,)))
    with pytest.raises(ValueError, match="a post norm needs float32 x"):
        _qmm.quantized_matmul(x.astype(mx.float16), w, s, b, group_size=32, bits=4, post_norm=True)
