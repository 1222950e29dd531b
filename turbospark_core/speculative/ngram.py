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


def lookup(context: Sequence[int], k: int, max_match: int = MAX_MATCH, min_match: int = MIN_MATCH) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest tail of ``context``.

    Tails of ``max_match`` down to ``min_match`` tokens are tried, longest
    first; the latest occurrence that has a continuation wins. ``[]`` when
    nothing matches.
    """
    n = len(context)
    if n < 2 or k < 1:
        return []
    ctx = np.asarray(context[-SEARCH_WINDOW:], dtype=np.int64)
    n = ctx.size
    for size in range(min(max_match, n - 1), min_match - 1, -1):
        tail = ctx[n - size :]
        # candidate starts s < n - size whose window ctx[s : s + size] equals the tail
        windows = np.lib.stride_tricks.sliding_window_view(ctx[: n - 1], size)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        hits = hits[hits + size < n]  # something follows the occurrence (not the tail itself)
        if hits.size:
            start = int(hits[-1]) + size
            return [int(t) for t in ctx[start : start + k]]
    return []


class NgramDrafter:
    """Prompt-lookup drafts for one sequence (stateless: the context is the whole input)."""

    name = "ngram"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, max_match: int = MAX_MATCH) -> None:
        self.max_match = max_match

    def reset(self) -> None:
        """Nothing is kept between steps."""

    def observe(self, start: int, hidden: Mapping[int, mx.array]) -> None:
        """Never called (no capture layers)."""

    def rewind(self, length: int) -> None:
        """Nothing is kept between steps."""

    def propose(self, context: Sequence[int], k: int, sampler: Sampler) -> Draft:
        """The lookup's continuation; deterministic (``probs=None``: q is one-hot) whatever the sampling."""
        del sampler
        return Draft(tokens=lookup(context, k, self.max_match))
