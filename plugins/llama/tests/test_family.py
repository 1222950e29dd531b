"""The flow's own refusals: Args validation and rope types, each named."""

from __future__ import annotations

import pytest

from turbospark_core.errors import ArchConfigError

from turbospark_llama.family import Args

BASE = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 32, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "qk_norm": None, "moe": None,
}


def test_valid_arch_has_no_problems() -> None:
    assert Args.problems(BASE) == []
    assert Args.from_arch(BASE).rotary_dim == 16


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"qk_norm": "rms_group"}, "qk_norm"),
        ({"moe": {"num_experts": 4, "top_k": 2, "scoring": "softmax_topk_bias", "sparse_layers": [0]}}, "scoring"),
        ({"moe": {"num_experts": 4, "top_k": 5, "scoring": "softmax", "sparse_layers": [0]}}, "top_k"),
    ],
)
def test_unsupported_arch_refused_by_name(change: dict, named: str) -> None:
    arch = {**BASE, **change}
    assert any(named in p for p in Args.problems(arch))
    with pytest.raises(ArchConfigError, match=named):
        Args.from_arch(arch)


def test_unknown_rope_type_refused_when_building() -> None:
    from turbospark_core.rope import Rope

    with pytest.raises(ArchConfigError, match="dynamic"):
        Rope.from_config(dims=16, theta=1e4, scaling={"rope_type": "dynamic", "factor": 2.0}, max_positions=64)
