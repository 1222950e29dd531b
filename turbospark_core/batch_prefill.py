"""How many prompt tokens a :class:`~turbospark_core.batch.Batch` prefills per step: chunks of equal cost.

A chunk of ``L`` tokens at offset ``o`` (tokens already in the caches) costs
about ``c + a*L + b*(L*o + L*(L+1)/2)``: ``a`` the weight products per token,
``b`` the attention per query per context token, ``c`` a forward's fixed cost.
Attention over the prefix makes a late chunk of a long prompt cost more than
an early one (SmolLM2 on 2 cores: a 512-token chunk at offset 0 ~0.9 s, at 1536
~1.6 s), so a fixed token count stalls the other rows longer the later the
chunk. A step's prefill is instead held to the cost of ``prefill_chunk``
tokens from an empty cache: costs are counted in tokens at offset 0
(``L + r*(L*o + L*(L+1)/2)`` with ``r = b/a``), the budget is the cost of
``prefill_chunk`` tokens at offset 0, and a chunk is the most tokens within
what is left of it. Only the ratio ``r`` matters, so a machine slowed
evenly (other processes) sizes chunks the same.

:class:`PrefillCost` measures ``r``: the batch times each prefill forward
(they are evaluated synchronously) and fits ``c``, ``a`` and ``b`` by least
squares over the recent ones, in relative error; a constant term is dropped
when the samples cannot tell it apart (e.g. every chunk the same length).
``b`` is taken as measured only once some forward had a prefix (a chunk after
the first: attention within one chunk alone is confounded with how a forward's
cost bends with its length), and the estimate moves at most 2x per forward, so
one noisy time cannot swing it. Before that it is :data:`PRIOR_RATIO`. Layers
whose attention is bounded (sliding windows) or absent (recurrent state)
simply measure a smaller ``b``. However wrong the estimate, a chunk has at
least :data:`MIN_CHUNK` tokens (or ``prefill_chunk``, when smaller), so a long
prompt always advances and the next measurement corrects the estimate.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import attrs
import numpy as np

PRIOR_RATIO = 2e-3  # r before any measurement: conservative (SmolLM2 on 2 cores measures ~8e-4; larger models less)
MIN_CHUNK = 32  # the fewest tokens a chunk carries, whatever the estimate (at most prefill_chunk)
SAMPLES = 64  # the prefill forwards the fit looks back over
RCOND = 1e-6  # singular values below this (relative, columns scaled to unit norm) do not count: no fit


@attrs.frozen
class ChunkSizer:
    """Costs and chunk sizes under one ratio ``r = b/a``, in tokens at offset 0 (one step's plan).

    Attributes:
        chunk: ``prefill_chunk``: the tokens whose cost from an empty cache is a step's budget.
        ratio: ``b/a``: attention per query per context token over weight products per token.
    """

    chunk: int
    ratio: float

    def cost(self, tokens: int, offset: int) -> float:
        """The cost of prefilling ``tokens`` tokens after ``offset`` cached ones, in tokens at offset 0."""
        return tokens + self.ratio * (tokens * offset + tokens * (tokens + 1) / 2)

    @property
    def budget(self) -> float:
        """A step's prefill budget: ``chunk`` tokens from an empty cache."""
        return self.cost(self.chunk, 0)

    @property
    def floor(self) -> int:
        """The fewest tokens a chunk carries (:data:`MIN_CHUNK`, at most ``chunk``)."""
        return min(MIN_CHUNK, self.chunk)

    def fits(self, tokens: int, offset: int, budget: float) -> bool:
        """Whether ``tokens`` after ``offset`` cost at most ``budget`` (up to rounding)."""
        return self.cost(tokens, offset) <= budget * (1 + 1e-9)

    def tokens(self, offset: int, left: int, budget: float) -> int:
        """The next chunk of a prompt ``left`` tokens short, at ``offset``: the most within ``budget``.

        At least :attr:`floor` tokens (a long prompt always advances), at most ``left``.
        """
        # r/2 L^2 + (1 + r (o + 1/2)) L = budget, solved in the form that stays exact as r -> 0
        beta = 1 + self.ratio * (offset + 0.5)
        most = 2 * max(budget, 0.0) / (beta + math.sqrt(beta * beta + 2 * self.ratio * max(budget, 0.0)))
        return min(left, max(self.floor, int(most * (1 + 1e-9))))


@attrs.frozen
class Sample:
    """One timed prefill forward: its tokens (padding included), query-context pairs and seconds.

    ``within``: pairs inside the forward's own chunks (``n*(n+1)/2`` per row);
    ``prefix``: pairs against what the caches held before (``n*offset`` per row).
    """

    tokens: int
    within: int
    prefix: int
    seconds: float

    @classmethod
    def of(cls, rows: Sequence[tuple[int, int]], seconds: float) -> Sample:
        """The sample of a forward over ``rows`` (``(tokens, offset)`` each) that took ``seconds``."""
        within = sum(n * (n + 1) // 2 for n, _ in rows)
        return cls(sum(n for n, _ in rows), within, sum(n * o for n, o in rows), seconds)


@attrs.define
class PrefillCost:
    """The measured cost model of a batch's prefill forwards (see the module docstring).

    Attributes:
        chunk: ``prefill_chunk`` (the step budget's tokens at offset 0).
        learn: Whether measurements update ``ratio`` (off where ranks of a
            group must size chunks alike: each rank's clock differs).
        ratio: The ratio ``b/a`` in use (:data:`PRIOR_RATIO` until measured).
    """

    chunk: int
    learn: bool = True
    ratio: float = PRIOR_RATIO
    samples: deque[Sample] = attrs.field(factory=lambda: deque(maxlen=SAMPLES))

    def sizer(self) -> ChunkSizer:
        """The sizes and costs under the current estimate (fixed for one step's plan).

        A ``chunk`` of at most :data:`MIN_CHUNK` tokens is counted in tokens
        (ratio 0): its chunks cannot shrink below it anyway, and so a step's
        plan does not depend on timings.
        """
        return ChunkSizer(self.chunk, self.ratio if self.chunk > MIN_CHUNK else 0.0)

    def record(self, rows: Sequence[tuple[int, int]], seconds: float) -> None:
        """One prefill forward of ``rows`` (``(tokens, offset)`` per row, padding included) took ``seconds``."""
        if not rows or not seconds > 0 or not math.isfinite(seconds):
            return
        self.samples.append(Sample.of(rows, seconds))
        if self.learn:
            fitted = fit_ratio(list(self.samples))
            if fitted is not None:  # at most halved or doubled per forward: one noisy fit cannot swing it
                self.ratio = fitted if self.ratio <= 0 else min(max(fitted, self.ratio / 2), self.ratio * 2)


def fit_ratio(samples: Sequence[Sample]) -> float | None:
    """``b/a`` from timed forwards; ``None`` when they do not determine it (see the module docstring).

    Least squares in relative error of ``seconds ~ c + a*tokens + b*pairs``
    (from 4 samples); without ``c`` (from 3) when the samples cannot separate
    it or it comes out negative. Only once some sample had a prefix; ``b``
    below zero (attention not measurable) counts as zero.
    """
    if not any(s.prefix for s in samples):
        return None
    data = np.asarray([(s.tokens, s.within + s.prefix, s.seconds) for s in samples], dtype=np.float64)
    tokens, pairs, seconds = data[:, 0], data[:, 1], data[:, 2]
    for columns in ((np.ones_like(tokens), tokens, pairs), (tokens, pairs)):
        if len(samples) <= len(columns):
            continue  # an exact solve: no sample left to average the noise out
        design = np.stack(columns, axis=1) / seconds[:, None]  # relative error: each row divided by its time
        scale = np.linalg.norm(design, axis=0)
        if not np.all(scale > 0):
            continue
        solved, _, rank, sv = np.linalg.lstsq(design / scale, np.ones_like(seconds), rcond=None)
        if rank < len(columns) or sv[-1] < RCOND * sv[0]:
            continue
        *const, a, b = (float(v) for v in solved / scale)
        if a > 0 and all(c >= 0 for c in const):
            return max(b, 0.0) / a
    return None
