"""Released MXFP4 experts become MLX mxfp4 matrices bit for bit (core convert/mxfp4.py + this plugin)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core.convert import convert, mxfp4
from turbospark_core.errors import ConversionError
from turbospark_core.experts import held
from turbospark_core.manifest import load_manifest
from turbospark_core.testing import relative_error

# transformers/integrations/mxfp4.py FP4_VALUES (e2m1 codes 0..15), reimplemented in numpy
FP4_VALUES = np.array(
    [+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
PROJ = ("gate_up_proj", "down_proj")


def dequantize_like_transformers(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``[..., rows, groups, 16]`` uint8 blocks + ``[..., rows, groups]`` scales -> ``[..., rows, cols]``."""
    *lead, groups, nbytes = blocks.shape
    out = np.empty((*lead, groups, nbytes * 2), dtype=np.float32)
    out[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    out[..., 1::2] = FP4_VALUES[blocks >> 4]
    out = np.ldexp(out, scales.astype(np.int32)[..., None] - 127)
    return out.reshape(*lead, groups * nbytes * 2)


@pytest.fixture(scope="module")
def source(turbospark_fixtures: Path) -> dict[str, np.ndarray]:
    raw = mx.load(str(turbospark_fixtures / "gpt_oss_mxfp4" / "model.safetensors"))
    return {k: np.array(v) for k, v in raw.items() if k.endswith(("_blocks", "_scales"))}


@pytest.fixture(scope="module")
def install(turbospark_install: Any) -> Path:
    return turbospark_install("gpt_oss_mxfp4", "float32")


def _dequantized(tensors: dict[str, mx.array], base: str) -> np.ndarray:
    w = mx.dequantize(tensors[f"{base}.weight"], tensors[f"{base}.scales"], None, group_size=32, bits=4, mode="mxfp4")
    return np.array(w.astype(mx.float32))


@pytest.mark.parametrize("layer", [0, 1])
def test_experts_dequantize_exactly_as_transformers(source: dict, install: Path, layer: int) -> None:
    tensors = held.read_expert_tensors(load_manifest(install))  # routed experts live in experts.bin
    p = f"model.layers.{layer}.mlp.experts"
    gate_up = dequantize_like_transformers(source[f"{p}.gate_up_proj_blocks"], source[f"{p}.gate_up_proj_scales"])
    down = dequantize_like_transformers(source[f"{p}.down_proj_blocks"], source[f"{p}.down_proj_scales"])
    assert np.array_equal(_dequantized(tensors, f"{p}.gate_proj"), gate_up[:, 0::2])
    assert np.array_equal(_dequantized(tensors, f"{p}.up_proj"), gate_up[:, 1::2])
    assert np.array_equal(_dequantized(tensors, f"{p}.down_proj"), down)


def test_install_keeps_mxfp4_storage(install: Path) -> None:
    manifest = json.loads((install / "manifest.json").read_text())
    tensors = held.read_expert_tensors(load_manifest(install))
    layer = manifest["experts"]["layers"]["model.layers.0.mlp.experts"]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        base = f"model.layers.0.mlp.experts.{proj}"
        assert layer["projections"][proj]["quantization"] == {"bits": 4, "group_size": 32, "mode": "mxfp4"}
        assert tensors[f"{base}.weight"].dtype == mx.uint32 and tensors[f"{base}.scales"].dtype == mx.uint8
        assert f"{base}.biases" not in tensors and f"{base}.bias" in tensors  # no affine biases; HF bias kept
    assert tensors["model.layers.0.mlp.experts.gate_proj.weight"].shape == (8, 64, 8)


def test_blocks_and_scales_pair_across_shards(turbospark_fixtures: Path, install: Path, tmp_path: Path) -> None:
    src = tmp_path / "sharded"
    shutil.copytree(turbospark_fixtures / "gpt_oss_mxfp4", src, ignore=shutil.ignore_patterns("references.npz"))
    tensors = mx.load(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    scales = {k: v for k, v in tensors.items() if k.endswith("_scales")}
    mx.save_safetensors(
        str(src / "model-00001-of-00002.safetensors"), {k: v for k, v in tensors.items() if k not in scales}
    )
    mx.save_safetensors(str(src / "model-00002-of-00002.safetensors"), scales)
    convert(src, tmp_path / "install")
    got = {
        **mx.load(str(tmp_path / "install" / "model_weights.safetensors")),
        **held.read_expert_tensors(load_manifest(tmp_path / "install")),
    }
    want = {**mx.load(str(install / "model_weights.safetensors")), **held.read_expert_tensors(load_manifest(install))}
    assert set(got) == set(want) and all(mx.array_equal(got[k], want[k]).item() for k in want)


def test_blocks_without_scales_refused_by_name(turbospark_fixtures: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(turbospark_fixtures / "gpt_oss_mxfp4", src, ignore=shutil.ignore_patterns("references.npz"))
    tensors = mx.load(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    mx.save_safetensors(str(src / "model.safetensors"), tensors)
    with pytest.raises(ConversionError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_blocks"):
        convert(src, tmp_path / "install")


@pytest.mark.parametrize(
    ("blocks", "scales", "named"),
    [
        (mx.zeros((4, 2, 16), mx.int8), mx.zeros((4, 2), mx.uint8), "w_blocks"),
        (mx.zeros((4, 2, 16), mx.uint8), mx.zeros((4, 2), mx.float32), "w_scales"),
        (mx.zeros((4, 2, 8), mx.uint8), mx.zeros((4, 2), mx.uint8), "w_blocks"),
        (mx.zeros((4, 2, 16), mx.uint8), mx.zeros((4, 3), mx.uint8), "w_scales"),
    ],
)
def test_malformed_pair_refused_by_name(blocks: mx.array, scales: mx.array, named: str) -> None:
    with pytest.raises(ConversionError, match=named):
        mxfp4.from_blocks("w", blocks, scales)


def test_quantized_kernels_serve_the_install(install: Path, turbospark_fixtures: Path) -> None:
    """The mxfp4 experts are multiplied as stored (native kernels on the CPU, MLX's gather_qmm elsewhere),
    also within a budget that could not hold them unpacked."""
    refs = np.load(turbospark_fixtures / "gpt_oss_mxfp4" / "references.npz")
    runner = turbospark_core.open(install, memory_budget=600_000, max_context=256)
    got = runner.logits(refs["prompt_ids"].tolist())
    # bf16 non-expert weights keep bf16 activations here: compare loosely
    assert float((got.argmax(-1) == refs["logits"].argmax(-1)).mean()) >= 0.95
    assert relative_error(got, refs["logits"]) < 5e-2


def test_mlx_lm_mxfp4_directory_converts(install: Path, turbospark_fixtures: Path, tmp_path: Path) -> None:
    """An mlx-lm gpt-oss directory (experts already split, mxfp4 ``.weight``/``.scales``) converts as is."""
    src = tmp_path / "mlx-lm"
    shutil.copytree(turbospark_fixtures / "gpt_oss_mxfp4", src, ignore=shutil.ignore_patterns("*.safetensors", "*.npz"))
    tensors = {
        **mx.load(str(install / "model_weights.safetensors")),
        **held.read_expert_tensors(load_manifest(install)),
    }
    mx.save_safetensors(str(src / "model.safetensors"), tensors)
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    config["quantization"] = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    (src / "config.json").write_text(json.dumps(config))
    convert(src, tmp_path / "install")
    refs = np.load(turbospark_fixtures / "gpt_oss_mxfp4" / "references.npz")
    got = turbospark_core.open(tmp_path / "install").logits(refs["prompt_ids"].tolist())
    assert relative_error(got, refs["logits"]) <= 1e-4
