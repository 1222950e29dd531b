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


def test_opt_out_and_late_import_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(blas.OFF_ENV, "reference")
    assert "reference" in blas._activate()
    monkeypatch.delenv(blas.OFF_ENV)
    if sys.platform.startswith("linux"):
        assert "imported before turbospark_core" in blas._activate()  # mlx is imported by now
