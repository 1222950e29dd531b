"""The split arithmetic: head shares, per-rank arch counts, tensor ranges, pipeline layer ranges, and their refusals."""

from __future__ import annotations

import pytest

from turbospark_core.distributed.plan import Split
from turbospark_core.distributed.shares import (
    find_split,
    head_share,
    layer_ranges,
    matches,
    per_rank_arch,
    split_ranges,
)
from turbospark_core.errors import DistributedError


def test_heads_split_evenly_or_replicate_when_fewer_than_ranks() -> None:
    assert [head_share(8, 4, r, "h") for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [head_share(2, 4, r, "kv") for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [head_share(1, 2, r, "kv") for r in range(2)] == [(0, 1), (0, 1)]


def test_indivisible_heads_are_refused_with_the_numbers_and_the_fix() -> None:
    with pytest.raises(DistributedError, match=r"over 2 ranks cannot split num_attention_heads=3 \(neither divides"):
        head_share(3, 2, 0, "num_attention_heads")
    with pytest.raises(DistributedError, match=r"launch with a group size that divides 6 \(or a multiple of 6\)"):
        head_share(6, 4, 0, "x")
    with pytest.raises(DistributedError, match=r"split experts=2 \(not divisible by 4\).*'pipeline'"):
        head_share(2, 4, 0, "experts", replicate=False)


def test_per_rank_arch_divides_the_declared_counts_only() -> None:
    arch = {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 64, "moe": {"heads": 4}, "none": None}
    got = per_rank_arch(arch, ["num_attention_heads", "num_key_value_heads", "moe.heads", "none", "absent"], 4)
    assert got == {
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "hidden_size": 64,
        "moe": {"heads": 1},
        "none": None,
    }
    assert arch["moe"] == {"heads": 4}  # the install's arch is not touched
    with pytest.raises(DistributedError, match="num_key_value_heads=3"):
        per_rank_arch({"num_key_value_heads": 3}, ["num_key_value_heads"], 2)


def test_sections_split_each_part_and_merge_adjacent_ranges() -> None:
    qkv = Split.out((2, 16), (2, 16), (4, 16))  # fused q | k | v: 32 + 32 + 64 rows
    assert split_ranges(qkv, 128, 2, 0, "qkv") == [(0, 16), (32, 48), (64, 96)]
    assert split_ranges(qkv, 128, 2, 1, "qkv") == [(16, 32), (48, 64), (96, 128)]
    assert split_ranges(Split.out((4, 8)), 32, 2, 1, "q") == [(16, 32)]
    assert split_ranges(Split.into(), 160, 2, 1, "down") == [(80, 160)]
    assert split_ranges(Split.out((1, 16)), 16, 2, 1, "k") == [(0, 16)]  # one key head: replicated


def test_a_plan_that_does_not_fit_or_cannot_split_is_refused() -> None:
    with pytest.raises(DistributedError, match=r"splits 'q' into sections \[\(4, 8\)\] \(32 rows\).*has 40"):
        split_ranges(Split.out((4, 8)), 40, 2, 0, "q")
    with pytest.raises(DistributedError, match=r"cannot split 'down': its 162 input columns are not divisible by 4"):
        split_ranges(Split.into(), 162, 4, 0, "down")
    with pytest.raises(DistributedError, match=r"cannot split the heads of 'o'=1 \(not divisible by 2\)"):
        split_ranges(Split.into((1, 16)), 16, 2, 0, "o")  # summed outputs cannot replicate a head


def test_exact_names_win_over_globs() -> None:
    a, b = Split.out(), Split.into()
    splits = {"*.q_proj": a, "model.layers.0.self_attn.q_proj": b}
    assert find_split(splits, "model.layers.0.self_attn.q_proj") is b
    assert find_split(splits, "model.layers.1.self_attn.q_proj") is a
    assert find_split(splits, "model.layers.1.self_attn.q_proj.weight") is None
    assert matches(["lm_head", "*.embed_tokens"], "model.embed_tokens") and not matches(["lm_head"], "x.lm_head")


def test_layer_ranges_balance_bytes_and_keep_tied_layers_together() -> None:
    assert layer_ranges([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert layer_ranges([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert layer_ranges([1] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # gemma4_e: layers 3 and 4 read the keys and values of layers 1 and 2
    assert layer_ranges([1] * 5, 2, [(3, 1), (4, 2)]) == [(0, 1), (1, 5)]


def test_layer_ranges_refuse_what_cannot_be_split() -> None:
    with pytest.raises(DistributedError, match="needs at least one decoder layer per rank, but the model has 2"):
        layer_ranges([1, 1], 4)
    with pytest.raises(DistributedError, match=r"must run together \(0-3: a layer and.*no split into 2"):
        layer_ranges([1] * 4, 2, [(3, 0)])
