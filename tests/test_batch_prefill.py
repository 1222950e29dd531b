"""A batch's prefill chunks: sized to one offset-0 chunk's cost by a ratio fitted from timed forwards."""

from __future__ import annotations

import itertools
import math

import attrs
import numpy as np
import pytest

from turbospark_core.batch_prefill import MIN_CHUNK, PRIOR_RATIO, ChunkSizer, PrefillCost, Sample, fit_ratio

A, B, C = 1.4e-3, 1.15e-6, 0.02  # seconds per token, per query-context pair, per forward (SmolLM2-like)


def _seconds(tokens: int, offset: int, a: float = A, b: float = B, c: float = C) -> float:
    return c + a * tokens + b * (tokens * offset + tokens * (tokens + 1) / 2)


def _schedule(sizer: ChunkSizer, prompt: int) -> list[tuple[int, int]]:
    """``(tokens, offset)`` of each chunk of a ``prompt``-token prompt prefilled alone, one chunk per step."""
    out, fed = [], 0
    while fed < prompt:
        n = sizer.tokens(fed, prompt - fed, sizer.budget)
        out.append((n, fed))
        fed += n
    return out


@pytest.mark.parametrize("ratio", [0.0, 8e-4, 2e-3, 1.0])
def test_a_chunk_from_an_empty_cache_is_prefill_chunk_tokens(ratio: float) -> None:
    sizer = ChunkSizer(512, ratio)
    assert sizer.tokens(0, 5000, sizer.budget) == 512
    assert sizer.tokens(0, 100, sizer.budget) == 100  # never more than the prompt has left
    assert math.isclose(sizer.budget, sizer.cost(512, 0))


def test_a_long_prompts_chunks_shrink_as_its_offset_grows_each_within_the_budget() -> None:
    sizer = ChunkSizer(512, B / A)
    chunks = _schedule(sizer, 1999)
    sizes = [n for n, _ in chunks]
    assert sizes[0] == 512 and all(x > y for x, y in itertools.pairwise(sizes[:-1]))  # the last: what is left
    assert sum(sizes) == 1999
    for n, offset in chunks:
        assert sizer.cost(n, offset) <= sizer.budget * (1 + 1e-9)
        assert sizer.cost(n + 1, offset) > sizer.budget or n == 1999 - offset  # the most that fits
        # in seconds (the cost model's own): no chunk costs more than the first, but the fixed cost per forward
        assert _seconds(n, offset, c=0) <= _seconds(512, 0, c=0) * (1 + 1e-9)
    assert sizes[-2] < 300  # at offset ~1700 attention is about as costly as the weights


def test_without_attention_cost_chunks_are_prefill_chunk_tokens() -> None:
    sizer = ChunkSizer(512, 0.0)  # e.g. recurrent layers only, or the ratio of a group that does not learn
    assert [n for n, _ in _schedule(sizer, 1999)] == [512, 512, 512, 463]


def test_chunks_never_fall_below_the_floor() -> None:
    sizer = ChunkSizer(512, 10.0)  # a wildly wrong estimate (or a prompt far into a long context)
    assert sizer.floor == MIN_CHUNK
    assert sizer.tokens(50_000, 900, sizer.budget) == MIN_CHUNK  # the prompt still advances
    assert sizer.tokens(50_000, 5, sizer.budget) == 5  # but never past the prompt
    small = ChunkSizer(7, 10.0)
    assert small.floor == 7 and small.tokens(100, 50, small.budget) == 7  # prefill_chunk below the floor: all of it
    # with what is left of a step's budget after another row, the floor still holds
    assert sizer.tokens(0, 900, 0.0) == MIN_CHUNK


def test_a_budget_of_at_most_the_floor_is_counted_in_tokens() -> None:
    assert PrefillCost(MIN_CHUNK, ratio=1e-3).sizer() == ChunkSizer(MIN_CHUNK, 0.0)  # plans independent of timings
    assert PrefillCost(MIN_CHUNK + 1, ratio=1e-3).sizer() == ChunkSizer(MIN_CHUNK + 1, 1e-3)


def test_fits_compares_costs_up_to_rounding() -> None:
    sizer = ChunkSizer(512, 8e-4)
    assert sizer.fits(512, 0, sizer.budget) and not sizer.fits(513, 0, sizer.budget)
    assert sizer.fits(100, 0, sizer.cost(100, 0)) and not sizer.fits(100, 1, sizer.cost(100, 0))


def _training(noise: float = 0.0, seed: int = 0, b: float = B) -> list[Sample]:
    """Samples a batch would record: short prompts, long prompts' chunks (sized at ratios 1e-3 and 5e-4)."""
    rng = np.random.default_rng(seed)
    rows = [(24, 0), (60, 0), *_schedule(ChunkSizer(512, 1e-3), 1999), *_schedule(ChunkSizer(512, 5e-4), 1500)]
    return [Sample.of([(n, o)], _seconds(n, o, b=b) * (1 + noise * abs(rng.standard_normal()))) for n, o in rows]


def test_the_fit_recovers_the_ratio_from_timings() -> None:
    fitted = fit_ratio(_training())
    assert fitted is not None and math.isclose(fitted, B / A, rel_tol=1e-6)


def test_the_fit_holds_under_timing_noise() -> None:
    # another process only ever adds time: one-sided noise of ~4% per forward
    for seed in range(5):
        fitted = fit_ratio(_training(noise=0.05, seed=seed))
        assert fitted is not None and abs(fitted / (B / A) - 1) < 0.25


def test_attention_without_measurable_cost_fits_a_zero_ratio() -> None:
    assert fit_ratio(_training(b=0.0)) == pytest.approx(0.0, abs=1e-9)  # sliding windows, recurrent state
    rows = _training(b=0.0)
    rows[-1] = attrs.evolve(rows[-1], seconds=rows[-1].seconds * 0.9)  # noise that makes b negative: counted as zero
    fitted = fit_ratio(rows)
    assert fitted is not None and fitted < 1e-5


def test_the_fit_drops_the_constant_when_the_samples_cannot_tell_it_apart() -> None:
    rows = [Sample.of([(512, o)], _seconds(512, o, c=0.0)) for o in (0, 512, 1024, 1536)]
    fitted = fit_ratio(rows)  # every chunk the same length: c and a*512 are one column
    assert fitted is not None and math.isclose(fitted, B / A, rel_tol=1e-6)


def test_too_few_samples_determine_nothing() -> None:
    rows = _training()
    assert fit_ratio([]) is None and fit_ratio([rows[0], rows[3]]) is None  # an exact solve of two fits any noise
    assert fit_ratio([rows[3]] * 5) is None  # one chunk measured five times: neither offset nor length varies
    # chunks from an empty cache only: attention within a chunk is confounded with how cost bends with length
    assert fit_ratio([*rows[:3], Sample.of([(300, 0)], _seconds(300, 0))]) is None
    assert fit_ratio(rows[:4]) is not None  # the long prompt's second chunk had a prefix


def test_the_cost_model_starts_from_the_prior_and_learns_at_most_twofold_per_forward() -> None:
    cost = PrefillCost(512)
    assert cost.ratio == PRIOR_RATIO and cost.sizer() == ChunkSizer(512, PRIOR_RATIO)
    ratios = []
    for n, o in _schedule(ChunkSizer(512, 1e-3), 1999) * 3:
        cost.record([(n, o)], _seconds(n, o, b=10 * B))  # attention 10x the prior's guess
        ratios.append(cost.ratio)
    assert all(r2 <= 2 * r1 for r1, r2 in zip([PRIOR_RATIO, *ratios], ratios, strict=False))
    assert math.isclose(ratios[-1], 10 * B / A, rel_tol=1e-6)  # and then it holds the measured ratio


def test_the_cost_model_records_forwards_of_several_rows_and_ignores_bad_times() -> None:
    cost = PrefillCost(512, learn=False)
    cost.record([(20, 0), (20, 100)], 0.05)  # one [2, 20] forward: its rows' tokens and pairs add up
    assert list(cost.samples) == [Sample(tokens=40, within=2 * 210, prefix=20 * 100, seconds=0.05)]
    for bad in (0.0, -1.0, math.nan, math.inf):
        cost.record([(20, 0)], bad)
    cost.record([], 0.1)
    assert len(cost.samples) == 1


def test_a_cost_model_that_does_not_learn_keeps_its_ratio() -> None:
    cost = PrefillCost(512, learn=False, ratio=0.0)
    for n, o in _schedule(ChunkSizer(512, 1e-3), 1999):
        cost.record([(n, o)], _seconds(n, o))
    assert cost.ratio == 0.0 and len(cost.samples) > 3
