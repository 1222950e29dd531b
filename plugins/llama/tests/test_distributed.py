"""The llama plugin's distributed plan against its fixtures: what two ranks hold, and the refusal of full q/k norms."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from turbospark_core.distributed.share import Slice
from turbospark_core.errors import DistributedError
from turbospark_core.testing import distributed_open


def test_two_ranks_split_heads_mlp_columns_and_vocabulary(turbospark_install: Callable[..., Path]) -> None:
    dist = distributed_open(turbospark_install("llama"), "tensor", 2, 1)
    assert (dist.arch["num_attention_heads"], dist.arch["num_key_value_heads"]) == (2, 1)
    share = dist.tensors
    assert share.slice_of("model.layers.0.self_attn.k_proj.weight") == Slice(0, ((16, 32),))
    assert share.slice_of("model.layers.1.self_attn.o_proj.weight") == Slice(1, ((32, 64),))
    assert share.slice_of("model.layers.1.mlp.up_proj.weight") == Slice(0, ((80, 160),))
    assert share.vocab_rows("lm_head") == (256, 512)
    moe = distributed_open(turbospark_install("qwen3_moe"), "tensor", 2, 0)
    assert "experts 0-3 of 8 per routed layer" in moe.share()


def test_full_qk_norm_refuses_tensor_parallelism_not_pipelining(turbospark_install: Callable[..., Path]) -> None:
    with pytest.raises(DistributedError, match=r"qk_norm='full' normalizes each token's query and key rows over all"):
        distributed_open(turbospark_install("minimax_m2"), "tensor", 2)
    assert distributed_open(turbospark_install("minimax_m2"), "pipeline", 2).layers == (0, 1)
