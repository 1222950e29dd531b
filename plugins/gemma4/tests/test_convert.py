"""Hugging Face config and tensor-name mapping of the gemma4 plugin."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core.errors import ConversionError

from turbospark_gemma4 import convert


def _config(fixtures: Path, name: str) -> dict[str, Any]:
    return json.loads((fixtures / name / "config.json").read_text())


def test_e_arch_reads_text_config(turbospark_fixtures: Path) -> None:
    arch = convert.arch_from_hf(_config(turbospark_fixtures, "gemma4_e"))
    assert arch["model_type"] == "gemma4" and arch["vocab_size"] == 512  # text_config's, not the default
    assert (arch["head_dim"], arch["global_head_dim"], arch["sliding_window"]) == (16, 32, 16)
    assert (arch["num_kv_shared_layers"], arch["hidden_size_per_layer_input"]) == (2, 16)
    assert arch["use_double_wide_mlp"] is True and arch["moe"] is None
    assert arch["rope_parameters"]["full_attention"] == {
        "rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25, "factor": 1.0
    }
    assert arch["final_logit_softcapping"] == 10.0 and arch["max_position_embeddings"] == 256


def test_moe_arch(turbospark_fixtures: Path) -> None:
    arch = convert.arch_from_hf(_config(turbospark_fixtures, "gemma4_moe"))
    assert arch["moe"] == {"num_experts": 8, "top_k": 2, "moe_intermediate_size": 32}
    assert arch["attention_k_eq_v"] is True and arch["num_global_key_value_heads"] == 1
    assert arch["hidden_size_per_layer_input"] == 0


def test_missing_layer_types_follow_transformers_defaults() -> None:
    cfg = {"model_type": "gemma4_text", "hidden_size": 8, "num_hidden_layers": 8, "num_attention_heads": 2,
           "vocab_size": 10}
    types = convert.arch_from_hf(cfg)["layer_types"]
    assert types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention", "full_attention"]


def test_bidirectional_encoder_refused_by_name() -> None:
    cfg = {"model_type": "gemma4", "text_config": {"hidden_size": 8, "num_hidden_layers": 2,
           "num_attention_heads": 2, "vocab_size": 10, "use_bidirectional_attention": "all"}}
    with pytest.raises(ConversionError, match="use_bidirectional_attention"):
        convert.arch_from_hf(cfg)


E_ARCH = {"num_hidden_layers": 5, "num_kv_shared_layers": 2, "tie_word_embeddings": True,
          "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                          "full_attention"], "attention_k_eq_v": True}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.language_model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.weight"),
        ("model.language_model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.v_proj.weight"),
        ("model.language_model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.q_proj.weight"),
        ("model.language_model.embed_tokens_per_layer.weight", "model.embed_tokens_per_layer.weight"),
        ("language_model.model.layers.2.router.proj.scales", "model.layers.2.router.proj.scales"),
        ("model.language_model.layers.0.experts.down_proj", "model.layers.0.experts.down_proj.weight"),
        (
            "language_model.model.layers.1.experts.switch_glu.gate_proj.biases",
            "model.layers.1.experts.gate_proj.biases",
        ),
        ("model.layers.0.layer_scalar", "model.layers.0.layer_scalar"),
    ],
)
def test_hf_names(name: str, expected: str) -> None:
    assert convert.hf_target(E_ARCH, name).name == expected


@pytest.mark.parametrize(
    "name",
    [
        "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight",
        "model.embed_vision.embedding_projection.weight",
        "model.audio_tower.layers.0.feed_forward1.ffw_layer_1.linear.weight",
        "model.embed_audio.embedding_projection.weight",
        # KV-shared layers reuse earlier K/V: their own k/v tensors are never read
        "model.language_model.layers.3.self_attn.k_proj.weight",
        "model.language_model.layers.4.self_attn.v_proj.weight",
        "model.language_model.layers.4.self_attn.k_norm.weight",
        # K = V on full layers: a stray v_proj is never read
        "model.language_model.layers.2.self_attn.v_proj.weight",
        "lm_head.weight",
    ],
)
def test_hf_drops_towers_and_unused_kv(name: str) -> None:
    assert convert.hf_target(E_ARCH, name).name is None


def test_fused_expert_gate_up_is_split() -> None:
    data = mx.arange(2 * 6 * 3, dtype=mx.float32).reshape(2, 6, 3)
    out = convert.hf_transform({}, "model.language_model.layers.1.experts.gate_up_proj", data)
    gate, up = out["model.layers.1.experts.gate_proj.weight"], out["model.layers.1.experts.up_proj.weight"]
    assert np.array_equal(np.array(gate), np.array(data)[:, :3]) and np.array_equal(np.array(up), np.array(data)[:, 3:])
    assert convert.hf_transform({}, "model.language_model.layers.1.mlp.gate_proj.weight", data) is None


def test_bad_fused_expert_tensor_refused_by_name() -> None:
    with pytest.raises(ConversionError, match=r"layers\.0\.experts\.gate_up_proj"):
        convert.hf_transform({}, "model.language_model.layers.0.experts.gate_up_proj", mx.zeros((2, 5, 3)))


def test_install_holds_only_what_the_flow_reads(turbospark_install: Any) -> None:
    install = turbospark_install("gemma4_e")
    names = set(mx.load(str(install / "model_weights.safetensors")))
    assert "model.layers.1.self_attn.k_proj.weight" in names
    assert not {n for n in names if n.startswith(("model.layers.3.self_attn.k", "model.layers.4.self_attn.k"))}
    assert not {n for n in names if "vision" in n or "audio" in n}
    moe_install = turbospark_install("gemma4_moe")
    moe = set(mx.load(str(moe_install / "model_weights.safetensors")))
    assert "model.layers.2.self_attn.v_proj.weight" not in moe  # K = V on the full layer
    experts = json.loads((moe_install / "manifest.json").read_text())["experts"]["layers"]
    assert set(experts["model.layers.2.experts"]["projections"]) == {"gate_proj", "up_proj", "down_proj"}
