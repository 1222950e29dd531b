"""The flow's own refusals (each named) and its cache layout."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from turbospark_core.errors import ArchConfigError

from turbospark_spark.family import Args

BASE: dict[str, Any] = {
    "model_type": "spark2_5", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "sliding_window": 16,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    "rope": {
        "sliding_attention": {"rope_theta": 1e4, "rotary_dim": 16, "rope_scaling": None},
        "full_attention": {"rope_theta": 1e6, "rotary_dim": 8, "rope_scaling": None},
    },
    "hidden_act": "gelu", "gate_attn_act_mode": "sigmoid", "headwise_attn_output_gate": True,
    "tie_word_embeddings": True,
}


def _with(**change: Any) -> dict[str, Any]:
    arch = copy.deepcopy(BASE)
    arch.update(change)
    return arch


def _with_rope(kind: str, **change: Any) -> dict[str, Any]:
    arch = copy.deepcopy(BASE)
    arch["rope"][kind].update(change)
    return arch


def test_valid_arch_has_no_problems() -> None:
    assert Args.problems(BASE) == []
    args = Args.from_arch(BASE)
    assert args.rope["full_attention"].rotary_dim == 8 and args.layer_types[3] == "full_attention"


def test_cache_layout_puts_rings_on_sliding_layers() -> None:
    layout = Args.from_arch(BASE).cache_layout()
    assert [spec.window for spec in layout] == [16, 16, 16, None]
    assert {(spec.n_kv_heads, spec.head_dim) for spec in layout} == {(2, 16)}


@pytest.mark.parametrize(
    ("arch", "named"),
    [
        (_with(hidden_act="gelu_pytorch_tanh"), "gelu_pytorch_tanh"),
        (_with(hidden_act="silu"), "'silu'"),
        (_with(gate_attn_act_mode="softmax"), "gate_attn_act_mode='softmax'"),
        (_with(headwise_attn_output_gate=False), "headwise_attn_output_gate=False"),
        (_with(layer_types=["sliding_attention", "linear_attention", "chunked_attention", "full_attention"]),
         "'chunked_attention', 'linear_attention'"),
        (_with(layer_types=["full_attention"] * 3), "layer_types"),
        (_with_rope("full_attention", rotary_dim=5), "full_attention rotary dims 5"),
        (_with_rope("sliding_attention", rotary_dim=18), "sliding_attention rotary dims 18"),
        (_with_rope("sliding_attention", rope_theta=0), "sliding_attention rope_theta"),
        (_with_rope("full_attention", rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "'dynamic'"),
        (_with(rope={"sliding_attention": BASE["rope"]["sliding_attention"]}), "'full_attention'"),
        (_with(num_key_value_heads=3), "num_key_value_heads=3"),
        (_with(sliding_window=0), "sliding_window"),
        (_with(intermediate_size=None), "intermediate_size"),
        (_with(tie_word_embeddings="yes"), "tie_word_embeddings"),
    ],
)
def test_unsupported_arch_refused_by_name(arch: dict[str, Any], named: str) -> None:
    problems = Args.problems(arch)
    assert any(named in p for p in problems), problems
    with pytest.raises(ArchConfigError, match=named.replace("[", r"\[")):
        Args.from_arch(arch)


def test_open_refuses_unsupported_arch_by_name(turbospark_install: Any, tmp_path: Any) -> None:
    import json
    import shutil

    import turbospark_core

    bad = tmp_path / "bad"
    shutil.copytree(turbospark_install("spark2_5", "float32"), bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["arch"]["gate_attn_act_mode"] = "softmax"
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArchConfigError, match="gate_attn_act_mode='softmax'"):
        turbospark_core.open(bad)
