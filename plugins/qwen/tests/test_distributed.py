"""The qwen plugin's distributed plan against its fixtures: DeltaNet heads split by section, and layer ranges."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from turbospark_core.distributed.share import Slice
from turbospark_core.testing import distributed_open


def test_deltanet_key_and_value_heads_split_by_section(turbospark_install: Callable[..., Path]) -> None:
    dist = distributed_open(turbospark_install("qwen3_5"), "tensor", 2, 1)
    assert (dist.arch["linear_num_key_heads"], dist.arch["linear_num_value_heads"]) == (1, 2)
    share = dist.tensors
    qkv = Slice(0, ((16, 32), (48, 64), (96, 128)))  # q | k | v: the second key head, value heads 2 and 3
    assert share.slice_of("model.layers.0.linear_attn.in_proj_qkv.weight") == qkv
    assert share.slice_of("model.layers.0.linear_attn.conv1d.weight") == qkv
    assert share.slice_of("model.layers.0.linear_attn.A_log") == Slice(0, ((2, 4),))
    assert share.slice_of("model.layers.0.linear_attn.out_proj.weight") == Slice(1, ((32, 64),))
    assert share.slice_of("model.layers.3.self_attn.q_proj.weight") == Slice(0, ((128, 256),))  # query | gate
    assert share.slice_of("model.layers.0.linear_attn.norm.weight") is None


def test_layers_split_into_two_ranges(turbospark_install: Callable[..., Path]) -> None:
    assert [distributed_open(turbospark_install("qwen3_5"), "pipeline", 2, r).layers for r in range(2)] == [
        (0, 2),
        (2, 4),
    ]
