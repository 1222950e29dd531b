"""Typed arch validation: hostile values are refused by name, before any loop or allocation.

The escapes of issue 20's first fuzz run are reproduced first (each raised a
non-turbospark error or hung before), then every family's ``Args.from_arch`` is
driven with hostile values in every key it reads.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import turbospark_core
import turbospark_core.errors
from turbospark_core import loader, plugins
from turbospark_core.arch_check import generic_problems, rope_scaling_problems
from turbospark_core.errors import ArchConfigError, TurbosparkError

from .conftest import FIXTURES

# (key, hostile value, a word the refusal names besides the key)
ISSUE_ESCAPES = [
    ("rotary_dim", "16", "integer"),  # was TypeError: '<=' not supported between 'str' and 'int'
    ("rope_scaling", 7, "object"),  # was AttributeError: 'int' object has no attribute 'get'
    ("head_dim", 1e308, "integer"),  # was OverflowError: cannot convert float infinity to integer
    ("rotary_dim", 2**40, "integer"),  # was ValueError: Maximum allowed size exceeded
    ("num_hidden_layers", 2**31, "integer"),  # was a hang of more than 20 s
]


@pytest.mark.parametrize(("key", "value", "word"), ISSUE_ESCAPES)
def test_the_issue_escapes_are_refused_by_name_at_open(
    install: Path, tamper, names, key: str, value: Any, word: str
) -> None:
    tamper.edit(install, lambda raw: raw["arch"].__setitem__(key, value))
    start = time.perf_counter()
    with pytest.raises(ArchConfigError) as err:
        turbospark_core.open(install)
    assert time.perf_counter() - start < 5
    names(err, key, word)


@pytest.mark.parametrize("text", ["Infinity", "-Infinity", "NaN", "1e999"])
def test_non_finite_json_numbers_are_refused(install: Path, names, text: str) -> None:
    raw = (install / "manifest.json").read_text()
    edited = re.sub(r'"rope_theta": [0-9.e+]+', f'"rope_theta": {text}', raw)
    assert edited != raw
    (install / "manifest.json").write_text(edited)
    with pytest.raises(ArchConfigError) as err:
        turbospark_core.open(install)
    names(err, "rope_theta", "finite")


@pytest.mark.parametrize(
    ("scaling", "word"),
    [
        ({"rope_type": "linear"}, "'factor'"),
        ({"rope_type": "yarn", "factor": "4"}, "'factor'"),
        (
            {
                "rope_type": "llama3",
                "factor": 8,
                "low_freq_factor": 1,
                "high_freq_factor": 1,
                "original_max_position_embeddings": 8192,
            },
            "must differ",
        ),
        ({"rope_type": ["yarn"]}, "string"),
        ({"rope_type": "yarn", "factor": 2, "truncate": "no"}, "'truncate'"),
        ({"rope_type": "yarn", "factor": float("inf")}, "finite"),
    ],
)
def test_rope_scaling_shapes_are_checked(scaling: dict[str, Any], word: str, names) -> None:
    problems = rope_scaling_problems(scaling)
    assert problems
    names("; ".join(problems), "rope_scaling", word)


def test_the_core_checks_consistency_of_generic_keys(names) -> None:
    arch = {"model_type": "x", "num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 8,
            "num_attention_heads": 3, "num_key_value_heads": 2, "head_dim": 4, "rotary_dim": 6,
            "layer_types": ["a"]}  # fmt: skip
    names("; ".join(generic_problems(arch)), "num_attention_heads=3", "rotary_dim=6", "'layer_types' has 1")


def test_a_huge_value_is_shown_briefly() -> None:
    (problem,) = generic_problems({"num_hidden_layers": 10**400, "hidden_size": 8, "vocab_size": 8})
    assert "bits" in problem and len(problem) < 200


# ------------------------------------------------------------------ every family, every key
def _fixture_arch(name: str) -> dict[str, Any]:
    config = FIXTURES / name / "config.json"
    if not config.is_file():
        pytest.skip(f"reference fixture {config.parent} is not available")
    arch = plugins.arch_from_hf_config(json.loads(config.read_text()))
    assert arch is not None
    return json.loads(json.dumps(arch))  # as read back from a manifest


FAMILY_FIXTURES = [
    "llama",
    "qwen3_moe",
    "minimax_m2",
    "gpt_oss",
    "qwen3_5",
    "qwen3_5_moe",
    "gemma4_e",
    "gemma4_moe",
    "spark2_5",
]
HOSTILE = [None, True, -1, 0, 2**31, 2**64, 1e308, -1e308, math.inf, math.nan, 0.5, "7", "", [], [1], {}, {"a": 1}]


def _check_then_build(arch: dict[str, Any]) -> None:
    """What open does with an arch: the checks, then (only if they pass) the family's layout."""
    hooks = plugins.family_hooks(arch["model_type"])
    try:
        loader._check_arch(arch, hooks)
    except ArchConfigError:
        return
    layout = hooks.cache_layout(arch) or ()
    assert len(layout) <= 1024


@pytest.mark.parametrize("fixture", FAMILY_FIXTURES)
def test_every_key_with_every_hostile_value_is_refused_or_served(fixture: str) -> None:
    arch = _fixture_arch(fixture)
    _check_then_build(arch)  # the unmodified arch is served
    keys = [k for k in arch if k != "model_type"]
    for key in keys:
        for value in HOSTILE:
            start = time.perf_counter()
            _check_then_build({**arch, key: value})
            assert time.perf_counter() - start < 1, (key, value)


@pytest.mark.parametrize("fixture", FAMILY_FIXTURES)
def test_families_check_their_own_sections_without_the_core(fixture: str) -> None:
    """``Args.problems`` stands alone: ``from_arch`` raises only ArchConfigError even unchecked by the core."""
    arch = _fixture_arch(fixture)
    hooks = plugins.family_hooks(arch["model_type"])
    for key, inner in [(k, v) for k, v in arch.items() if isinstance(v, dict)]:
        for sub in inner:
            for value in HOSTILE:
                mutated = {**arch, key: {**inner, sub: value}}
                with contextlib.suppress(ArchConfigError):
                    hooks.cache_layout(mutated)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@pytest.mark.parametrize("fixture", ["llama", "gpt_oss", "qwen3_5_moe", "gemma4_e", "spark2_5"])
@settings(
    max_examples=150,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_random_json_in_any_key_is_refused_or_served(fixture: str, data: st.DataObject) -> None:
    arch = _fixture_arch(fixture)
    key = data.draw(st.sampled_from(sorted(k for k in arch if k != "model_type")))
    value = data.draw(json_values)
    with contextlib.suppress(TurbosparkError):
        _check_then_build({**arch, key: value})


@pytest.mark.parametrize(("key", "value"), [("head_dim", 32), ("num_attention_heads", 2), ("num_key_value_heads", 1)])
@pytest.mark.parametrize("warmup", [False, True])
def test_an_arch_that_passes_every_check_but_does_not_fit_the_tensors_is_refused_at_open(
    install: Path, tamper, names, key: str, value: int, warmup: bool
) -> None:
    """Was a ValueError from MLX at the first request (or the warm-up): the open builds one token's graph."""
    tamper.edit(install, lambda raw: raw["arch"].__setitem__(key, value))
    with pytest.raises(turbospark_core.errors.InstallError) as err:
        turbospark_core.open(install, warmup=warmup)
    names(err, "do not fit the arch config", "'llama'", "turbospark convert")


@pytest.mark.parametrize("theta", [1, 1.0, 0.5])
def test_a_rope_base_of_at_most_1_is_refused(theta: float, names) -> None:
    """YaRN divides by log(rope_theta): a base of 1 was a ZeroDivisionError when the rope was built."""
    arch = {"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 8, "rope_theta": theta}
    names("; ".join(generic_problems(arch)), "rope_theta", "(1, ")


def test_yarn_multipliers_may_be_zero_but_not_negative(names) -> None:
    assert rope_scaling_problems({"rope_type": "yarn", "factor": 4, "mscale": 0, "mscale_all_dim": 0}) == []
    names("; ".join(rope_scaling_problems({"rope_type": "yarn", "factor": 4, "mscale": -1})), "'mscale'", ">= 0")
