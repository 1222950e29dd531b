"""The harness loads only on request: pytest elsewhere imports neither mlx nor turbospark_core."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import sys

def test_probe():
    assert "mlx" not in sys.modules and "turbospark_core" not in sys.modules
"""

OPTION = """
def test_option(turbospark_fixtures):
    assert turbospark_fixtures.name == "elsewhere"
"""


def _pytest(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(root)]
    return subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)


def test_unrelated_pytest_run_imports_no_mlx(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(PROBE)
    result = _pytest(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_on_request_with_p_registers_the_fixtures_option(tmp_path: Path) -> None:
    (tmp_path / "test_option.py").write_text(OPTION)
    result = _pytest(tmp_path, "-p", "turbospark_core.testing", "--turbospark-fixtures", str(tmp_path / "elsewhere"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_chi_square_pools_rare_cells_and_refuses_too_few_draws() -> None:
    from turbospark_core.testing import chi_square

    stat, bound = chi_square({"a": 50, "b": 50}, {"a": 0.5, "b": 0.5}, 100)
    assert stat == 0.0 and bound > 0
    stat, _ = chi_square({"a": 60, "b": 40, "c": 0}, {"a": 0.5, "b": 0.49, "c": 0.01}, 100)  # "c" expects 1 draw
    assert stat == pytest.approx(0.1**2 * 100 / 0.5 + 9**2 / 49)
    with pytest.raises(ValueError, match=r"4 draws leave fewer than 2 cells expecting 5 or more"):
        chi_square({"a": 2, "b": 2}, {"a": 0.5, "b": 0.5}, 4)
