"""The harness loads only on request: pytest elsewhere imports neither mlx nor turbospark_core."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
