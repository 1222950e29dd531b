"""Property-based fuzzing in CI: every reader of untrusted bytes raises only TurbosparkError, in bounded time.

Hypothesis drives the structure-aware mutators (``derandomize=True``: the same
inputs every run, no example database needed); ``run.py`` beside this file is
the long run (>= 100,000 inputs per reader).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .targets import TARGETS, Seeds, run_one

EXAMPLES = {
    "open": 40,
    "manifest": 150,
    "safetensors": 150,
    "experts": 150,
    "gguf": 60,
    "tokenizer": 60,
    "template": 100,
    "hadamard": 150,
    "directions": 150,
    "sidecar": 60,
}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_only_turbospark_errors_escape(name: str, seeds: Seeds) -> None:
    try:
        target = TARGETS[name](seeds)
    except RuntimeError as e:  # a seed this environment lacks (the SmolLM2 package, a fixture)
        pytest.skip(str(e))

    @settings(
        max_examples=EXAMPLES[name],
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(seed=st.integers(min_value=0, max_value=2**32 - 1))
    def check(seed: int) -> None:
        run_one(target, target.mutate(random.Random(seed)))

    check()


def test_the_seeds_themselves_are_read(seeds: Seeds) -> None:
    """The unmutated seeds open cleanly: the targets exercise the real readers, not an early refusal."""
    import json

    from .targets import _manifest_phase

    for name, path in seeds.installs.items():
        del name
        _manifest_phase(path)
        assert json.loads((path / "manifest.json").read_text())["format"] == "turbospark-install"
