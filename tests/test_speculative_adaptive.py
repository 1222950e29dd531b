"""The adaptive draft length (turbospark_core.speculative.adaptive)."""

from __future__ import annotations

import pytest

from turbospark_core.speculative.adaptive import (
    COSTLY_PROBES,
    EXPLORE_EVERY,
    MAX_PROBE_EVERY,
    PRIOR_RATE,
    PROBE_EVERY,
    VERIFY_COST,
    Acceptance,
    DraftHistory,
    DraftPolicy,
    Probe,
    StepTimes,
    best_length,
    best_width,
    expected_tokens,
)


def test_expected_tokens_per_verify() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_acceptance_is_the_rate_of_a_cut_geometric_run_per_source() -> None:
    acc = Acceptance()
    assert acc.rate(3) == pytest.approx(PRIOR_RATE)  # nothing seen: the prior
    for _ in range(20):
        acc.update(4, 4, source=4)  # every token kept: no rejection observed
        acc.update(4, 0, source=1)  # the first token rejected each time
    assert acc.rate(4) > 0.95
    low = acc.rate(1)
    assert low < 0.2  # a few pseudo-observations of the prior stay behind the decayed counts
    acc.update(0, 0, source=1)  # nothing drafted: nothing learnt
    assert acc.rate(1) == low
    copied = acc.copy()
    copied.update(4, 0, source=4)
    assert copied.rate(4) < acc.rate(4)  # independent of the original from then on


def test_step_times_are_measured_interpolated_and_scaled_along_the_prior() -> None:
    times = StepTimes()
    assert times(1) == 1.0 and times(5) == pytest.approx(1.0 + 4 * VERIFY_COST)  # the prior, relative
    for _ in range(3):
        times.record(1, 0.010)
    assert times(5) / times(1) == pytest.approx(1 + 4 * VERIFY_COST)  # scaled from the measured count
    for seconds in (0.030, 0.031, 0.029):
        times.record(9, seconds)
    assert times(9) / times(1) == pytest.approx(3.0, rel=0.05)
    assert times(5) / times(1) == pytest.approx(2.0, rel=0.05)  # interpolated
    before = times(9)
    times.record(9, 1.0)  # a stall of the machine: the median does not move
    assert times(9) == pytest.approx(before, rel=0.05)


def test_a_count_measured_too_little_is_trusted_only_as_far_as_its_neighbours_allow() -> None:
    times = StepTimes()
    for _ in range(3):
        for t, s in ((1, 0.010), (3, 0.020)):
            times.record(t, s)
    times.record(2, 0.050)  # one slow sample (warm-up?): no worse than the neighbours say, so tried again
    assert times(2) / times(1) == pytest.approx(1.5, rel=0.1)
    times.record(2, 0.050)
    times.record(2, 0.050)  # confirmed
    assert times(2) / times(1) > 3


def test_decisions_now_and_then_try_a_near_count_the_table_is_unsure_of() -> None:
    times = StepTimes()
    for t in (1, 3):
        for _ in range(3):
            times.record(t, 0.01 * t)
    chosen = [times.decide(range(4), lambda c: 1.0 - 0.01 * c, lambda c: c + 1) for _ in range(EXPLORE_EVERY)]
    assert chosen[:-1] == [0] * (EXPLORE_EVERY - 1)  # the best...
    assert chosen[-1] in (1, 3)  # ...but every EXPLORE_EVERY-th decision a near count with too few samples
    far = [times.decide(range(4), lambda c: 1.0 if c == 0 else 0.1, lambda c: c + 1) for _ in range(EXPLORE_EVERY)]
    assert far == [0] * EXPLORE_EVERY  # a count far from the best is never tried


def test_probes_back_off_after_failures_and_reset_after_a_hit() -> None:
    probe = Probe()
    gaps = []
    for _ in range(5):
        n = 1
        while not probe.skip():
            n += 1
        gaps.append(n)
        assert probe.probing
        probe.result(pays=False)
    assert gaps[0] == PROBE_EVERY and gaps[-1] == MAX_PROBE_EVERY
    while not probe.skip():
        pass
    probe.result(pays=True)
    assert probe.every == PROBE_EVERY


def test_best_length_weighs_acceptance_against_measured_cost() -> None:
    times = StepTimes()
    for t in range(1, 10):
        times.record(t, 0.01 * (1 + 0.25 * (t - 1)))
    assert best_length(0.95, 8, times) >= 6  # nearly every draft kept: draft long
    assert best_length(0.1, 8, times) == 0  # almost none kept: a plain step is better
    assert best_length(0.95, 2, times) == 2  # never more than available
    costly = StepTimes()
    for t in range(1, 10):
        costly.record(t, 0.01 * (1 + 2.0 * (t - 1)))  # a slow drafter: each token costs two steps
    assert best_length(0.8, 8, costly) == 0


def test_the_batch_width_counts_every_row_and_the_tokens_the_forward_runs() -> None:
    times = StepTimes()
    for t in range(1, 33):
        times.record(t, 0.01 * (1 + 0.25 * (t - 1)))
    sure = [(1, 8, 0.99)] * 2
    assert best_width(sure, times) > 3
    assert best_width([(1, 8, 0.05)] * 4, times) == 1  # nothing is worth verifying: a plain step
    assert best_width([(3, 0, 0.0), (1, 0, 0.0)], times) == 3  # never narrower than a backlog


def test_a_free_drafter_is_planned_by_source_and_probed_when_skipped() -> None:
    policy = DraftPolicy(8)
    assert policy.lookahead
    for _ in range(10):
        policy.update(8, 8, source=4)
        policy.update(2, 0, source=1)
    assert policy.plan(4, 8) > 3
    assert policy.plan(4, 2) == 2  # no more than proposed
    plans = [policy.plan(1, 8) for _ in range(PROBE_EVERY)]
    assert plans[:-1] == [0] * (PROBE_EVERY - 1) and plans[-1] == 1  # a probe after PROBE_EVERY skips
    assert policy.plan(1, 8) == 1  # still probing until the verify is recorded
    policy.update(1, 1, source=1)
    assert policy.plan(0, 0) == 0


def test_a_costly_drafter_drafts_less_and_a_fixed_length_never_adapts() -> None:
    cheap, costly = DraftPolicy(8), DraftPolicy(8, draft_cost=0.6)
    for policy in (cheap, costly):
        for _ in range(5):
            policy.update(4, 3)
    assert not costly.lookahead
    assert costly.next_k() < cheap.plan(0, 8)
    fixed = DraftPolicy(3, adaptive=False)
    fixed.update(3, 0)
    assert fixed.next_k() == 3 and fixed.plan(0, 8) == 3 and fixed.plan(0, 2) == 2


def test_sequences_of_one_drafter_share_step_times_and_seed_each_others_acceptance() -> None:
    history = DraftHistory()
    first = DraftPolicy(4, history=history)
    for t in (1, 1, 1, 5, 5, 5):
        first.timed(t, 0.01 * t)
    for _ in range(10):
        first.update(4, 4, source=2)
    second = DraftPolicy(4, history=history)
    assert second.times is first.times and second.times(5) / second.times(1) == pytest.approx(5, rel=0.1)
    assert second.acceptance.rate(2) > 0.9


def test_a_probe_that_keeps_its_token_but_leaves_drafting_unpaid_still_backs_off() -> None:
    """A costly drafter at 40% acceptance: a probe's token is often kept, yet drafting does not pay."""
    policy = DraftPolicy(4, draft_cost=1.0)  # each drafted token costs a plain step more
    for _ in range(6):
        policy.update(2, 0)  # the rate falls: plain steps
    gaps = []
    for _ in range(COSTLY_PROBES):
        n = 1
        while policy.next_k() == 0:
            n += 1
        gaps.append(n)
        policy.update(1, 1)  # the probe's token is kept...
    assert gaps[0] == PROBE_EVERY and gaps[1] == 2 * PROBE_EVERY  # ...but the rate still does not pay: longer gaps
    assert all(policy.next_k() == 0 for _ in range(10 * MAX_PROBE_EVERY))  # and then no more probes
    free = DraftPolicy(4)  # a free drafter (prompt lookup) never stops probing
    for _ in range(6):
        free.update(2, 0, source=1)
    probes = 0
    for _ in range(10 * MAX_PROBE_EVERY):
        if free.plan(1, 4):
            probes += 1
            free.update(1, 0, source=1)
    assert probes >= 8
