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
