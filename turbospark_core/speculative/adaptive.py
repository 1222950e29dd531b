"""How many tokens to draft: the count that commits the most tokens per unit of compute.

A verify of ``k`` drafts commits ``E(a, k) = (1 - a^(k+1)) / (1 - a)`` tokens on
average when each drafted token is kept with probability ``a`` (given the ones
before it were), and costs a forward of ``k + 1`` tokens plus the drafting.
Both are measured while the sequence decodes:

* :class:`Acceptance`: the per-token acceptance rate for each *source* of
  drafts (prompt lookup: the length of the matched tail, a strong predictor;
  other drafters: one source), as decayed counts of kept tokens and rejections
  (the maximum-likelihood rate of a geometric run cut off at ``k``), pulled
  towards a prior by a few pseudo-observations.
* :class:`StepTimes`: the cost of a step by the tokens its forward runs
  (``k + 1`` for one sequence, ``B * L`` for a batch), in CPU seconds of the
  process (:func:`clock`: on a shared machine wall time swings twofold with
  the neighbours' load while CPU time stays put, so counts measured minutes
  apart compare fairly; on an idle machine it weighs the parallel part of a
  big forward a little heavier than wall time would, which errs towards
  shorter drafts), the median of its latest samples per count;
  counts not measured yet are estimated from the measured ones (interpolated,
  or scaled along the prior slope of :data:`VERIFY_COST` plain steps per extra
  token, plus the drafting). A count measured fewer than three times is
  trusted only as far as it is not worse than its neighbours say (a sample may
  be warm-up), so it is run again and corrected; now and then a near-best
  count measured too little (or too long ago) is tried (:meth:`StepTimes.decide`).

:class:`DraftPolicy` makes the choice for one sequence: a drafter that
proposes for free (prompt lookup: ``draft_cost == 0``) proposes first and the
policy keeps the prefix worth verifying (:meth:`DraftPolicy.plan`); a drafter
that costs (a model, a head) is asked for :meth:`DraftPolicy.next_k` tokens.
:func:`best_width` picks the common width of a batched verify. A source never
worth drafting gets a 1-token probe now and then (:class:`Probe`: every 8
skips, twice as long after each probe that leaves drafting unpaid, up to 64;
a costly drafter's sequence stops after 3 such probes in a row, since each
makes the drafter catch up on the tokens decoded since), so one that starts
matching again is noticed at little cost.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence

import attrs

# a verify's extra cost per token, in plain decode steps, until measured (CPU: benchmarks/speculative.py)
VERIFY_COST = 0.25
PRIOR_RATE = 0.6  # per-token acceptance assumed before anything is measured
PRIOR_WEIGHT = 2.0  # pseudo-observations of PRIOR_RATE behind every measured rate
DECAY = 0.8  # weight of the past acceptance counts per new verify (per source)
WINDOW = 7  # step times kept per token count (their median is the estimate: a stall does not move it)
PROBE_EVERY = 8
MAX_PROBE_EVERY = 64
COSTLY_PROBES = 3  # a costly drafter's failed probes in a row before a sequence stops probing it
BATCH_MARGIN = 1.05  # a batched verify is chosen over a plain batch step only when it promises this much more
EXPLORE_EVERY = 8  # every this many length decisions, one may try a count the step times are unsure of
EXPLORE_SAMPLES = 3  # samples of a count before its time is trusted
EXPLORE_WITHIN = 0.75  # only counts whose estimated gain is at least this share of the best's are tried
STALE = 256  # decisions after which a count's time is measured again (the machine's load changes)


def clock() -> float:
    """What step costs are measured in: the process's CPU time (all threads), in seconds."""
    return time.process_time()


def expected_tokens(rate: float, k: int) -> float:
    """Tokens one verify of ``k`` drafts commits on average at per-token acceptance ``rate``."""
    if rate >= 1.0:
        return float(k + 1)
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


@attrs.define
class Acceptance:
    """Per-token acceptance rates of drafts, per draft source."""

    prior: float = PRIOR_RATE
    decay: float = DECAY
    _counts: dict[int, tuple[float, float]] = attrs.Factory(dict)  # source -> (kept tokens, rejections)

    def rate(self, source: int = 0) -> float:
        """The estimated chance that a drafted token of ``source`` is kept, given the ones before it were."""
        kept, rejected = self._counts.get(source, (0.0, 0.0))
        return (kept + self.prior * PRIOR_WEIGHT) / (kept + rejected + PRIOR_WEIGHT)

    def copy(self) -> Acceptance:
        """An independent copy (a new sequence starts from what the earlier ones taught)."""
        return Acceptance(self.prior, self.decay, dict(self._counts))

    def update(self, drafted: int, accepted: int, source: int = 0) -> None:
        """Record a verify: ``accepted`` of ``drafted`` kept (nothing drafted: nothing learnt)."""
        if drafted <= 0:
            return
        kept, rejected = self._counts.get(source, (0.0, 0.0))
        self._counts[source] = (self.decay * kept + accepted, self.decay * rejected + float(accepted < drafted))


@attrs.define
class StepTimes:
    """Wall seconds of a step by the tokens its forward runs (see the module docstring)."""

    slope: float = VERIFY_COST
    _samples: dict[int, deque[float]] = attrs.Factory(dict)  # tokens -> its latest WINDOW step costs
    _last: dict[int, int] = attrs.Factory(dict)  # tokens -> the decision count at its latest sample
    _decisions: int = 0

    def record(self, tokens: int, seconds: float) -> None:
        """A step that ran ``tokens`` tokens cost ``seconds`` of the process's CPU time (:func:`clock`)."""
        self._samples.setdefault(tokens, deque(maxlen=WINDOW)).append(seconds)
        self._last[tokens] = self._decisions

    def _count(self, tokens: int) -> int:
        return len(self._samples.get(tokens, ()))

    def unsure(self, tokens: int) -> bool:
        """Whether ``tokens`` has fewer than :data:`EXPLORE_SAMPLES` samples, or none recent."""
        fresh = self._decisions - self._last.get(tokens, -STALE) < STALE
        return self._count(tokens) < EXPLORE_SAMPLES or not fresh

    def decide(
        self, candidates: Sequence[int], gain: Callable[[int], float], tokens: Callable[[int], int], margin: float = 1.0
    ) -> int:
        """The candidate of most ``gain`` (the first, drafting nothing, unless another beats it by ``margin``);
        every :data:`EXPLORE_EVERY` decisions, a near one not measured enough.

        A candidate is explored when its estimated gain is within
        :data:`EXPLORE_WITHIN` of the best's and its step count (``tokens(c)``)
        is :meth:`unsure`: the table then learns the costs that interpolation
        cannot guess (a kernel's tile sizes make them uneven), at the price of
        an occasional step a little off the best.
        """
        self._decisions += 1
        gains = {c: gain(c) for c in candidates}
        best = max(candidates, key=gains.__getitem__)
        if gains[best] < margin * gains[candidates[0]]:
            best = candidates[0]
        if self._decisions % EXPLORE_EVERY:
            return best
        near = [c for c in candidates if gains[c] >= EXPLORE_WITHIN * gains[best] and self.unsure(tokens(c))]
        return min(near, key=lambda c: (self._count(tokens(c)), abs(c - best)), default=best)

    @property
    def measured(self) -> bool:
        """Whether any step was recorded."""
        return bool(self._samples)

    def _prior(self, tokens: int) -> float:
        return 1.0 + self.slope * (tokens - 1)

    def _estimate(self, tokens: int, skip: int | None = None) -> float:
        known = {t: statistics.median(v) for t, v in self._samples.items() if t != skip}
        if tokens in known:
            return known[tokens]
        if not known:
            return self._prior(tokens)
        below = max((t for t in known if t < tokens), default=None)
        above = min((t for t in known if t > tokens), default=None)
        if below is not None and above is not None:
            w = (tokens - below) / (above - below)
            return (1.0 - w) * known[below] + w * known[above]
        near = below if below is not None else above
        assert near is not None
        return known[near] * self._prior(tokens) / self._prior(near)

    def __call__(self, tokens: int) -> float:
        """Estimated CPU seconds of a step running ``tokens`` tokens (relative units until a step is measured).

        The median of its latest samples; with fewer than
        :data:`EXPLORE_SAMPLES` (one may be warm-up, or a stall of the
        machine), no worse than its fastest sample and than its neighbours say.
        """
        if 0 < self._count(tokens) < EXPLORE_SAMPLES:
            return min(min(self._samples[tokens]), self._estimate(tokens, skip=tokens))
        return self._estimate(tokens)


@attrs.define
class Probe:
    """When drafting is not worth it: a 1-token probe every ``every`` skips (twice as long after a failed one).

    ``give_up``: after this many failed probes in a row, no more (``None``:
    never give up). A costly drafter gives up: a probe after ``g`` plain
    tokens makes it catch up on them (a draft model runs those ``g`` tokens),
    so probing forever would cost it the whole context again.
    """

    every: int = PROBE_EVERY
    give_up: int | None = None
    _skipped: int = 0
    _failed: int = 0
    probing: bool = False

    def skip(self) -> bool:
        """Count a skipped draft; ``True`` when a probe is due (then :attr:`probing` until :meth:`result`)."""
        if self.give_up is not None and self._failed >= self.give_up:
            return False
        self._skipped += 1
        if self._skipped < self.every:
            return False
        self._skipped = 0
        self.probing = True
        return True

    def result(self, pays: bool) -> None:
        """The probe's outcome: drafting pays again (the interval resets), or not yet (it doubles)."""
        self.probing = False
        self.every = PROBE_EVERY if pays else min(2 * self.every, MAX_PROBE_EVERY)
        self._failed = 0 if pays else self._failed + 1


def best_length(rate: float, available: int, times: StepTimes, base: int = 1) -> int:
    """The ``k`` in ``0 .. available`` maximizing ``E(rate, k) / times(base + k)`` (now and then a near one
    the table is unsure of: :meth:`StepTimes.decide`)."""

    def gain(k: int) -> float:
        return expected_tokens(rate, k) / times(base + k)

    return times.decide(range(available + 1), gain, lambda k: base + k)


def best_width(rows: Sequence[tuple[int, int, float]], times: StepTimes) -> int:
    """The width ``L`` of a batched verify: most tokens committed per second over every row.

    ``rows``: per row ``(backlog, available, rate)``: the committed tokens it
    must run, the drafts it could verify after them, and their acceptance rate.
    Every row is padded to ``L``, so the forward runs ``len(rows) * L`` tokens
    and a row verifies ``min(available, L - backlog)`` drafts. A width past the
    narrowest must promise :data:`BATCH_MARGIN` more: on a CPU a batch's forward
    costs nearly in proportion to its tokens, so its gains are small and the
    estimates' noise would otherwise turn them into losses.
    """
    low = max(m for m, _, _ in rows)
    high = max(m + n for m, n, _ in rows)

    def gain(width: int) -> float:
        tokens = sum(expected_tokens(a, max(0, min(n, width - m))) for m, n, a in rows)
        return tokens / times(len(rows) * width)

    return times.decide(range(low, high + 1), gain, lambda width: len(rows) * width, BATCH_MARGIN)


@attrs.define
class DraftHistory:
    """What every sequence of one open's drafter has taught: step times, and acceptance to start from.

    Step times depend on the model and the machine, not on the sequence, so
    they are shared: ``times`` for one sequence's steps (by ``k + 1``),
    ``batch_times`` for the batch engine's forwards over several rows (by
    ``B * L``: several rows' bookkeeping makes them dearer per token). Each
    sequence keeps its own acceptance rates, starting from these.
    """

    times: StepTimes = attrs.Factory(StepTimes)
    batch_times: StepTimes = attrs.Factory(StepTimes)
    acceptance: Acceptance = attrs.Factory(Acceptance)


@attrs.define
class DraftPolicy:
    """The draft length of one sequence.

    Attributes:
        k_max: The most tokens drafted per verify (``num_draft_tokens``).
        draft_cost: A drafted token's cost in plain target steps (0: the
            drafter proposes for free and :meth:`plan` trims its proposal;
            otherwise :meth:`next_k` says how many to draft).
        adaptive: ``False``: always ``k_max`` (or all a free drafter proposes, up to it).
        history: Shared with the drafter's other sequences (its step times
            are this policy's; this one's acceptance starts as a copy of its
            acceptance, which also learns from this sequence).
    """

    k_max: int
    draft_cost: float = 0.0
    adaptive: bool = True
    history: DraftHistory = attrs.Factory(DraftHistory)
    acceptance: Acceptance = attrs.field(init=False)
    _probes: dict[int, Probe] = attrs.Factory(dict)

    def __attrs_post_init__(self) -> None:
        self.acceptance = self.history.acceptance.copy()
        for times in (self.history.times, self.history.batch_times):
            if not times.measured:
                times.slope = VERIFY_COST + self.draft_cost

    @property
    def times(self) -> StepTimes:
        """The step times (shared)."""
        return self.history.times

    @property
    def lookahead(self) -> bool:
        """Whether the drafter proposes before the length is chosen (it costs nothing)."""
        return self.draft_cost == 0.0

    def _probe(self, source: int) -> Probe:
        return self._probes.setdefault(source, Probe(give_up=None if self.lookahead else COSTLY_PROBES))

    def plan(self, source: int, available: int, base: int = 1) -> int:
        """How many of a free proposal's ``available`` tokens (from ``source``) to verify after ``base`` tokens."""
        available = min(available, self.k_max)
        if not self.adaptive or available <= 0:
            return available
        return self.or_probe(best_length(self.acceptance.rate(source), available, self.times, base), source)

    def next_k(self, base: int = 1) -> int:
        """How many tokens a costly drafter should draft for the next verify (0: a plain step)."""
        if not self.adaptive:
            return self.k_max
        return self.or_probe(best_length(self.acceptance.rate(), self.k_max, self.times, base), 0)

    def or_probe(self, k: int, source: int) -> int:
        """``k``, or when it is 0 a 1-token probe of ``source`` if one is due (until its verify is recorded)."""
        if k > 0:
            return k
        probe = self._probe(source)
        return 1 if probe.probing or probe.skip() else 0

    def update(self, drafted: int, accepted: int, source: int = 0) -> None:
        """Record a verify: ``accepted`` of ``drafted`` (from ``source``) kept."""
        if drafted <= 0:
            return
        self.acceptance.update(drafted, accepted, source)
        self.history.acceptance.update(drafted, accepted, source)
        probe = self._probes.get(source)
        if probe is not None and probe.probing:  # judged by the rate it leaves, not by one kept token
            probe.result(self._pays(source))

    def _pays(self, source: int) -> bool:
        """Whether drafting from ``source`` beats a plain step at its current rate (nothing counted)."""
        rate = self.acceptance.rate(source)
        plain = 1.0 / self.times(1)
        return any(expected_tokens(rate, k) / self.times(1 + k) > plain for k in range(1, self.k_max + 1))

    def timed(self, tokens: int, seconds: float) -> None:
        """Record a step's wall time (its forward ran ``tokens`` tokens)."""
        self.times.record(tokens, seconds)
