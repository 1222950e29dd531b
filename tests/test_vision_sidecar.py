"""Vision sidecars: written by ``convert --vision``, refused as a model, validated like an install."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import turbospark_core
from turbospark_core.errors import ConversionError, FileTableError, NotAnInstallError
from turbospark_core.manifest import MANIFEST
from turbospark_core.vision.convert import convert_sidecar
from turbospark_core.vision.sidecar import (
    CHAT_TEMPLATE,
    SIDECAR_FORMAT,
    VISION_WEIGHTS,
    SidecarError,
    is_sidecar,
    load_sidecar,
)

Made = Callable[[str], tuple[Path, Path]]


@pytest.fixture
def sidecar(turbospark_vision_install: Made, tmp_path: Path) -> Path:
    """A private copy of the qwen3_vl sidecar (tests alter it)."""
    dst = tmp_path / "sidecar"
    shutil.copytree(turbospark_vision_install("qwen3_vl")[1], dst)
    return dst


def _edit(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    raw = json.loads((path / MANIFEST).read_text())
    change(raw)
    (path / MANIFEST).write_text(json.dumps(raw))


def test_convert_writes_a_sidecar_of_its_own_kind(sidecar: Path, turbospark_fixtures: Path) -> None:
    raw = json.loads((sidecar / MANIFEST).read_text())
    assert raw["format"] == SIDECAR_FORMAT and raw["sidecar"] == "vision"
    assert set(raw["files"]) == {VISION_WEIGHTS, CHAT_TEMPLATE}
    loaded = load_sidecar(sidecar)
    assert loaded.family == "llama" and loaded.trunk == {"model_type": "qwen3_vl", "hidden_size": 64, "vocab_size": 512}
    assert loaded.tokens == {"image": 7, "vision_start": 5, "vision_end": 6}
    assert loaded.token_texts["image"] == "<|image_pad|>"
    assert loaded.processor == json.loads((turbospark_fixtures / "qwen3_vl" / "preprocessor_config.json").read_text())
    assert loaded.chat_template() == (turbospark_fixtures / "qwen3_vl" / CHAT_TEMPLATE).read_text()
    assert is_sidecar(sidecar) and not is_sidecar(sidecar.parent)


def test_opening_a_sidecar_as_a_model_is_refused(sidecar: Path) -> None:
    with pytest.raises(NotAnInstallError, match=r"is a vision sidecar, not a language model install.*vision=SIDECAR"):
        turbospark_core.open(sidecar)


def test_an_install_or_an_empty_directory_is_not_a_sidecar(turbospark_vision_install: Made, tmp_path: Path) -> None:
    with pytest.raises(NotAnInstallError, match="not a vision sidecar"):
        load_sidecar(turbospark_vision_install("qwen3_vl")[0])
    with pytest.raises(NotAnInstallError, match=r"no manifest\.json"):
        load_sidecar(tmp_path)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda raw: raw.update(format_version=99), SidecarError, "re-convert with this turbospark version"),
        (lambda raw: raw["tokens"].pop("image"), SidecarError, "no 'image' placeholder id"),
        (lambda raw: raw["tokens"].update(image=-1), SidecarError, "tokens.image must be a non-negative integer"),
        (lambda raw: raw["trunk"].update(hidden_size="64"), SidecarError, "trunk.hidden_size"),
        (lambda raw: raw.update(vision=[]), SidecarError, "'vision' must be a dict"),
        (lambda raw: raw.update(quantization=[1]), SidecarError, "'quantization' must be an object"),  # fuzz find
        (lambda raw: raw.update(provenance="x"), SidecarError, "'provenance' must be an object"),
        (lambda raw: raw["files"].update({"../w": {"size": 1, "sha256": ""}}), FileTableError, "not a sidecar file"),
        (lambda raw: raw["files"][VISION_WEIGHTS].update(size=3), FileTableError, "truncated or altered"),
        (lambda raw: raw["files"].pop(VISION_WEIGHTS), FileTableError, "lacks 'vision_weights.safetensors'"),
    ],
)
def test_a_malformed_sidecar_is_refused_by_name(
    sidecar: Path, change: Callable[[dict[str, Any]], None], error: type[Exception], match: str
) -> None:
    _edit(sidecar, change)
    with pytest.raises(error, match=match):
        load_sidecar(sidecar)


def test_a_manifest_that_is_not_json_is_refused(sidecar: Path) -> None:
    (sidecar / MANIFEST).write_text('{"sidecar": "vision", ')
    with pytest.raises(SidecarError, match="not valid JSON"):
        load_sidecar(sidecar)
    (sidecar / MANIFEST).write_text("[1, 2]")
    with pytest.raises(NotAnInstallError, match="not a vision sidecar"):
        load_sidecar(sidecar)


def test_convert_refuses_a_text_only_checkpoint(turbospark_fixtures: Path, tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match=r"has no vision tower for model type 'qwen3'; convert without --vision"):
        convert_sidecar(turbospark_fixtures / "qwen3", tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_convert_refuses_a_checkpoint_without_a_processor_config(turbospark_fixtures: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(turbospark_fixtures / "qwen3_vl", src, ignore=shutil.ignore_patterns("*.npz", "bf16", "*.png"))
    (src / "preprocessor_config.json").unlink()
    with pytest.raises(ConversionError, match=r"no preprocessor_config\.json"):
        convert_sidecar(src, tmp_path / "s")


def test_convert_casts_with_dtype(turbospark_fixtures: Path, tmp_path: Path) -> None:
    import mlx.core as mx

    convert_sidecar(turbospark_fixtures / "qwen3_vl", tmp_path / "s", dtype="bfloat16")
    tensors: Any = mx.load(str(tmp_path / "s" / VISION_WEIGHTS))
    assert {t.dtype for t in tensors.values()} == {mx.bfloat16}
    with pytest.raises(ConversionError, match="not empty"):
        convert_sidecar(turbospark_fixtures / "qwen3_vl", tmp_path / "s")
