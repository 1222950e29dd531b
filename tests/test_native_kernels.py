"""The native kernel sets against the portable kernels, standalone (``tests/native_kernels``, no MLX).

The NEON set runs where the CPU is aarch64 or, on other machines, cross-compiled and
under qemu's user-mode emulation; without either this test is skipped (CI's x86 machine
has no cross toolchain: its own sets are checked against MLX by test_native_qmm/ops).
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parent / "native_kernels" / "run.sh"
NATIVE = platform.machine().lower() in {"aarch64", "arm64"}
NEEDS = ("g++",) if NATIVE else ("aarch64-linux-gnu-g++", "qemu-aarch64")
MISSING = [tool for tool in NEEDS if shutil.which(tool) is None]


@pytest.mark.skipif(
    bool(MISSING),
    reason=f"the NEON kernel check needs {', '.join(MISSING)} "
    f"(Debian: apt-get install g++-aarch64-linux-gnu qemu-user); run tests/native_kernels/run.sh by hand",
)
def test_neon_kernels_equal_exact_and_scalar_results() -> None:
    run = subprocess.run(
        ["bash", str(HARNESS), "native" if NATIVE else "aarch64", "--quick", "--set=neon"],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    assert "kernel sets: neon" in run.stdout and "all passed" in run.stdout
