"""The BLAS shim: MLX's CPU matmuls go to OpenBLAS and stay correct for every operand layout."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core import blas


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the shim exists for MLX's Linux CPU wheel only")
def test_shim_is_active_on_linux() -> None:
    assert blas.STATUS.startswith("OpenBLAS"), blas.STATUS


@pytest.mark.parametrize("m", [1, 2, 17])
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
def test_matmul_matches_numpy(m: int, transpose_a: bool, transpose_b: bool) -> None:
    rng = np.random.default_rng(m)
    k, n = 37, 53
    a = rng.standard_normal((k, m) if transpose_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if transpose_b else (k, n)).astype(np.float32)
    ma, mb = mx.array(a), mx.array(b)
    got = (ma.T if transpose_a else ma) @ (mb.T if transpose_b else mb)
    want = (a.T if transpose_a else a) @ (b.T if transpose_b else b)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)


def test_batched_and_addmm_match_numpy() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 1, 64)).astype(np.float32)
    w = rng.standard_normal((96, 64)).astype(np.float32)
    bias = rng.standard_normal((96,)).astype(np.float32)
    got = mx.addmm(mx.array(bias), mx.array(x), mx.array(w).T)
    np.testing.assert_allclose(np.array(got), x @ w.T + bias, rtol=1e-5, atol=1e-5)


def test_opt_out_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(blas.OFF_ENV, "reference")
    assert "reference" in blas._activate()
    assert blas.openblas_path() is None


_ORDER_CHILD = """
import sys
if sys.argv[1] == "mlx-first":
    import mlx.core as mx
    a = mx.ones((64, 64))
    mx.eval(a @ a)  # MLX's BLAS slot is bound (to the reference BLAS) before turbospark loads
import turbospark_core
from turbospark_core import blas
import mlx.core as mx
before = blas.routed_calls()
a = mx.random.normal((96, 80))
mx.eval(a @ a.T)
print(blas.ROUTE, blas.routed_calls() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the shim exists for MLX's Linux CPU wheel only")
@pytest.mark.parametrize(("order", "route"), [("turbospark-first", "preloaded"), ("mlx-first", "patched")])
def test_import_order_does_not_matter(order: str, route: str) -> None:
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _ORDER_CHILD, order], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    assert out == [route, "1"], out  # the product went through the shim (to OpenBLAS) either way
