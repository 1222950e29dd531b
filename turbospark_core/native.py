"""Native CPU kernels for quantized matrices (an MLX custom primitive built at install).

With the extension, quantized weights stay quantized on the CPU and multiply
through :func:`quantized_matmul` (AVX2/FMA or portable kernels, a thread pool
that sleeps when idle). Without it (not built, built against another MLX, or
``TURBOSPARK_NATIVE=0``) the compute policy unpacks them as before;
:data:`STATUS` says which, for ``turbospark inspect`` and the runner's stats.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import mlx.core as mx  # before the extension: it finds libmlx because mlx loaded it

from turbospark_core.tensor_index import QuantSpec

OFF_ENV = "TURBOSPARK_NATIVE"
BITS = frozenset({2, 3, 4, 5, 6, 8})
MLX_VERSION: str = mx.__version__  # type: ignore[attr-defined]  # the stubs omit it


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get(OFF_ENV, "1").lower() in {"0", "off", "false", "no"}:
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
    panels = _bind_blas(_qmm) and _qmm.gemm_min_rows() < 2**62
    gemm = f", dequantized panels through OpenBLAS from {_qmm.gemm_min_rows()} rows" if panels else ""
    return _qmm, f"native {_qmm.kernel()} kernels, {_qmm.threads()} threads{gemm}"


def _bind_blas(module: ModuleType) -> bool:
    from turbospark_core import blas

    path = blas.openblas_path()
    if path is None or not module.bind_blas(str(path), "scipy_"):
        return False
    blas.use_one_thread()  # panels run one per pool thread; no BLAS threads spinning beside them
    return True


_MODULE, STATUS = _load()


def available() -> bool:
    """Whether the native kernels loaded."""
    return _MODULE is not None


def supports(quant: QuantSpec) -> bool:
    """Whether the native kernels multiply matrices stored as ``quant``."""
    return _MODULE is not None and quant.mode == "affine" and quant.bits in BITS and quant.group_size % 8 == 0


def quantized_matmul(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, quant: QuantSpec
) -> mx.array:
    """``x @ dequantize(w).T``: native on the CPU when supported, else MLX's own kernel."""
    if _MODULE is not None and biases is not None and supports(quant) and mx.default_device() == mx.cpu:
        out: mx.array = _MODULE.quantized_matmul(x, w, scales, biases, group_size=quant.group_size, bits=quant.bits)
        return out
    return mx.quantized_matmul(
        x, w, scales, biases, transpose=True, group_size=quant.group_size, bits=quant.bits, mode=quant.mode
    )
