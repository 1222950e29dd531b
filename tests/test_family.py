"""turbospark_core.family: the curated import surface for plugin authors."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import turbospark_core
from turbospark_core import family

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_PACKAGES = [
    *ROOT.glob("plugins/*/turbospark_*"),
    ROOT / "examples/turbospark-gemma3/turbospark_gemma3",
    ROOT / "tests/plugins/turbospark_dummy/turbospark_dummy",
]


def test_every_exported_name_exists_and_is_documented() -> None:
    doc = inspect.getdoc(family) or ""
    assert sorted(family.__all__) == sorted(set(family.__all__))
    for name in family.__all__:
        assert getattr(family, name) is not None
        assert f"``{name}``" in doc, f"list {name} in turbospark_core.family's docstring"


def test_it_re_exports_the_core_objects_themselves() -> None:
    from turbospark_core.convert.records import TensorTarget
    from turbospark_core.kv_cache import causal_mask

    assert family.hookimpl is turbospark_core.hookimpl
    assert family.TensorTarget is TensorTarget and family.causal_mask is causal_mask


def _core_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return {n for n in names if n.startswith("turbospark_core")}


@pytest.mark.parametrize("package", PLUGIN_PACKAGES, ids=lambda p: p.name)
def test_shipped_plugins_import_only_the_family_surface(package: Path) -> None:
    used = set().union(*(_core_modules(p) for p in package.glob("*.py")))
    assert used <= {"turbospark_core.family"}, f"{package.name} imports {sorted(used)}"
