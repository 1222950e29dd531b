"""Hugging Face / mlx-lm config and tensor mapping of the qwen plugin."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core.convert import convert as convert_checkpoint
from turbospark_core.errors import ConversionError

from turbospark_qwen import convert


def _config(fixtures: Path, name: str) -> dict[str, Any]:
    return json.loads((fixtures / name / "config.json").read_text())


def test_dense_arch_from_text_config(turbospark_fixtures: Path) -> None:
    arch = convert.arch_from_hf(_config(turbospark_fixtures, "qwen3_5"))
    assert arch["model_type"] == "qwen3_5" and arch["hidden_size"] == 64 and arch["vocab_size"] == 512
    assert arch["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (arch["head_dim"], arch["rotary_dim"], arch["rope_theta"]) == (32, 8, 1e7)
    assert arch["rope_scaling"] is None  # mrope on text-only positions is plain rope
    assert arch["moe"] is None and arch["max_position_embeddings"] == 256


def test_moe_arch(turbospark_fixtures: Path) -> None:
    moe = convert.arch_from_hf(_config(turbospark_fixtures, "qwen3_5_moe"))["moe"]
    assert moe == {"num_experts": 8, "top_k": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32, "norm_topk_prob": True}


def test_layer_types_from_interval(turbospark_fixtures: Path) -> None:
    cfg = _config(turbospark_fixtures, "qwen3_5")
    text = {k: v for k, v in cfg["text_config"].items() if k != "layer_types"}
    text.update(num_hidden_layers=6, full_attention_interval=3)
    arch = convert.arch_from_hf({**cfg, "text_config": text})
    assert arch["layer_types"] == ["linear_attention", "linear_attention", "full_attention"] * 2


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}, "mamba"),
        ({"layer_types": None, "full_attention_interval": 0}, "full_attention_interval"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ],
)
def test_unservable_config_refused_at_conversion(turbospark_fixtures: Path, change: dict, named: str) -> None:
    cfg = _config(turbospark_fixtures, "qwen3_5")
    cfg["text_config"] = {**cfg["text_config"], **change}
    with pytest.raises(ConversionError, match=named):
        convert.arch_from_hf(cfg)


ARCH = {"model_type": "qwen3_5_moe", "hidden_size": 64, "tie_word_embeddings": False,
        "moe": {"num_experts": 8, "moe_intermediate_size": 32}}


@pytest.mark.parametrize(
    ("name", "expected", "keep"),
    [
        ("model.language_model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.A_log", True),
        ("model.language_model.layers.0.linear_attn.norm.weight", "model.layers.0.linear_attn.norm.weight", True),
        ("model.language_model.layers.0.linear_attn.dt_bias", "model.layers.0.linear_attn.dt_bias", False),
        ("model.language_model.norm.weight", "model.norm.weight", False),
        ("lm_head.weight", "lm_head.weight", False),
        (
            "language_model.model.layers.1.mlp.switch_mlp.up_proj.scales",
            "model.layers.1.mlp.experts.up_proj.scales",
            False,
        ),
        ("language_model.lm_head.weight", "lm_head.weight", False),
    ],
)
def test_hf_names(name: str, expected: str, keep: bool) -> None:
    target = convert.hf_target(ARCH, name)
    assert (target.name, target.keep_dtype) == (expected, keep)


@pytest.mark.parametrize(
    "name", ["model.visual.blocks.0.attn.qkv.weight", "mtp.layers.0.mlp.gate.weight", "model.visual.merger.norm.weight"]
)
def test_vision_tower_and_mtp_dropped(name: str) -> None:
    assert convert.hf_target(ARCH, name).name is None
    assert convert.hf_transform(ARCH, name, mx.zeros((2,))) is None


def test_tied_checkpoint_drops_duplicate_head() -> None:
    assert convert.hf_target({**ARCH, "tie_word_embeddings": True}, "lm_head.weight").name is None


def test_fused_experts_split_into_the_expert_bank() -> None:
    gate_up = mx.random.normal((8, 64, 64))
    out = convert.hf_transform(ARCH, "model.language_model.layers.2.mlp.experts.gate_up_proj", gate_up)
    gate, up = out["model.layers.2.mlp.experts.gate_proj.weight"], out["model.layers.2.mlp.experts.up_proj.weight"]
    assert gate.shape == up.shape == (8, 32, 64)
    assert mx.array_equal(mx.concatenate([gate, up], axis=1), gate_up)
    down = convert.hf_transform(ARCH, "model.language_model.layers.2.mlp.experts.down_proj", mx.zeros((8, 64, 32)))
    assert list(down) == ["model.layers.2.mlp.experts.down_proj.weight"]


def test_fused_experts_of_the_wrong_shape_refused_by_name() -> None:
    with pytest.raises(ConversionError, match=r"layers\.0\.mlp\.experts\.gate_up_proj"):
        convert.hf_transform(ARCH, "model.language_model.layers.0.mlp.experts.gate_up_proj", mx.zeros((8, 60, 64)))


def test_mlx_lm_norms_lose_their_added_one() -> None:
    w = mx.array([1.5, 0.75], dtype=mx.bfloat16)
    out = convert.hf_transform(ARCH, "language_model.model.layers.0.input_layernorm.weight", w)
    assert np.array_equal(np.array(out["model.layers.0.input_layernorm.weight"]), [0.5, -0.25])
    gated = "language_model.model.layers.0.linear_attn.norm.weight"  # plain weight, not zero-centered
    assert convert.hf_transform(ARCH, gated, w) is None
    assert convert.hf_transform(ARCH, "model.language_model.layers.0.input_layernorm.weight", w) is None


def test_dtype_cast_keeps_state_parameters_float32(turbospark_fixtures: Path, tmp_path: Path) -> None:
    convert_checkpoint(turbospark_fixtures / "qwen3_5", tmp_path / "bf16", dtype="bfloat16")
    tensors = mx.load(str(tmp_path / "bf16" / "model_weights.safetensors"))
    assert tensors["model.layers.0.linear_attn.A_log"].dtype == mx.float32
    assert tensors["model.layers.0.linear_attn.norm.weight"].dtype == mx.float32
    assert tensors["model.layers.0.input_layernorm.weight"].dtype == mx.bfloat16
    assert not any("visual" in name for name in tensors)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_mlx_lm_checkpoint_converts_to_the_same_model(turbospark_fixtures: Path, tmp_path: Path, name: str) -> None:
    """mlx-lm saves sanitized names, (1 + w) norms and [C, K, 1] conv weights."""
    import shutil

    import turbospark_core
    from turbospark_core.testing import relative_error

    mlx_lm = pytest.importorskip("mlx_lm")
    from mlx.utils import tree_flatten

    src = turbospark_fixtures / name
    model, _ = mlx_lm.load(str(src))
    saved = tmp_path / "mlx_lm"
    saved.mkdir()
    mx.save_safetensors(str(saved / "model.safetensors"), dict(tree_flatten(model.parameters())))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / f, saved / f)
    convert_checkpoint(saved, tmp_path / "install")
    refs = np.load(src / "references.npz")
    got = turbospark_core.open(tmp_path / "install").logits(refs["prompt_ids"].tolist())
    assert relative_error(got, refs["logits"]) <= 1e-5
