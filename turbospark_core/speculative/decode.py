"""The speculative decode loop of one sequence: draft, verify in one forward, accept, rewind.

Each step the drafter proposes up to ``k`` tokens (``k`` from
:class:`~.adaptive.AdaptiveK`); the target runs the last committed token and
the drafts in one forward; :func:`~.verify.accept` keeps a prefix and adds the
bonus token; the caches drop what was rejected (:mod:`.rewind`). Committed
tokens are yielded one at a time, so EOS and stop strings end the output at
the right token even inside an accepted block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import attrs
import mlx.core as mx

from turbospark_core.kv_cache import Cache, trim_caches, trimmable
from turbospark_core.sampling import Sampler
from turbospark_core.speculative.adaptive import AdaptiveK
from turbospark_core.speculative.drafter import Draft, Drafter
from turbospark_core.speculative.rewind import Checkpoint
from turbospark_core.speculative.verify import accept, penalized_rows

if TYPE_CHECKING:
    from turbospark_core.speculative.factory import DrafterSetup

# tokens, caches, capture (None: capture nothing) -> logits [1, T, V]
Forward = Callable[[list[int], list[Cache], "dict[int, mx.array] | None"], mx.array]


@attrs.define
class DraftCounts:
    """Tokens drafted and accepted over one generation."""

    drafted: int = 0
    accepted: int = 0
    verifies: int = 0


def observe(drafter: Drafter, start: int, capture: dict[int, mx.array] | None) -> None:
    """Hand a forward's captured residuals (batch row 0) to the drafter."""
    if capture is not None:
        drafter.observe(start, {layer: capture[layer][0] for layer in drafter.capture_layers})


@attrs.define
class SpeculativeLoop:
    """Decodes one sequence speculatively after its prefill.

    Attributes:
        forward: Runs tokens on the caches (with the request's steering).
        caches: The sequence's caches, holding ``held`` tokens of ``context``.
        drafter: This sequence's drafter.
        sampler: The request's sampler.
        context: Every committed token: the prompt and the output so far
            (the last one sampled and not yet run by the target).
        held: How many tokens of ``context`` the caches hold.
    """

    forward: Forward
    caches: list[Cache]
    drafter: Drafter
    setup: DrafterSetup
    sampler: Sampler
    context: list[int]
    held: int
    counts: DraftCounts = attrs.Factory(DraftCounts)
    control: AdaptiveK = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.control = AdaptiveK(self.setup.num_draft_tokens, self.setup.draft_cost, self.setup.adaptive)

    def tokens(self, budget: int) -> Iterator[int]:
        """Commit and yield up to ``budget`` more tokens (the caller stops early at EOS or a stop string)."""
        while budget > 0:
            committed = self.step(budget)
            for tok in committed:
                budget -= 1
                yield tok

    def step(self, budget: int) -> list[int]:
        """One verify: commits between 1 and ``min(k + 1, budget)`` tokens, returned in order."""
        k = min(self.control.next_k(), budget - 1)
        draft = self.drafter.propose(self.context, k, self.sampler) if k > 0 else Draft(tokens=())
        drafted = list(draft.tokens[:k])
        probs = None if draft.probs is None else draft.probs[: len(drafted)]
        checkpoint = Checkpoint(self.caches, self.held) if drafted and not trimmable(self.caches) else None
        feed = [*self.context[self.held :], *drafted]
        capture: dict[int, mx.array] | None = {} if self.drafter.capture_layers else None
        logits = self.forward(feed, self.caches, capture)[0]
        observe(self.drafter, self.held, capture)
        rows = logits[len(feed) - len(drafted) - 1 :]
        history = self.context[-self.sampler.params.repetition_context :]
        rows = penalized_rows(rows, history, drafted, self.sampler)
        verdict = accept(rows, Draft(tokens=drafted, probs=probs), self.sampler)
        j = len(verdict.accepted)
        self.counts.drafted += len(drafted)
        self.counts.accepted += j
        self.counts.verifies += 1
        self.control.update(len(drafted), j)
        held_now = self.held + len(feed)
        keep = len(self.context) + j  # the context and the accepted drafts; the bonus is run next step
        if keep < held_now:
            if checkpoint is None:
                trim_caches(self.caches, held_now - keep)
            else:
                restored = checkpoint.rewind(self.caches, held_now, keep)
                replay = [*self.context, *verdict.accepted][restored:keep]
                if replay:
                    self.forward(replay, self.caches, None)
        self.held = keep
        self.context.extend(verdict.tokens)
        self.drafter.rewind(len(self.context))
        return verdict.tokens
