"""The deepseek plugin's distributed plan against its fixtures: latent attention by heads over a latent cache every
rank holds whole, shared experts by columns, routed experts by expert; a pipeline rank building only its layers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from tiny_v3 import V3, v3_tensors

from turbospark_core import plugins
from turbospark_core.cache_spec import CacheSpec
from turbospark_core.compute import ComputePolicy
from turbospark_core.context import FamilyContext
from turbospark_core.distributed.pipeline import Relay
from turbospark_core.distributed.share import Slice
from turbospark_core.errors import DistributedError
from turbospark_core.testing import distributed_open

ATTN = "model.layers.1.self_attn"


def test_heads_split_and_the_latent_cache_stays_whole(turbospark_install: Callable[..., Path]) -> None:
    dist = distributed_open(turbospark_install("deepseek_v2"), "tensor", 2, 1)  # 4 heads: dn 16, dr 16, dv 16, r 32
    assert dist.arch["num_attention_heads"] == 2
    share = dist.tensors
    assert share.slice_of(f"{ATTN}.q_proj.weight") == Slice(0, ((64, 128),))  # heads 2-3: [q_nope | q_rope]
    assert share.slice_of(f"{ATTN}.kv_b_proj.weight") == Slice(0, ((64, 128),))  # heads 2-3: [k_nope | v]
    assert share.slice_of(f"{ATTN}.o_proj.weight") == Slice(1, ((32, 64),))
    for whole in ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"):  # the latent [c | k_r] every head reads
        assert share.slice_of(f"{ATTN}.{whole}") is None
    layout = plugins.family_hooks("deepseek_v2").cache_layout(dist.arch)
    assert layout == (CacheSpec(n_kv_heads=1, head_dim=48, v_head_dim=0),) * 3  # one latent row per token, whole
    assert share.slice_of("model.layers.1.mlp.shared_experts.up_proj.weight") == Slice(0, ((24, 48),))
    assert share.slice_of("model.layers.1.mlp.shared_experts.down_proj.weight") == Slice(1, ((24, 48),))
    assert share.slice_of("model.layers.0.mlp.gate_proj.weight") == Slice(0, ((48, 96),))  # the dense layer
    assert share.slice_of("model.layers.1.mlp.gate.weight") is None  # the router: every rank routes alike
    assert "experts 4-7 of 8 per routed layer" in dist.share()
    assert share.vocab_rows("lm_head") == (256, 512)


def test_low_rank_queries_split_after_their_shared_down_projection(turbospark_install: Callable[..., Path]) -> None:
    share = distributed_open(turbospark_install("deepseek_v2_qlora"), "tensor", 2, 1).tensors  # dq 24, dn + dv 40
    assert share.slice_of(f"{ATTN}.q_a_proj.weight") is None and share.slice_of(f"{ATTN}.q_a_layernorm.weight") is None
    assert share.slice_of(f"{ATTN}.q_b_proj.weight") == Slice(0, ((48, 96),))
    assert share.slice_of(f"{ATTN}.kv_b_proj.weight") == Slice(0, ((80, 160),))
    assert share.slice_of(f"{ATTN}.o_proj.weight") == Slice(1, ((48, 96),))  # v_head_dim 24


def test_v3_routing_tensors_are_replicated(turbospark_tiny_install: Callable[..., Path]) -> None:
    share = distributed_open(turbospark_tiny_install("deepseek_v3", V3, v3_tensors(V3)), "tensor", 2, 0).tensors
    assert share.slice_of("model.layers.1.mlp.gate.e_score_correction_bias") is None
    assert share.slice_of("model.layers.1.mlp.shared_experts.gate_proj.weight") == Slice(0, ((0, 12),))


def test_splits_the_group_cannot_make_are_refused(turbospark_install: Callable[..., Path]) -> None:
    install = turbospark_install("deepseek_v2")
    with pytest.raises(DistributedError, match=r"over 8 ranks cannot split the heads of 'model\.layers\.0\.self_attn"):
        distributed_open(install, "tensor", 8)  # 4 query heads: a query head is never replicated
    with pytest.raises(DistributedError, match="needs at least one decoder layer per rank, but the model has 3"):
        distributed_open(install, "pipeline", 4)


def test_a_pipeline_rank_builds_only_its_layers(turbospark_tiny_install: Callable[..., Path]) -> None:
    """The per-head maps cut from kv_b_proj are computed at the first forward, for the blocks the model runs:
    built at open, a pipeline rank would compute them for every other rank's layer too (from placeholders)."""
    dense: dict[str, Any] = V3 | {
        "num_hidden_layers": 4, "first_k_dense_replace": 4, "num_nextn_predict_layers": 0, "kv_lora_rank": 128,
    }  # fmt: skip
    dist = distributed_open(turbospark_tiny_install("deepseek_v3_dense", dense, v3_tensors(dense)), "pipeline", 2, 1)
    assert dist.layers == (2, 4)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    weights = dist.weights(ComputePolicy(unpack=False, compute_dtype=mx.float32, reason="float32 install"))
    context = FamilyContext(arch=dist.arch, weights=weights, cache_layout=(), compute_dtype=mx.float32)
    model = dist.finish(plugins.family_hooks("deepseek_v3").build_family_state(context), "deepseek")
    weights.materialize()
    assert [isinstance(b, Relay) for b in model.layers] == [True, True, False, False]
    held = dist.held_index().stored_bytes()
    assert mx.get_peak_memory() - before <= held + 32768  # its layers' weights (and a few scalars), nothing more
