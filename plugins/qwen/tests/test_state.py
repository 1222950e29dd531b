"""Recurrent and conv state live in the core's caches: prefill == decode, snapshot/restore replays exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core.cache_spec import CacheSpec, StateSpec
from turbospark_core.kv_cache import KVCache, RecurrentState, restore_caches, snapshot_caches
from turbospark_core.testing import relative_error

from turbospark_qwen import gated_delta

FIXTURES = ("qwen3_5", "qwen3_5_moe")
LONG = 150  # several recurrence chunks


@pytest.fixture(params=FIXTURES)
def runner(request: pytest.FixtureRequest, turbospark_install: Any) -> turbospark_core.Runner:
    return turbospark_core.open(turbospark_install(request.param, "float32"))


def _ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(9, vocab, n).tolist()


def _run(runner: turbospark_core.Runner, ids: list[int], cache: list[Any]) -> np.ndarray:
    out = runner.model(mx.array([ids]), cache)
    mx.eval(out, [c.state for c in cache])
    return np.array(out[0])


def test_cache_layout_declares_state_per_deltanet_layer(runner: turbospark_core.Runner) -> None:
    arch = runner.manifest.arch
    layout = runner.opened.cache_layout
    for kind, spec in zip(arch["layer_types"], layout, strict=True):
        if kind == "full_attention":
            assert spec == CacheSpec.full(arch["num_key_value_heads"], arch["head_dim"])
        else:
            conv_dim = 2 * 2 * 16 + 4 * 16
            assert isinstance(spec, StateSpec)
            assert spec.shapes == {"conv": (3, conv_dim), "recurrent": (4, 16, 16)}


def test_state_is_held_by_the_core(runner: turbospark_core.Runner) -> None:
    cache = runner.opened.new_cache()
    _run(runner, _ids(10, 512), cache)
    states = [c for c in cache if isinstance(c, RecurrentState)]
    assert len(states) == 3 and all(isinstance(c, KVCache) for c in cache if c not in states)
    for state in states:
        assert state.offset == 10
        assert state.arrays["conv"].shape == (1, 3, 128)
        assert state.arrays["recurrent"].shape == (1, 4, 16, 16)


def _text_ids(turbospark_fixtures: Path, runner: turbospark_core.Runner) -> list[int]:
    refs = np.load(turbospark_fixtures / runner.manifest.model_type / "references.npz")
    prompt, greedy = refs["prompt_ids"].tolist(), refs["greedy_tokens"].tolist()
    return prompt + greedy + prompt[::-1] + greedy[::-1] + prompt[:40]  # 168 tokens: several chunks


def test_prefill_matches_token_by_token_decoding(runner: turbospark_core.Runner, turbospark_fixtures: Path) -> None:
    ids = _text_ids(turbospark_fixtures, runner)
    prefill = _run(runner, ids, runner.opened.new_cache())
    cache = runner.opened.new_cache()
    decoded = np.concatenate([_run(runner, [t], cache) for t in ids])
    err = relative_error(prefill, decoded)
    assert err <= 1e-5, f"prefill vs decode: {err:.2e}"


def test_prefill_runs_no_per_token_step(runner: turbospark_core.Runner, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> None:
        raise AssertionError("prefill took the token-by-token path")

    monkeypatch.setattr(gated_delta, "_step", refuse)
    _run(runner, _ids(LONG, 512), runner.opened.new_cache())


def test_restore_and_replay_is_bit_identical(runner: turbospark_core.Runner) -> None:
    a, b = _ids(20, 512, seed=2), _ids(70, 512, seed=3)
    cache = runner.opened.new_cache()
    _run(runner, a, cache)
    snap = snapshot_caches(cache)
    first = _run(runner, b, cache)
    restore_caches(cache, snap)
    again = _run(runner, b, cache)
    assert np.array_equal(first, again)
    uninterrupted = runner.opened.new_cache()
    _run(runner, a, uninterrupted)
    assert np.array_equal(first, _run(runner, b, uninterrupted))


def test_restore_then_two_chunks_and_decode_is_bit_identical(runner: turbospark_core.Runner) -> None:
    a, b, c = _ids(33, 512, seed=4), _ids(9, 512, seed=5), _ids(3, 512, seed=6)

    def b_then_c(cache: list[Any]) -> list[np.ndarray]:
        return [_run(runner, b, cache), _run(runner, c, cache), _run(runner, c[:1], cache)]

    cache = runner.opened.new_cache()
    _run(runner, a, cache)
    snap = snapshot_caches(cache)
    straight = b_then_c(cache)
    restore_caches(cache, snap)
    replayed = b_then_c(cache)
    assert all(np.array_equal(x, y) for x, y in zip(straight, replayed, strict=True))
    fresh = runner.opened.new_cache()
    _run(runner, a, fresh)
    assert all(np.array_equal(x, y) for x, y in zip(straight, b_then_c(fresh), strict=True))
