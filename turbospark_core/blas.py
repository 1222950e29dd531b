"""Make MLX's CPU matmuls use an optimized BLAS, whatever the import order.

MLX's Linux CPU wheel links a reference BLAS (~2 GFLOP/s). At import,
turbospark loads a small shim (built at install) that defines the ``cblas_*gemm``
symbols MLX calls and forwards them to OpenBLAS from the ``scipy-openblas32``
wheel. Loaded before MLX, the shim's symbols win at MLX's load; when MLX was
imported first, the shim rewrites the loaded libmlx's slots for those symbols
(its GOT) instead. ``TURBOSPARK_BLAS=reference`` turns it off. :data:`STATUS`
says what happened, for ``turbospark inspect``; :data:`ROUTE` names the path.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from pathlib import Path

OFF_ENV = "TURBOSPARK_BLAS"
STATUS = "not attempted"
ROUTE = "none"  # "preloaded" (before mlx), "patched" (mlx loaded first) or "none"
_SHIM: ctypes.CDLL | None = None


def _shim_path() -> Path | None:
    here = Path(__file__).parent / "_native"
    found = sorted(here.glob("_blas_shim*.so"))
    return found[0] if found else None


def openblas_path() -> Path | None:
    """The OpenBLAS library of the ``scipy-openblas32`` wheel, when installed and not turned off."""
    if os.environ.get(OFF_ENV, "").lower() == "reference":
        return None
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(spec.submodule_search_locations[0], "lib").glob("libscipy_openblas*.so*"))
    return found[0] if found else None


def _threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return int(os.environ.get("OPENBLAS_NUM_THREADS", cores))


def _set_threads(openblas: Path) -> None:
    lib = ctypes.CDLL(str(openblas), mode=ctypes.RTLD_LOCAL)
    setter = getattr(lib, "scipy_openblas_set_num_threads", None)
    if setter is not None:
        # every core this process may use (decode step 1.4x faster with 2 than 1 here);
        # OPENBLAS_NUM_THREADS overrides, e.g. 1 on an oversubscribed machine
        setter(_threads())


def use_one_thread() -> bool:
    """Run OpenBLAS on one thread per call (the native kernels' pool spreads work instead).

    Kept as set when ``OPENBLAS_NUM_THREADS`` is given. Returns whether it now runs one thread.
    """
    openblas = openblas_path()
    if openblas is None or "OPENBLAS_NUM_THREADS" in os.environ:
        return False
    setter = getattr(ctypes.CDLL(str(openblas), mode=ctypes.RTLD_LOCAL), "scipy_openblas_set_num_threads", None)
    if setter is None:
        return False
    setter(1)
    return True


def activate() -> str:
    """Load the shim (once). Returns and records a one-line status."""
    global STATUS
    if STATUS != "not attempted":
        return STATUS
    STATUS = _activate()
    return STATUS


def routed_calls() -> int:
    """How many single-precision products went through the shim so far (0 when inactive)."""
    return 0 if _SHIM is None else int(_SHIM.turbospark_blas_calls())


def _activate() -> str:
    global ROUTE, _SHIM
    if os.environ.get(OFF_ENV, "").lower() == "reference":
        return f"reference BLAS ({OFF_ENV}=reference)"
    if not sys.platform.startswith("linux"):
        return "platform BLAS (not Linux)"
    mlx_first = "mlx.core" in sys.modules
    shim, openblas = _shim_path(), openblas_path()
    if shim is None or openblas is None:
        missing = "the BLAS shim (not built at install)" if shim is None else "scipy-openblas32"
        return f"reference BLAS: {missing} is missing"
    lib = ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL)
    if not lib.turbospark_blas_bind(str(openblas).encode(), b"scipy_"):
        return f"reference BLAS: could not bind {openblas.name}"
    lib.turbospark_blas_calls.restype = ctypes.c_long
    _set_threads(openblas)
    _SHIM = lib
    if not mlx_first:
        ROUTE = "preloaded"
        return f"OpenBLAS ({openblas.name}) via the turbospark BLAS shim"
    patched = lib.turbospark_blas_patch(b"libmlx")
    if patched <= 0:
        return "reference BLAS: mlx was imported first and its BLAS calls could not be redirected"
    ROUTE = "patched"
    return f"OpenBLAS ({openblas.name}) via the turbospark BLAS shim (patched into the already loaded mlx)"
