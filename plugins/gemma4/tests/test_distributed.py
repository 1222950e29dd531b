"""The gemma4 plugin's distributed plan against its fixtures: per-layer head sizes, one key/value head, KV sharing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from turbospark_core.distributed.share import Slice
from turbospark_core.testing import distributed_open


def test_one_key_value_head_is_held_by_both_ranks(turbospark_install: Callable[..., Path]) -> None:
    ranks = [distributed_open(turbospark_install("gemma4_e"), "tensor", 2, r) for r in range(2)]
    assert [d.arch["num_key_value_heads"] for d in ranks] == [1, 1]
    sliding, full = "model.layers.0.self_attn.k_proj.weight", "model.layers.2.self_attn.k_proj.weight"
    assert [d.tensors.slice_of(sliding) for d in ranks] == [Slice(0, ((0, 16),))] * 2
    assert [d.tensors.slice_of(full) for d in ranks] == [Slice(0, ((0, 32),))] * 2  # the global head is wider
    assert ranks[1].tensors.slice_of("model.layers.2.self_attn.q_proj.weight") == Slice(0, ((64, 128),))
    assert ranks[1].tensors.vocab_rows("model.embed_tokens_per_layer") == (256, 512)


def test_kv_sharing_layers_stay_with_the_layers_they_read(turbospark_install: Callable[..., Path]) -> None:
    ranks = [distributed_open(turbospark_install("gemma4_e"), "pipeline", 2, r) for r in range(2)]
    assert ranks[0].plan.tied == ((3, 1), (4, 2)) and ranks[0].plan.block_outputs == 2
    assert [d.layers for d in ranks] == [(0, 1), (1, 5)]
