"""The tensor-parallel forms of the core's objects: what a family gets instead of a plain linear, embedding or bank.

Each holds this rank's share and does the one collective its math needs, so a
family's flow is the same code on one process or many:

* :class:`RowLinear` (input columns split): the partial products are summed over
  the group (``all_sum``), then the bias is added once.
* :class:`GatheredLinear` (an output head split by vocabulary rows): each rank's
  logits are gathered (``all_gather``) into the full row.
* :class:`VocabEmbedding` (a table split by rows): each rank looks up the ids it
  holds, zeros elsewhere, summed over the group (exact: one rank adds each row).
* :class:`ExpertParallel` (experts split by expert): each rank runs only the
  (token, expert) pairs routed to its experts; the outputs are summed (exact: one
  rank computes each pair).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from turbospark_core.layers import Activation, Embedding, Experts, Linear


def _parts(linear: Linear, bias: mx.array | None) -> dict[str, Any]:
    return {"bias": bias, "quant": linear.quant, "scales": linear.scales, "biases": linear.biases}


class RowLinear(Linear):
    """``y = sum over ranks (x_r @ W_r.T) + b``: this rank's input columns of the matrix."""

    def __init__(self, part: Linear, group: Any) -> None:
        super().__init__(part.weight, **_parts(part, None))
        self.after = part.bias
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(super().__call__(x), group=self.group)
        return y if self.after is None else y + self.after


def gather_last(y: mx.array, group: Any) -> mx.array:
    """Each rank's ``[..., n]`` side by side along the last axis, ``[..., size * n]``, on every rank."""
    lead, n = y.shape[:-1], y.shape[-1]
    rows = mx.distributed.all_gather(mx.contiguous(y.reshape(-1, n).T), group=group)  # [size * n, M]
    return rows.T.reshape(*lead, -1)


class GatheredLinear(Linear):
    """An output head whose rows (the vocabulary) are split: each rank's logits, gathered."""

    def __init__(self, part: Linear, group: Any) -> None:
        super().__init__(part.weight, **_parts(part, part.bias))
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        return gather_last(super().__call__(x), self.group)


class VocabEmbedding(Embedding):
    """An embedding table split by rows: rows ``[start, stop)`` here; lookups summed over the group.

    ``table`` is a :class:`GatheredLinear`, so :meth:`as_linear` (a tied head) gathers the logits.
    """

    def __init__(self, table: Linear, dtype: mx.Dtype | None, rows: tuple[int, int], group: Any) -> None:
        super().__init__(table, dtype)
        self.start, self.count = rows[0], rows[1] - rows[0]
        self.group = group

    def __call__(self, ids: mx.array) -> mx.array:
        local = ids - self.start
        held = (local >= 0) & (local < self.count)
        rows = self._rows(mx.where(held, local, 0))
        rows = mx.where(held[..., None], rows, mx.zeros((), rows.dtype))
        out = mx.distributed.all_sum(rows, group=self.group)
        return out if self.dtype is None or out.dtype == self.dtype else out.astype(self.dtype)


class ExpertParallel:
    """A routed layer's experts ``[first, first + count)`` of ``total`` on this rank.

    Each call reads the router's choice (one host sync, as a streamed bank
    does), runs the pairs routed here through the local bank, and sums the
    ``[..., k, D]`` outputs over the group: every rank returns every pair's
    output, computed by the one rank holding its expert.
    """

    def __init__(self, local: Experts, first: int, count: int, total: int, group: Any) -> None:
        self.local, self.first, self.count, self.total, self.group = local, first, count, total, group

    @property
    def num_experts(self) -> int:
        """How many experts the layer has (over every rank)."""
        return self.total

    def glu(self, x: mx.array, indices: mx.array, activation: Activation, weights: mx.array | None = None) -> mx.array:
        """Gated expert MLP for each chosen expert (see :meth:`~turbospark_core.layers.Experts.glu`)."""
        del weights
        k, width = indices.shape[-1], x.shape[-1]
        chosen = np.asarray(indices).astype(np.int64).reshape(-1) - self.first
        pairs = np.flatnonzero((chosen >= 0) & (chosen < self.count))
        out = mx.zeros((chosen.size, width), x.dtype)
        if pairs.size:
            rows = x.reshape(-1, width)[mx.array((pairs // k).astype(np.uint32))]
            local = mx.array(chosen[pairs].astype(np.uint32)[:, None])
            out[mx.array(pairs.astype(np.uint32))] = self.local.glu(rows, local, activation)[:, 0].astype(x.dtype)
        return mx.distributed.all_sum(out, group=self.group).reshape(*indices.shape, width)
