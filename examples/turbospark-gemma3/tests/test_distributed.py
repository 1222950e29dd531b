"""The plugin's distributed plan: what each rank holds, on the tiny checkpoint and on the real 270M."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tiny_gemma3 import TINY

from turbospark_core.distributed.share import Slice
from turbospark_core.testing import distributed_open

ATTN = "model.layers.2.self_attn"


def test_two_ranks_split_heads_geglu_columns_and_vocabulary(turbospark_install: Any) -> None:
    dist = distributed_open(turbospark_install(TINY), "tensor", 2, 1)  # 4 / 2 heads of 32 rows (hidden 64)
    assert (dist.arch["num_attention_heads"], dist.arch["num_key_value_heads"]) == (2, 1)
    share = dist.tensors
    assert share.slice_of(f"{ATTN}.q_proj.weight") == Slice(0, ((64, 128),))
    assert share.slice_of(f"{ATTN}.k_proj.weight") == share.slice_of(f"{ATTN}.v_proj.weight") == Slice(0, ((32, 64),))
    assert share.slice_of(f"{ATTN}.o_proj.weight") == Slice(1, ((64, 128),))
    assert share.slice_of(f"{ATTN}.q_norm.weight") is None  # one head's norm weights, applied to every head
    assert share.slice_of("model.layers.2.mlp.up_proj.weight") == Slice(0, ((48, 96),))
    assert share.slice_of("model.layers.2.mlp.down_proj.weight") == Slice(1, ((48, 96),))
    assert share.vocab_rows("model.embed_tokens") == (256, 512)  # the tied table: lookups summed, logits gathered
    assert [distributed_open(turbospark_install(TINY), "pipeline", 2, r).layers for r in range(2)] == [(0, 2), (2, 4)]


@pytest.mark.slow
def test_the_real_model_splits_its_quantized_matrices(gemma3_270m_install: Path) -> None:
    """Gemma 3 270M: one key/value head (held by both ranks), 4-bit matrices split on whole groups of 32."""
    ranks = [distributed_open(gemma3_270m_install, "tensor", 2, r) for r in range(2)]
    assert [(d.arch["num_attention_heads"], d.arch["num_key_value_heads"]) for d in ranks] == [(2, 1)] * 2
    k = "model.layers.2.self_attn.k_proj.scales"
    assert ranks[0].tensors.slice_of(k) == ranks[1].tensors.slice_of(k) == Slice(0, ((0, 256),))
    o = "model.layers.2.self_attn.o_proj"  # 4 heads of 256 input columns, 4-bit: 8 columns per uint32 word
    assert ranks[1].tensors.slice_of(f"{o}.weight") == Slice(1, ((64, 128),))
    assert ranks[1].tensors.slice_of(f"{o}.scales") == Slice(1, ((16, 32),))  # groups of 32 columns
    assert ranks[1].tensors.vocab_rows("model.embed_tokens") == (131072, 262144)
