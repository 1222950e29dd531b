"""The native kernel sets against exact results and the portable kernels, standalone (``tests/native_kernels``, no MLX).

``native``: the sets this CPU runs (x86-64: AVX2 and AVX-512 as far as it has them; aarch64: NEON),
built with the machine's C++ compiler. ``aarch64`` (other machines): the NEON set cross-compiled and
run under qemu's user-mode emulation. Where a tool is missing (CI has no cross toolchain) the harness
exits 77 with its reason and the test is skipped with that reason; the x86 sets are also checked
against MLX by test_native_qmm / test_native_ops.
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import pytest

from turbospark_core import native

HARNESS = Path(__file__).resolve().parent / "native_kernels" / "run.sh"
ARM_HOST = platform.machine().lower() in {"aarch64", "arm64"}
SKIPPED = 77  # run.sh: nothing checked, the reason printed


@pytest.mark.parametrize("mode", ["native"] if ARM_HOST else ["native", "aarch64"])
def test_kernel_sets_equal_exact_and_scalar_results(mode: str) -> None:
    run = subprocess.run(["bash", str(HARNESS), mode, "--quick"], capture_output=True, text=True, timeout=600)
    if run.returncode == SKIPPED:
        pytest.skip(run.stdout.strip().splitlines()[-1])
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    assert "all passed" in run.stdout
    checked = next(line for line in run.stdout.splitlines() if line.startswith("kernel sets:")).split()[2:]
    if mode == "aarch64":
        assert "neon" in checked
    elif native.available():
        from turbospark_core._native import _qmm

        assert _qmm.kernel() in [*checked, "scalar"]  # the set the extension runs here is among them
