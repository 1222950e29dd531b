"""The drafter protocol: what speculative decoding asks of a drafter, and the :class:`Draft` it returns.

A *drafter* guesses the next few tokens of one sequence cheaply; the target
model then checks them all in one forward (the *verify*), keeps the longest
acceptable prefix and samples one more token itself (the *bonus* token), so
every verify commits between 1 and ``k + 1`` tokens. Output is exactly plain
decoding's: token for token when greedy, in distribution when sampling.

Who calls what, for one sequence (positions are 0-based token indices):

1. ``reset()`` when the sequence starts afresh (nothing of an earlier
   sequence may be used; a drafter that keeps per-sequence state drops it).
   Then ``rewind(n)`` if the run reuses the first ``n`` tokens of a parked
   session (the drafter may keep what it holds for those, or drop it).
2. Prefill: the target runs the prompt in chunks. After each chunk, when
   :attr:`Drafter.capture_layers` is non-empty, ``observe(start, hidden)``.
   The first sampled token is then committed.
3. Each decode step, with ``context`` = every committed token (prompt +
   output so far, the last one freshly sampled and not yet run by the target):
   ``draft = propose(context, k, sampler)``; the target runs
   ``[context[-1], *draft.tokens]`` at positions ``len(context)-1 ..``
   (one forward, ``T = len(draft.tokens) + 1``) and ``observe`` is called
   with those positions; ``j`` drafts are accepted and a bonus token sampled;
   then ``rewind(len(context) + j + 1)``: the committed context now holds the
   accepted drafts and the bonus token.

A drafter is per sequence: the runner gets one from the
:data:`DrafterFactory` built at open for each sequence it decodes (one
generate, one session, one batch row), so state is never shared across
sequences. Drafters are not steered; the target verifies under its own
steering, so a steered target still decodes exactly as its plain steered self.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs
import mlx.core as mx

if TYPE_CHECKING:
    from turbospark_core.sampling import Sampler


def _tokens(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(t) for t in value)


@attrs.frozen(kw_only=True)
class Draft:
    """The tokens a drafter proposes for one verify, and the distribution it drew them from.

    Attributes:
        tokens: The proposed continuation of the committed context, at most
            the ``k`` asked for (empty: nothing to propose; the step is then a
            plain decode step).
        probs: ``None`` for a deterministic draft (the draft distribution is
            one-hot on each token: greedy decoding, prompt lookup, any
            argmax proposal). Otherwise a float32 ``[len(tokens), vocab]``
            array: row ``i`` is the probability distribution ``q_i`` that
            ``tokens[i]`` was *sampled* from, after the very transforms plain
            sampling applies (repetition penalty over the history
            ``context + tokens[:i]``, temperature, top-k, min-p, top-p):
            ``mx.exp(sampler.logprobs(sampler.penalize(logits, history)))``.
            Speculative sampling accepts ``tokens[i]`` with probability
            ``min(1, p_i / q_i)`` and on rejection resamples from
            ``max(0, p - q)``, so ``q`` must be the true sampling distribution
            or the output is no longer distributed as plain sampling.
            When greedy (``sampler.params.greedy``), return ``None``.
        source: What kind of proposal this is, for the adaptive draft length,
            which tracks acceptance per source (prompt lookup: the length of
            the matched tail; 0 for drafters with one kind of proposal).
    """

    tokens: tuple[int, ...] = attrs.field(converter=_tokens)
    probs: mx.array | None = attrs.field(default=None, eq=False)
    source: int = 0

    def __attrs_post_init__(self) -> None:
        if self.probs is not None and (self.probs.ndim != 2 or self.probs.shape[0] != len(self.tokens)):
            msg = f"Draft.probs must be [len(tokens)={len(self.tokens)}, vocab], got shape {tuple(self.probs.shape)}"
            raise ValueError(msg)


class Drafter(Protocol):
    """One sequence's drafter (see the module docstring for the call order).

    Attributes:
        name: What ``turbospark inspect`` and the stats show (``"ngram"``,
            ``"draft_model"``, ``"mtp"``).
        capture_layers: The target's 0-based decoder layers whose *output*
            residuals the drafter reads, the points steering edits and
            :meth:`~turbospark_core.runner.Runner.capture` reads: the residual
            stream after the layer (after any steering edit), before the
            final norm. A drafter that needs the final-norm state (the MTP
            head reads what ``lm_head`` reads) takes the last layer and
            applies the target's final norm itself. ``()`` for drafters that
            read only tokens (prompt lookup, a draft model): then ``observe``
            is never called and no residual is captured.
    """

    name: str
    capture_layers: tuple[int, ...]

    def reset(self) -> None:
        """A new sequence starts: forget everything about the previous one."""
        ...

    def observe(self, start: int, hidden: Mapping[int, mx.array]) -> None:
        """Residuals of a target forward that ran positions ``start .. start+T-1``.

        Called after every target forward of this sequence (each prefill
        chunk, each verify) when :attr:`capture_layers` is non-empty, before
        the forward's tokens are accepted or rewound. ``hidden[layer]`` is a
        ``[T, hidden_size]`` array in the target's compute dtype for every
        layer of :attr:`capture_layers` (unevaluated: keep it lazy). A verify's
        rows past the accepted ones are invalidated by the ``rewind`` that
        follows. After a session's prefix reuse, positions before the first
        ``start`` may never be observed: a drafter must still propose (its
        acceptance may be lower).
        """
        ...

    def rewind(self, length: int) -> None:
        """The committed context is now ``length`` tokens: drop state for later positions.

        After a verify the last committed token is the freshly sampled bonus
        token, which the target has not run yet: hidden states observed are
        valid for positions ``< length - 1`` only. ``length`` never exceeds
        what was committed before plus what the last verify accepted + 1.
        """
        ...

    def propose(self, context: Sequence[int], k: int, sampler: Sampler) -> Draft:
        """Up to ``k`` tokens continuing ``context`` (every committed token, prompt included).

        ``sampler`` is the request's sampler: ``sampler.params`` says greedy or
        not (greedy: propose argmax tokens, ``probs=None``); when sampling,
        build each row's ``q`` with ``sampler.penalize`` and
        ``sampler.logprobs`` and draw with ``sampler.next_key()`` (``None``
        when the request is unseeded: MLX's global generator), so seeded
        runs are reproducible. ``k >= 1``; returning fewer (or none) is fine.
        """
        ...


# Built once at open (open step 12): makes a fresh per-sequence Drafter.
DrafterFactory = Callable[[], Drafter]
