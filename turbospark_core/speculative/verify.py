"""Acceptance: which drafted tokens the target keeps, and the token it adds (the bonus).

Greedy: the longest prefix of the draft equal to the target's argmax at each
position, then the target's argmax after it. Sampling: speculative sampling
(Leviathan et al. 2023; Chen et al. 2023): draft ``i`` is kept with
probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection the bonus
is drawn from the normalized residual ``max(0, p_i - q_i)``; when all are kept
it is drawn from ``p_k``. ``p`` and ``q`` are built with the request's own
sampler (repetition penalty, temperature, top-k, min-p, top-p), so what is
emitted is distributed exactly as plain sampling's.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core import native
from turbospark_core.sampling import Sampler
from turbospark_core.speculative.drafter import Draft


@attrs.frozen
class Verdict:
    """The outcome of one verify: ``accepted`` drafts (a prefix of the draft) and the ``bonus`` token."""

    accepted: tuple[int, ...]
    bonus: int

    @property
    def tokens(self) -> list[int]:
        """Everything this verify commits, in order."""
        return [*self.accepted, self.bonus]


def penalized_rows(logits: mx.array, history: Sequence[int], draft: Sequence[int], sampler: Sampler) -> mx.array:
    """Row ``i`` of ``logits`` ``[k+1, V]`` penalized for the history plain decoding would have there.

    Row ``i`` predicts the token after ``draft[:i]``: its repetition history is
    ``(history + draft[:i])[-repetition_context:]``, as in plain decoding.
    """
    logits = logits.astype(mx.float32)
    if sampler.params.repetition_penalty == 1.0:
        return logits
    ctx = sampler.params.repetition_context
    seen = list(history)
    rows = []
    for i in range(logits.shape[0]):
        hist = [*seen, *draft[:i]][-ctx:]
        row = logits[i : i + 1]
        rows.append(sampler.penalize(row, mx.array(hist)) if hist else row)
    return mx.concatenate(rows, axis=0)


def accept(logits: mx.array, draft: Draft, sampler: Sampler) -> Verdict:
    """Judge ``draft`` against the target's (already penalized) ``logits`` ``[len(draft)+1, V]``."""
    k = len(draft.tokens)
    if sampler.params.greedy:
        best = token_ids(native.argmax(logits))
        j = 0
        while j < k and draft.tokens[j] == best[j]:
            j += 1
        return Verdict(draft.tokens[:j], best[j])
    logp = sampler.logprobs(logits)  # [k+1, V]
    if k == 0:
        return Verdict((), token_ids(mx.random.categorical(logp[0:1], key=sampler.next_key()))[0])
    drafted = mx.array(draft.tokens)
    rows = mx.arange(k)
    p_d = mx.exp(logp[rows, drafted])
    q_d = mx.ones((k,)) if draft.probs is None else draft.probs[rows, drafted].astype(mx.float32)
    u = mx.random.uniform(shape=(k,), key=sampler.next_key())
    # accept while u < p/q (q > 0 for a token the drafter drew); u*q < p avoids dividing
    kept = np.array(u * q_d < p_d).tolist()
    j = kept.index(False) if False in kept else k
    if j == k:
        bonus = mx.random.categorical(logp[k], key=sampler.next_key())
    else:
        p = mx.exp(logp[j])
        q = _one_hot(draft.tokens[j], p.shape[-1]) if draft.probs is None else draft.probs[j].astype(mx.float32)
        residual = mx.maximum(p - q, 0.0)
        residual = mx.where(residual.sum() > 0, residual, p)  # p == q up to rounding: never rejected in exact math
        bonus = mx.random.categorical(mx.log(residual), key=sampler.next_key())
    return Verdict(draft.tokens[:j], token_ids(bonus.reshape(1))[0])


def token_ids(tokens: mx.array) -> list[int]:
    """Host ints of a 1-D token array (one synchronisation)."""
    return [int(t) for t in np.array(tokens, dtype=np.int64).reshape(-1)]


def _one_hot(token: int, vocab: int) -> mx.array:
    return (mx.arange(vocab) == token).astype(mx.float32)
