"""The spark plugin's distributed plan against its fixture: the fused q|k|v by section, the head-wise gate, layers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from turbospark_core.distributed.share import Slice
from turbospark_core.errors import DistributedError
from turbospark_core.testing import distributed_open

QKV = "model.layers.3.self_attn.q_k_v_proj.weight"  # 4 query heads, 2 key/value heads of 16 rows: [64 | 32 | 32]


def test_fused_qkv_splits_by_section_and_the_gate_by_query_heads(turbospark_install: Callable[..., Path]) -> None:
    dist = distributed_open(turbospark_install("spark2_5"), "tensor", 2, 1)
    assert (dist.arch["num_attention_heads"], dist.arch["num_key_value_heads"]) == (2, 1)
    share = dist.tensors
    assert share.slice_of(QKV) == Slice(0, ((32, 64), (80, 96), (112, 128)))  # query heads 2-3, kv head 1 of k, of v
    assert share.slice_of("model.layers.3.self_attn.g_proj.weight") == Slice(0, ((2, 4),))  # one gate row per head
    assert share.slice_of("model.layers.3.self_attn.out_proj.weight") == Slice(1, ((32, 64),))
    assert share.slice_of("model.layers.3.mlp.down_proj.weight") == Slice(1, ((64, 128),))
    assert share.vocab_rows("model.embedding") == (256, 512)  # the tied table: lookups summed, logits gathered
    assert share.slice_of("model.layers.3.input_layernorm.weight") is None


def test_four_ranks_hold_the_key_value_head_their_queries_read(turbospark_install: Callable[..., Path]) -> None:
    ranks = [distributed_open(turbospark_install("spark2_5"), "tensor", 4, r) for r in range(4)]
    assert [(d.arch["num_attention_heads"], d.arch["num_key_value_heads"]) for d in ranks] == [(1, 1)] * 4
    assert ranks[1].tensors.slice_of(QKV) == Slice(0, ((16, 32), (64, 80), (96, 112)))  # query head 1 reads kv head 0
    assert ranks[2].tensors.slice_of(QKV) == Slice(0, ((32, 48), (80, 96), (112, 128)))  # query head 2 reads kv head 1
    pipeline = [distributed_open(turbospark_install("spark2_5"), "pipeline", 4, r).layers for r in range(4)]
    assert pipeline == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_splits_the_group_cannot_make_are_refused(turbospark_install: Callable[..., Path]) -> None:
    install = turbospark_install("spark2_5")
    with pytest.raises(DistributedError, match=r"over 3 ranks cannot split num_attention_heads=4 \(neither divides"):
        distributed_open(install, "tensor", 3)
    with pytest.raises(DistributedError, match="needs at least one decoder layer per rank, but the model has 4"):
        distributed_open(install, "pipeline", 5)
