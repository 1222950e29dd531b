"""Pipeline parallelism's run-time parts in one process: relays, empty cache entries, the stage model."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from turbospark_core.batch_cache import BatchCaches
from turbospark_core.cache_spec import CacheSpec, StateSpec
from turbospark_core.distributed import world
from turbospark_core.distributed.pipeline import Relay, Stage, StageModel, check_layers, install_relays, stage_layout
from turbospark_core.distributed.plan import PipelinePlan
from turbospark_core.errors import DistributedError
from turbospark_core.kv_cache import KVCache, RecurrentState, make_caches
from turbospark_core.steering import steer


class Toy:
    """Three layers adding 1, 10 and 100, each output through ``steer``."""

    def __init__(self) -> None:
        self.blocks: list[Any] = [self._adder(10**i) for i in range(3)]

    @staticmethod
    def _adder(n: int) -> Any:
        return lambda h, cache: h + n

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        h = inputs.astype(mx.float32)
        for i, block in enumerate(self.blocks):
            h = steer(block(h, None if cache is None else cache[i]), i)
        return h

    @property
    def layers(self) -> list[Any]:
        return self.blocks


class CopyingLayers(Toy):
    @property
    def layers(self) -> list[Any]:
        return list(self.blocks)


def test_a_relay_hands_its_input_on_in_the_blocks_shape() -> None:
    h = mx.ones((1, 2, 4))
    assert Relay(0, 1)(h, "cache", offset=3) is h
    assert Relay(0, 2)(h, None) == (h, None)


def test_other_ranks_cache_entries_hold_nothing() -> None:
    layout = [CacheSpec.full(2, 16), CacheSpec.sliding(2, 16, 8), StateSpec(shapes={"conv": (3, 32), "rec": (2, 4, 4)})]
    held = stage_layout(layout, (1, 2))
    assert held[1] == layout[1]
    assert held[0] == CacheSpec.full(0, 16) and held[0].bytes_at(1000, 4) == 0
    assert isinstance(held[2], StateSpec) and held[2].bytes_at(0, 4) == 0 and set(held[2].shapes) == {"conv", "rec"}


def test_a_rank_runs_its_layers_and_relays_the_others() -> None:
    model = Toy()
    install_relays(model, (0, 2), PipelinePlan(), "toy")
    staged = StageModel(model, Stage(world().handle, 0, 1, (0, 2), 3), [2])
    assert mx.array_equal(staged(mx.zeros((1, 2))), mx.full((1, 2), 11.0))  # layers 0 and 1 ran, not 2
    assert isinstance(staged, Toy) and staged.blocks is model.blocks  # passes for the family's model


def test_relays_need_the_list_the_forward_runs() -> None:
    with pytest.raises(DistributedError, match="its model's `layers` property does not return the list its forward"):
        install_relays(CopyingLayers(), (0, 1), PipelinePlan(), "toy")
    with pytest.raises(
        DistributedError, match=r"lists 3 decoder blocks in `layers`, the arch config has num_hidden_layers=4"
    ):
        check_layers(Toy(), 4, "toy")


def test_other_ranks_entries_follow_the_sequence_position() -> None:
    layout = stage_layout([CacheSpec.full(2, 16), CacheSpec.full(2, 16), StateSpec(shapes={"s": (4,)})], (0, 1))
    caches = make_caches(list(layout), 64, mx.float32)
    model = Toy()
    install_relays(model, (0, 1), PipelinePlan(), "toy")
    staged = StageModel(model, Stage(world().handle, 0, 1, (0, 1), 3), [1, 2])
    staged(mx.zeros((1, 5)), caches)
    assert caches[0].offset == 0  # the family's own layers keep their caches (the toy writes none)
    assert isinstance(caches[1], KVCache) and caches[1].offset == 5 and caches[1].state == []
    assert isinstance(caches[2], RecurrentState) and caches[2].offset == 5
    batch = BatchCaches(make_caches(list(layout), 64, mx.float32))
    batch.add_row(make_caches(list(layout), 64, mx.float32), 0)
    staged(mx.zeros((1, 1)), batch.caches)
    assert batch.caches[2].arrays["s"].shape == (1, 0)  # the rewind bookkeeping of a recurrent layer, no memory


def test_the_stage_shares_the_last_layer_and_starts_its_collectives() -> None:
    stage = Stage(world().handle, 0, 1, (0, 3), 3)
    h = mx.ones((1, 2, 4))
    assert stage.exchange(h, 1) is h and not stage.issued
    assert mx.array_equal(stage.exchange(h, 2), h) and len(stage.issued) == 1
    assert mx.array_equal(stage.owned(h, 0), h) and len(stage.issued) == 2
    stage.start()
    assert not stage.issued
