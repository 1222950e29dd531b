"""The Hugging Face conventions shared by every family's converter."""

from __future__ import annotations

from typing import Any

import pytest

from turbospark_core.convert.conventions import (
    MTP_HEADS,
    VISION_TOWERS,
    drop_pattern,
    is_tied_head,
    rope_scaling,
    rope_theta,
    strip_language_model_prefix,
    text_config,
    tied_embeddings,
)


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("model.language_model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),  # Hugging Face VL
        ("language_model.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),  # mlx-lm sanitized
        ("language_model.model.norm.weight", "model.norm.weight"),
        ("language_model.lm_head.weight", "lm_head.weight"),
        ("language_model.lm_head.scales", "lm_head.scales"),
        ("language_model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),  # a plain decoder
        ("lm_head.weight", "lm_head.weight"),
    ],
)
def test_strip_language_model_prefix(name: str, want: str) -> None:
    assert strip_language_model_prefix(name) == want


def test_text_config_and_tied_embeddings() -> None:
    vl = {"model_type": "x_vl", "text_config": {"hidden_size": 8, "tie_word_embeddings": True}}
    assert text_config(vl)["hidden_size"] == 8
    assert tied_embeddings(vl) is True  # from text_config when the top level is silent
    assert tied_embeddings({**vl, "tie_word_embeddings": False}) is False  # the top level wins
    plain = {"hidden_size": 4}
    assert text_config(plain) is plain
    assert tied_embeddings(plain) is False
    assert tied_embeddings(plain, default=True) is True


def test_is_tied_head() -> None:
    tied, untied = {"tie_word_embeddings": True}, {"tie_word_embeddings": False}
    assert is_tied_head(tied, "lm_head.weight") and is_tied_head(tied, "lm_head.scales")
    assert not is_tied_head(untied, "lm_head.weight")
    assert not is_tied_head({}, "lm_head.weight")
    assert not is_tied_head(tied, "model.embed_tokens.weight")


@pytest.mark.parametrize(
    ("name", "dropped"),
    [
        ("model.visual.blocks.0.attn.qkv.weight", True),
        ("visual.merger.norm.weight", True),
        ("model.vision_tower.encoder.layers.0.weight", True),
        ("vision_tower.patch_embed.weight", True),
        ("mtp.layers.0.mlp.up_proj.weight", True),
        ("model.mtp.fc.weight", True),
        ("model.layers.0.self_attn.rotary_emb.inv_freq", True),
        ("model.layers.0.visual_gate.weight", False),
        ("model.language_model.layers.0.mlp.up_proj.weight", False),
        ("model.mtp_like.weight", False),
        ("lm_head.weight", False),
    ],
)
def test_drop_pattern_towers_heads_and_rotary_buffers(name: str, dropped: bool) -> None:
    assert bool(drop_pattern(VISION_TOWERS + MTP_HEADS).search(name)) is dropped


def test_drop_pattern_without_modules_drops_only_rotary_buffers() -> None:
    pattern = drop_pattern()
    assert pattern.search("model.layers.3.self_attn.rotary_emb.inv_freq")
    assert not pattern.search("model.visual.blocks.0.weight")
    assert not pattern.search("model.layers.3.self_attn.rotary_emb.weight")


def test_drop_pattern_extra() -> None:
    pattern = drop_pattern(("audio_tower",), extra=r"\.(input|output)_(max|min)$")
    assert pattern.search("model.audio_tower.layers.0.weight")
    assert pattern.search("model.layers.0.mlp.up_proj.input_max")
    assert not pattern.search("model.layers.0.mlp.up_proj.weight")


@pytest.mark.parametrize(
    ("cfg", "params", "want"),
    [
        ({"rope_theta": 5e5}, {"rope_theta": 1e4}, 5e5),  # the config's own theta first
        ({}, {"rope_theta": 1e7}, 1e7),  # transformers 5: inside rope_parameters
        ({"rope_theta": None}, None, 123.0),  # the family's default
    ],
)
def test_rope_theta(cfg: dict[str, Any], params: dict[str, Any] | None, want: float) -> None:
    assert rope_theta(cfg, params, 123.0) == want


@pytest.mark.parametrize(
    ("params", "want"),
    [
        (None, None),
        ({}, None),
        ({"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}, None),
        # Multimodal rope on text-only positions is plain rope
        ({"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True}, None),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "rope_theta": 5e5},
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
        ),
        ({"type": "yarn", "factor": 40.0}, {"rope_type": "yarn", "factor": 40.0}),  # the legacy key
        (
            {"rope_type": "yarn", "factor": 4.0, "mrope_section": [1], "partial_rotary_factor": 0.5},
            {"rope_type": "yarn", "factor": 4.0},
        ),
    ],
)
def test_rope_scaling(params: dict[str, Any] | None, want: dict[str, Any] | None) -> None:
    original = None if params is None else dict(params)
    assert rope_scaling(params) == want
    assert params == original  # the config is not modified
