"""Image inputs: decode what a caller passes (path, bytes, PIL image, numpy array, ``data:`` URL) to RGB uint8.

Every input is bounded before it is decoded: encoded bytes by
``MAX_IMAGE_BYTES``, pixels by ``max_pixels`` (read from the header, so a
decompression bomb is refused before its pixels are allocated). Remote URLs
are refused by name: the runtime fetches nothing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from pathlib import Path
from typing import Any

import numpy as np

from turbospark_core.errors import OptionError

MAX_IMAGE_BYTES = 32 * 1024 * 1024
MAX_IMAGE_PIXELS = 4096 * 4096
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_DATA_URL = re.compile(r"^data:(image/[a-zA-Z0-9.+-]+)?(;[^,]*)?,", re.DOTALL)


class ImageError(OptionError):
    """An image input that cannot be used: undecodable, too large, remote, or of an unknown kind."""


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - the `vision` extra installs it
        msg = "image input needs Pillow; install it with `pip install turbospark[vision]`"
        raise ImageError(msg) from None
    return Image


def load_image(image: Any, *, max_pixels: int = MAX_IMAGE_PIXELS, where: str = "image") -> np.ndarray:
    """Decode ``image`` to an RGB ``uint8`` array ``[H, W, 3]``.

    Args:
        image: A path (``str`` or ``Path``), encoded bytes, a ``data:`` URL
            (base64), a PIL image, or a numpy array (``[H, W]`` grey,
            ``[H, W, 3]`` RGB or ``[H, W, 4]`` RGBA; uint8, or float in [0, 1]).
        max_pixels: The most pixels (H x W) accepted.
        where: How error messages name the input (``"messages[0].content[1]"``).

    Raises:
        ImageError: A remote URL, an unreadable or undecodable input, or one
            over the bounds, naming ``where`` and the fix.
    """
    if isinstance(image, np.ndarray):
        return _from_array(image, max_pixels, where)
    if isinstance(image, (bytes, bytearray, memoryview)):
        return _decode(bytes(image), max_pixels, where)
    if isinstance(image, str) and image.startswith("data:"):
        return _decode(decode_data_url(image, where), max_pixels, where)
    if isinstance(image, str):
        scheme = _SCHEME.match(image)
        if scheme and scheme.group(1).lower() != "file":
            msg = (
                f"{where}: remote image URL {image[:80]!r} refused: turbospark fetches nothing; "
                "download it and pass the file, its bytes, or a base64 data: URL"
            )
            raise ImageError(msg)
        return _read_path(Path(image[7:] if scheme else image), max_pixels, where)
    if isinstance(image, Path):
        return _read_path(image, max_pixels, where)
    if hasattr(image, "convert") and hasattr(image, "size"):  # a PIL image
        return _from_pil(image, max_pixels, where)
    msg = (
        f"{where}: an image must be a path, bytes, a data: URL, a PIL image or a numpy array "
        f"(got {type(image).__name__})"
    )
    raise ImageError(msg)


def decode_data_url(url: str, where: str = "image") -> bytes:
    """The bytes of a base64 ``data:`` URL (bounded by ``MAX_IMAGE_BYTES``)."""
    m = _DATA_URL.match(url[:256])
    if m is None or ";base64" not in (m.group(2) or ""):
        msg = f"{where}: a data: URL must be base64 ('data:image/png;base64,...'), got {url[:40]!r}"
        raise ImageError(msg)
    payload = url[m.end() :]
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        msg = f"{where}: the data: URL holds more than {MAX_IMAGE_BYTES} bytes; send a smaller image"
        raise ImageError(msg)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        msg = f"{where}: the data: URL's base64 payload is malformed"
        raise ImageError(msg) from None


def _read_path(path: Path, max_pixels: int, where: str) -> np.ndarray:
    try:
        size = path.stat().st_size
    except OSError as e:
        msg = f"{where}: cannot read image file {str(path)!r} ({e.strerror or e})"
        raise ImageError(msg) from None
    if not path.is_file():
        raise ImageError(f"{where}: {str(path)!r} is not a file")
    if size > MAX_IMAGE_BYTES:
        msg = f"{where}: image file {str(path)!r} is {size} bytes, over the {MAX_IMAGE_BYTES}-byte bound"
        raise ImageError(msg)
    with path.open("rb") as f:
        return _decode(f.read(MAX_IMAGE_BYTES + 1), max_pixels, f"{where} ({path.name})")


def _decode(data: bytes, max_pixels: int, where: str) -> np.ndarray:
    if len(data) > MAX_IMAGE_BYTES:
        msg = f"{where}: the image is {len(data)} bytes, over the {MAX_IMAGE_BYTES}-byte bound"
        raise ImageError(msg)
    pil = _pil()
    try:
        im = pil.open(io.BytesIO(data))
        _check_pixels(im.size[1], im.size[0], max_pixels, where)  # from the header, before decoding
        im.load()
    except ImageError:
        raise
    except Exception as e:  # noqa: BLE001 - Pillow raises many kinds for bad data
        msg = f"{where}: the image cannot be decoded ({type(e).__name__}: {str(e)[:200]}); send a PNG or JPEG"
        raise ImageError(msg) from None
    return _from_pil(im, max_pixels, where)


def _from_pil(im: Any, max_pixels: int, where: str) -> np.ndarray:
    _check_pixels(im.size[1], im.size[0], max_pixels, where)
    try:
        rgb = im.convert("RGB")
    except Exception as e:  # noqa: BLE001
        msg = f"{where}: the image cannot be converted to RGB ({type(e).__name__}: {str(e)[:200]})"
        raise ImageError(msg) from None
    out: np.ndarray = np.asarray(rgb, dtype=np.uint8).copy()
    return out


def _from_array(a: np.ndarray, max_pixels: int, where: str) -> np.ndarray:
    if a.ndim == 2:
        a = np.repeat(a[:, :, None], 3, axis=2)
    if a.ndim != 3 or a.shape[2] not in (3, 4) or 0 in a.shape:
        msg = f"{where}: a numpy image must be [H, W], [H, W, 3] or [H, W, 4] (got shape {a.shape})"
        raise ImageError(msg)
    _check_pixels(a.shape[0], a.shape[1], max_pixels, where)
    a = a[:, :, :3]
    if a.dtype == np.uint8:
        return np.ascontiguousarray(a)
    if np.issubdtype(a.dtype, np.floating):
        if not np.isfinite(a).all() or a.min() < 0 or a.max() > 1:
            raise ImageError(f"{where}: a float numpy image must hold finite values in [0, 1]")
        return np.ascontiguousarray(np.round(a * 255).astype(np.uint8))
    raise ImageError(f"{where}: a numpy image must be uint8 or float in [0, 1] (got {a.dtype})")


def _check_pixels(height: int, width: int, max_pixels: int, where: str) -> None:
    if height < 1 or width < 1:
        raise ImageError(f"{where}: the image is empty ({height} x {width})")
    if height * width > max_pixels:
        msg = (
            f"{where}: the image is {height} x {width} = {height * width} pixels, over the "
            f"{max_pixels}-pixel bound; send a smaller image"
        )
        raise ImageError(msg)


def image_key(rgb: np.ndarray) -> str:
    """A content hash of a decoded image (shape and pixels): sessions reuse a prefix only with the same images."""
    h = hashlib.sha256(str(rgb.shape).encode())
    h.update(np.ascontiguousarray(rgb).tobytes())
    return h.hexdigest()


def resize_rgb(rgb: np.ndarray, height: int, width: int, resample: int = 3) -> np.ndarray:
    """``rgb`` resized to ``height`` x ``width`` with PIL (``resample``: PIL's filter code, 3 = bicubic).

    PIL antialiases when shrinking and returns uint8, as the Hugging Face PIL
    image processors do.
    """
    if rgb.shape[:2] == (height, width):
        return rgb
    pil = _pil()
    out = pil.fromarray(rgb).resize((width, height), resample=resample)
    resized: np.ndarray = np.asarray(out, dtype=np.uint8).copy()
    return resized
