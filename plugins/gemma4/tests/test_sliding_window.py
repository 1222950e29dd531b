"""Sliding layers keep a ring bounded by the window; long decodes still match full recomputation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core.kv_cache import KVCache, RingKVCache
from turbospark_core.testing import relative_error

WINDOW = 16  # both fixtures' sliding_window
MAX_CONTEXT = 256


def _decode_steps(runner: Any, ids: list[int], prompt_len: int) -> tuple[np.ndarray, list[Any]]:
    """Prefill ``ids[:prompt_len]``, then feed the rest one token at a time; logits of every step."""
    cache = runner.opened.new_cache()
    model = runner.model
    steps = [np.array(model(mx.array([ids[:prompt_len]]), cache)[0, -1])]
    for t in ids[prompt_len:-1]:
        out = model(mx.array([[t]]), cache)
        mx.eval(out, [c.state for c in cache])
        steps.append(np.array(out[0, -1]))
    return np.stack(steps), cache


def _long_ids(refs: Any, extra: int) -> tuple[list[int], int]:
    prompt = refs["prompt_ids"].tolist()
    tail = np.random.default_rng(7).integers(3, 500, size=extra).tolist()
    return prompt + tail, len(prompt)


@pytest.mark.parametrize("fixture_name", ["gemma4_e", "gemma4_moe"])
@pytest.mark.parametrize("ring_capacity", [None, 40])
def test_three_windows_of_decoding_match_full_recomputation(
    turbospark_install: Any, turbospark_fixtures: Path, fixture_name: str, ring_capacity: int | None
) -> None:
    refs = np.load(turbospark_fixtures / fixture_name / "references.npz")
    runner = turbospark_core.open(
        turbospark_install(fixture_name), max_context=MAX_CONTEXT, ring_capacity=ring_capacity
    )
    ids, prompt_len = _long_ids(refs, 3 * WINDOW + 1)
    steps, cache = _decode_steps(runner, ids, prompt_len)
    full = runner.logits(ids)[prompt_len - 1 : -1]
    assert steps.shape == full.shape
    assert relative_error(steps, full) <= 1e-4
    # the same again against a pass with no cache at all (the flow's own window masks)
    uncached = np.array(runner.model(mx.array([ids]))[0])[prompt_len - 1 : -1]
    assert relative_error(steps, uncached) <= 1e-4
    rings = [c for c in cache if isinstance(c, RingKVCache)]
    assert rings and all(r.keys.shape[2] == (ring_capacity or WINDOW) for r in rings)


def test_ring_memory_stays_flat_as_context_grows(turbospark_install: Any) -> None:
    runner = turbospark_core.open(turbospark_install("gemma4_e"), max_context=MAX_CONTEXT)
    cache = runner.opened.new_cache()
    rings = [c for c in cache if isinstance(c, RingKVCache)]
    fulls = [c for c in cache if isinstance(c, KVCache)]
    assert len(rings) == 2 and len(fulls) == 1  # layers 0, 1 sliding; 2 full; 3, 4 share K/V
    runner.model(mx.array([list(range(3, 40))]), cache)
    shapes = []
    for t in range(80):
        mx.eval(runner.model(mx.array([[3 + t % 400]]), cache), [c.state for c in cache])
        shapes.append({tuple(r.keys.shape) for r in rings} | {tuple(r.values.shape) for r in rings})
    assert all(s == {(1, 1, WINDOW, 16)} for s in shapes)
    assert cache[0].offset == 117
    assert fulls[0].offset == 117 and fulls[0].keys.shape[2] >= 117  # full attention grows


def test_decoding_past_many_windows_matches_mlx_lm(turbospark_install: Any, turbospark_fixtures: Path) -> None:
    """An independent oracle: mlx-lm's full forward over eight windows of context."""
    mlx_lm = pytest.importorskip("mlx_lm")
    refs = np.load(turbospark_fixtures / "gemma4_e" / "references.npz")
    ids, prompt_len = _long_ids(refs, 8 * WINDOW - 48 + 1)
    runner = turbospark_core.open(turbospark_install("gemma4_e"), max_context=MAX_CONTEXT)
    steps, _ = _decode_steps(runner, ids, prompt_len)
    # mlx-lm 0.32.2 reads the top-level vocab_size (default 262144), not text_config.vocab_size
    model, _ = mlx_lm.load(str(turbospark_fixtures / "gemma4_e"), model_config={"vocab_size": 512})
    want = np.array(model(mx.array([ids])).astype(mx.float32)[0])[prompt_len - 1 : -1]
    assert relative_error(steps, want) <= 1e-4
