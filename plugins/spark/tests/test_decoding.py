"""Sliding-window decoding on the core's ring KV cache against a full recomputation."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core.kv_cache import RingKVCache

WINDOW = 16
BEYOND = 3 * WINDOW  # decode three windows' worth of tokens past the prompt
TOL = 1e-4


@pytest.fixture(scope="module")
def prompt(turbospark_fixtures: Any) -> list[int]:
    return np.load(turbospark_fixtures / "spark2_5" / "references.npz")["prompt_ids"].tolist()


def _decode(runner: Any, prompt: list[int], chunks: list[int]) -> tuple[list[int], np.ndarray, list[Any]]:
    """Prefill in ``chunks``-sized pieces, then greedy-decode BEYOND tokens one at a time."""
    model, cache = runner.model, runner.opened.new_cache()
    start, logits = 0, None
    for size in chunks:
        logits = model(mx.array([prompt[start : start + size]]), cache)
        start += size
    assert start == len(prompt) and logits is not None
    tokens, steps = [], [np.array(logits[0, -1])]
    for _ in range(BEYOND):
        tokens.append(int(np.argmax(steps[-1])))
        steps.append(np.array(model(mx.array([[tokens[-1]]]), cache)[0, -1]))
    return tokens, np.stack(steps), cache


@pytest.mark.parametrize(
    ("ring_capacity", "chunks"),
    [(None, [48]), (None, [5, 20, 3, 20]), (24, [16, 16, 16])],
    ids=["one-prefill", "odd-chunks", "ring-capacity-24"],
)
def test_decoding_three_windows_matches_full_recomputation(
    turbospark_install: Any, prompt: list[int], ring_capacity: int | None, chunks: list[int]
) -> None:
    runner = turbospark_core.open(turbospark_install("spark2_5", "float32"), ring_capacity=ring_capacity)
    tokens, steps = _decode(runner, prompt, chunks)[:2]
    full = runner.logits(prompt + tokens)[len(prompt) - 1 :]
    assert steps.shape == full.shape == (BEYOND + 1, 512)
    assert np.abs(steps - full).max() <= TOL
    assert [int(t) for t in full[:-1].argmax(-1)] == tokens


def test_sliding_layers_hold_at_most_their_ring(turbospark_install: Any, prompt: list[int]) -> None:
    runner = turbospark_core.open(turbospark_install("spark2_5", "float32"))
    cache = _decode(runner, prompt, [len(prompt)])[2]
    rings = [c for c in cache if isinstance(c, RingKVCache)]
    assert len(rings) == 3
    assert all(c.keys.shape[2] == WINDOW and c.offset == len(prompt) + BEYOND for c in rings)
