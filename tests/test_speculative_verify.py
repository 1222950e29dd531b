"""Acceptance (turbospark_core.speculative.verify): greedy prefix match, and speculative sampling is exact."""

from __future__ import annotations

from collections import Counter
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core.sampling import Sampler, SamplingParams
from turbospark_core.speculative.drafter import Draft
from turbospark_core.speculative.verify import accept, penalized_rows
from turbospark_core.testing import chi_square

V = 6


def test_greedy_keeps_the_longest_matching_prefix_and_adds_the_target_token() -> None:
    logits = mx.array(np.eye(V, dtype=np.float32)[[1, 2, 3, 4]])  # the target's argmax: 1, 2, 3, 4
    sampler = Sampler(SamplingParams())
    assert accept(logits, Draft(tokens=[1, 2, 3]), sampler).tokens == [1, 2, 3, 4]
    assert accept(logits, Draft(tokens=[1, 5, 3]), sampler).tokens == [1, 2]
    assert accept(logits, Draft(tokens=[0, 2, 3]), sampler).tokens == [1]
    assert accept(logits[:1], Draft(tokens=[]), sampler).tokens == [1]


def _sampled_pairs(q: np.ndarray | None, n: int, params: SamplingParams, logits: mx.array) -> Counter[Any]:
    """(first, second) committed tokens of ``n`` verifies with drafts drawn from ``q`` (None: fixed one-hot draft)."""
    sampler = Sampler(params)
    rng = np.random.default_rng(1)
    out: Counter[Any] = Counter()

    def draft(rows: int) -> Draft:
        if q is None:
            return Draft(tokens=[2, 3][-rows:])
        tokens = [int(rng.choice(V, p=q[i])) for i in range(2 - rows, 2)]
        return Draft(tokens=tokens, probs=mx.array(q[2 - rows :].astype(np.float32)))

    for _ in range(n):
        got = accept(logits, draft(2), sampler).tokens
        if len(got) == 1:  # rejected at once: the next step verifies a fresh draft for the second position
            got += accept(logits[1:], draft(1), sampler).tokens
        out[tuple(got[:2])] += 1
    return out


@pytest.mark.parametrize("kind", ["model", "one-hot"])
def test_speculative_sampling_reproduces_the_target_distribution(kind: str) -> None:
    """The first two committed tokens follow p exactly: chi-square over 3000 seeded verifies."""
    rng = np.random.default_rng(0)
    raw = rng.normal(size=(3, V)).astype(np.float32) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5, seed=11)
    logits = mx.array(raw)
    p = np.exp(np.array(Sampler(params).logprobs(logits)))  # the plain sampling distribution per row
    # rows do not depend on the earlier tokens here (a fixed context per row), so P(a, b) = p0(a) p1(b)
    expected = {(a, b): float(p[0, a] * p[1, b]) for a in range(V) for b in range(V)}
    q = rng.dirichlet(np.ones(V) * 0.7, size=2) if kind == "model" else None
    n = 3000
    counts = _sampled_pairs(q, n, params, logits)
    stat, critical = chi_square(counts, expected, n)
    assert stat < critical, (stat, critical)


def test_a_draft_equal_to_the_target_is_always_accepted() -> None:
    params = SamplingParams(temperature=1.0, seed=3)
    logits = mx.array(np.random.default_rng(2).normal(size=(3, V)).astype(np.float32))
    q = np.exp(np.array(Sampler(params).logprobs(logits)))[:2]
    sampler = Sampler(params)
    for d0, d1 in [(0, 1), (4, 2), (5, 5)]:
        verdict = accept(logits, Draft(tokens=[d0, d1], probs=mx.array(q)), sampler)
        assert verdict.accepted == (d0, d1)


def test_penalized_rows_match_plain_decodings_history() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, repetition_context=3)
    sampler = Sampler(params)
    logits = mx.array(np.full((3, V), 1.0, np.float32))
    rows = np.array(penalized_rows(logits, [0, 1, 2], [3, 4], sampler))
    # row i penalizes the last 3 of history + draft[:i]
    assert rows[0].tolist() == [0.5, 0.5, 0.5, 1, 1, 1]
    assert rows[1].tolist() == [1, 0.5, 0.5, 0.5, 1, 1]
    assert rows[2].tolist() == [1, 1, 0.5, 0.5, 0.5, 1]
