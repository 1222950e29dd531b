"""Config and tensor-name mapping, and a Gemma 3 GGUF converted end to end (exact, group 16, dequantized, strict)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from tiny_gemma3 import SPECIALS, TINY_CONFIG, random_weights, tokenizer_json

import turbospark_core
from turbospark_core import cli
from turbospark_core.convert import convert
from turbospark_core.errors import ConversionError

from turbospark_gemma3 import convert as gconvert


# ------------------------------------------------------------------ Hugging Face configs
def test_hf_config_v5_rope_parameters_and_layer_types() -> None:
    arch = gconvert.arch_from_hf(TINY_CONFIG)
    assert (arch["rope_theta"], arch["rope_local_base_freq"]) == (500000.0, 20000.0)
    assert arch["rope_scaling"] is None and arch["norm_adds_one"] is True
    assert arch["layer_types"] == TINY_CONFIG["layer_types"]
    assert (arch["head_dim"], arch["query_pre_attn_scalar"], arch["sliding_window"]) == (32, 24.0, 16)


def test_hf_legacy_config_pattern_and_global_only_scaling() -> None:
    cfg = {k: v for k, v in TINY_CONFIG.items() if k not in ("layer_types", "rope_parameters")}
    cfg |= {
        "num_hidden_layers": 12,
        "sliding_window_pattern": 6,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    arch = gconvert.arch_from_hf(cfg)
    assert [i for i, t in enumerate(arch["layer_types"]) if t == "full_attention"] == [5, 11]
    assert arch["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert arch["rope_local_scaling"] is None and arch["rope_local_base_freq"] == 20000.0


def test_hf_defaults_follow_transformers() -> None:
    cfg = {k: TINY_CONFIG[k] for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                       "intermediate_size", "vocab_size")}
    arch = gconvert.arch_from_hf(cfg)
    assert (arch["rope_theta"], arch["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)
    assert arch["query_pre_attn_scalar"] == 256.0 and arch["tie_word_embeddings"] is True


@pytest.mark.parametrize(
    "name",
    ["model.layers.3.self_attn.q_norm.weight", "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight",
     "model.layers.1.post_feedforward_layernorm.weight", "model.layers.2.self_attn.o_proj.scales"],
)
def test_hf_names_map_to_themselves(name: str) -> None:
    assert gconvert.hf_target({"tie_word_embeddings": True}, name).name == name


def test_hf_tied_head_and_buffers_are_dropped() -> None:
    assert gconvert.hf_target({"tie_word_embeddings": True}, "lm_head.weight").name is None
    assert gconvert.hf_target({"tie_word_embeddings": False}, "lm_head.weight").name == "lm_head.weight"
    assert gconvert.hf_target({}, "model.layers.0.self_attn.rotary_emb.inv_freq").name is None


def test_hf_foreign_tensor_is_refused_by_name() -> None:
    with pytest.raises(ConversionError, match=r"model\.vision_tower\.blocks\.0\.weight"):
        gconvert.hf_target({}, "model.vision_tower.blocks.0.weight")


# ------------------------------------------------------------------ GGUF names and metadata
def test_gguf_names() -> None:
    pairs = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "blk.3.ffn_norm.weight": "model.layers.3.pre_feedforward_layernorm.weight",
        "blk.3.post_ffw_norm.weight": "model.layers.3.post_feedforward_layernorm.weight",
        "blk.0.post_attention_norm.weight": "model.layers.0.post_attention_layernorm.weight",
        "blk.0.attn_k_norm.weight": "model.layers.0.self_attn.k_norm.weight",
        "blk.7.attn_output.weight": "model.layers.7.self_attn.o_proj.weight",
    }
    for name, expected in pairs.items():
        target = gconvert.gguf_target({}, name)
        assert (target.name, target.unpermute_heads) == (expected, None)


def test_gguf_foreign_tensor_is_refused_by_name() -> None:
    with pytest.raises(ConversionError, match=r"blk\.0\.ssm_conv1d\.weight"):
        gconvert.gguf_target({}, "blk.0.ssm_conv1d.weight")


def _gguf_md(**extra: object) -> dict:
    md = {"gemma3.embedding_length": 5376, "gemma3.attention.head_count": 32, "gemma3.block_count": 62,
          "gemma3.attention.key_length": 128, "gemma3.feed_forward_length": 21504, "gemma3.vocab_size": 262208}
    return md | {f"gemma3.{k}": v for k, v in extra.items()}


def test_gguf_27b_query_scale_and_linear_rope() -> None:
    arch = gconvert.arch_from_gguf("gemma3", _gguf_md(**{"rope.scaling.type": "linear", "rope.scaling.factor": 8.0}))
    assert arch["query_pre_attn_scalar"] == 5376 // 32  # llama.cpp's rule for the 62-layer model
    assert arch["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert arch["norm_adds_one"] is False and arch["rope_local_base_freq"] == 10000.0
    smaller = gconvert.arch_from_gguf("gemma3", _gguf_md(block_count=34))
    assert smaller["query_pre_attn_scalar"] == 128


def test_gguf_sliding_pattern_as_period_or_flags() -> None:
    by_period = gconvert.arch_from_gguf("gemma3", _gguf_md(block_count=4, **{"attention.sliding_window_pattern": 2}))
    assert by_period["layer_types"] == ["sliding_attention", "full_attention"] * 2
    flags = [True, False, True, True]
    by_flags = gconvert.arch_from_gguf("gemma3", _gguf_md(block_count=4, **{"attention.sliding_window_pattern": flags}))
    assert by_flags["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    assert gconvert.arch_from_gguf("gemma3", _gguf_md())["layer_types"].count("full_attention") == 10  # 62 // 6


def test_gguf_unknown_rope_scaling_is_refused_by_name() -> None:
    with pytest.raises(ConversionError, match="yarn"):
        gconvert.arch_from_gguf("gemma3", _gguf_md(**{"rope.scaling.type": "yarn", "rope.scaling.factor": 2.0}))


# ------------------------------------------------------------------ a Gemma 3 GGUF, end to end
GGUF_CONFIG = TINY_CONFIG | {
    # what a llama.cpp file implies: pattern 6, query scale head_dim, local rope base 10000;
    # K-quant rows are 256 wide
    "num_hidden_layers": 6,
    "intermediate_size": 256,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 32,
    "rope_local_base_freq": 10000.0,
    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
}
_GGUF_NAMES = {v: k for k, v in gconvert._GGUF_LAYER.items()}


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def _write_gguf(
    path: Path, weights: dict[str, np.ndarray], zero: tuple[str, gguf.GGMLQuantizationType] | None = None
) -> Path:
    """The tiny model as llama.cpp writes Gemma 3: norms hold 1 + w, matrices Q8_0/Q5_0 or F32.

    ``zero``: one tensor written as all-zero blocks (d = 0: every value 0) of another type.
    """
    cfg = GGUF_CONFIG
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_sliding_window(cfg["sliding_window"])
    tokenizer = json.loads(tokenizer_json(cfg["vocab_size"]))
    pieces = sorted(tokenizer["model"]["vocab"], key=tokenizer["model"]["vocab"].get)
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([-float(i) for i in range(len(pieces))])
    w.add_token_types(
        [3 if p in SPECIALS or p.startswith("<unused") else 6 if p.startswith("<0x") else 1 for p in pieces]
    )
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    for name, arr in weights.items():
        gname = _gguf_name(name)
        if name.endswith("norm.weight"):
            w.add_tensor(gname, arr + np.float32(1.0))
        elif zero is not None and gname == zero[0]:
            block, size = gguf.GGML_QUANT_SIZES[zero[1]]
            raw = np.zeros((arr.shape[0], arr.shape[1] // block * size), np.uint8)
            w.add_tensor(gname, raw, raw_dtype=zero[1])
        elif "mlp" in name or "q_proj" in name:
            qtype = gguf.GGMLQuantizationType.Q5_0 if "mlp" in name else gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _dequantized_like_gguf(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, arr in weights.items():
        qtype = gguf.GGMLQuantizationType.Q5_0 if "mlp" in name else gguf.GGMLQuantizationType.Q8_0
        lossy = "mlp" in name or "q_proj" in name
        out[name] = gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype) if lossy else arr
    return out


@pytest.fixture(scope="module")
def gguf_case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same weights as a GGUF file and as a Hugging Face checkpoint (block-quantization applied)."""
    from safetensors.numpy import save_file

    root = tmp_path_factory.mktemp("gguf-case")
    weights = random_weights(GGUF_CONFIG, seed=3)
    hf = root / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(GGUF_CONFIG))
    (hf / "tokenizer.json").write_text(tokenizer_json(GGUF_CONFIG["vocab_size"]))
    save_file(_dequantized_like_gguf(weights), str(hf / "model.safetensors"))
    return {"gguf": _write_gguf(root / "tiny.gguf", weights), "hf": hf, "root": root,
            "q6k": _write_gguf(root / "q6k.gguf", weights, zero=("blk.2.ffn_down.weight", Q.Q6_K)),
            "iq4nl": _write_gguf(root / "iq4nl.gguf", weights, zero=("blk.2.ffn_down.weight", Q.IQ4_NL))}


def test_gguf_install_matches_the_checkpoint_install(gguf_case: dict[str, Path]) -> None:
    root = gguf_case["root"]
    manifest = convert(gguf_case["gguf"], root / "from-gguf")
    convert(gguf_case["hf"], root / "from-hf")
    assert manifest.quantization["model.layers.0.mlp.down_proj"] == {"bits": 5, "group_size": 32, "mode": "affine"}
    assert manifest.quantization["model.layers.0.self_attn.q_proj"]["bits"] == 8
    assert "dequantized" not in manifest.provenance
    prompt = [2, *np.random.default_rng(0).integers(6, 512, 40).tolist()]
    from_gguf = turbospark_core.open(root / "from-gguf").logits(prompt)
    from_hf = turbospark_core.open(root / "from-hf").logits(prompt)
    assert np.abs(from_gguf - from_hf).max() <= 1e-4 * np.abs(from_hf).max()


def test_q6_k_stays_quantized_in_groups_of_16(gguf_case: dict[str, Path]) -> None:
    dst = gguf_case["root"] / "q6k-install"
    manifest = convert(gguf_case["q6k"], dst, strict=True)  # exact: strict accepts it
    assert "dequantized" not in manifest.provenance
    assert manifest.quantization["model.layers.2.mlp.down_proj"] == {"bits": 6, "group_size": 16, "mode": "affine"}
    # the same zero matrix dequantized to float (IQ4_NL has no exact affine form) is the reference
    reference = convert(gguf_case["iq4nl"], gguf_case["root"] / "zero-float")
    assert "model.layers.2.mlp.down_proj" not in reference.quantization
    prompt = [2, *np.random.default_rng(1).integers(6, 512, 20).tolist()]
    want = turbospark_core.open(gguf_case["root"] / "zero-float").logits(prompt)
    got = turbospark_core.open(dst).logits(prompt)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_inexact_blocks_are_dequantized_and_reported(
    gguf_case: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    dst = gguf_case["root"] / "iq4nl-install"
    assert cli.main(["convert", str(gguf_case["iq4nl"]), str(dst), "-q"]) == 0
    out = capsys.readouterr().out
    assert "dequantized 1 tensors (IQ4_NL, no exact affine form) to float: blk.2.ffn_down.weight" in out
    manifest = json.loads((dst / "manifest.json").read_text())
    assert manifest["provenance"]["dequantized"] == {"IQ4_NL": ["blk.2.ffn_down.weight"]}
    assert "model.layers.2.mlp.down_proj" not in manifest["quantization"]


def test_strict_refuses_inexact_blocks_by_name(gguf_case: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    dst = gguf_case["root"] / "strict"
    with pytest.raises(ConversionError, match=r"--strict.*IQ4_NL: blk\.2\.ffn_down\.weight"):
        convert(gguf_case["iq4nl"], dst, strict=True)
    assert not dst.exists()
    assert cli.main(["convert", str(gguf_case["iq4nl"]), str(dst), "--strict", "-q"]) == 2
    assert "blk.2.ffn_down.weight" in capsys.readouterr().err
    convert(gguf_case["gguf"], dst, strict=True)  # every block type exact: strict accepts it
