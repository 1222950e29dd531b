"""How many tokens to draft next: the count that maximizes expected tokens per unit of cost.

With a per-token acceptance rate ``a``, a verify of ``k`` drafts commits
``(1 - a^(k+1)) / (1 - a)`` tokens on average and costs about
``1 + unit * k`` plain decode steps. The rate is tracked as a moving average
of what recent verifies accepted; ``unit`` (a verify's extra cost per drafted
token plus the drafting itself) is measured from the steps' wall time: plain
steps give the base, drafting steps the slope. Until measured it is
``verify_cost + draft_cost``. When no ``k >= 1`` pays, the sequence decodes
plainly and probes with one draft every few steps (twice as long after each
failed probe, up to 64), so a drafter that stops matching (open-ended chat under prompt lookup) costs little.
"""

from __future__ import annotations

import attrs

# a verify's extra cost per drafted token, in plain decode steps, until measured (CPU: benchmarks/speculative.py)
VERIFY_COST = 0.25
PROBE_EVERY = 8
MAX_PROBE_EVERY = 64


def expected_tokens(rate: float, k: int) -> float:
    """Tokens one verify of ``k`` drafts commits on average at per-token acceptance ``rate``."""
    if rate >= 1.0:
        return float(k + 1)
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


@attrs.define
class AdaptiveK:
    """The draft length controller of one sequence.

    Attributes:
        k_max: The most tokens drafted per verify (``num_draft_tokens``).
        draft_cost: A drafted token's cost in plain target steps (0 for prompt
            lookup; about the size ratio for a draft model).
        adaptive: ``False`` always drafts ``k_max``.
    """

    k_max: int
    draft_cost: float = 0.0
    adaptive: bool = True
    verify_cost: float = VERIFY_COST
    rate: float = 0.8  # optimistic start: the first verifies measure it
    decay: float = 0.7
    _idle: int = 0
    _base: float | None = None  # seconds of a plain step (moving average)
    _slope: float | None = None  # extra seconds per drafted token (moving average)
    _steps: int = 0
    _probe_every: int = PROBE_EVERY
    _probing: bool = False

    @property
    def unit(self) -> float:
        """A drafted token's cost (verify + drafting) in plain steps: measured, else the prior."""
        if self._base is None or self._slope is None or self._base <= 0:
            return self.verify_cost + self.draft_cost
        return min(max(self._slope / self._base, 0.01), 4.0)

    def timed(self, k: int, seconds: float) -> None:
        """Record a step's wall time (``k`` drafts; 0: a plain step)."""
        if k == 0:
            self._base = seconds if self._base is None else 0.8 * self._base + 0.2 * seconds
        elif self._base is not None:
            slope = max(seconds - self._base, 0.0) / k
            self._slope = slope if self._slope is None else 0.8 * self._slope + 0.2 * slope

    def next_k(self) -> int:
        """The draft length for the next step (0: a plain step)."""
        if not self.adaptive:
            return self.k_max
        self._steps += 1
        if self._steps in (2, 3):  # measure a plain step's cost (the first step pays warm-up)
            return 0
        unit = self.unit
        best = max(range(self.k_max + 1), key=lambda k: expected_tokens(self.rate, k) / (1.0 + unit * k))
        if best == 0:
            self._idle += 1
            if self._idle >= self._probe_every:
                self._idle = 0
                self._probing = True
                return 1
        return best

    def update(self, drafted: int, accepted: int) -> None:
        """Record a verify: ``accepted`` of ``drafted`` kept (nothing drafted: nothing learnt)."""
        if drafted <= 0:
            return
        if self._probing:  # a failed probe waits twice as long for the next (up to MAX_PROBE_EVERY)
            self._probing = False
            self._probe_every = PROBE_EVERY if accepted else min(2 * self._probe_every, MAX_PROBE_EVERY)
        # per-token acceptance of a truncated geometric run: accepted successes, one failure unless all kept
        observed = 1.0 if accepted == drafted else accepted / (accepted + 1.0)
        self.rate = self.decay * self.rate + (1.0 - self.decay) * observed
