"""Batched verify: every decoding row's drafts checked in one ``[B, L]`` forward.

Each row runs its *backlog* (the committed tokens its caches do not hold yet:
the token sampled last, or after a recurrent row was rewound a few more) and
up to ``L - len(backlog)`` of its drafts; a shorter row is padded to ``L``.
Pads and rejected drafts come after every token the row keeps, so causal
attention never lets a kept token see them, and the rewind that follows drops
them (:meth:`~turbospark_core.batch_cache.BatchCaches.rewind`): attention
layers cut each row right after its last kept token (the columns become holes,
compacted later); recurrent layers, which keep only the step's start, take a
row that did not keep all ``L`` tokens back there, and the tokens it kept
become the backlog of its next step (checkpoint and replay, the replay riding
in the next forward). A row's backlog never exceeds ``k_max + 1``: a row with
that backlog drafts nothing and keeps all it runs.

Each row accepts by the rules of the single-sequence path
(:func:`~.verify.accept`, its own sampler and repetition history) and reports
log probabilities, when asked, from the rows of the verify it commits.
:func:`choose_width` picks ``L`` for the most tokens committed per second.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core.sampling import Sampler
from turbospark_core.speculative.adaptive import DraftPolicy, StepTimes, best_width
from turbospark_core.speculative.drafter import Draft, Drafter
from turbospark_core.speculative.verify import accept, penalized_rows

EMPTY = Draft(tokens=())


def _tokens(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(value)


@attrs.frozen
class RowPlan:
    """One row's part of a batched forward: its backlog, its drafter's proposal, and how much of it is verified."""

    backlog: tuple[int, ...] = attrs.field(converter=_tokens)
    draft: Draft = EMPTY
    verify: int = 0

    @property
    def drafted(self) -> Draft:
        """The verified part of the proposal."""
        if self.verify == len(self.draft.tokens):
            return self.draft
        probs = None if self.draft.probs is None else self.draft.probs[: self.verify]
        return Draft(tokens=self.draft.tokens[: self.verify], probs=probs, source=self.draft.source)

    @property
    def feed(self) -> list[int]:
        """The tokens the row runs (before padding)."""
        return [*self.backlog, *self.draft.tokens[: self.verify]]


def propose(
    policy: DraftPolicy | None, drafter: Drafter | None, context: list[int], held: int, room: int, sampler: Sampler
) -> RowPlan:
    """A row's plan before the width is chosen: its backlog and what its drafter proposes.

    ``room``: the most drafts worth running (tokens the row may still emit,
    less the bonus); a free drafter proposes that many, a costly one what its
    policy asks for. Nothing when the backlog already fills ``k_max + 1``.
    """
    backlog = context[held:]
    if policy is None or drafter is None:
        return RowPlan(backlog)
    room = min(room, policy.k_max + 1 - len(backlog))
    if room <= 0:
        return RowPlan(backlog)
    if policy.lookahead:
        draft = drafter.propose(context, room, sampler)
    else:
        k = min(policy.next_k(len(backlog)), room)
        draft = drafter.propose(context, k, sampler) if k else EMPTY
    return RowPlan(backlog, draft, len(draft.tokens))


def choose_width(plans: Sequence[RowPlan], policies: Sequence[DraftPolicy | None], times: StepTimes) -> int:
    """The common width ``L``: every proposal when the length is fixed, else the most tokens per second.

    An adaptive row whose drafts the chosen width leaves out counts a skip;
    when its probe is due, the width grows to verify one of its drafts.
    """
    fixed = any(p is not None and not p.adaptive for p in policies)
    if fixed:
        return max(len(p.backlog) + len(p.draft.tokens) for p in plans)
    rows = [
        (len(p.backlog), len(p.draft.tokens), 0.0 if pol is None else pol.acceptance.rate(p.draft.source))
        for p, pol in zip(plans, policies, strict=True)
    ]
    width = best_width(rows, times)
    for plan, policy in zip(plans, policies, strict=True):
        skipped = policy is not None and plan.draft.tokens and width <= len(plan.backlog)
        if skipped and policy is not None and policy.or_probe(0, plan.draft.source):
            width = len(plan.backlog) + 1
    return width


def fit(plan: RowPlan, width: int) -> RowPlan:
    """``plan`` verifying as many drafts as fit ``width``."""
    return attrs.evolve(plan, verify=max(0, min(len(plan.draft.tokens), width - len(plan.backlog))))


def padded(plans: Sequence[RowPlan], width: int) -> mx.array:
    """``[B, width]`` token ids: each row's feed, padded with its last token."""
    return mx.array([[*p.feed, *[p.feed[-1]] * (width - len(p.feed))] for p in plans])


@attrs.frozen
class Judged:
    """A row's verdict: the drafts it kept and the bonus token (``committed``), and their log-probability rows."""

    committed: list[int]
    accepted: int
    scores: mx.array | None = None  # [len(committed), V] penalized logits, when the row reports log probabilities


def judge(
    logits: mx.array, plan: RowPlan, context: Sequence[int], sampler: Sampler, best: np.ndarray | None, keep_rows: bool
) -> Judged:
    """Accept a prefix of ``plan``'s drafts against the row's verify ``logits`` ``[L, V]``.

    ``best``: the row's argmax over ``L`` when it is greedy without a
    repetition penalty (the fast path: no further device work);
    ``keep_rows``: return the penalized rows of the committed tokens (for log probabilities).
    """
    start = len(plan.backlog) - 1
    draft = plan.drafted
    k = len(draft.tokens)
    if best is not None and not keep_rows:
        j = 0
        while j < k and draft.tokens[j] == int(best[start + j]):
            j += 1
        return Judged([*draft.tokens[:j], int(best[start + j])], j)
    rows = logits[start : start + k + 1]
    history = list(context[-sampler.params.repetition_context :])
    rows = penalized_rows(rows, history, draft.tokens, sampler)
    verdict = accept(rows, draft, sampler)
    committed = verdict.tokens
    return Judged(committed, len(verdict.accepted), rows[: len(committed)] if keep_rows else None)
