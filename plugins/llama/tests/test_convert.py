"""Hugging Face / GGUF config and tensor-name mapping of the llama plugin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from turbospark_core.errors import ConversionError

from turbospark_llama import convert


def _config(fixtures: Path, name: str) -> dict:
    return json.loads((fixtures / name / "config.json").read_text())


def test_qwen3_vl_reads_text_config_and_plain_rope(turbospark_fixtures: Path) -> None:
    arch = convert.arch_from_hf(_config(turbospark_fixtures, "qwen3_vl"))
    assert arch["model_type"] == "qwen3_vl" and arch["hidden_size"] == 64
    assert arch["rope_scaling"] is None  # mrope on text-only positions is plain rope
    assert arch["tie_word_embeddings"] is True and arch["qk_norm"] == "head"


def test_minimax_partial_rope_full_width_norm_and_sigmoid_routing(turbospark_fixtures: Path) -> None:
    arch = convert.arch_from_hf(_config(turbospark_fixtures, "minimax_m2"))
    assert (arch["rotary_dim"], arch["head_dim"], arch["qk_norm"]) == (8, 16, "full")
    assert arch["moe"]["scoring"] == "sigmoid" and arch["moe"]["num_experts"] == 8


def test_llama3_rope_scaling_is_kept(turbospark_fixtures: Path) -> None:
    arch = convert.arch_from_hf(_config(turbospark_fixtures, "llama"))
    assert arch["rope_scaling"]["rope_type"] == "llama3"


def test_qwen3_moe_sparse_layers_honour_mlp_only_layers() -> None:
    cfg = {"model_type": "qwen3_moe", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 4,
           "vocab_size": 10, "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [1],
           "decoder_sparse_step": 1}
    assert convert.arch_from_hf(cfg)["moe"]["sparse_layers"] == [0, 2, 3]


@pytest.mark.parametrize(
    ("name", "expected", "expert"),
    [
        ("model.layers.3.mlp.experts.5.gate_proj.weight", "model.layers.3.mlp.experts.gate_proj.weight", 5),
        ("model.layers.0.block_sparse_moe.experts.2.w1.weight", "model.layers.0.mlp.experts.gate_proj.weight", 2),
        ("model.layers.0.block_sparse_moe.experts.2.w2.weight", "model.layers.0.mlp.experts.down_proj.weight", 2),
        ("model.layers.0.block_sparse_moe.experts.2.w3.scales", "model.layers.0.mlp.experts.up_proj.scales", 2),
        ("model.layers.1.mlp.switch_mlp.up_proj.biases", "model.layers.1.mlp.experts.up_proj.biases", None),
        ("model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.mlp.gate.weight", None),
        ("model.language_model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight", None),
        ("language_model.model.norm.weight", "model.norm.weight", None),
    ],
)
def test_hf_names(name: str, expected: str, expert: int | None) -> None:
    target = convert.hf_target({"model_type": "qwen3_moe"}, name)
    assert (target.name, target.expert) == (expected, expert)


@pytest.mark.parametrize(
    "name", ["model.visual.blocks.0.attn.qkv.weight", "model.layers.0.self_attn.rotary_emb.inv_freq"]
)
def test_hf_drops_vision_and_buffers(name: str) -> None:
    assert convert.hf_target({"model_type": "qwen3_vl"}, name).name is None


def test_tied_checkpoint_drops_duplicate_head() -> None:
    assert convert.hf_target({"tie_word_embeddings": True}, "lm_head.weight").name is None


def test_gguf_names_and_rotary_unpermute() -> None:
    arch = {"num_attention_heads": 9, "num_key_value_heads": 3}
    q = convert.gguf_target(arch, "blk.4.attn_q.weight")
    k = convert.gguf_target(arch, "blk.4.attn_k.weight")
    v = convert.gguf_target(arch, "blk.4.attn_v.weight")
    assert (q.name, q.unpermute_heads) == ("model.layers.4.self_attn.q_proj.weight", 9)
    assert (k.unpermute_heads, v.unpermute_heads) == (3, None)
    assert convert.gguf_target(arch, "token_embd.weight").name == "model.embed_tokens.weight"
    assert convert.gguf_target(arch, "output.weight").name == "lm_head.weight"


def test_gguf_refusals_name_the_tensor() -> None:
    with pytest.raises(ConversionError, match="rope_freqs"):
        convert.gguf_target({}, "rope_freqs.weight")
    with pytest.raises(ConversionError, match=r"blk\.0\.ssm_conv1d\.weight"):
        convert.gguf_target({}, "blk.0.ssm_conv1d.weight")


def test_gguf_unknown_rope_scaling_refused() -> None:
    md = {"llama.attention.head_count": 4, "llama.embedding_length": 64, "llama.block_count": 1,
          "llama.feed_forward_length": 128, "llama.vocab_size": 10, "llama.rope.scaling.type": "longrope"}
    with pytest.raises(ConversionError, match="longrope"):
        convert.arch_from_gguf("llama", md)
