"""Hugging Face config and tensor-name mapping of the spark plugin, and its refusals at conversion."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from turbospark_core.errors import ConversionError

from turbospark_spark import convert


def _config(fixtures: Path) -> dict[str, Any]:
    return json.loads((fixtures / "spark2_5" / "config.json").read_text())


def test_fixture_config_maps_per_layer_type_rope(turbospark_fixtures: Path) -> None:
    arch = convert.arch_from_hf(_config(turbospark_fixtures))
    assert arch["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert arch["rope"]["sliding_attention"] == {"rope_theta": 1e4, "rotary_dim": 16, "rope_scaling": None}
    assert arch["rope"]["full_attention"] == {"rope_theta": 1e6, "rotary_dim": 8, "rope_scaling": None}
    assert (arch["sliding_window"], arch["tie_word_embeddings"], arch["max_position_embeddings"]) == (16, True, 256)


def test_missing_layer_types_follow_the_reference_pattern(turbospark_fixtures: Path) -> None:
    cfg = {k: v for k, v in _config(turbospark_fixtures).items() if k != "layer_types"}
    cfg["num_hidden_layers"] = 6
    arch = convert.arch_from_hf(cfg)
    assert arch["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 2


def test_rope_scaling_is_kept_per_layer_type(turbospark_fixtures: Path) -> None:
    cfg = _config(turbospark_fixtures)
    cfg["rope_parameters"]["full_attention"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}
    arch = convert.arch_from_hf(cfg)
    assert arch["rope"]["full_attention"]["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert arch["rope"]["sliding_attention"]["rope_scaling"] is None


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hidden_act": "gelu_pytorch_tanh"}, "gelu_pytorch_tanh"),
        ({"gate_attn_act_mode": "tanh"}, "gate_attn_act_mode='tanh'"),
        ({"headwise_attn_output_gate": False}, "headwise_attn_output_gate=False"),
        ({"layer_types": ["sliding_attention", "mamba", "sliding_attention", "full_attention"]}, "'mamba'"),
        (
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_theta": 1e4},
                    "full_attention": {"partial_rotary_factor": 0.3125},
                }
            },
            "full_attention rotary dims 5",
        ),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}, "rope_parameters['full_attention']"),
        ({"rope_parameters": {"sliding_attention": {"rope_type": "longrope"}, "full_attention": {}}}, "'longrope'"),
    ],
)
def test_unsupported_config_refused_by_name(turbospark_fixtures: Path, change: dict, named: str) -> None:
    cfg = {**_config(turbospark_fixtures), **change}
    with pytest.raises(ConversionError, match=named.replace("[", r"\[").replace("]", r"\]")):
        convert.arch_from_hf(cfg)


def test_convert_refuses_checkpoint_with_unsupported_activation(turbospark_fixtures: Path, tmp_path: Path) -> None:
    from turbospark_core.convert import convert as run_convert

    src = tmp_path / "src"
    shutil.copytree(turbospark_fixtures / "spark2_5", src, ignore=shutil.ignore_patterns("bf16"))
    (src / "config.json").chmod(0o644)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "hidden_act": "relu2"}))
    with pytest.raises(ConversionError, match="relu2"):
        run_convert(src, tmp_path / "dst")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.embedding.weight", "model.embedding.weight"),
        ("model.embed_tokens.weight", "model.embedding.weight"),
        ("model.embed_tokens.scales", "model.embedding.scales"),
        ("model.layers.2.self_attn.q_k_v_proj.weight", "model.layers.2.self_attn.q_k_v_proj.weight"),
        ("model.layers.2.self_attn.out_proj.bias", "model.layers.2.self_attn.out_proj.bias"),
        ("model.layers.0.mlp.down_proj.biases", "model.layers.0.mlp.down_proj.biases"),
        ("model.layers.0.post_attention_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"),
        ("model.norm.weight", "model.norm.weight"),
        ("model.layers.1.self_attn.rotary_emb.inv_freq", None),
    ],
)
def test_hf_names(name: str, expected: str | None) -> None:
    assert convert.hf_target({"model_type": "spark2_5", "tie_word_embeddings": True}, name).name == expected


def test_head_is_dropped_when_tied_and_kept_when_untied() -> None:
    assert convert.hf_target({"model_type": "spark2_5", "tie_word_embeddings": True}, "lm_head.weight").name is None
    kept = convert.hf_target({"model_type": "spark2_5", "tie_word_embeddings": False}, "lm_head.weight")
    assert kept.name == "lm_head.weight"


def test_head_gate_keeps_source_precision() -> None:
    arch = {"model_type": "spark2_5", "tie_word_embeddings": True}
    assert convert.hf_target(arch, "model.layers.0.self_attn.g_proj.weight").keep_dtype
    assert not convert.hf_target(arch, "model.layers.0.self_attn.q_k_v_proj.weight").keep_dtype


def test_unknown_tensor_refused_by_name() -> None:
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.self_attn\.q_norm\.weight"):
        convert.hf_target({"model_type": "spark2_5"}, "model.layers.0.self_attn.q_norm.weight")


def test_quantized_install_keeps_the_gate_unquantized(turbospark_fixtures: Path, tmp_path: Path) -> None:
    from turbospark_core.convert import convert as run_convert

    manifest = run_convert(turbospark_fixtures / "spark2_5", tmp_path / "q8", quantize="q8", group_size=32)
    quant = json.loads((tmp_path / "q8" / "manifest.json").read_text())["quantization"]
    assert "model.layers.0.self_attn.q_k_v_proj" in quant and "model.embedding" in quant
    assert not any(base.endswith("g_proj") for base in quant)
    assert manifest.model_type == "spark2_5"
