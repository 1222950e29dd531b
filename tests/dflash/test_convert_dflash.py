"""``turbospark convert`` of a DFlash drafter checkpoint: an install of its own kind; every refusal."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core.convert import convert
from turbospark_core.errors import ConversionError, ManifestError, NotAnInstallError
from turbospark_core.manifest import DFLASH_KIND, MANIFEST, WEIGHTS, load_manifest
from turbospark_core.runner import Runner
from turbospark_core.speculative.dflash import DFlashFactory

Factory = Callable[[Runner, Path], DFlashFactory]


@pytest.fixture
def source(fx: Any, tmp_path: Path) -> Path:
    """A private copy of the fixture's drafter checkpoint."""
    dst = tmp_path / "src"
    shutil.copytree(fx.source / "dflash", dst)
    return dst


def _edit_tensors(src: Path, fn: Callable[[dict[str, mx.array]], None]) -> None:
    path = src / "model.safetensors"
    tensors = dict(mx.load(str(path)))  # type: ignore[arg-type]
    fn(tensors)
    mx.save_safetensors(str(path), tensors)


def _edit_config(src: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    raw = json.loads((src / "config.json").read_text())
    fn(raw)
    (src / "config.json").write_text(json.dumps(raw))


def test_install_is_of_its_own_kind(fx: Any) -> None:
    manifest = load_manifest(fx.drafter)
    assert manifest.kind == DFLASH_KIND
    assert manifest.model_type == "dflash"
    assert set(manifest.files) == {WEIGHTS}
    tensors = mx.load(str(fx.drafter / WEIGHTS))
    released = mx.load(str(fx.source / "dflash" / "model.safetensors"))
    assert set(tensors) == set(released)  # type: ignore[arg-type]
    for name in released:  # type: ignore[union-attr]
        assert np.array_equal(np.array(tensors[name]), np.array(released[name]))  # type: ignore[index]


def test_model_installs_say_so(fx: Any) -> None:
    assert load_manifest(fx.target).kind == "model"
    raw = json.loads((fx.target / MANIFEST).read_text())
    assert raw["kind"] == "model"


def test_opening_the_drafter_as_a_model_is_refused(fx: Any) -> None:
    with pytest.raises(NotAnInstallError, match=r"is a 'dflash' drafter install, not a language model.*dflash="):
        turbospark_core.open(fx.drafter)


def test_an_unknown_kind_is_refused(drafter_copy: Path) -> None:
    raw = json.loads((drafter_copy / MANIFEST).read_text())
    raw["kind"] = "eagle"
    (drafter_copy / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match="kind 'eagle' is not one of 'model', 'dflash'"):
        load_manifest(drafter_copy)


def test_a_foreign_tensor_is_refused_by_name(source: Path, tmp_path: Path) -> None:
    _edit_tensors(source, lambda t: t.update({"embed_tokens.weight": mx.zeros((512, 64))}))
    with pytest.raises(ConversionError, match=r"'embed_tokens.weight' is not one the drafter uses \(drafters with"):
        convert(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_missing_tensor_is_refused_by_name(source: Path, tmp_path: Path) -> None:
    _edit_tensors(source, lambda t: t.pop("layers.0.self_attn.k_norm.weight"))
    with pytest.raises(ConversionError, match=r"lacks tensor 'layers.0.self_attn.k_norm.weight'"):
        convert(source, tmp_path / "out")


def test_a_wrong_shape_is_refused_by_name(source: Path, tmp_path: Path) -> None:
    _edit_tensors(source, lambda t: t.update({"fc.weight": mx.zeros((64, 128))}))
    with pytest.raises(ConversionError, match=r"tensor 'fc.weight' has shape \[64, 128\], its config needs \[64, 64\]"):
        convert(source, tmp_path / "out")


def test_a_bad_config_is_refused_by_name(source: Path, tmp_path: Path) -> None:
    _edit_config(source, lambda c: c.update({"block_size": 1}))
    with pytest.raises(ConversionError, match="cannot convert this DFlash drafter: 'block_size' must be at least 2"):
        convert(source, tmp_path / "out")


def test_rotation_is_refused(source: Path, tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match="is a DFlash drafter; --rotate"):
        convert(source, tmp_path / "out", rotate=True)


def test_dtype_and_quantize_apply(fx: Any, source: Path, tmp_path: Path, factory_for: Factory) -> None:
    convert(source, tmp_path / "q8", quantize="q8")
    manifest = load_manifest(tmp_path / "q8")
    assert "fc" in manifest.quantization
    convert(source, tmp_path / "bf16", dtype="bfloat16")
    assert mx.load(str(tmp_path / "bf16" / WEIGHTS))["fc.weight"].dtype == mx.bfloat16  # type: ignore[call-overload]
    runner, refs = fx.open(), fx.refs
    hidden = {0: mx.array(refs["target_hidden"][0])}
    for variant in ("q8", "bf16"):
        logits = np.array(
            factory_for(runner, tmp_path / variant).block_logits(hidden, int(refs["round1_block_ids"][0]))
        )
        assert np.abs(logits - refs["round1_logits"]).max() < 0.25  # stored narrower: close (bf16 ~1e-1), not exact
