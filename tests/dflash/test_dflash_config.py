"""A DFlash checkpoint config -> a checked drafter arch; every refusal by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospark_core.speculative.dflash_config import (
    ARCH_KEYS,
    DFlashConfig,
    arch_from_hf,
    arch_problems,
    default_target_layers,
    is_dflash_config,
)

FIXTURE_CONFIGS = ("qwen3_dflash", "llama_dflash")
QWEN_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "block_size": 16,
    "dflash_config": {"mask_token_id": 15, "target_layer_ids": [0]},
    "num_target_layers": 2,
    "hidden_size": 64,
    "vocab_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "intermediate_size": 96,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
}


@pytest.fixture(params=FIXTURE_CONFIGS)
def config(request: pytest.FixtureRequest, turbospark_fixtures: Path) -> dict[str, Any]:
    path = turbospark_fixtures / request.param / "dflash" / "config.json"
    if not path.is_file():
        pytest.skip(f"reference fixture {path} is not available")
    return dict(json.loads(path.read_text()))


def test_fixture_configs_give_flat_arches(config: dict[str, Any]) -> None:
    assert is_dflash_config(config)
    arch, problems = arch_from_hf(config)
    assert problems == []
    cfg = DFlashConfig.from_arch(arch)
    assert cfg.block_size == config["block_size"] == 16
    assert cfg.mask_token_id == config["dflash_config"]["mask_token_id"]
    assert cfg.target_layer_ids == tuple(config["dflash_config"]["target_layer_ids"])
    assert cfg.rope_theta == config["rope_theta"]  # the drafter's own RoPE, not the target's
    assert cfg.rope_scaling == config["rope_scaling"]
    assert cfg.head_dim == config["head_dim"]
    assert cfg.tensor_shapes()["fc.weight"] == (config["hidden_size"], config["hidden_size"])


def test_a_target_config_is_not_a_drafter(turbospark_fixtures: Path) -> None:
    path = turbospark_fixtures / "qwen3_dflash" / "config.json"
    if not path.is_file():
        pytest.skip(f"reference fixture {path} is not available")
    assert not is_dflash_config(json.loads(path.read_text()))


def test_default_layers_follow_z_lab() -> None:
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layers(36, 1) == [18]


def test_absent_target_layers_take_the_default(config: dict[str, Any]) -> None:
    del config["dflash_config"]["target_layer_ids"]
    config["num_target_layers"] = 36
    config["num_hidden_layers"] = 5
    config["layer_types"] = ["full_attention"] * 5
    arch, problems = arch_from_hf(config)
    assert problems == []
    assert arch["target_layer_ids"] == [1, 9, 17, 25, 33]


def test_top_level_keys_are_read_too(config: dict[str, Any]) -> None:
    section = config.pop("dflash_config")
    config |= section
    arch, problems = arch_from_hf(config)
    assert problems == []
    assert arch["mask_token_id"] == section["mask_token_id"]


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"architectures": ["DFlash2DraftModel"]}, "DFlash2DraftModel"),
        ({"architectures": ["Qwen3ForCausalLM"]}, "'DFlashDraftModel' is supported"),
        ({"dflash_config": [1]}, "'dflash_config' must be an object"),
        ({"target_hidden_size": 4096}, "target_hidden_size"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"block_size": 1}, "block_size"),
        ({"block_size": 10**9}, "block_size"),
        ({"block_size": "16"}, "block_size"),
        ({"head_dim": 25}, "'head_dim' must be even"),
        ({"num_attention_heads": 5, "num_key_value_heads": 2}, "num_attention_heads=5 is not a multiple"),
        ({"rope_theta": float("inf")}, "rope_theta"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_attention"),
        ({"intermediate_size": None}, "intermediate_size"),
        ({"rope_theta": 0.5}, "rope_theta"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
        ({"num_target_layers": -1}, "num_target_layers"),
    ],
)
def test_bad_configs_are_refused_by_name(config: dict[str, Any], edit: dict[str, Any], named: str) -> None:
    config |= edit
    if "layer_types" in edit:
        config["num_hidden_layers"] = len(edit["layer_types"])
    _, problems = arch_from_hf(config)
    assert any(named in p for p in problems), problems


@pytest.mark.parametrize(
    ("section", "named"),
    [
        ({"mask_token_id": 10**6}, "'mask_token_id' must be a token id"),
        ({"mask_token_id": -1}, "'mask_token_id' must be a token id"),
        ({"mask_token_id": "15"}, "'mask_token_id' must be a token id"),
        ({"target_layer_ids": []}, "'target_layer_ids' must list"),
        ({"target_layer_ids": [0, 0]}, "'target_layer_ids' must list"),
        ({"target_layer_ids": [-1]}, "'target_layer_ids' must list"),
        ({"target_layer_ids": [10**9]}, "'target_layer_ids' must list"),
        ({"target_layer_ids": "0"}, "'target_layer_ids' must list"),
    ],
)
def test_bad_dflash_sections_are_refused_by_name(config: dict[str, Any], section: dict[str, Any], named: str) -> None:
    config["dflash_config"] |= section
    _, problems = arch_from_hf(config)
    assert any(named in p for p in problems), problems


def test_install_arch_checks_refuse_tampering(config: dict[str, Any]) -> None:
    arch, _ = arch_from_hf(config)
    assert arch_problems({**arch, "model_type": "qwen3"}) == ["model_type is 'qwen3', not 'dflash'"]
    assert "unknown arch key(s) 'extra'" in arch_problems({**arch, "extra": 1})[0]
    assert any("hidden_size" in p for p in arch_problems({**arch, "hidden_size": 2**40}))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(sorted(set(ARCH_KEYS) - {"model_type"})), value=JSON)
def test_any_json_value_is_a_problem_or_fine(key: str, value: Any) -> None:
    """A hostile manifest arch never escapes as TypeError / OverflowError: a list of problems, or a typed config."""
    arch, problems = arch_from_hf(QWEN_CONFIG)
    assert not problems
    arch[key] = value
    if not arch_problems(arch):
        cfg = DFlashConfig.from_arch(arch)
        assert cfg.block_size >= 2 and all(i >= 0 for i in cfg.target_layer_ids)
