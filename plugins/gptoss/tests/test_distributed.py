"""The gptoss plugin's distributed plan against its fixture: heads with their biases and sinks, experts by expert."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from turbospark_core.distributed.share import Slice
from turbospark_core.testing import distributed_open


def test_heads_biases_and_sinks_split_and_experts_by_expert(turbospark_install: Callable[..., Path]) -> None:
    dist = distributed_open(turbospark_install("gpt_oss"), "tensor", 2, 1)
    share = dist.tensors
    assert share.slice_of("model.layers.0.self_attn.sinks") == Slice(0, ((2, 4),))
    assert share.slice_of("model.layers.0.self_attn.q_proj.bias") == Slice(0, ((32, 64),))
    assert share.slice_of("model.layers.0.self_attn.o_proj.bias") is None  # added once, after the sum
    layers = dist.held_experts().layers.values()
    assert all(x.num_experts == 4 for x in layers) and "experts 4-7 of 8" in dist.share()
