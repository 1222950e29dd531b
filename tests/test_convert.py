"""Tests of the converter: Hugging Face and mlx-lm sources, dtypes, quantization, refusals."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core.convert import convert
from turbospark_core.errors import ConversionError, UnknownFamilyError
from turbospark_core.manifest import MANIFEST, WEIGHTS, load_manifest, verify_checksums
from turbospark_core.tensor_index import read_header


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _dtypes(root: Path) -> dict[str, str]:
    header, _ = read_header(root / WEIGHTS, (root / WEIGHTS).stat().st_size)
    return {name: entry["dtype"] for name, entry in header.items()}


def _copy_source(src: Path, dst: Path, *, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        if p.is_file() and p.name not in skip:
            shutil.copy(p, dst / p.name)
    return dst


# ------------------------------------------------------------------ Hugging Face round trip
def test_hf_round_trip(f32_install: Path, llama_src: Path, references) -> None:
    m = load_manifest(f32_install)
    on_disk = {p.name for p in f32_install.iterdir()} - {MANIFEST}
    assert set(m.files) == on_disk
    for name, entry in m.files.items():
        data = (f32_install / name).read_bytes()
        assert entry.size == len(data)
        assert entry.sha256 == hashlib.sha256(data).hexdigest()
    assert verify_checksums(m) == []
    assert m.provenance["source"] == str(llama_src.resolve())
    assert m.provenance["options"]["quantize"] is None
    assert set(_dtypes(f32_install).values()) == {"F32"}
    # every source tensor made it, with the same values
    src = mx.load(str(llama_src / "model.safetensors"))
    out = mx.load(str(f32_install / WEIGHTS))
    assert set(src) == set(out)
    assert all(mx.array_equal(src[k], out[k]).item() for k in src)
    logits = turbospark_core.open(f32_install).logits(references["prompt_ids"].tolist())
    assert np.abs(logits - references["logits"]).max() <= 1e-5 * np.abs(references["logits"]).max()


def test_tokenizer_files_are_copied(f32_install: Path, llama_src: Path) -> None:
    for name in ("tokenizer.json", "generation_config.json"):
        assert (f32_install / name).read_bytes() == (llama_src / name).read_bytes()
    assert json.loads((f32_install / "tokenizer_config.json").read_text()).get("chat_template")


def test_dtype_bfloat16(llama_src: Path, tmp_path: Path, references) -> None:
    m = convert(llama_src, tmp_path / "bf16", dtype="bfloat16")
    assert set(_dtypes(tmp_path / "bf16").values()) == {"BF16"}
    assert m.provenance["options"]["dtype"] == "bfloat16"
    assert verify_checksums(m) == []
    logits = turbospark_core.open(tmp_path / "bf16").logits(references["prompt_ids"].tolist())
    assert _rel(logits, references["logits_bf16_weights"]) < 1e-5


def test_bfloat16_source_stays_bfloat16(llama_src: Path, tmp_path: Path, references) -> None:
    convert(llama_src / "bf16", tmp_path / "inst")
    assert set(_dtypes(tmp_path / "inst").values()) == {"BF16"}
    logits = turbospark_core.open(tmp_path / "inst").logits(references["prompt_ids"].tolist())
    assert _rel(logits, references["logits_bf16_weights"]) < 1e-5


def test_quantize_q8(llama_src: Path, tmp_path: Path, references) -> None:
    m = convert(llama_src, tmp_path / "q8", quantize="q8")
    table = m.quantization
    matrices = {f"model.layers.{i}.{p}" for i in range(2) for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")}
    assert set(table) == matrices | {"model.embed_tokens", "lm_head"}  # down_proj: 160 columns, not a group multiple
    assert all(q == {"bits": 8, "group_size": 64, "mode": "affine"} for q in table.values())
    dtypes = _dtypes(tmp_path / "q8")
    assert all(dtypes[f"{b}.weight"] == "U32" for b in table)
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == "F32"
    assert verify_checksums(m) == []
    logits = turbospark_core.open(tmp_path / "q8").logits(references["prompt_ids"].tolist())
    assert _rel(logits, references["logits"]) < 2e-2


def test_quantize_q4_is_mlx_affine(llama_src: Path, q4_install: Path, references) -> None:
    m = load_manifest(q4_install)
    assert len(m.quantization) == 14
    assert all(q == {"bits": 4, "group_size": 64, "mode": "affine"} for q in m.quantization.values())
    src = mx.load(str(llama_src / "model.safetensors"))
    out = mx.load(str(q4_install / WEIGHTS))
    w, scales, biases = mx.quantize(src["model.layers.1.self_attn.o_proj.weight"], group_size=64, bits=4)
    base = "model.layers.1.self_attn.o_proj"
    assert mx.array_equal(out[f"{base}.weight"], w).item()
    assert mx.array_equal(out[f"{base}.scales"], scales).item()
    assert mx.array_equal(out[f"{base}.biases"], biases).item()
    q4 = turbospark_core.open(q4_install).logits(references["prompt_ids"].tolist())
    assert 2e-2 < _rel(q4, references["logits"]) < 0.5  # 4 bits on random weights: coarse, but not noise


def test_quantize_q4_group_32_equals_mlx_lm(llama_src: Path, mlx_q4_dir: Path, tmp_path: Path) -> None:
    """Our quantizer and mlx-lm's produce the same bytes for the same checkpoint."""
    m = convert(llama_src, tmp_path / "q4g32", quantize="q4", group_size=32)
    ours = mx.load(str(tmp_path / "q4g32" / WEIGHTS))
    theirs = mx.load(str(mlx_q4_dir / "model.safetensors"))
    assert set(ours) == set(theirs)
    assert all(mx.array_equal(ours[k], theirs[k]).item() for k in theirs)
    assert len(m.quantization) == 16


# ------------------------------------------------------------------ mlx-lm source
def test_mlx_lm_quantized_directory(mlx_q4_dir: Path, tmp_path: Path, references) -> None:
    import mlx_lm

    m = convert(mlx_q4_dir, tmp_path / "inst")
    theirs = mx.load(str(mlx_q4_dir / "model.safetensors"))
    ours = mx.load(str(tmp_path / "inst" / WEIGHTS))
    packed = [k for k in theirs if theirs[k].dtype == mx.uint32]
    assert len(packed) == 16
    assert set(ours) == set(theirs)
    for k in theirs:  # kept exactly: packed words, scales and biases
        assert ours[k].dtype == theirs[k].dtype and mx.array_equal(ours[k], theirs[k]).item(), k
    assert set(m.quantization) == {k.rpartition(".")[0] for k in packed}
    assert all(q == {"bits": 4, "group_size": 32, "mode": "affine"} for q in m.quantization.values())

    ids = references["prompt_ids"].tolist()
    model, _ = mlx_lm.load(str(mlx_q4_dir))
    expected = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    logits = turbospark_core.open(tmp_path / "inst").logits(ids)
    assert _rel(logits, expected) < 1e-4


# ------------------------------------------------------------------ destinations
def test_non_empty_destination_is_refused_without_force(llama_src: Path, tmp_path: Path, names) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError) as e:
        convert(llama_src, dst)
    names(e, str(dst), "not empty", "--force")
    assert (dst / "keep.txt").read_text() == "mine"
    convert(llama_src, dst, force=True)
    assert not (dst / "keep.txt").exists() and (dst / MANIFEST).is_file()
    assert not (tmp_path / "dst.partial").exists()


def test_empty_destination_is_used(llama_src: Path, tmp_path: Path) -> None:
    (tmp_path / "dst").mkdir()
    assert convert(llama_src, tmp_path / "dst").model_type == "llama"


def test_failed_conversion_leaves_no_staging(llama_src: Path, tmp_path: Path) -> None:
    src = _copy_source(llama_src, tmp_path / "src")
    arrays = dict(mx.load(str(src / "model.safetensors")))
    arrays["model.language_model.norm.weight"] = arrays["model.norm.weight"]  # maps onto model.norm.weight too
    mx.save_safetensors(str(src / "model.safetensors"), arrays)
    with pytest.raises(ConversionError, match=r"two source tensors map onto install tensor 'model\.norm\.weight'"):
        convert(src, tmp_path / "dst")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# ------------------------------------------------------------------ sources refused
def test_source_without_config(llama_src: Path, tmp_path: Path, names) -> None:
    src = _copy_source(llama_src, tmp_path / "src", skip=("config.json",))
    with pytest.raises(ConversionError) as e:
        convert(src, tmp_path / "dst")
    names(e, str(src), "config.json", "checkpoint directory")
    assert not (tmp_path / "dst").exists()


def test_source_with_only_a_pickle_checkpoint(llama_src: Path, tmp_path: Path, names) -> None:
    src = _copy_source(llama_src, tmp_path / "src", skip=("model.safetensors",))
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04\x95 not to be unpickled")
    with pytest.raises(ConversionError) as e:
        convert(src, tmp_path / "dst")
    names(e, "pytorch_model.bin", "pickle", "safetensors")


def test_source_with_unknown_model_type(llama_src: Path, tmp_path: Path, names) -> None:
    src = _copy_source(llama_src, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "mamba9"
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownFamilyError) as e:
        convert(src, tmp_path / "dst")
    names(e, "'mamba9'", "installed families: ", "llama (llama, qwen2")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("config", ['{"hidden_size": 64}', "{oops", "[]"])
def test_source_config_without_model_type(llama_src: Path, tmp_path: Path, config: str, names) -> None:
    src = _copy_source(llama_src, tmp_path / "src")
    (src / "config.json").write_text(config)
    with pytest.raises(ConversionError) as e:
        convert(src, tmp_path / "dst")
    names(e, "config.json")


def test_source_without_tokenizer_json(llama_src: Path, tmp_path: Path, names) -> None:
    src = _copy_source(llama_src, tmp_path / "src", skip=("tokenizer.json",))
    with pytest.raises(ConversionError) as e:
        convert(src, tmp_path / "dst")
    names(e, "tokenizer.json")


def test_source_that_does_not_exist(tmp_path: Path, names) -> None:
    with pytest.raises(ConversionError) as e:
        convert(tmp_path / "nope", tmp_path / "dst")
    names(e, "nope", "checkpoint directory", ".gguf")


@pytest.mark.parametrize(
    ("option", "flag"),
    [
        ({"quantize": "q5"}, "--quantize 'q5'"),
        ({"dtype": "float64"}, "--dtype 'float64'"),
        ({"group_size": 48}, "--group-size 48"),
    ],
)
def test_bad_convert_options(llama_src: Path, tmp_path: Path, option, flag: str, names) -> None:
    with pytest.raises(ConversionError) as e:
        convert(llama_src, tmp_path / "dst", **option)
    names(e, flag)
    assert not (tmp_path / "dst").exists()
