"""One rank's share of the install: which slice of each tensor it reads, and the index of what it holds.

:class:`TensorShare` (tensor parallelism) slices declared tensors, expert
stacks by expert and vocabulary tables by rows; :class:`StageShare`
(pipeline parallelism) keeps whole tensors outside other ranks' layers.
Both are computed from the tensor index and the family's plan before
anything is read, so every refusal comes first, and the open's memory guard
counts only what this rank holds (:meth:`local_index`).
"""

from __future__ import annotations

import attrs

from turbospark_core.distributed.plan import PipelinePlan, TensorPlan
from turbospark_core.distributed.reader import ShardReader
from turbospark_core.distributed.shares import Range, find_split, head_share, matches, split_ranges
from turbospark_core.errors import DistributedError
from turbospark_core.experts.layout import EXPERT_TENSOR
from turbospark_core.tensor_index import QuantSpec, TensorIndex, TensorInfo

MATRIX_LEAVES = ("weight", "scales", "biases", "bias")


@attrs.frozen
class Slice:
    """The part of a tensor a rank reads: ``ranges`` along ``axis``."""

    axis: int
    ranges: tuple[Range, ...]


def _leaf(name: str) -> tuple[str, str]:
    base, _, leaf = name.rpartition(".")
    return (base, leaf) if leaf in MATRIX_LEAVES else (name, "")


class TensorShare:
    """Rank ``rank`` of ``size``'s slice of every tensor under a :class:`TensorPlan`.

    Raises:
        DistributedError: At construction, naming the first tensor, head count or
            expert count that cannot be split (or a plan that does not fit).
    """

    def __init__(self, plan: TensorPlan, index: TensorIndex, size: int, rank: int) -> None:
        self.plan, self.index, self.size, self.rank = plan, index, size, rank
        self.slices: dict[str, Slice | None] = {name: self._slice(name, info) for name, info in index.tensors.items()}

    def slice_of(self, name: str) -> Slice | None:
        """The slice of ``name`` this rank reads (``None``: all of it)."""
        return self.slices.get(name)

    def vocab_rows(self, base: str) -> Range | None:
        """The vocabulary rows of table ``base`` this rank holds (``None``: not split, as when the
        group size does not divide the rows)."""
        info = self.index.tensors.get(f"{base}.weight")
        if info is None or not matches(self.plan.vocab, base) or info.shape[0] % self.size:
            return None
        rows = info.shape[0] // self.size
        return self.rank * rows, (self.rank + 1) * rows

    def is_row_parallel(self, base: str) -> bool:
        """Whether matrix ``base``'s input columns are split (its outputs summed over the ranks)."""
        split = find_split(self.plan.splits, base)
        return split is not None and split.axis == "in"

    def experts_share(self, num_experts: int, where: str) -> tuple[int, int]:
        """``(first, count)`` of a routed layer's experts this rank holds (expert parallelism)."""
        return head_share(num_experts, self.size, self.rank, f"num_experts of {where!r}", replicate=False)

    def _slice(self, name: str, info: TensorInfo) -> Slice | None:
        expert = EXPERT_TENSOR.match(name)
        if expert is not None:
            first, count = self.experts_share(info.shape[0], expert.group("prefix"))
            return Slice(0, ((first, first + count),))
        base, leaf = _leaf(name)
        quant = self.index.quantization.get(base)
        rows = self.vocab_rows(base) if leaf else None
        if rows is not None:
            return Slice(0, (rows,))
        split = find_split(self.plan.splits, base) if leaf else None
        if split is None:
            split = find_split(self.plan.splits, name)
            leaf = ""
        if split is None:
            return None
        if split.axis == "out":
            return Slice(0, tuple(split_ranges(split, info.shape[0], self.size, self.rank, base)))
        if leaf == "bias":
            return None  # added once, after the sum
        columns = self.index.logical_shape(base)[-1] if quant is not None else info.shape[-1]
        ranges = split_ranges(split, columns, self.size, self.rank, base)
        if quant is None:
            return Slice(len(info.shape) - 1, tuple(ranges))
        return Slice(len(info.shape) - 1, tuple(_packed(ranges, quant, leaf, base, self.size)))

    def local_index(self) -> TensorIndex:
        """The index of what this rank holds (its slices' shapes and bytes): what the memory guard counts."""
        tensors = {}
        for name, info in self.index.tensors.items():
            s = self.slices[name]
            if s is None:
                tensors[name] = info
                continue
            shape = ShardReader.shape_of(info, s.axis, list(s.ranges))
            tensors[name] = attrs.evolve(info, shape=shape, nbytes=ShardReader.nbytes_of(info, shape))
        return TensorIndex(tensors=tensors, quantization=self.index.quantization)


def _packed(ranges: list[Range], quant: QuantSpec, leaf: str, base: str, size: int) -> list[Range]:
    """Column ranges of a quantized matrix's ``leaf``: packed words of the weight, groups of scales/biases."""
    group = quant.group_size
    width = ranges[0][1] - ranges[0][0]
    if any(a % group or b % group for a, b in ranges):
        msg = (
            f"distributed='tensor' over {size} ranks cannot split quantized matrix {base!r}: each rank's "
            f"{width} input columns are not a multiple of its quantization group ({group}); launch with fewer "
            f"ranks, re-convert with a smaller --group-size, or use distributed='pipeline'"
        )
        raise DistributedError(msg)
    if any(a * quant.bits % 32 or b * quant.bits % 32 for a, b in ranges):  # e.g. 3-bit groups of 16 (GGUF Q3_K)
        msg = (
            f"distributed='tensor' over {size} ranks cannot split quantized matrix {base!r}: each rank's "
            f"{width} input columns of {quant.bits}-bit codes do not end on a 32-bit word of the packed rows; "
            f"launch with fewer ranks, or use distributed='pipeline'"
        )
        raise DistributedError(msg)
    if leaf == "weight":
        return [(a * quant.bits // 32, b * quant.bits // 32) for a, b in ranges]
    return [(a // group, b // group) for a, b in ranges]


class StageShare:
    """A pipeline rank's share: whole tensors, except those of decoder layers other ranks run.

    Args:
        plan: The family's pipeline declaration.
        index: The install's tensor index.
        layers: This rank's decoder layers ``[start, stop)``.
        num_layers: The model's decoder layers.
    """

    def __init__(self, plan: PipelinePlan, index: TensorIndex, layers: Range, num_layers: int) -> None:
        self.plan, self.index, self.layers, self.num_layers = plan, index, layers, num_layers
        self._others = tuple(plan.layer_prefix.format(i) for i in range(num_layers) if not layers[0] <= i < layers[1])

    def holds(self, name: str) -> bool:
        """Whether this rank reads ``name`` (everything but other ranks' layers)."""
        return not name.startswith(self._others) if self._others else True

    def slice_of(self, name: str) -> Slice | None:
        """Pipeline ranks read whole tensors."""
        del name
        return None

    def local_index(self) -> TensorIndex:
        """The index of the tensors this rank reads."""
        tensors = {n: t for n, t in self.index.tensors.items() if self.holds(n)}
        return TensorIndex(tensors=tensors, quantization=self.index.quantization)


def layer_costs(index: TensorIndex, plan: PipelinePlan, num_layers: int, expert_bytes: dict[str, int]) -> list[int]:
    """Bytes each decoder layer's tensors (and experts.bin records) take: what pipeline ranges balance."""
    costs = [0] * num_layers
    prefixes = [plan.layer_prefix.format(i) for i in range(num_layers)]
    for name, info in index.tensors.items():
        for i, p in enumerate(prefixes):
            if name.startswith(p):
                costs[i] += info.nbytes
                break
    for prefix, nbytes in expert_bytes.items():
        for i, p in enumerate(prefixes):
            if prefix.startswith(p):
                costs[i] += nbytes
                break
    return [max(c, 1) for c in costs]
