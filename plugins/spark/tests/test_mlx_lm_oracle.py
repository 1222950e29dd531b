"""A variant the fixture does not cover, checked against mlx-lm (the test oracle).

Untied head, attention and MLP biases, partial rope on the sliding layers
too, and another layer pattern: built from the fixture's weights plus random
extras, then run through both runtimes, full sequence and cached decode.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core.convert import convert
from turbospark_core.testing import relative_error

mlx_lm_utils = pytest.importorskip("mlx_lm.utils")

TOL = 1e-4


def _variant(src: Path, dst: Path) -> None:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(src / name, dst / name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(
        tie_word_embeddings=False,
        attention_bias=True,
        mlp_bias=True,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_theta": 5e4, "partial_rotary_factor": 0.75, "rope_type": "default"},
            "full_attention": {"rope_theta": 1e6, "partial_rotary_factor": 0.25, "rope_type": "default"},
        },
    )
    (dst / "config.json").write_text(json.dumps(cfg))
    weights = dict(mx.load(str(src / "model.safetensors")))
    rng = np.random.default_rng(7)
    extras = {"lm_head.weight": (cfg["vocab_size"], cfg["hidden_size"])}
    for name, w in weights.items():
        if name.endswith("_proj.weight"):
            extras[name.replace(".weight", ".bias")] = (w.shape[0],)
    for name, shape in extras.items():
        weights[name] = mx.array(rng.normal(0.0, 0.1, shape).astype(np.float32))
    mx.save_safetensors(str(dst / "model.safetensors"), weights)


@pytest.fixture(scope="module")
def variant(tmp_path_factory: pytest.TempPathFactory, turbospark_fixtures: Path) -> tuple[Any, Any]:
    root = tmp_path_factory.mktemp("spark-variant")
    _variant(turbospark_fixtures / "spark2_5", root / "hf")
    convert(root / "hf", root / "install")
    reference, _ = mlx_lm_utils.load_model(root / "hf")
    return turbospark_core.open(root / "install"), reference


@pytest.fixture(scope="module")
def ids(turbospark_fixtures: Path) -> list[int]:
    return np.load(turbospark_fixtures / "spark2_5" / "references.npz")["prompt_ids"].tolist()


def test_untied_biased_variant_matches_mlx_lm(variant: tuple[Any, Any], ids: list[int]) -> None:
    runner, reference = variant
    assert runner.opened.index.tensors.get("lm_head.weight") is not None
    want = np.array(reference(mx.array([ids]))[0].astype(mx.float32))
    assert relative_error(runner.logits(ids), want) <= TOL


def test_cached_decode_matches_mlx_lm_rotating_cache(variant: tuple[Any, Any], ids: list[int]) -> None:
    runner, reference = variant
    ours, theirs = runner.opened.new_cache(), reference.make_cache()
    got = [np.array(runner.model(mx.array([ids]), ours)[0, -1])]
    want = [np.array(reference(mx.array([ids]), cache=theirs)[0, -1])]
    for t in ids[:40]:  # teacher-forced past two and a half windows
        got.append(np.array(runner.model(mx.array([[t]]), ours)[0, -1]))
        want.append(np.array(reference(mx.array([[t]]), cache=theirs)[0, -1]))
    assert relative_error(np.stack(got), np.stack(want)) <= TOL


def test_mlx_lm_quantized_directory_converts_and_matches(
    tmp_path: Path, turbospark_fixtures: Path, ids: list[int]
) -> None:
    from mlx_lm import convert as mlx_lm_convert

    src = tmp_path / "mlx-q4"
    mlx_lm_convert(str(turbospark_fixtures / "spark2_5"), str(src), quantize=True, q_group_size=32, q_bits=4)
    convert(src, tmp_path / "install")
    quant = json.loads((tmp_path / "install" / "manifest.json").read_text())["quantization"]
    assert quant["model.layers.0.self_attn.q_k_v_proj"] == {"bits": 4, "group_size": 32, "mode": "affine"}
    reference, _ = mlx_lm_utils.load_model(src)
    want = np.array(reference(mx.array([ids]))[0].astype(mx.float32))
    assert relative_error(turbospark_core.open(tmp_path / "install").logits(ids), want) <= TOL
