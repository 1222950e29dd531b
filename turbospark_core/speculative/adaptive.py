"""How many tokens to draft next: the count that maximizes expected tokens per unit of cost.

With a per-token acceptance rate ``a``, a verify of ``k`` drafts commits
``(1 - a^(k+1)) / (1 - a)`` tokens on average and costs about
``1 + (verify_cost + draft_cost) * k`` plain decode steps. The rate is tracked
as a moving average of what recent verifies accepted; when no ``k >= 1`` pays,
the sequence decodes plainly and probes with one draft every few steps, so a
drafter that stops matching (open-ended chat under prompt lookup) costs little.
"""

from __future__ import annotations

import attrs

# a verify's extra cost per drafted token, in plain decode steps (measured on CPU: benchmarks/speculative.py)
VERIFY_COST = 0.08
PROBE_EVERY = 8


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

    def next_k(self) -> int:
        """The draft length for the next step (0: a plain step)."""
        if not self.adaptive:
            return self.k_max
        unit = self.verify_cost + self.draft_cost
        best = max(range(self.k_max + 1), key=lambda k: expected_tokens(self.rate, k) / (1.0 + unit * k))
        if best == 0:
            self._idle += 1
            if self._idle >= PROBE_EVERY:
                self._idle = 0
                return 1
        return best

    def update(self, drafted: int, accepted: int) -> None:
        """Record a verify: ``accepted`` of ``drafted`` kept (nothing drafted: nothing learnt)."""
        if drafted <= 0:
            return
        # per-token acceptance of a truncated geometric run: accepted successes, one failure unless all kept
        observed = 1.0 if accepted == drafted else accepted / (accepted + 1.0)
        self.rate = self.decay * self.rate + (1.0 - self.decay) * observed
