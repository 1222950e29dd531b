"""Image inputs: every accepted kind decodes to the same RGB pixels; every bad input is refused by name."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from turbospark_core.errors import OptionError
from turbospark_core.vision import images
from turbospark_core.vision.images import ImageError, decode_data_url, image_key, load_image, resize_rgb


@pytest.fixture
def rgb() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=(12, 20, 3), dtype=np.uint8)


@pytest.fixture
def png(rgb: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG")
    return out.getvalue()


def test_every_input_kind_decodes_to_the_same_pixels(rgb: np.ndarray, png: bytes, tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    path.write_bytes(png)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    for given in (str(path), path, f"file://{path}", png, bytearray(png), url, Image.open(io.BytesIO(png)), rgb):
        got = load_image(given)
        assert got.dtype == np.uint8 and got.shape == (12, 20, 3)
        assert np.array_equal(got, rgb), type(given)


def test_numpy_grey_rgba_and_float_inputs(rgb: np.ndarray) -> None:
    assert np.array_equal(load_image(rgb[:, :, 0]), np.repeat(rgb[:, :, :1], 3, axis=2))
    rgba = np.concatenate([rgb, np.full((12, 20, 1), 7, np.uint8)], axis=2)
    assert np.array_equal(load_image(rgba), rgb)
    assert np.array_equal(load_image(rgb.astype(np.float32) / 255), rgb)
    grey = Image.fromarray(rgb).convert("L")
    assert np.array_equal(load_image(grey), np.repeat(np.array(grey)[:, :, None], 3, axis=2))


@pytest.mark.parametrize("url", ["http://example.com/a.png", "https://x.org/cat.jpg", "ftp://h/p.png"])
def test_remote_urls_are_refused_by_name(url: str) -> None:
    with pytest.raises(ImageError, match=r"remote image URL .* fetches nothing"):
        load_image(url)


def test_undecodable_bytes_and_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="cannot be decoded"):
        load_image(b"definitely not an image")
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    with pytest.raises(ImageError, match=r"bad.png.*cannot be decoded"):
        load_image(bad)
    with pytest.raises(ImageError, match="cannot read image file"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(ImageError, match="not a file"):
        load_image(tmp_path)


def test_images_over_the_bounds_are_refused(rgb: np.ndarray, png: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ImageError, match="over the 100-pixel bound"):
        load_image(png, max_pixels=100)  # read from the header, before the pixels are decoded
    with pytest.raises(ImageError, match="over the 100-pixel bound"):
        load_image(rgb, max_pixels=100)
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 64)
    with pytest.raises(ImageError, match="over the 64-byte bound"):
        load_image(png)


def test_bad_data_urls_and_kinds_are_refused(rgb: np.ndarray) -> None:
    with pytest.raises(ImageError, match="must be base64"):
        load_image("data:image/png,rawbytes")
    with pytest.raises(ImageError, match="malformed"):
        decode_data_url("data:image/png;base64,@@@not base64@@@")
    with pytest.raises(ImageError, match="got int"):
        load_image(42)
    with pytest.raises(ImageError, match=r"shape \(2, 2, 5\)"):
        load_image(np.zeros((2, 2, 5), np.uint8))
    with pytest.raises(ImageError, match=r"finite values in \[0, 1\]"):
        load_image(np.full((2, 2, 3), 2.0))
    with pytest.raises(ImageError, match="uint8 or float"):
        load_image(np.zeros((2, 2, 3), np.int64))
    assert issubclass(ImageError, OptionError)  # the server answers it with a 400


def test_image_key_tells_content_and_shape(rgb: np.ndarray) -> None:
    assert image_key(rgb) == image_key(rgb.copy())
    assert image_key(rgb) != image_key(rgb[::-1])
    assert image_key(rgb) != image_key(rgb.reshape(20, 12, 3))


def test_resize_rgb_is_pil_bicubic(rgb: np.ndarray) -> None:
    want = np.array(Image.fromarray(rgb).resize((16, 8), Image.Resampling.BICUBIC))
    assert np.array_equal(resize_rgb(rgb, 8, 16, 3), want)
    assert resize_rgb(rgb, 12, 20) is rgb
