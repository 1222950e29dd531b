"""What a family declares so the core can split it across ranks (the ``distributed_plan`` hook's answer).

A declaration, not sharding code: the family names which of its tensors
split along which axis, in units of which heads, and which arch keys count
heads each rank holds a share of; the core's weight store, linear, embedding
and expert objects and cache layout do the rest (:mod:`turbospark_core.distributed`).

Tensor parallelism (``distributed="tensor"``):

* ``Split.out``: the tensor's first axis (a matrix's output rows, a bias, a
  per-head vector such as attention sinks, a conv weight's channels) is split:
  each rank computes its own heads (column-parallel).
* ``Split.into``: a matrix's input columns are split: each rank multiplies
  its slice of the input, the core sums the partial outputs over the ranks
  (row-parallel, one ``all_sum``) and adds the bias once.
* Sections: a fused tensor (``[q | k | v]``) lists its parts as
  ``(heads, width)``: ``heads`` units of ``width`` rows each, every part split
  on its own. A part with fewer heads than ranks is replicated (each rank
  holds the head its share of the queries reads, as grouped-query attention
  needs when ``num_key_value_heads`` is below the group size); a row-parallel
  split must divide evenly.
* Every tensor not named is replicated. Embeddings and the names in
  ``vocab`` (an untied output head) are split by vocabulary rows when the
  group size divides the vocabulary (lookups summed, logits gathered), and
  routed experts are split by expert (expert parallelism), with no
  declaration.

Pipeline parallelism (``distributed="pipeline"``): each rank runs a
contiguous range of decoder layers, whose tensors start with
``layer_prefix.format(i)``; the family's forward runs its ``layers`` list
and passes each layer's output through ``steer(h, i)`` (the core replaces
the other ranks' layers and moves the activations there).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

import attrs

Section = tuple[int, int]  # (heads, width): `heads` units of `width` rows (or columns) each


def _pairs(value: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Pairs of ints as a tuple (a plugin may give lists)."""
    return tuple((int(a), int(b)) for a, b in value)


@attrs.frozen
class Split:
    """How one tensor (a matrix by its base name) splits across tensor-parallel ranks.

    Attributes:
        axis: ``"out"`` (first axis: output rows) or ``"in"`` (a matrix's input columns, summed over ranks).
        sections: ``(heads, width)`` parts along the axis; empty: split evenly.
    """

    axis: Literal["out", "in"]
    sections: tuple[Section, ...] = attrs.field(default=(), converter=_pairs)

    @classmethod
    def out(cls, *sections: Section) -> Split:
        """Column-parallel: the first axis splits (by ``(heads, width)`` sections, or evenly)."""
        return cls("out", sections)

    @classmethod
    def into(cls, *sections: Section) -> Split:
        """Row-parallel: a matrix's input columns split (by sections, or evenly); outputs are summed."""
        return cls("in", sections)


def _splits(value: Mapping[str, Split]) -> dict[str, Split]:
    return dict(value)


def _names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class TensorPlan:
    """A family's tensor-parallel declaration.

    Attributes:
        splits: Install names (a matrix by its base name) or ``fnmatch`` globs -> :class:`Split`.
        per_rank: Arch keys that count heads each rank holds a share of (the family's
            flow and cache layout are built from the per-rank counts).
        vocab: Output heads over the vocabulary (an untied ``lm_head``): rows split, logits gathered.
    """

    splits: dict[str, Split] = attrs.field(factory=dict, converter=_splits)
    per_rank: tuple[str, ...] = attrs.field(default=(), converter=_names)
    vocab: tuple[str, ...] = attrs.field(default=(), converter=_names)


@attrs.frozen(kw_only=True)
class PipelinePlan:
    """A family's pipeline-parallel declaration.

    Attributes:
        layer_prefix: Decoder layer ``i``'s tensors start with ``layer_prefix.format(i)``;
            cache entry ``i`` of the family's cache layout is layer ``i``'s.
        block_outputs: What a decoder block returns: ``1``, the hidden state; ``n > 1``, a
            tuple of ``n`` whose first item is the hidden state (the other items of another
            rank's layer read ``None``).
        tied: ``(layer, source)`` pairs that must run on one rank (a layer reading another's
            keys and values).
    """

    layer_prefix: str = "model.layers.{}."
    block_outputs: int = 1
    tied: tuple[tuple[int, int], ...] = attrs.field(default=(), converter=_pairs)


@attrs.frozen(kw_only=True)
class DistributedPlan:
    """The ``distributed_plan`` hook's answer: what each mode may split, or why it cannot.

    Attributes:
        tensor: The tensor-parallel declaration (``None``: the mode is refused).
        tensor_refusal: Why this arch cannot be split by tensor parallelism (with ``tensor=None``).
        pipeline: The pipeline declaration (``None``: the mode is refused).
        pipeline_refusal: Why this arch cannot be split into layer ranges (with ``pipeline=None``).
    """

    tensor: TensorPlan | None = None
    tensor_refusal: str | None = None
    pipeline: PipelinePlan | None = None
    pipeline_refusal: str | None = None
