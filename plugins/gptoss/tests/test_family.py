"""The flow's own refusals (each named) and its pieces: window mask, clamped SwiGLU, cache layout."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core.errors import ArchConfigError
from turbospark_core.kv_cache import causal_mask

from turbospark_gptoss import family
from turbospark_gptoss.family import Args

BASE = {
    "model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "vocab_size": 32,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "truncate": False},
    "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
    "num_local_experts": 8, "num_experts_per_tok": 2, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
}


def test_valid_arch_has_no_problems() -> None:
    assert Args.problems(BASE) == []
    assert Args.from_arch(BASE).layer_types == ("sliding_attention", "full_attention")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"swiglu_limit": None}, "swiglu_limit"),
        ({"layer_types": ["sliding_attention"]}, "layer_types"),
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, "chunked_attention"),
        ({"sliding_window": None}, "sliding_window"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ],
)
def test_unsupported_arch_refused_by_name(change: dict, named: str) -> None:
    arch = {**BASE, **change}
    assert any(named in p for p in Args.problems(arch))
    with pytest.raises(ArchConfigError, match=named):
        Args.from_arch(arch)


def test_full_attention_only_needs_no_window() -> None:
    arch = {**BASE, "sliding_window": None, "layer_types": ["full_attention"] * 2}
    assert Args.problems(arch) == []


def test_cache_layout_rings_sliding_layers() -> None:
    sliding, full = Args.from_arch(BASE).cache_layout()
    assert (sliding.window, sliding.n_kv_heads, sliding.head_dim) == (16, 2, 16)
    assert full.window is None


def test_window_mask_keeps_window_tokens_including_self() -> None:
    m = np.array(causal_mask(6, 3))
    assert m[5].tolist() == [False, False, False, True, True, True]
    assert m[1].tolist() == [True, True, False, False, False, False]


def test_clamped_swiglu_matches_transformers_formula() -> None:
    gate = np.array([-9.0, -1.0, 0.5, 3.0, 8.0], dtype=np.float32)
    up = np.array([-8.0, 0.2, -0.4, 9.0, 1.0], dtype=np.float32)
    g, u = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
    want = (u + 1) * (g / (1 + np.exp(-1.702 * g)))
    got = np.array(family.clamped_swiglu(1.702, 7.0)(mx.array(gate), mx.array(up)))
    np.testing.assert_allclose(got, want, rtol=1e-6)
