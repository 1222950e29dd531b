"""A draft model: another install with the same vocabulary proposes tokens autoregressively.

It runs unsteered on its own per-sequence caches. Each proposal first feeds
the committed tokens its caches do not hold yet (after a verify: the
accepted drafts and the bonus token, in one forward), then drafts ``k``
tokens one forward each; the draws stay lazy until the last, so the whole
proposal synchronises once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import mlx.core as mx

from turbospark_core.context import FamilyModel
from turbospark_core.kv_cache import Cache
from turbospark_core.sampling import Sampler
from turbospark_core.speculative.drafter import Draft
from turbospark_core.speculative.rewind import Checkpoint
from turbospark_core.speculative.verify import token_ids

CHUNK = 512  # catch-up feeds longer than this (a prompt) run in chunks


class ModelDrafter:
    """One sequence's drafts from a draft install's model."""

    name = "draft_model"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, model: FamilyModel, new_cache: Callable[[], list[Cache]]) -> None:
        self._model = model
        self._new_cache = new_cache
        self._caches = new_cache()
        self._held: list[int] = []  # the tokens the caches hold, in order
        self._mark: Checkpoint | None = None

    def reset(self) -> None:
        """Fresh caches: nothing of the previous sequence is kept."""
        self._caches = self._new_cache()
        self._held = []
        self._mark = None

    def observe(self, start: int, hidden: Mapping[int, mx.array]) -> None:
        """Never called (no capture layers)."""

    def rewind(self, length: int) -> None:
        """Nothing to do now: :meth:`propose` drops what the new context does not share."""

    def _sync(self, context: Sequence[int]) -> None:
        """Drop held tokens the context does not share (and keep one committed token to feed)."""
        n = min(len(self._held), len(context) - 1)
        common = next((i for i in range(n) if self._held[i] != context[i]), n)
        if common == len(self._held):
            return
        mark = self._mark
        if mark is not None and mark.length <= common:
            kept = mark.rewind(self._caches, len(self._held), common)
            self._held = self._held[:kept]
        else:
            self.reset()

    def _feed(self, tokens: Sequence[int]) -> mx.array:
        """Run ``tokens`` (at least one) on the caches; the last position's logits ``[1, V]``."""
        for start in range(0, len(tokens) - 1, CHUNK):
            chunk = tokens[start : min(start + CHUNK, len(tokens) - 1)]
            self._model(mx.array([list(chunk)]), self._caches)
            mx.eval([c.state for c in self._caches])
        logits: mx.array = self._model(mx.array([list(tokens[-1:])]), self._caches)[:, -1, :]
        return logits.astype(mx.float32)

    def propose(self, context: Sequence[int], k: int, sampler: Sampler) -> Draft:
        """``k`` tokens drawn from the draft model as plain decoding would (argmax when greedy)."""
        self._sync(context)
        logits = self._feed(context[len(self._held) :])
        self._held = list(context)
        self._mark = Checkpoint(self._caches, len(self._held))
        ctx = sampler.params.repetition_context
        history = mx.array(list(context[-ctx:]))
        drafted: list[mx.array] = []
        probs: list[mx.array] = []
        for i in range(k):
            logits = sampler.penalize(logits, history)
            if sampler.params.greedy:
                token = mx.argmax(logits, axis=-1)
            else:
                logp = sampler.logprobs(logits)
                probs.append(mx.exp(logp[0]))
                token = mx.random.categorical(logp, axis=-1, key=sampler.next_key())
            drafted.append(token)
            history = mx.concatenate([history, token])[-ctx:]
            if i + 1 < k:
                logits = self._model(token[:, None], self._caches)[:, -1, :].astype(mx.float32)
                mx.async_eval(token)  # type: ignore[no-untyped-call]  # mlx's stub leaves it unannotated
        tokens = token_ids(mx.concatenate(drafted)) if drafted else []
        self._held.extend(tokens[:-1])
        return Draft(tokens=tokens, probs=mx.stack(probs) if probs else None)
