"""The batched verify's pieces (turbospark_core.speculative.batched): plans, width, padding, judging a row."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core.sampling import Sampler, SamplingParams
from turbospark_core.speculative.adaptive import PROBE_EVERY, DraftPolicy, StepTimes
from turbospark_core.speculative.batched import RowPlan, choose_width, fit, judge, padded, propose
from turbospark_core.speculative.drafter import Draft


class _Fixed:
    """Proposes ``tokens`` (as many as asked) from source 3."""

    name = "fixed"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.asked: list[int] = []

    def reset(self) -> None:
        """Stateless."""

    def observe(self, start: int, hidden: object) -> None:
        """Never called."""

    def rewind(self, length: int) -> None:
        """Stateless."""

    def propose(self, context: Sequence[int], k: int, sampler: Sampler) -> Draft:
        self.asked.append(k)
        return Draft(tokens=self.tokens[:k], source=3)


GREEDY = Sampler(SamplingParams())


def test_a_row_proposes_after_its_backlog_and_never_past_k_max_plus_one() -> None:
    policy, drafter = DraftPolicy(4), _Fixed([7, 8, 9, 10, 11])
    context = [1, 2, 3, 4, 5]
    plan = propose(policy, drafter, context, held=4, room=10, sampler=GREEDY)
    assert plan.backlog == (5,) and plan.draft.tokens == (7, 8, 9, 10) and plan.feed == [5, 7, 8, 9, 10]
    plan = propose(policy, drafter, context, held=2, room=10, sampler=GREEDY)  # a recurrent row catching up
    assert plan.backlog == (3, 4, 5) and plan.draft.tokens == (7, 8)  # backlog + drafts <= k_max + 1
    assert propose(policy, drafter, context, held=0, room=10, sampler=GREEDY).draft.tokens == ()
    assert propose(policy, drafter, context, held=4, room=1, sampler=GREEDY).draft.tokens == (7,)  # max_tokens
    assert propose(None, None, context, held=3, room=5, sampler=GREEDY) == RowPlan((4, 5))  # no drafter


def test_the_width_verifies_every_proposal_when_fixed_and_what_pays_when_adaptive() -> None:
    plans = [RowPlan((1,), Draft(tokens=[2, 3, 4])), RowPlan((5, 6), Draft(tokens=()))]
    fixed = [DraftPolicy(3, adaptive=False)] * 2
    assert choose_width(plans, fixed, StepTimes()) == 4
    times = StepTimes()
    for t in range(1, 13):
        for _ in range(3):
            times.record(t, 0.01 * t)  # every token costs a full step: drafting never pays
    adaptive = [DraftPolicy(3), DraftPolicy(3)]
    assert choose_width(plans, adaptive, times) == 2  # the widest backlog: the other row's first draft rides free
    lone = [RowPlan((1,), Draft(tokens=[2, 3, 4])), RowPlan((5,), Draft(tokens=()))]
    widths = [choose_width(lone, adaptive, times) for _ in range(PROBE_EVERY)]
    assert widths == [1] * (PROBE_EVERY - 1) + [2]  # plain steps, then a 1-token probe of the drafting row
    cheap = StepTimes()
    for t in range(1, 13):
        for _ in range(3):
            cheap.record(t, 0.01)  # a forward costs the same whatever its tokens: verify everything
    assert choose_width(plans, [DraftPolicy(3), DraftPolicy(3)], cheap) == 4


def test_fit_and_padding() -> None:
    plan = RowPlan((1,), Draft(tokens=[2, 3, 4]))
    assert fit(plan, 3).feed == [1, 2, 3] and fit(plan, 3).drafted.tokens == (2, 3)
    assert fit(plan, 1).feed == [1] and fit(plan, 9).verify == 3
    assert np.array(padded([fit(plan, 3), RowPlan((7,))], 3)).tolist() == [[1, 2, 3], [7, 7, 7]]


@pytest.mark.parametrize("logprobs", [False, True])
def test_a_greedy_row_keeps_the_longest_exact_prefix_on_both_paths(logprobs: bool) -> None:
    rng = np.random.default_rng(0)
    logits = mx.array(rng.standard_normal((5, 50)).astype(np.float32))  # [L, V], the row's verify
    best = np.argmax(np.array(logits), axis=-1)
    # backlog of 2 tokens: the drafts sit at rows 1.., the first two right, the third wrong
    plan = RowPlan((11, 12), Draft(tokens=[int(best[1]), int(best[2]), (int(best[3]) + 1) % 50]), verify=3)
    fast = judge(logits, plan, [11, 12], GREEDY, best, keep_rows=logprobs)
    slow = judge(logits, plan, [11, 12], GREEDY, None, keep_rows=logprobs)
    assert fast.committed == slow.committed == [int(best[1]), int(best[2]), int(best[3])]
    assert fast.accepted == slow.accepted == 2
    if logprobs:  # the committed tokens' rows (what their log probabilities come from)
        assert fast.scores is not None and fast.scores.shape == (3, 50)
        np.testing.assert_array_equal(np.array(fast.scores), np.array(logits[1:4]))
