"""Pipeline parallelism at run time: relays for other ranks' layers, and the hand-over at layer outputs.

Rank ``r`` of ``R`` runs decoder layers ``[a, b)``. The family's flow is
unchanged: the core puts a :class:`Relay` (returns its input, computes
nothing) in the family's ``layers`` list for every other layer, and, during a
forward, :func:`~turbospark_core.steering.steer` hands each layer's output to
the :class:`Stage`, which

* after layer ``a - 1`` replaces the relayed state with the one received from rank ``r - 1``;
* after layer ``b - 1`` sends the state to rank ``r + 1``;
* after the last layer shares the last rank's state with every rank (an
  ``all_sum`` with zeros elsewhere: exact), so each rank's final norm and
  output head compute the same logits.

Each rank computes exactly the layers a single process computes for them,
so the logits are the single process's, bit for bit.

Caches: another rank's layer gets a cache entry that holds nothing
(:func:`stage_layout`); :class:`StageModel` advances its position after each
forward, so positions read from any entry, sessions, rewinds and batches
behave as on one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx

from turbospark_core.batch_cache import BatchRecurrentState
from turbospark_core.cache_spec import CacheSpec, StateSpec
from turbospark_core.context import FamilyModel
from turbospark_core.distributed.plan import PipelinePlan
from turbospark_core.errors import DistributedError
from turbospark_core.kv_cache import KVCache, RecurrentState, RingKVCache
from turbospark_core.steering import staging

Range = tuple[int, int]


class Stage:
    """The hand-over of rank ``rank`` (layers ``layers``) at decoder-layer outputs (a ``LayerStage``)."""

    def __init__(self, group: Any, rank: int, size: int, layers: Range, num_layers: int) -> None:
        self.group, self.rank, self.size, self.layers, self.num_layers = group, rank, size, layers, num_layers
        self._false = mx.array(False)
        self.issued: list[mx.array] = []  # this forward's collectives, in the order every rank issues them

    def _shared(self, h: mx.array, mine: bool) -> mx.array:
        out = mx.distributed.all_sum(h if mine else self._zeroed(h), group=self.group)
        self.issued.append(out)
        return out

    def _zeroed(self, h: mx.array) -> mx.array:
        return mx.where(self._false, h, mx.zeros((), h.dtype))  # zeros that still wait for h (and its send)

    def exchange(self, h: mx.array, layer: int) -> mx.array:
        """The state after ``layer``: received before this rank's layers, sent after them, shared after the last."""
        first, stop = self.layers
        if layer == first - 1:
            return mx.distributed.recv_like(h, self.rank - 1, group=self.group)
        if layer == stop - 1 and self.rank < self.size - 1:
            h = mx.distributed.send(h, self.rank + 1, group=self.group)
        if layer == self.num_layers - 1:
            h = self._shared(h, self.rank == self.size - 1)
        return h

    def owned(self, h: mx.array, layer: int) -> mx.array:
        """Layer ``layer``'s output from the rank running it, on every rank."""
        return self._shared(h, self.layers[0] <= layer < self.layers[1])

    def start(self) -> None:
        """Start this forward's hand-overs, in order, whatever the caller evaluates of it.

        A caller may evaluate only part of a forward (a prefill chunk's caches):
        on one rank that part needs the state received from the previous rank,
        on that rank it does not include the send. Evaluating each collective
        as soon as the forward is built keeps every rank's sends, receives and
        sums in one order.
        """
        for out in self.issued:
            mx.async_eval(out)  # type: ignore[no-untyped-call]  # mlx's stub leaves it unannotated
        self.issued.clear()


class Relay:
    """Stands in for a decoder layer another rank runs: hands its input on, computes nothing."""

    def __init__(self, layer: int, outputs: int) -> None:
        self.layer, self.outputs = layer, outputs

    def __call__(self, h: mx.array, *args: Any, **kwargs: Any) -> Any:
        return h if self.outputs == 1 else (h, *([None] * (self.outputs - 1)))


def stage_layout(layout: Sequence[CacheSpec | StateSpec], layers: Range) -> tuple[CacheSpec | StateSpec, ...]:
    """The cache layout a pipeline rank allocates: entries of other ranks' layers hold nothing."""

    def empty(spec: CacheSpec | StateSpec) -> CacheSpec | StateSpec:
        if isinstance(spec, StateSpec):
            return StateSpec(shapes={name: (0,) for name in spec.shapes}, dtype=spec.dtype)
        return attrs.evolve(spec, n_kv_heads=0)

    return tuple(s if layers[0] <= i < layers[1] else empty(s) for i, s in enumerate(layout))


def install_relays(model: FamilyModel, layers: Range, plan: PipelinePlan, family: str) -> None:
    """Put a :class:`Relay` in ``model.layers`` for every layer outside ``layers``.

    Raises:
        DistributedError: The family's ``layers`` is not one list the flow runs (it cannot be split).
    """
    blocks = model.layers
    for i in range(len(blocks)):
        if not layers[0] <= i < layers[1]:
            blocks[i] = Relay(i, plan.block_outputs)
    if any(not isinstance(b, Relay) for i, b in enumerate(model.layers) if not layers[0] <= i < layers[1]):
        msg = (
            f"family {family!r}: its model's `layers` property does not return the list its forward runs, so "
            f"distributed='pipeline' cannot replace other ranks' layers; the plugin must return that list"
        )
        raise DistributedError(msg)


class StageModel:
    """A pipeline rank's model: the family's forward with this rank's :class:`Stage` active.

    After each forward it advances the cache entries of other ranks' layers by
    the tokens run (their positions follow the sequence, they hold nothing).
    Everything else is the family model's: attribute access falls through, and
    it passes for an instance of the family's class (a plugin's multi-token
    prediction head checks the trunk it reuses the embedding and head of).
    """

    def __init__(self, model: FamilyModel, stage: Stage, remote: Sequence[int]) -> None:
        self.model, self.stage, self.remote = model, stage, tuple(remote)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **kwargs: Any) -> mx.array:
        with staging(self.stage):
            try:
                out = self.model(inputs, cache, **kwargs)
            except BaseException:
                self.stage.issued.clear()  # a forward that failed while building sends nothing
                raise
        self.stage.start()
        if cache is not None:
            self._advance(cache, inputs.shape[0], inputs.shape[1])
        return out

    def _advance(self, cache: list[Any], rows: int, tokens: int) -> None:
        for i in self.remote:
            entry = cache[i] if i < len(cache) else None
            if isinstance(entry, (KVCache, RingKVCache, RecurrentState)):
                entry.offset += tokens
            elif isinstance(entry, BatchRecurrentState):  # keeps the rewind bookkeeping the rank's own layers keep
                for name, shape in entry.spec.shapes.items():
                    entry.set(name, mx.zeros((rows, *shape), entry.dtype))

    @property
    def layers(self) -> list[Any]:
        """The family's decoder blocks (relays for other ranks' layers)."""
        return self.model.layers

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    @property  # type: ignore[misc]  # a proxy: isinstance() sees the family's class
    def __class__(self) -> type:
        return self.model.__class__


def check_layers(model: FamilyModel, num_layers: int, family: str) -> None:
    """The family's ``layers`` must list one block per decoder layer (what pipeline ranges index)."""
    if len(model.layers) != num_layers:
        msg = (
            f"family {family!r}: its model lists {len(model.layers)} decoder blocks in `layers`, the arch config "
            f"has num_hidden_layers={num_layers}; distributed='pipeline' cannot place them"
        )
        raise DistributedError(msg)
