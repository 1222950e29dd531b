"""Prompt lookup (turbospark_core.speculative.ngram)."""

from __future__ import annotations

from turbospark_core.sampling import Sampler, SamplingParams
from turbospark_core.speculative.ngram import NgramDrafter, lookup


def test_the_latest_occurrence_of_the_longest_tail_wins() -> None:
    #          0  1  2  3  4  5  6  7  8  9 10
    context = [1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3]
    # tail (2, 3) occurs at 1 and 5: the latest (5) is followed by 5, 6, 2
    assert lookup(context, 3) == [5, 6, 2]
    # a longer tail that matches beats a more recent shorter one
    assert lookup([7, 8, 1, 2, 0, 2, 7, 8], 2) == [1, 2]


def test_the_proposal_stops_at_k_and_a_copy_reaching_the_tail_repeats_its_period() -> None:
    assert lookup([1, 2, 3, 1, 2], 1) == [3]
    # (1, 2) last occurred 3 tokens back: what followed it (3, 1, 2) is copied again and again
    assert lookup([1, 2, 3, 1, 2], 7) == [3, 1, 2, 3, 1, 2, 3]
    assert lookup([9, 5, 5, 5], 4) == [5, 5, 5, 5]


def test_nothing_matches_nothing_is_proposed() -> None:
    assert lookup([1, 2, 3, 4], 4) == []
    assert lookup([5], 4) == []
    assert lookup([1, 1], 0) == []


def test_the_drafter_is_deterministic_whatever_the_sampling() -> None:
    drafter = NgramDrafter()
    draft = drafter.propose([4, 5, 6, 4, 5], 3, Sampler(SamplingParams(temperature=1.0, seed=0)))
    assert draft.tokens == (6, 4, 5)
    assert draft.probs is None
    assert drafter.capture_layers == ()


def test_a_short_match_that_continues_the_previous_copy_is_its_own_source() -> None:
    from turbospark_core.speculative.ngram import ALIGNED, match

    #          0  1  2  3  4  5  6  7  8  9
    source = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert match([*source, 1, 2], 3) == ([3, 4, 5], 2, 2)  # the copy starts at index 2
    drafter = NgramDrafter()
    sampler = Sampler(SamplingParams())
    first = drafter.propose([*source, 1, 2], 3, sampler)
    assert (first.tokens, first.source) == ((3, 4, 5), 2)
    # the model rewrote "3 4" as "33" and went on with 5: a 1-token match, where the copy would be now
    again = drafter.propose([*source, 1, 2, 33, 5], 3, sampler)
    assert (again.tokens, again.source) == ((6, 7, 8), 1 + ALIGNED)
    drafter.reset()
    assert drafter.propose([*source, 1, 2, 33, 5], 3, sampler).source == 1  # nothing to continue
    elsewhere = NgramDrafter()
    elsewhere.propose([*source, 9], 2, sampler)  # copying from index 9 on
    assert elsewhere.propose([*source, 9, 44, 2], 2, sampler).source == 1  # index 2 is behind that copy
