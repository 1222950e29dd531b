# Copyright 2026 the turbospark authors. Apache-2.0.
"""Gemma 4 image preprocessing, as its processor config says: resize rule, rescale, normalization, patches.

The steps follow transformers' ``Gemma4ImageProcessorPil``: an optional
aspect-ratio-preserving bicubic resize (sides multiples of
``pooling_kernel_size * patch_size``, at most ``max_soft_tokens * k^2`` patches),
``pixel * rescale_factor`` (computed in float64, then float32), an optional
``(x - mean) / std``, then patches in raster order, each ``patch_size^2 * 3``
values ordered (row in patch, column in patch, channel).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np

from turbospark_core.family import ArchConfigError, float_problem, int_problems, resize_rgb

from turbospark_gemma4.errors import ImageInputError

MAX_SOFT_TOKENS = 1 << 16  # soft tokens one image may take
_INTS = {"patch_size": 64, "pooling_kernel_size": 64, "max_soft_tokens": MAX_SOFT_TOKENS}


class ProcessorConfigError(ArchConfigError):
    """A gemma4 processor config with a missing or out-of-range setting."""


@attrs.frozen(kw_only=True)
class ImageProcessing:
    """The settings of a gemma4 ``preprocessor_config.json`` the preprocessing reads."""

    patch_size: int
    pooling_kernel_size: int
    max_soft_tokens: int
    do_resize: bool
    resample: int
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, float, float] = attrs.field(converter=tuple)
    image_std: tuple[float, float, float] = attrs.field(converter=tuple)

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2

    @property
    def side_multiple(self) -> int:
        return self.pooling_kernel_size * self.patch_size

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ImageProcessing:
        """Read a ``preprocessor_config.json`` (or ``processor_config.json``'s ``image_processor``).

        Missing keys take transformers' ``Gemma4ImageProcessor`` defaults.

        Raises:
            ProcessorConfigError: A setting has the wrong type or range, named.
        """
        cfg = config.get("image_processor", config)
        if not isinstance(cfg, dict):
            raise ProcessorConfigError("gemma4 processor config: 'image_processor' must be an object")
        values: dict[str, Any] = {
            "patch_size": cfg.get("patch_size", 16),
            "pooling_kernel_size": cfg.get("pooling_kernel_size", 3),
            "max_soft_tokens": cfg.get("max_soft_tokens", 280),
            "do_resize": cfg.get("do_resize", True),
            "resample": cfg.get("resample", 3),
            "do_rescale": cfg.get("do_rescale", True),
            "rescale_factor": cfg.get("rescale_factor", 1 / 255),
            "do_normalize": cfg.get("do_normalize", False),
            "image_mean": cfg.get("image_mean", [0.0, 0.0, 0.0]),
            "image_std": cfg.get("image_std", [1.0, 1.0, 1.0]),
        }
        problems = _problems(values)
        if problems:
            raise ProcessorConfigError("gemma4 processor config: " + "; ".join(problems))
        values["image_mean"] = [float(v) for v in values["image_mean"]]
        values["image_std"] = [float(v) for v in values["image_std"]]
        return cls(**values)


def _problems(values: dict[str, Any]) -> list[str]:
    out = int_problems(values, _INTS)
    out += [f"{key!r} must be true or false" for key in ("do_resize", "do_rescale", "do_normalize")
            if not isinstance(values[key], bool)]  # fmt: skip
    resample = values["resample"]
    if not isinstance(resample, int) or isinstance(resample, bool) or not 0 <= resample <= 5:
        out.append(f"'resample' must be a PIL resampling filter 0-5 (got {resample!r})")
    if p := float_problem(values, "rescale_factor", 1.0):
        out.append(p)
    for key in ("image_mean", "image_std"):
        v = values[key]
        if not (isinstance(v, list) and len(v) == 3 and all(_finite(x) for x in v)):
            out.append(f"{key!r} must be 3 finite numbers (got {v!r})")
        elif key == "image_std" and any(x == 0 for x in v):
            out.append("'image_std' must not contain 0")
    return out


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def target_size(height: int, width: int, cfg: ImageProcessing) -> tuple[int, int]:
    """The size the resize rule gives an ``height x width`` image (transformers' aspect-ratio rule).

    The largest sides, multiples of ``s = pooling_kernel_size * patch_size``, that keep
    the aspect ratio and at most ``max_patches`` patches; a side that rounds to 0
    takes ``s`` and the other the aspect ratio, capped at ``max_soft_tokens * s``.
    The ideal sides multiply to the pixel budget, which is at least ``s^2``, so they
    never both round to 0 and the result never exceeds the budget.
    """
    target_px = cfg.max_patches * cfg.patch_size**2
    factor = math.sqrt(target_px / (height * width))
    side = cfg.side_multiple
    h = math.floor(factor * height / side) * side
    w = math.floor(factor * width / side) * side
    longest = (cfg.max_patches // cfg.pooling_kernel_size**2) * side
    if h == 0:
        h, w = side, min(math.floor(width / height) * side, longest)
    elif w == 0:
        h, w = min(math.floor(height / width) * side, longest), side
    return h, w


@attrs.frozen(kw_only=True, eq=False)
class ImagePatches:
    """One image as the tower takes it: its real patches (raster order) and their grid."""

    patches: np.ndarray  # [rows * cols, patch_size^2 * 3] float32
    rows: int  # patches per column (height / patch_size)
    cols: int  # patches per row (width / patch_size)
    num_soft_tokens: int

    def positions(self) -> np.ndarray:
        """``(x, y)`` = (column, row) of each patch, ``[rows * cols, 2]`` int32."""
        gx, gy = np.meshgrid(np.arange(self.cols), np.arange(self.rows), indexing="xy")
        return np.stack([gx, gy], axis=-1).reshape(-1, 2).astype(np.int32)

    def padded(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """The processor's ``pixel_values`` and ``image_position_ids``: padded to ``length`` rows (0, -1)."""
        n = self.patches.shape[0]
        pixels = np.zeros((length, self.patches.shape[1]), dtype=np.float32)
        pixels[:n] = self.patches
        positions = np.full((length, 2), -1, dtype=np.int32)
        positions[:n] = self.positions()
        return pixels, positions


def prepare(image: np.ndarray, cfg: ImageProcessing) -> ImagePatches:
    """Preprocess one decoded RGB image, ``[H, W, 3]`` uint8.

    Raises:
        ImageInputError: Not an ``[H, W, 3]`` uint8 array; without resizing, a side that is
            not a multiple of ``pooling_kernel_size * patch_size`` or more patches than
            ``max_soft_tokens * pooling_kernel_size^2``.
    """
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        shape = getattr(image, "shape", None)
        dtype = getattr(image, "dtype", type(image).__name__)
        raise ImageInputError(f"gemma4 preprocessing takes an [H, W, 3] uint8 RGB image (got {shape} {dtype})")
    height, width = image.shape[:2]
    if height == 0 or width == 0:
        raise ImageInputError(f"image {height}x{width} is empty")
    if cfg.do_resize:
        size = target_size(height, width, cfg)
        if size != (height, width):
            image = resize_rgb(image, size[0], size[1], cfg.resample)
            height, width = size
    side = cfg.side_multiple
    if height % side or width % side:
        msg = (f"image {height}x{width}: with do_resize false both sides must be multiples of "
               f"pooling_kernel_size * patch_size = {side}; resize or crop it first")  # fmt: skip
        raise ImageInputError(msg)
    p = cfg.patch_size
    rows, cols = height // p, width // p
    if rows * cols > cfg.max_patches:
        msg = (f"image {height}x{width} has {rows * cols} patches, more than max_soft_tokens * "
               f"pooling_kernel_size^2 = {cfg.max_patches}; use a smaller image")  # fmt: skip
        raise ImageInputError(msg)
    x = image.astype(np.float64)
    x = (x * cfg.rescale_factor).astype(np.float32) if cfg.do_rescale else x.astype(np.float32)
    if cfg.do_normalize:
        mean = np.asarray(cfg.image_mean, dtype=np.float32)
        std = np.asarray(cfg.image_std, dtype=np.float32)
        x = (x - mean) / std
    patches = x.reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, p * p * 3)
    k2 = cfg.pooling_kernel_size**2
    return ImagePatches(patches=np.ascontiguousarray(patches), rows=rows, cols=cols,
                         num_soft_tokens=rows * cols // k2)  # fmt: skip


def from_processor_output(
    pixel_values: np.ndarray, position_ids: np.ndarray, pooling_kernel_size: int
) -> ImagePatches:
    """One image of a processor's padded output (``pixel_values[i]``, ``image_position_ids[i]``).

    Raises:
        ImageInputError: The real rows (positions not -1) are not a raster-ordered grid.
    """
    real = position_ids[:, 0] >= 0
    n = int(real.sum())
    if n == 0:
        raise ImageInputError("processor output has no real patch (every position is -1)")
    rows, cols = int(position_ids[:n, 1].max()) + 1, int(position_ids[:n, 0].max()) + 1
    image = ImagePatches(patches=np.ascontiguousarray(pixel_values[:n], dtype=np.float32), rows=rows, cols=cols,
                          num_soft_tokens=n // pooling_kernel_size**2)  # fmt: skip
    if rows * cols != n or real[n:].any() or not np.array_equal(position_ids[:n], image.positions()):
        raise ImageInputError("processor output: the real patches are not a raster-ordered rows x cols grid first")
    return image


def expand_placeholders(ids: list[int], soft_tokens: list[int], image: int, boi: int, eoi: int) -> list[int]:
    """The processor's expansion: the i-th ``image`` id becomes ``boi``, ``image`` x ``soft_tokens[i]``, ``eoi``.

    Raises:
        ImageInputError: The prompt has not exactly one placeholder per image.
    """
    slots = [i for i, t in enumerate(ids) if t == image]
    if len(slots) != len(soft_tokens):
        msg = (f"the prompt has {len(slots)} image placeholders (id {image}) for {len(soft_tokens)} images; "
               f"put one image part in the messages per image")  # fmt: skip
        raise ImageInputError(msg)
    out: list[int] = []
    start = 0
    for slot, n in zip(slots, soft_tokens, strict=True):
        out += [*ids[start:slot], boi, *([image] * n), eoi]
        start = slot + 1
    return out + ids[start:]
