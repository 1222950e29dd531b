"""Gemma 4 preprocessing: ``pixel_values`` from the PNG files as transformers' processor made them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from turbospark_gemma4.errors import ImageInputError
from turbospark_gemma4.image_processing import (
    ImageProcessing,
    ProcessorConfigError,
    from_processor_output,
    prepare,
    target_size,
)

FIXTURES = ("gemma4_e", "gemma4_moe")


def _png(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))


def _config(fixture: Path) -> ImageProcessing:
    return ImageProcessing.from_config(json.loads((fixture / "preprocessor_config.json").read_text()))


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("case", ["one", "two"])
def test_pixel_values_from_png_match_the_processor(turbospark_fixtures: Path, name: str, case: str) -> None:
    fixture = turbospark_fixtures / name
    ref = np.load(fixture / "references_vision.npz")
    cfg = _config(fixture)
    for slot, index in enumerate(ref[f"{case}_image_indices"]):
        image = prepare(_png(fixture / f"image_{index}.png"), cfg)
        pixels, positions = image.padded(cfg.max_patches)
        assert np.abs(pixels - ref[f"{case}_pixel_values"][slot]).max() <= 1e-6
        assert np.array_equal(positions, ref[f"{case}_image_position_ids"][slot])
        assert image.num_soft_tokens == ref[f"{case}_num_soft_tokens_per_image"][slot]


def test_processor_config_nested_form_reads_the_same(turbospark_fixtures: Path) -> None:
    fixture = turbospark_fixtures / "gemma4_e"
    nested = ImageProcessing.from_config(json.loads((fixture / "processor_config.json").read_text()))
    assert nested == _config(fixture)
    assert nested.max_patches == 630 and not nested.do_resize


def test_processor_output_round_trips(turbospark_fixtures: Path) -> None:
    ref = np.load(turbospark_fixtures / "gemma4_e" / "references_vision.npz")
    image = from_processor_output(ref["two_pixel_values"][1], ref["two_image_position_ids"][1], 3)
    assert (image.rows, image.cols, image.num_soft_tokens) == (15, 9, 15)
    pixels, positions = image.padded(630)
    assert np.array_equal(pixels, ref["two_pixel_values"][1])
    assert np.array_equal(positions, ref["two_image_position_ids"][1])


def test_processor_output_out_of_raster_order_refused(turbospark_fixtures: Path) -> None:
    ref = np.load(turbospark_fixtures / "gemma4_e" / "references_vision.npz")
    positions = ref["one_image_position_ids"][0].copy()
    positions[[0, 1]] = positions[[1, 0]]
    with pytest.raises(ImageInputError, match="raster"):
        from_processor_output(ref["one_pixel_values"][0], positions, 3)
    with pytest.raises(ImageInputError, match="no real patch"):
        from_processor_output(ref["one_pixel_values"][0], np.full((630, 2), -1), 3)


def test_resize_rule_matches_transformers_cases(turbospark_fixtures: Path) -> None:
    cases = json.loads((turbospark_fixtures / "gemma4_e" / "references_vision.json").read_text())["resize_cases"]
    fixture_cfg = _config(turbospark_fixtures / "gemma4_e")
    checked = 0
    for key, rows in cases.items():
        if key == "rule":
            continue
        if key.startswith("patch16_k3_max_soft_tokens_"):
            cfg = ImageProcessing.from_config({"patch_size": 16, "pooling_kernel_size": 3,
                                               "max_soft_tokens": int(key.rsplit("_", 1)[1])})  # fmt: skip
        else:
            cfg = fixture_cfg
        for h, w, th, tw in rows:
            assert target_size(h, w, cfg) == (th, tw), (key, h, w)
            checked += 1
    assert checked >= 15


def test_resizing_configuration_resizes_with_pil() -> None:
    cfg = ImageProcessing.from_config({"patch_size": 4, "pooling_kernel_size": 3, "max_soft_tokens": 70})
    image = np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    prepared = prepare(image, cfg)
    h, w = target_size(50, 70, cfg)
    assert (prepared.rows, prepared.cols) == (h // 4, w // 4)
    from PIL import Image

    resized = np.asarray(Image.fromarray(image).resize((w, h), Image.Resampling.BICUBIC)).astype(np.float64) / 255
    want = resized.reshape(h // 4, 4, w // 4, 4, 3).transpose(0, 2, 1, 3, 4).reshape(-1, 48)
    assert np.abs(prepared.patches - want).max() < 1e-6


def test_normalization_when_configured() -> None:
    cfg = ImageProcessing.from_config({"patch_size": 4, "pooling_kernel_size": 3, "max_soft_tokens": 70,
                                       "do_resize": False, "do_normalize": True,
                                       "image_mean": [0.5, 0.25, 0.0], "image_std": [0.5, 2.0, 1.0]})  # fmt: skip
    image = np.full((12, 12, 3), 255, dtype=np.uint8)
    patches = prepare(image, cfg).patches.reshape(-1, 16, 3)
    assert np.allclose(patches[..., 0], 1.0) and np.allclose(patches[..., 1], 0.375)
    assert np.allclose(patches[..., 2], 1.0)


@pytest.mark.parametrize(
    ("image", "named"),
    [
        (np.zeros((12, 12), dtype=np.uint8), "uint8 RGB"),
        (np.zeros((12, 12, 3), dtype=np.float32), "uint8 RGB"),
        (np.zeros((12, 13, 3), dtype=np.uint8), "multiples of"),
        (np.zeros((0, 12, 3), dtype=np.uint8), "empty"),
        (np.zeros((12, 12 * 71, 3), dtype=np.uint8), "max_soft_tokens"),
    ],
)
def test_unusable_images_refused_by_name(turbospark_fixtures: Path, image: np.ndarray, named: str) -> None:
    cfg = _config(turbospark_fixtures / "gemma4_e")
    with pytest.raises(ImageInputError, match=named):
        prepare(image, cfg)


def test_elongated_image_resize_keeps_one_multiple() -> None:
    cfg = ImageProcessing.from_config({"patch_size": 16, "pooling_kernel_size": 3, "max_soft_tokens": 70})
    assert target_size(1, 100000, cfg) == (48, 70 * 48)
    assert target_size(100000, 1, cfg) == (70 * 48, 48)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"patch_size": 0}, "patch_size"),
        ({"max_soft_tokens": "70"}, "max_soft_tokens"),
        ({"do_resize": "no"}, "do_resize"),
        ({"resample": 9}, "resample"),
        ({"rescale_factor": -1.0}, "rescale_factor"),
        ({"image_mean": [0.5, 0.5]}, "image_mean"),
        ({"image_std": [1.0, 0.0, 1.0]}, "image_std"),
    ],
)
def test_bad_processor_config_refused_by_key(change: dict[str, Any], named: str) -> None:
    with pytest.raises(ProcessorConfigError, match=named):
        ImageProcessing.from_config({"patch_size": 4, "pooling_kernel_size": 3, "max_soft_tokens": 70, **change})
