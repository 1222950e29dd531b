"""The adaptive draft length (turbospark_core.speculative.adaptive)."""

from __future__ import annotations

import pytest

from turbospark_core.speculative.adaptive import PROBE_EVERY, AdaptiveK, expected_tokens


def test_expected_tokens_per_verify() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_high_acceptance_drafts_the_most_and_low_acceptance_backs_off_to_plain_steps() -> None:
    control = AdaptiveK(6)
    for _ in range(5):
        control.update(6, 6)
    assert control.next_k() == 6
    for _ in range(10):
        control.update(control.next_k() or 1, 0)
    ks = [control.next_k() for _ in range(PROBE_EVERY * 2)]
    assert ks.count(0) >= len(ks) - 2  # plain steps, with a probe now and then
    assert 1 in ks
    for _ in range(10):
        control.update(1, 1)
    assert control.next_k() > 1  # drafts pay again


def test_a_costly_drafter_drafts_less_and_a_fixed_count_never_adapts() -> None:
    cheap, costly = AdaptiveK(8, rate=0.6), AdaptiveK(8, draft_cost=0.5, rate=0.6)
    assert costly.next_k() < cheap.next_k()
    fixed = AdaptiveK(3, adaptive=False)
    fixed.update(3, 0)
    assert fixed.next_k() == 3


def test_a_step_that_drafted_nothing_teaches_nothing() -> None:
    control = AdaptiveK(4)
    before = control.rate
    control.update(0, 0)
    assert control.rate == before


def test_the_cost_per_drafted_token_is_measured_from_step_times() -> None:
    control = AdaptiveK(8)
    assert control.unit == pytest.approx(control.verify_cost)  # the prior until measured
    assert [control.next_k() > 0, control.next_k(), control.next_k()] == [True, 0, 0]  # steps 2-3 time a plain step
    control.timed(0, 0.010)
    control.timed(4, 0.030)
    assert control.unit == pytest.approx(0.5)
    for _ in range(30):
        control.timed(4, 0.090)  # drafting got expensive (a slow drafter): k shrinks
    assert control.unit > 1.5
    assert control.next_k() < 8


def test_failed_probes_back_off() -> None:
    control = AdaptiveK(4, rate=0.0, draft_cost=2.0)
    gaps = []
    for _ in range(4):
        n = 1
        while control.next_k() == 0:
            n += 1
        gaps.append(n)
        control.update(1, 0)
    assert gaps[-1] > gaps[1] >= PROBE_EVERY
