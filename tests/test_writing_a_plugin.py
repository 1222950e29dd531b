"""The minimal plugin of docs/writing-a-plugin.md runs through the harness's tiny-random-weights path.

The plugin lives in ``docs/example/turbospark-minimal``; the doc shows its files
verbatim (checked below), so the page cannot drift from code that passes.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest

from turbospark_core import plugins
from turbospark_core.testing import TinyRandomConformance

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "example" / "turbospark-minimal"
FILES = ("pyproject.toml", "turbospark_minimal/plugin.py", "turbospark_minimal/family.py")

TINY_CONFIG = {
    "model_type": "minimal_llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module", autouse=True)
def minimal_plugin() -> Iterator[None]:
    """The example registered under its entry-point name, as ``pip install`` would make it."""
    entry_points = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]["entry-points"]["turbospark"]
    (name, target), = entry_points.items()
    sys.path.insert(0, str(EXAMPLE))
    plugins.load_plugins()
    plugins.pm.register(importlib.import_module(target), name=name)
    try:
        yield
    finally:
        plugins.pm.unregister(name=name)
        sys.path.remove(str(EXAMPLE))


class TestMinimalPlugin(TinyRandomConformance):
    tiny_configs: ClassVar[Mapping[str, Mapping[str, Any]]] = {"minimal_llama": TINY_CONFIG}


def test_registry_lists_the_minimal_family() -> None:
    claim = plugins.registry().claim("minimal_llama")
    assert claim is not None
    assert (claim.spec.name, claim.spec.distribution) == ("minimal", "turbospark-minimal")


@pytest.mark.parametrize("name", FILES)
def test_doc_shows_the_example_verbatim(name: str) -> None:
    doc = (ROOT / "docs" / "writing-a-plugin.md").read_text()
    assert (EXAMPLE / name).read_text() in doc, f"docs/writing-a-plugin.md no longer shows {name} as it is"
