"""The speculative decode loop of one sequence: draft, verify in one forward, accept, rewind.

Each step the drafter proposes up to ``k`` tokens (``k`` from
:class:`~.adaptive.DraftPolicy`); the target runs the last committed token and
the drafts in one forward; :func:`~.verify.accept` keeps a prefix and adds the
bonus token; the caches drop what was rejected (:mod:`.rewind`). Committed
tokens are yielded one at a time, so EOS and stop strings end the output at
the right token even inside an accepted block.

While nothing is worth drafting (adaptive length, the default),
:meth:`SpeculativeLoop.tokens` decodes as
plain decoding does, each forward queued before the previous token is read
(so the graph building overlaps the compute), and asks the drafter after every
token whether a draft would pay; only then does it wait for the token and go
back to verifying. A drafter that stops matching (open-ended chat under prompt
lookup) so costs next to nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import attrs
import mlx.core as mx

from turbospark_core.kv_cache import Cache, trim_caches, trimmable
from turbospark_core.sampling import Sampler
from turbospark_core.speculative.adaptive import DraftPolicy, clock
from turbospark_core.speculative.drafter import Draft, Drafter
from turbospark_core.speculative.rewind import Checkpoint
from turbospark_core.speculative.verify import accept, penalized_rows

if TYPE_CHECKING:
    from turbospark_core.speculative.factory import DrafterSetup

# tokens [1, T] (lazily sampled ones too), caches, capture (None: capture nothing) -> logits [1, T, V]
Forward = Callable[[mx.array, list[Cache], "dict[int, mx.array] | None"], mx.array]


@attrs.define
class DraftCounts:
    """Tokens drafted and accepted over one generation."""

    drafted: int = 0
    accepted: int = 0
    verifies: int = 0


def observe(drafter: Drafter, start: int, capture: dict[int, mx.array] | None, row: int = 0, length: int = -1) -> None:
    """Hand a forward's captured residuals (batch row ``row``, its first ``length`` tokens; -1: all) to the drafter."""
    if capture is not None:
        end = None if length < 0 else length
        drafter.observe(start, {layer: capture[layer][row, :end] for layer in drafter.capture_layers})


def new_policy(setup: DrafterSetup) -> DraftPolicy:
    """A fresh draft-length policy for one sequence drafting with ``setup``."""
    return DraftPolicy(setup.num_draft_tokens, setup.draft_cost, setup.adaptive, setup.history)


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
        policy: The sequence's draft length policy (a fresh one by default).
    """

    forward: Forward
    caches: list[Cache]
    drafter: Drafter
    setup: DrafterSetup
    sampler: Sampler
    context: list[int]
    held: int
    counts: DraftCounts = attrs.Factory(DraftCounts)
    policy: DraftPolicy = attrs.field()
    _carried: tuple[Draft, int] | None = attrs.field(default=None, init=False)  # the next verify's draft, decided
    _feed: list[int] = attrs.field(factory=list, init=False)  # what the latest verify ran

    @policy.default
    def _policy(self) -> DraftPolicy:
        return new_policy(self.setup)

    def tokens(self, budget: int) -> Iterator[int]:
        """Commit and yield up to ``budget`` more tokens (the caller stops early at EOS or a stop string)."""
        while budget > 0:
            t0 = clock()
            draft, k = self._draft(budget)
            if k == 0 and budget > 1 and self.policy.adaptive:  # a fixed length verifies every proposal
                for tok in self._plain(budget):
                    budget -= 1
                    yield tok
                continue
            committed = self._verify(draft, k, t0, timed=False)
            for tok in committed:
                budget -= 1
                yield tok
            # the step's cost runs until its tokens are handled, as a plain step's does (between its tokens)
            self.policy.timed(len(self._feed), clock() - t0)

    def step(self, budget: int) -> list[int]:
        """One verify: commits between 1 and ``min(k + 1, budget)`` tokens, returned in order."""
        t0 = clock()
        return self._verify(*self._draft(budget), t0)

    def _draft(self, budget: int) -> tuple[Draft, int]:
        """The drafter's proposal for the next verify and how many of its tokens to verify."""
        carried, self._carried = self._carried, None
        room = min(budget - 1, self.policy.k_max)
        if room <= 0:
            return Draft(tokens=()), 0
        if carried is not None:  # what the plain steps decided to verify when they stopped
            draft, k = carried
            if not self.policy.lookahead:
                draft = self.drafter.propose(self.context, min(k, room), self.sampler)
            return draft, min(k, room, len(draft.tokens))
        if self.policy.lookahead:  # free to ask: propose first, then keep what pays
            draft = self.drafter.propose(self.context, room, self.sampler)
            return draft, min(self.policy.plan(draft.source, len(draft.tokens)), room)
        k = min(self.policy.next_k(), room)
        return (self.drafter.propose(self.context, k, self.sampler) if k else Draft(tokens=())), k

    def _leave_after(self, pending: mx.array) -> bool:
        """After a plain token: whether to verify after ``pending`` (the next token, queued) instead.

        A costly drafter: when the policy would draft. A free one is asked
        for its proposal now; when a draft after ``pending`` would pay, and
        the proposal's first token is ``pending`` (read, so this one step is
        not overlapped), the rest of it is what the verify will check. That
        first token is a drafted token the plain step verified: the policy
        learns from it, so a source whose first tokens miss stops costing
        these reads.
        """
        if not self.policy.lookahead:
            k = self.policy.next_k()
            if k:
                self._carried = Draft(tokens=()), k  # drafted once the next token is committed
            return k > 0
        draft = self.drafter.propose(self.context, self.policy.k_max + 1, self.sampler)
        k = self.policy.plan(draft.source, len(draft.tokens) - 1) if len(draft.tokens) > 1 else 0
        if k == 0:
            return False
        kept = draft.tokens[0] == _token(pending)
        self.policy.update(1, int(kept), draft.source)
        if kept:
            self._carried = Draft(tokens=draft.tokens[1:], source=draft.source), k
        return kept

    def _plain(self, budget: int) -> Iterator[int]:
        """Plain steps, each forward queued before the previous token is read, until a draft would pay.

        On entry and exit the caches hold all of ``context`` but its last token.

        The stretch is timed as a whole (its clock from before its first forward until its last
        token is handled, over the tokens it made): its forwards overlap one another, so the
        time between two reads is not one step's (the first read waits for two forwards, the
        last for none when the forward queued before it has already run), and edits leave
        many stretches of one or two tokens.
        """
        t0 = clock()
        ctx = self.sampler.params.repetition_context
        history = mx.array(self.context[-ctx:])
        pending = self._queue(mx.array([self.context[-1:]]), history)  # the token after the context
        produced = 0
        while True:
            nxt = None
            if produced + 1 < budget:
                history = mx.concatenate([history, pending])[-ctx:]
                if not (produced and self._leave_after(pending)):
                    nxt = self._queue(pending[None], history)
            tok = _token(pending)
            self.context.append(tok)
            produced += 1
            yield tok
            if nxt is None:
                break
            pending = nxt
        self.policy.timed(1, (clock() - t0) / produced)

    def _queue(self, token: mx.array, history: mx.array) -> mx.array:
        """Queue the forward of ``token`` ``[1, 1]`` (it may be lazy) and the sampling after it; the token, lazy."""
        capture: dict[int, mx.array] | None = {} if self.drafter.capture_layers else None
        logits = self.forward(token, self.caches, capture)[:, -1, :]
        observe(self.drafter, self.held, capture)
        self.held += 1
        self.counts.verifies += 1  # a target forward of the decode (the stats count plain ones too)
        sampled = self.sampler(self.sampler.penalize(logits.astype(mx.float32), history))
        mx.async_eval(sampled)  # type: ignore[no-untyped-call]  # mlx's stub leaves it unannotated
        return sampled

    def _verify(self, draft: Draft, k: int, t0: float, *, timed: bool = True) -> list[int]:
        """Run the pending tokens and ``k`` of the draft in one forward; commit what is accepted and the bonus.

        ``t0``: the :func:`~.adaptive.clock` when the step began (drafting included); ``timed``: record
        the step's cost now (else the caller does, once the committed tokens are handled).
        """
        drafted = list(draft.tokens[:k])
        probs = None if draft.probs is None else draft.probs[: len(drafted)]
        checkpoint = Checkpoint(self.caches, self.held) if drafted and not trimmable(self.caches) else None
        feed = self._feed = [*self.context[self.held :], *drafted]
        capture: dict[int, mx.array] | None = {} if self.drafter.capture_layers else None
        logits = self.forward(mx.array([feed]), self.caches, capture)[0]
        observe(self.drafter, self.held, capture)
        rows = logits[len(feed) - len(drafted) - 1 :]
        history = self.context[-self.sampler.params.repetition_context :]
        rows = penalized_rows(rows, history, drafted, self.sampler)
        verdict = accept(rows, Draft(tokens=drafted, probs=probs), self.sampler)
        j = len(verdict.accepted)
        self.counts.drafted += len(drafted)
        self.counts.accepted += j
        self.counts.verifies += 1
        self.policy.update(len(drafted), j, draft.source)
        held_now = self.held + len(feed)
        keep = len(self.context) + j  # the context and the accepted drafts; the bonus is run next step
        if keep < held_now:
            if checkpoint is None:
                trim_caches(self.caches, held_now - keep)
            else:
                restored = checkpoint.rewind(self.caches, held_now, keep)
                replay = [*self.context, *verdict.accepted][restored:keep]
                if replay:
                    self.forward(mx.array([replay]), self.caches, None)
        self.held = keep
        self.context.extend(verdict.tokens)
        self.drafter.rewind(len(self.context))
        if timed:
            self.policy.timed(len(feed), clock() - t0)
        return verdict.tokens


def _token(token: mx.array) -> int:
    """A one-element token array's value (waits for it)."""
    value = token.item()
    assert isinstance(value, int)
    return value
