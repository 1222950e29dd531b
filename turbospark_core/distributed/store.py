"""The weight stores of a distributed open: each hands a family its rank's share as the core's usual objects.

:class:`ShardedWeightStore` (tensor parallelism) reads only the slices
:class:`~turbospark_core.distributed.share.TensorShare` assigns and wraps the
split matrices, tables and expert banks in the objects of
:mod:`turbospark_core.distributed.tensor`. :class:`StageWeightStore`
(pipeline parallelism) reads only the tensors outside other ranks' layers;
what a family builds for those layers gets placeholders that read nothing and
refuse to run (the core puts relays in their place).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from turbospark_core.compute import ComputePolicy
from turbospark_core.distributed.reader import ShardReader
from turbospark_core.distributed.share import StageShare, TensorShare
from turbospark_core.distributed.tensor import ExpertParallel, GatheredLinear, RowLinear, VocabEmbedding
from turbospark_core.errors import DistributedError
from turbospark_core.layers import Activation, Embedding, Experts, Linear
from turbospark_core.tensor_index import TensorIndex
from turbospark_core.weights import WeightStore


class ShardedWeightStore(WeightStore):
    """The weight store of a tensor-parallel rank: its slices, as row-/vocab-/expert-parallel objects."""

    def __init__(
        self, path: Path, index: TensorIndex, policy: ComputePolicy, share: TensorShare, reader: ShardReader, group: Any
    ) -> None:
        super().__init__(path, index, policy)
        self.share, self.reader, self.group = share, reader, group

    def _take(self, name: str) -> mx.array:
        self._claim(name)  # refuses a missing tensor, marks it used; the rank reads only its share
        info = self.index.tensors[name]
        part = self.share.slice_of(name)
        return self.reader.read(info) if part is None else self.reader.read(info, part.axis, list(part.ranges))

    def linear(self, base: str, *, native_ok: bool = True) -> Linear:
        """As :meth:`WeightStore.linear`; a row-parallel matrix sums its outputs, a vocabulary head gathers them."""
        part = super().linear(base, native_ok=native_ok)
        if self.share.is_row_parallel(base):
            return RowLinear(part, self.group)
        if self.share.vocab_rows(base) is not None:
            return GatheredLinear(part, self.group)
        return part

    def embedding(self, base: str) -> Embedding:
        """As :meth:`WeightStore.embedding`; a table split by vocabulary rows sums its lookups."""
        rows = self.share.vocab_rows(base)
        if rows is None:
            return super().embedding(base)
        return VocabEmbedding(self.linear(base), self.policy.compute_dtype, rows, self.group)

    def experts(self, prefix: str, gate: str, up: str, down: str) -> Experts:
        """This rank's experts of layer ``prefix`` (expert parallelism); experts.bin records of the others unread."""
        local = super().experts(prefix, gate, up, down)
        total = self._expert_count(prefix, gate, local)
        first, count = self.share.experts_share(total, prefix)
        return ExpertParallel(local, first, count, total, self.group)

    def _expert_count(self, prefix: str, gate: str, local: Experts) -> int:
        stacked = self.index.tensors.get(f"{prefix}.{gate}.weight")
        if stacked is not None:
            return stacked.shape[0]
        return local.num_experts * self.share.size  # experts.bin: the local layout holds 1/size of them


def placeholder(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """A zero array of ``shape`` that takes no memory (a broadcast scalar) and reads nothing."""
    return mx.broadcast_to(mx.zeros((), dtype), shape)


class RemoteLinear(Linear):
    """A matrix of a decoder layer another pipeline rank runs: its shape only; calling it is refused."""

    def __init__(self, base: str, shape: tuple[int, ...], dtype: mx.Dtype) -> None:
        super().__init__(placeholder(shape, dtype))
        self.base = base

    def __call__(self, x: mx.array) -> mx.array:
        raise _ran_remote(self.base)


class RemoteExperts:
    """The routed experts of a decoder layer another pipeline rank runs (nothing read; calling is refused)."""

    def __init__(self, prefix: str, num_experts: int) -> None:
        self.prefix, self._num = prefix, num_experts

    @property
    def num_experts(self) -> int:
        """How many experts the layer has."""
        return self._num

    def glu(self, x: mx.array, indices: mx.array, activation: Activation, weights: mx.array | None = None) -> mx.array:
        """Refused: another rank runs this layer."""
        raise _ran_remote(self.prefix)


def _ran_remote(name: str) -> DistributedError:
    return DistributedError(
        f"{name!r} belongs to a decoder layer another pipeline rank runs, yet the family's forward called it: "
        f"the flow does not run its decoder layers through the list its `layers` property returns (which the "
        f"core fills with relays); the plugin cannot declare a pipeline plan as written"
    )


class StageWeightStore(WeightStore):
    """The weight store of a pipeline rank: whole tensors outside other ranks' layers, placeholders inside."""

    def __init__(
        self,
        path: Path,
        index: TensorIndex,
        policy: ComputePolicy,
        share: StageShare,
        reader: ShardReader,
        expert_counts: dict[str, int],
    ) -> None:
        super().__init__(path, index, policy)
        self.share, self.reader, self.expert_counts = share, reader, expert_counts

    def _take(self, name: str) -> mx.array:
        self._claim(name)
        return self.reader.read(self.index.tensors[name])

    def _remote(self, names: list[str]) -> None:
        self._used.update(n for n in names if n in self._names)

    def tensor(self, name: str) -> mx.array:
        """As :meth:`WeightStore.tensor`; another rank's layer gets a placeholder of its shape."""
        if self.share.holds(name):
            return super().tensor(name)
        leaves = [f"{name}.{leaf}" for leaf in ("weight", "scales", "biases")]
        self._remote([name, *leaves])
        shape = self.index.logical_shape(name) if name in self.index.quantization else self.index.tensors[name].shape
        return placeholder(shape, self.policy.compute_dtype)

    def linear(self, base: str, *, native_ok: bool = True) -> Linear:
        """As :meth:`WeightStore.linear`; another rank's layer gets a :class:`RemoteLinear`."""
        if self.share.holds(f"{base}.weight"):
            return super().linear(base, native_ok=native_ok)
        self._remote([f"{base}.{leaf}" for leaf in ("weight", "bias", "scales", "biases")])
        return RemoteLinear(base, self.index.logical_shape(base), self.policy.compute_dtype)

    def experts(self, prefix: str, gate: str, up: str, down: str) -> Experts:
        """As :meth:`WeightStore.experts`; another rank's layer gets :class:`RemoteExperts` (nothing read)."""
        if self.share.holds(f"{prefix}."):
            return super().experts(prefix, gate, up, down)
        self._remote(
            [f"{prefix}.{p}.{leaf}" for p in (gate, up, down) for leaf in ("weight", "bias", "scales", "biases")]
        )
        stacked = self.index.tensors.get(f"{prefix}.{gate}.weight")
        count = stacked.shape[0] if stacked is not None else self.expert_counts.get(prefix, 0)
        return RemoteExperts(prefix, count)
