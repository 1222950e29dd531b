"""Hugging Face config and tensor-name mapping; every unsupported field and DeepSeek-V4 refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from turbospark_core.errors import ConversionError

from turbospark_deepseek import convert


def _config(fixtures: Path, name: str) -> dict[str, Any]:
    return dict(json.loads((fixtures / name / "config.json").read_text()))


def test_v2_lite_and_full_v2_configs(turbospark_fixtures: Path) -> None:
    lite = convert.arch_from_hf(_config(turbospark_fixtures, "deepseek_v2"))
    full = convert.arch_from_hf(_config(turbospark_fixtures, "deepseek_v2_qlora"))
    assert lite["q_lora_rank"] is None and full["q_lora_rank"] == 48
    assert (full["qk_rope_head_dim"], full["v_head_dim"], full["kv_lora_rank"]) == (8, 24, 32)
    assert lite["moe"]["sparse_layers"] == [1, 2] and lite["moe"]["routed_scaling_factor"] == 1.5
    assert (full["moe"]["topk_method"], full["moe"]["n_group"], full["moe"]["topk_group"]) == (
        "group_limited_greedy", 4, 2
    )  # fmt: skip
    assert lite["rope_scaling"]["rope_type"] == "yarn" and lite["rope_scaling"]["mscale_all_dim"] == 0.707
    assert "head_dim" not in lite


def test_head_dim_key_is_ignored(turbospark_fixtures: Path) -> None:
    cfg = _config(turbospark_fixtures, "deepseek_v2") | {"head_dim": 16}
    assert "head_dim" not in convert.arch_from_hf(cfg)


def test_moe_layer_freq_and_dense_first_layers() -> None:
    cfg = {"n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 2}
    assert convert._moe(cfg, 6)["sparse_layers"] == [2, 4]
    assert convert._moe({"n_routed_experts": None}, 6) is None


ARCH = {"num_hidden_layers": 2, "tie_word_embeddings": False}


@pytest.mark.parametrize(
    ("name", "expected", "expert"),
    [
        ("model.layers.1.mlp.experts.5.gate_proj.weight", "model.layers.1.mlp.experts.gate_proj.weight", 5),
        ("model.layers.1.mlp.experts.0.down_proj.scales", "model.layers.1.mlp.experts.down_proj.scales", 0),
        ("model.layers.1.mlp.switch_mlp.up_proj.weight", "model.layers.1.mlp.experts.up_proj.weight", None),
        ("model.layers.1.mlp.shared_experts.up_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight", None),
        ("model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.gate.e_score_correction_bias", None),
        ("model.layers.0.self_attn.kv_b_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight", None),
        ("model.layers.2.eh_proj.weight", None, None),  # V3's MTP layer (index num_hidden_layers): dropped
        ("model.layers.2.self_attn.q_a_proj.weight", None, None),
        ("model.layers.0.self_attn.rotary_emb.inv_freq", None, None),
    ],
)
def test_hf_names(name: str, expected: str | None, expert: int | None) -> None:
    target = convert.hf_target(ARCH, name)
    assert (target.name, target.expert) == (expected, expert)


def test_mlx_lm_split_of_kv_b_proj_refused_by_name() -> None:
    with pytest.raises(ConversionError, match=r"embed_q.*kv_b_proj"):
        convert.hf_target(ARCH, "model.layers.0.self_attn.embed_q.weight")


@pytest.mark.parametrize("model_type", ["deepseek_v4", "deepseek_v4_flash", "deepseek_v4_pro", "deepseek_v32"])
def test_unserved_deepseek_types_refused_by_name(turbospark_fixtures: Path, model_type: str) -> None:
    cfg = _config(turbospark_fixtures, "deepseek_v2") | {"model_type": model_type}
    with pytest.raises(ConversionError, match=f"model type '{model_type}' is refused"):
        convert.arch_from_hf(cfg)


def test_deepseek_v4_refused_by_the_converter_naming_the_family(turbospark_fixtures: Path, tmp_path: Path) -> None:
    import shutil

    from turbospark_core.convert import convert as run_convert

    src = tmp_path / "v4"
    shutil.copytree(turbospark_fixtures / "deepseek_v2", src, ignore=shutil.ignore_patterns("bf16"))
    cfg = json.loads((src / "config.json").read_text()) | {"model_type": "deepseek_v4"}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"DeepSeek-V4.*deepseek_v4"):
        run_convert(src, tmp_path / "out")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_interleave": False}, "rope_interleave"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "fp8"),
        ({"scoring_func": "sigmoid"}, "scoring_func/topk_method"),
        ({"topk_method": "noaux_tc"}, "scoring_func/topk_method"),
        ({"norm_topk_prob": True}, "norm_topk_prob"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.type"),
    ],
)
def test_unsupported_fields_refused_by_name(turbospark_fixtures: Path, change: dict[str, Any], named: str) -> None:
    cfg = _config(turbospark_fixtures, "deepseek_v2") | change
    with pytest.raises(ConversionError, match=named.replace(".", r"\.")):
        convert.arch_from_hf(cfg)


def test_quantized_install_serves_sliced_and_router_matrices(turbospark_fixtures: Path, tmp_path: Path) -> None:
    """``convert --quantize q8``: kv_b_proj (cut per head) and the router come back dequantized."""
    import numpy as np

    import turbospark_core
    from turbospark_core.convert import convert as run_convert

    src = turbospark_fixtures / "deepseek_v2"
    manifest = run_convert(src, tmp_path / "q8", quantize="q8", group_size=32)
    assert {"model.layers.1.self_attn.kv_b_proj", "model.layers.1.mlp.gate"} <= set(manifest.quantization)
    refs = np.load(src / "references.npz")
    got = turbospark_core.open(tmp_path / "q8").logits(refs["prompt_ids"].tolist())
    assert np.abs(got - refs["logits"]).max() <= 0.1 * np.abs(refs["logits"]).max()  # measured 0.046
