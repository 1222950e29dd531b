"""Tests of open options: checked before anything is read, each refused by name."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import attrs
import pytest

import turbospark_core
from turbospark_core import options
from turbospark_core.errors import OptionError, TurbosparkError
from turbospark_core.manifest import MANIFEST
from turbospark_core.options import OpenOptions


def test_defaults() -> None:
    opts = OpenOptions.from_kwargs({})
    assert (opts.max_context, opts.expert_slots, opts.residency, opts.kv_quant, opts.warmup) == (
        None, "auto", "auto", None, False,
    )
    assert isinstance(opts.memory_budget, int) and opts.memory_budget > 0
    assert opts.ring_capacity is None


def test_good_values_are_kept() -> None:
    opts = OpenOptions.from_kwargs(
        {"max_context": 1024, "expert_slots": 4, "residency": "resident", "memory_budget": "2GB", "kv_quant": "q8"}
    )
    assert (opts.max_context, opts.expert_slots, opts.residency, opts.memory_budget, opts.kv_quant) == (
        1024, 4, "resident", 2_000_000_000, "q8",
    )


BAD = [
    ("expert_slots", 0, "positive integer or 'auto'"),
    ("expert_slots", -1, "positive integer or 'auto'"),
    ("expert_slots", "many", "positive integer or 'auto'"),
    ("expert_slots", True, "positive integer or 'auto'"),
    ("expert_slots", 2.0, "positive integer or 'auto'"),
    ("max_context", 0, "positive number of tokens"),
    ("max_context", -8, "positive number of tokens"),
    ("max_context", "4096", "positive number of tokens"),
    ("max_context", True, "positive number of tokens"),
    ("memory_budget", "lots", "'8GB'"),
    ("memory_budget", "8 parsecs", "'8GB'"),
    ("memory_budget", -1, "must be positive"),
    ("memory_budget", 0, "must be positive"),
    ("ring_capacity", 0, "positive number of tokens"),
    ("ring_capacity", "big", "positive number of tokens"),
    ("kv_quant", "q3", "'q8', 'q4'"),
    ("kv_quant", "fp8", "'q8', 'q4'"),
    ("kv_recent", -1, "number of tokens >= 0"),
    ("kv_recent", True, "number of tokens >= 0"),
    ("kv_recent", "32", "number of tokens >= 0"),
    ("residency", "sometimes", "'resident', 'auto'"),
    ("residency", None, "'resident', 'auto'"),
]


@pytest.mark.parametrize(("name", "value", "fix"), BAD)
def test_bad_option_value(name: str, value, fix: str, names) -> None:
    with pytest.raises(OptionError) as e:
        OpenOptions.from_kwargs({name: value})
    names(e, f"{name}={value!r}", fix)


@pytest.mark.parametrize(("name", "value", "fix"), BAD)
def test_bad_option_value_through_open(f32_install: Path, name: str, value, fix: str, names) -> None:
    with pytest.raises(OptionError) as e:
        turbospark_core.open(f32_install, **{name: value})
    names(e, f"{name}={value!r}", fix)


def test_unknown_option_name(f32_install: Path, names) -> None:
    with pytest.raises(OptionError) as e:
        turbospark_core.open(f32_install, max_ctx=128, expert_slot=2)
    names(e, "unknown open option(s) expert_slot, max_ctx", "known: ", "max_context", "expert_slots")


def test_options_are_checked_before_the_manifest_is_read(install: Path, names) -> None:
    (install / MANIFEST).write_text("{corrupt")
    with pytest.raises(OptionError) as e:
        turbospark_core.open(install, expert_slots=0)
    names(e, "expert_slots=0")


def test_kv_quant_the_runtime_lacks_is_refused_by_name(f32_install: Path, names) -> None:
    with pytest.raises(OptionError) as e:
        turbospark_core.open(f32_install, kv_quant="q8")
    names(e, "kv_quant='q8'", "kv_quant=None")


def test_option_errors_are_turbospark_and_value_errors() -> None:
    with pytest.raises(OptionError) as e:
        OpenOptions.from_kwargs({"expert_slots": 0})
    assert isinstance(e.value, TurbosparkError) and isinstance(e.value, ValueError)


def test_good_options_open(f32_install: Path) -> None:
    runner = turbospark_core.open(
        f32_install, max_context=128, expert_slots=2, residency="resident", memory_budget="1GiB", warmup=True
    )
    assert runner.max_context == 128
    assert runner.opened.options.memory_budget == 2**30


def test_open_takes_exactly_the_open_options_keyword_only_with_their_defaults() -> None:
    params = inspect.signature(turbospark_core.open).parameters
    typed = {name: p for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    fields = {f.name: f for f in attrs.fields(OpenOptions)}
    assert list(typed) == list(fields)
    for name, param in typed.items():
        assert param.default == fields[name].default, name
    assert params["unknown"].kind is inspect.Parameter.VAR_KEYWORD  # refused by name, as an OptionError


def test_closed_option_sets_match_their_literal_types() -> None:
    assert typing.get_args(options.Residency) == options.RESIDENCY
    assert (None, *typing.get_args(options.KVQuant)) == options.KV_QUANT


def test_kv_recent_without_kv_quant_is_refused(f32_install: Path, names) -> None:
    with pytest.raises(OptionError) as e:
        turbospark_core.open(f32_install, kv_recent=16)
    names(e, "kv_recent=16", "kv_quant is None", "kv_quant='q4'", "leave kv_recent out")
    assert OpenOptions.from_kwargs({"kv_recent": 0}).kv_recent == 0  # zero quantizes nothing less: allowed
