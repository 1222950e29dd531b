"""Latent attention over the compressed cache: the cache after the prompt equals the reference's
(c after kv_a_layernorm, k_r after RoPE), the absorbed form equals the expanded one, and the
memory estimate counts kv_lora_rank + qk_rope_head_dim values per token and layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core

FIXTURES = ("deepseek_v2", "deepseek_v2_qlora")


@pytest.fixture(params=FIXTURES)
def fixture(request: pytest.FixtureRequest, turbospark_install: Any, turbospark_fixtures: Path) -> tuple[Any, Any]:
    runner = turbospark_core.open(turbospark_install(request.param))
    return runner, np.load(turbospark_fixtures / request.param / "references.npz")


def test_cache_after_prompt_is_the_reference_latent_and_rope_key(fixture: tuple[Any, Any]) -> None:
    runner, refs = fixture
    ids = refs["prompt_ids"].tolist()
    cache = runner.opened.new_cache()
    runner.model(mx.array([ids]), cache)
    r = runner.manifest.arch["kv_lora_rank"]
    held = np.stack([np.array(c.keys[0, 0, : len(ids)]) for c in cache])  # [L, T, r + dr]: one row, no values
    assert held.shape[-1] == r + runner.manifest.arch["qk_rope_head_dim"]
    assert all(c.values is not None and c.values.shape[-1] == 0 for c in cache)
    assert np.abs(held[..., :r] - refs["mla_kv_latent"]).max() <= 1e-5
    assert np.abs(held[..., r:] - refs["mla_k_rope"]).max() <= 1e-5


def test_absorbed_form_equals_expanded_form(fixture: tuple[Any, Any]) -> None:
    runner, refs = fixture
    ids = refs["prompt_ids"].tolist()
    block = runner.model.layers[1]
    attn = block.self_attn
    h = mx.fast.rms_norm(runner.model.embed_tokens(mx.array([ids])), block.input_layernorm, block.eps)
    q_nope, q_r = attn.query(h, 0)
    keys = attn.cache_row(h, 0)
    expanded = np.array(attn.expanded(q_nope, q_r, keys, "causal"))
    absorbed = np.array(attn.absorbed(attn.absorbed_query(q_nope, q_r), keys, "causal"))
    assert np.abs(absorbed - expanded).max() <= 1e-5 * max(1.0, np.abs(expanded).max())
    assert attn.expand_is_cheaper(len(ids), len(ids)) != attn.expand_is_cheaper(1, len(ids))


def test_decode_one_token_at_a_time_matches_reference_logits(fixture: tuple[Any, Any]) -> None:
    runner, refs = fixture
    ids, want = refs["prompt_ids"].tolist(), refs["logits"]
    cache = runner.opened.new_cache()
    runner.model(mx.array([ids[:8]]), cache)
    got = np.stack([np.array(runner.model(mx.array([[t]]), cache)[0, -1]) for t in ids[8:]])
    assert np.abs(got - want[8:]).max() <= 1e-5 * np.abs(want).max()


def test_memory_estimate_counts_the_compressed_rows(turbospark_install: Any) -> None:
    runner = turbospark_core.open(turbospark_install("deepseek_v2"), max_context=4096)
    arch = runner.manifest.arch
    per_token = arch["num_hidden_layers"] * (arch["kv_lora_rank"] + arch["qk_rope_head_dim"]) * 4  # float32
    assert runner.opened.estimate.kv == 4096 * per_token
    expanded = (
        arch["num_hidden_layers"]
        * arch["num_attention_heads"]
        * (arch["qk_nope_head_dim"] + arch["qk_rope_head_dim"] + arch["v_head_dim"])
        * 4
    )
    assert per_token * 4 == expanded  # 48 against 192 values per token and layer here
