"""Which quantized layouts stay quantized on the CPU: chosen per layout by measured speed.

The native kernels (:mod:`turbospark_core.native`) multiply a quantized matrix as
stored; the alternative is to unpack it to float32 at open and multiply through
the BLAS. With AVX-512 the native kernels win every layout (they read 4-8x fewer
bytes); with AVX2 some layouts lose, the portable scalar kernels lose all of them,
and NEON has never been timed. So the first time a
machine meets a layout (mode, bits, group), one decode-shaped product (one row
of x times a ``ROWS x COLS`` matrix) is timed both ways and the layout stays
quantized unless float32 is more than ``MARGIN`` times faster. The margin keeps
the choice stable under load: a close call keeps the smaller, stored form.

The timings are kept per machine (the kernel set, its threads, the MLX version
and the CPU) in ``$XDG_CACHE_HOME/turbospark/kernel-speed.json`` (or
``$TURBOSPARK_CACHE_DIR``), so later opens only read them; an unreadable or
foreign file is measured over. ``TURBOSPARK_KERNEL_CHOICE=native`` or ``float``
decides without measuring (the test suite pins ``native``, so that which kernel
runs never depends on the load of the machine running it).

The choice only applies where the compute policy unpacks (weights fit in float32);
under the stored-form policy the native kernels multiply every layout they take.
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import mlx.core as mx

from turbospark_core import dequant, native
from turbospark_core.errors import OptionError
from turbospark_core.tensor_index import QuantSpec

CHOICE_ENV = "TURBOSPARK_KERNEL_CHOICE"
CACHE_ENV = "TURBOSPARK_CACHE_DIR"
CHOICES = ("measure", "native", "float")
MARGIN = 1.25  # float32 must be this many times faster before a layout is unpacked
ROWS, COLS = 2048, 4096  # 32 MB in float32: past the private caches, as a decode step's weights are
TRIALS = 7
_FILE = "kernel-speed.json"


@attrs.frozen
class LayoutSpeed:
    """One layout's decode-shaped product, timed both ways (milliseconds, the fastest of alternating trials)."""

    quant: QuantSpec
    native_ms: float
    float_ms: float

    @property
    def native(self) -> bool:
        """Whether the layout stays quantized: float32 is not ``MARGIN`` times faster."""
        return self.float_ms * MARGIN >= self.native_ms

    def describe(self) -> str:
        kept = "stays quantized" if self.native else "unpacked to float32"
        return f"{layout_name(self.quant)}: native {self.native_ms:.2f} ms, float32 {self.float_ms:.2f} ms, {kept}"


def layout_name(quant: QuantSpec) -> str:
    if quant.mode == "affine":
        return f"affine {quant.bits}-bit g{quant.group_size}"
    return f"{quant.mode} g{quant.group_size}"


def choice() -> str:
    """``TURBOSPARK_KERNEL_CHOICE`` (default ``measure``), refused by name when it is none of :data:`CHOICES`."""
    value = os.environ.get(CHOICE_ENV, "measure").strip().lower() or "measure"
    if value not in CHOICES:
        msg = f"{CHOICE_ENV}={value!r} is not one of {', '.join(CHOICES)}; unset it to choose by measured speed"
        raise OptionError(msg)
    return value


def stays_quantized(quant: QuantSpec) -> bool:
    """Whether matrices stored as ``quant`` stay as stored where the policy unpacks:
    the native kernels take the layout, on the CPU, and are not outrun by float32."""
    if not (native.supports(quant) and mx.default_device() == mx.cpu):
        return False
    how = choice()
    if how != "measure":
        return how == "native"
    return speed(quant).native


_SPEEDS: dict[QuantSpec, LayoutSpeed] = {}


def speed(quant: QuantSpec) -> LayoutSpeed:
    """The layout's timings: this process's, else the machine's cache file, else measured now (and saved)."""
    known = _SPEEDS.get(quant)
    if known is None:
        known = _read_cache().get(layout_name(quant))
        if known is None or known.quant != quant:
            known = measure(quant)
            _write_cache(known)
        _SPEEDS[quant] = known
    return known


def measured() -> list[LayoutSpeed]:
    """The layouts this process has chosen for by measurement, for ``turbospark inspect``."""
    return sorted(_SPEEDS.values(), key=lambda s: layout_name(s.quant))


def measure(quant: QuantSpec, rows: int = ROWS, cols: int = COLS) -> LayoutSpeed:
    """Time one row of x times a random ``rows x cols`` matrix stored as ``quant``: native vs unpacked float32."""
    w, scales, biases = _random_matrix(quant, rows, cols)
    weight_t = dequant.dequantize(w, scales, biases, quant, mx.float32).T  # as a float Linear holds it
    x = mx.random.normal((1, cols), key=mx.random.key(1))
    mx.eval(w, scales, biases, weight_t, x)
    native_ms, float_ms = _fastest_ms(
        lambda: native.quantized_matmul(x, w, scales, biases, quant),
        lambda: x @ weight_t,
    )
    return LayoutSpeed(quant=quant, native_ms=native_ms, float_ms=float_ms)


def _random_matrix(quant: QuantSpec, rows: int, cols: int) -> tuple[mx.array, mx.array, mx.array | None]:
    """Packed codes, scales and biases of the layout's shapes (values do not matter to the timing, but stay finite)."""
    words = cols * quant.bits // 32
    w = mx.random.randint(0, 2**31 - 1, (rows, words), key=mx.random.key(2)).astype(mx.uint32)
    groups = cols // quant.group_size
    if quant.mode == "mxfp4":
        return w, mx.random.randint(120, 130, (rows, groups), key=mx.random.key(3)).astype(mx.uint8), None
    scales = (mx.random.uniform(shape=(rows, groups), key=mx.random.key(3)) * 0.01).astype(mx.float16)
    return w, scales, (-8 * scales).astype(mx.float16)


def _fastest_ms(*products: Callable[[], mx.array]) -> list[float]:
    """Each product's fastest of ``TRIALS`` timed runs, the products alternating: another process
    on the machine only ever adds time, so the minimum is the measure that holds under load."""
    for product in products:
        mx.eval(product())  # warm: first-touch pages, the pool's threads
    best = [float("inf")] * len(products)
    for _ in range(TRIALS):
        for i, product in enumerate(products):
            start = time.perf_counter()
            mx.eval(product())
            best[i] = min(best[i], (time.perf_counter() - start) * 1e3)
    return best


def cache_path() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "turbospark"
    )
    return Path(base) / _FILE


def machine_key() -> str:
    """What the timings depend on: the kernel set and threads, this build of them, MLX's version, the CPU.

    The build (the extension file's size and time) makes a reinstall measure afresh: its kernels may be
    faster or slower than the ones the cached timings were taken with.
    """
    return f"{native.STATUS}; build {native.BUILD}; mlx {native.MLX_VERSION}; {_cpu_name()}"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read_cache() -> dict[str, LayoutSpeed]:
    """This machine's timings from the cache file; anything unreadable or malformed counts as none."""
    try:
        raw = json.loads(cache_path().read_text())
        entries = raw.get(machine_key(), {}) if isinstance(raw, dict) else {}
        out = {}
        for name, entry in entries.items():
            quant = QuantSpec(bits=int(entry["bits"]), group_size=int(entry["group_size"]), mode=str(entry["mode"]))
            times = float(entry["native_ms"]), float(entry["float_ms"])
            if all(math.isfinite(t) and t > 0 for t in times):  # else measured over
                out[name] = LayoutSpeed(quant, *times)
        return out
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def _write_cache(entry: LayoutSpeed) -> None:
    """Add one layout's timings to the cache file (atomically); a cache that cannot be written is skipped."""
    path = cache_path()
    try:
        raw = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(raw, dict):
            raw = {}
    except (OSError, ValueError):
        raw = {}
    mine = raw.setdefault(machine_key(), {})
    if not isinstance(mine, dict):
        mine = raw[machine_key()] = {}
    mine[layout_name(entry.quant)] = {
        **attrs.asdict(entry.quant),
        "native_ms": entry.native_ms,
        "float_ms": entry.float_ms,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(raw, f, indent=1, sort_keys=True)
        os.replace(f.name, path)
    except OSError:
        return
