"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the context's tail.

No extra model. Edits, rewrites and code completions repeat long spans of
their prompt; where the last few committed tokens occurred before, the tokens
that followed them then are a good guess for what follows now.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from turbospark_core.speculative.drafter import Draft

if TYPE_CHECKING:
    from turbospark_core.sampling import Sampler

MAX_MATCH = 4  # the longest tail matched (longer tails are tried first)
MIN_MATCH = 1
SEARCH_WINDOW = 4096  # how far back the lookup searches (bounded work per step)
ALIGNED = 16  # added to a draft's source when the copy continues the previous proposal's
NEAR = 12  # how far past where the previous copy would be now a match still continues it


def lookup(context: Sequence[int], k: int, max_match: int = MAX_MATCH, min_match: int = MIN_MATCH) -> list[int]:
    """``k`` tokens that followed the latest earlier occurrence of the longest tail of ``context``.

    Tails of ``max_match`` down to ``min_match`` tokens are tried, longest
    first; the latest occurrence wins. Where the occurrence is so recent that
    its continuation runs into the tail itself, the copy goes on through what
    it copies (so a repeating pattern is continued: ``a b a b`` proposes
    ``a b a ...``). ``[]`` when nothing matches.
    """
    return match(context, k, max_match, min_match)[0]


def match(
    context: Sequence[int], k: int, max_match: int = MAX_MATCH, min_match: int = MIN_MATCH
) -> tuple[list[int], int, int]:
    """:func:`lookup`'s continuation, the length of the tail it matched (0: nothing matched), and
    where in ``context`` the copied continuation starts (-1: nowhere).

    One pass: the earlier positions holding the context's last token are the
    candidates; each is extended backwards while the tokens before it equal
    the tail's, up to ``max_match``; the longest wins, the latest among equals.
    """
    if len(context) < 2 or k < 1:
        return [], 0, -1
    skipped = max(len(context) - SEARCH_WINDOW, 0)
    ctx = np.asarray(context[skipped:], dtype=np.int64)
    n = ctx.size
    ends = np.flatnonzero(ctx[:-1] == ctx[-1])  # an occurrence of the tail ends at e (e + 1 < n follows it)
    if ends.size == 0:
        return [], 0, -1
    length = np.ones(ends.size, dtype=np.int64)
    for d in range(1, min(max_match, n - 1)):
        grow = (length == d) & (ends >= d)
        grow[grow] = ctx[ends[grow] - d] == ctx[n - 1 - d]
        length[grow] += 1
    best = int(length.max())
    if best < min_match:
        return [], 0, -1
    start = int(ends[np.flatnonzero(length == best)[-1]]) + 1
    period = n - start  # the copy overlaps the context's end: it repeats with this period
    return [int(t) for t in ctx[start + np.arange(k) % period]], best, skipped + start


class NgramDrafter:
    """Prompt-lookup drafts for one sequence.

    The draft's ``source`` says how much to trust it: the length of the
    matched tail, plus :data:`ALIGNED` when the copy continues where the
    previous proposal was copying from (its start advanced by the tokens
    committed since, give or take :data:`NEAR`). A short match is rarely right
    by chance (open chat: 15% of 1-token matches propose the next token), but
    one that picks up the text being copied is (an edit, after the model
    rewrote a word: 88%); the adaptive draft length learns each source's rate.
    """

    name = "ngram"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, max_match: int = MAX_MATCH) -> None:
        self.max_match = max_match
        self._anchor: tuple[int, int] | None = None  # (context length, copy start) of the latest proposal

    def reset(self) -> None:
        """Forget where the last copy came from."""
        self._anchor = None

    def observe(self, start: int, hidden: Mapping[int, mx.array]) -> None:
        """Never called (no capture layers)."""

    def rewind(self, length: int) -> None:
        """A context cut below the latest proposal's forgets where it copied from."""
        if self._anchor is not None and length < self._anchor[0]:
            self._anchor = None

    def propose(self, context: Sequence[int], k: int, sampler: Sampler) -> Draft:
        """The lookup's continuation; deterministic (``probs=None``: q is one-hot) whatever the sampling."""
        del sampler
        tokens, matched, start = match(context, k, self.max_match)
        if not tokens:
            return Draft(tokens=())
        aligned = False
        if self._anchor is not None:
            length, copied = self._anchor
            aligned = 0 <= start - (copied + len(context) - length) <= NEAR
        self._anchor = (len(context), start)
        return Draft(tokens=tokens, source=matched + (ALIGNED if aligned else 0))
