"""The outsider's view: installed through its entry point, built on the public API, refused by name when absent."""

from __future__ import annotations

import ast
import importlib.metadata
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tiny_gemma3 import TINY

import turbospark_core
from turbospark_core import cli, plugins
from turbospark_core.convert import convert
from turbospark_core.errors import UnknownFamilyError

import turbospark_gemma3

# What a third-party plugin imports from turbospark: the curated surface for plugin authors
PUBLIC = {"turbospark_core.family"}


def _core_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return {n for n in names if n.startswith("turbospark_core")}


def test_plugin_uses_only_the_public_api() -> None:
    package = Path(turbospark_gemma3.__file__).parent
    used = set().union(*(_core_imports(p) for p in package.glob("*.py")))
    assert used - PUBLIC == set()


def test_entry_point_is_declared_by_the_distribution() -> None:
    (ep,) = [ep for ep in importlib.metadata.entry_points(group="turbospark") if ep.name == "gemma3"]
    assert ep.value == "turbospark_gemma3.plugin"
    assert ep.dist is not None and ep.dist.name == turbospark_gemma3.DISTRIBUTION


def test_families_lists_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["families"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("gemma3 "))
    assert "turbospark-gemma3" in line and "gemma3_text" in line and "GGUF: gemma3" in line


@pytest.fixture
def tiny_install(turbospark_install: Any) -> Path:
    """The tiny checkpoint converted while the plugin is installed."""
    return turbospark_install(TINY)


@pytest.fixture
def without_gemma3(tiny_install: Path) -> Iterator[None]:
    """Every installed plugin but this one, as if turbospark-gemma3 were uninstalled (after converting)."""
    old = os.environ.get(plugins.ALLOW_LIST_ENV)
    others = [ep.name for ep in importlib.metadata.entry_points(group="turbospark") if ep.name != "gemma3"]
    os.environ[plugins.ALLOW_LIST_ENV] = ",".join(others)
    plugins.reset_plugins()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(plugins.ALLOW_LIST_ENV, None)
        else:
            os.environ[plugins.ALLOW_LIST_ENV] = old
        plugins.reset_plugins()


def test_uninstalled_open_is_refused_naming_the_package(tiny_install: Path, without_gemma3: None) -> None:
    with pytest.raises(UnknownFamilyError) as info:
        turbospark_core.open(tiny_install)
    message = str(info.value)
    assert "'gemma3_text'" in message and "install turbospark-gemma3" in message
    assert "gemma3 (" not in message  # not among the installed families


def test_uninstalled_convert_is_refused_naming_the_model_type(tiny_dir: Path, tmp_path: Path,
                                                              without_gemma3: None) -> None:
    with pytest.raises(UnknownFamilyError, match="'gemma3_text'"):
        convert(tiny_dir, tmp_path / "install")
    assert not (tmp_path / "install").exists()


def test_plugin_state_is_restored(turbospark_install: Any) -> None:
    assert turbospark_core.open(turbospark_install(TINY)).manifest.family == "gemma3"
