"""Hugging Face gpt-oss config and tensor mapping: arch keys, names, fused-expert splits."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core.convert.records import AffineQuantized
from turbospark_core.errors import ConversionError

from turbospark_gptoss import convert


def _config(fixtures: Path, name: str) -> dict:
    return json.loads((fixtures / name / "config.json").read_text())


def test_arch_keeps_yarn_truncate_layer_kinds_and_swiglu(turbospark_fixtures: Path) -> None:
    arch = convert.arch_from_hf(_config(turbospark_fixtures, "gpt_oss"))
    assert arch["rope_scaling"]["rope_type"] == "yarn" and arch["rope_scaling"]["truncate"] is False
    assert arch["rope_theta"] == 150000.0 and arch["max_position_embeddings"] == 131072
    assert arch["layer_types"] == ["sliding_attention", "full_attention"] and arch["sliding_window"] == 16
    assert (arch["num_local_experts"], arch["num_experts_per_tok"]) == (8, 2)
    assert (arch["swiglu_alpha"], arch["swiglu_limit"]) == (1.702, 7.0)
    assert arch["head_dim"] == 16 and arch["tie_word_embeddings"] is False


def test_arch_defaults_follow_transformers() -> None:
    cfg = {"model_type": "gpt_oss", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 3,
           "intermediate_size": 8, "vocab_size": 10, "num_local_experts": 4, "num_experts_per_tok": 2,
           "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 5000.0}}
    arch = convert.arch_from_hf(cfg)
    assert arch["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert arch["rope_theta"] == 5000.0 and "rope_theta" not in arch["rope_scaling"]
    del cfg["rope_parameters"]
    assert convert.arch_from_hf(cfg)["rope_scaling"]["truncate"] is False  # GptOssConfig's default yarn


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.sinks",
        "model.layers.1.self_attn.o_proj.bias",
        "model.layers.0.mlp.router.bias",
        "model.layers.0.mlp.experts.gate_proj.weight",  # mlx-lm layout passes through
        "model.layers.3.mlp.experts.down_proj.scales",
        "lm_head.weight",
    ],
)
def test_hf_names_pass_through(name: str) -> None:
    assert convert.hf_target({"model_type": "gpt_oss"}, name).name == name


def test_rotary_buffer_and_tied_head_dropped() -> None:
    assert convert.hf_target({}, "model.layers.0.self_attn.rotary_emb.inv_freq").name is None
    assert convert.hf_target({"tie_word_embeddings": True}, "lm_head.weight").name is None


def test_unknown_tensor_refused_by_name() -> None:
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.mlp\.shared_expert\.weight"):
        convert.hf_target({}, "model.layers.0.mlp.shared_expert.weight")


def test_float_experts_are_transposed_and_deinterleaved() -> None:
    E, D, F = 3, 4, 5
    gate_up = np.arange(E * D * 2 * F, dtype=np.float32).reshape(E, D, 2 * F)
    out = convert.hf_transform({}, "model.layers.2.mlp.experts.gate_up_proj", mx.array(gate_up))
    p = "model.layers.2.mlp.experts"
    assert set(out) == {f"{p}.gate_proj.weight", f"{p}.up_proj.weight"}
    np.testing.assert_array_equal(np.array(out[f"{p}.gate_proj.weight"]), gate_up[..., 0::2].swapaxes(1, 2))
    np.testing.assert_array_equal(np.array(out[f"{p}.up_proj.weight"]), gate_up[..., 1::2].swapaxes(1, 2))
    down = np.arange(E * F * D, dtype=np.float32).reshape(E, F, D)
    out = convert.hf_transform({}, f"{p}.down_proj", mx.array(down))
    np.testing.assert_array_equal(np.array(out[f"{p}.down_proj.weight"]), down.swapaxes(1, 2))


def test_expert_biases_are_deinterleaved() -> None:
    p = "model.layers.0.mlp.experts"
    bias = np.arange(12, dtype=np.float32).reshape(2, 6)
    out = convert.hf_transform({}, f"{p}.gate_up_proj_bias", mx.array(bias))
    np.testing.assert_array_equal(np.array(out[f"{p}.gate_proj.bias"]), bias[:, 0::2])
    np.testing.assert_array_equal(np.array(out[f"{p}.up_proj.bias"]), bias[:, 1::2])
    assert list(convert.hf_transform({}, f"{p}.down_proj_bias", mx.array(bias))) == [f"{p}.down_proj.bias"]


def test_quantized_gate_up_rows_split_without_dequantizing() -> None:
    w = mx.random.normal((2, 6, 64))
    q, s = mx.quantize(w, mode="mxfp4")
    packed = AffineQuantized(weight=q, scales=s, biases=None, bits=4, group_size=32, mode="mxfp4")
    out = convert.hf_transform({}, "model.layers.0.mlp.experts.gate_up_proj", packed)
    up = out["model.layers.0.mlp.experts.up_proj.weight"]
    assert isinstance(up, AffineQuantized) and up.mode == "mxfp4" and up.shape == (3, 64)
    np.testing.assert_array_equal(np.array(up.weight), np.array(q)[:, 1::2])
    np.testing.assert_array_equal(np.array(up.scales), np.array(s)[:, 1::2])


def test_other_tensors_are_not_transformed() -> None:
    assert convert.hf_transform({}, "model.layers.0.mlp.router.weight", mx.zeros((2, 2))) is None


def test_malformed_float_expert_refused_by_name() -> None:
    with pytest.raises(ConversionError, match="down_proj"):
        convert.hf_transform({}, "model.layers.0.mlp.experts.down_proj", mx.zeros((4, 4)))
