"""Hugging Face MXFP4 ``*_blocks``/``*_scales`` pairs as MLX ``mxfp4`` quantized matrices, bit for bit.

A Hugging Face MXFP4 checkpoint (``quantization_config.quant_method ==
"mxfp4"``) stores a matrix ``X`` ``[..., rows, cols]`` as two uint8 tensors:

- ``X_blocks`` ``[..., rows, cols // 32, 16]``: byte ``j`` of a 32-element
  block holds element ``2j`` in its low nibble and ``2j + 1`` in its high one
  (e2m1 codes);
- ``X_scales`` ``[..., rows, cols // 32]``: one e8m0 exponent per block
  (value = fp4 * 2 ** (scale - 127)).

MLX's ``mxfp4`` mode packs 8 e2m1 codes per little-endian uint32 (element
``i`` at bits ``4 * i``) with the same uint8 e8m0 scales per group of 32, so
the blocks read as uint32 words are already MLX's weight: nothing is
dequantized.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from turbospark_core.convert.records import AffineQuantized
from turbospark_core.errors import ConversionError

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
GROUP = 32
BLOCK_BYTES = GROUP // 2


def is_mxfp4(config: dict[str, Any]) -> bool:
    """Whether ``config.json`` declares a Hugging Face MXFP4 checkpoint."""
    q = config.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


def base_name(name: str) -> str | None:
    """``X`` for ``X_blocks`` or ``X_scales``, else ``None``."""
    for suffix in (BLOCKS_SUFFIX, SCALES_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def from_blocks(name: str, blocks: mx.array, scales: mx.array) -> AffineQuantized:
    """The MLX ``mxfp4`` matrix ``name`` from its Hugging Face blocks and scales.

    Args:
        name: The matrix's name (``X``), for error messages.
        blocks: ``X_blocks``, uint8 ``[..., rows, cols // 32, 16]``.
        scales: ``X_scales``, uint8 ``[..., rows, cols // 32]``.

    Returns:
        ``weight`` uint32 ``[..., rows, cols // 8]``, ``scales`` uint8
        ``[..., rows, cols // 32]``, no biases (lazy arrays).

    Raises:
        ConversionError: Naming the tensor whose dtype or shape is not MXFP4.
    """
    for part, arr in (("blocks", blocks), ("scales", scales)):
        if arr.dtype != mx.uint8:
            msg = f"MXFP4 tensor '{name}_{part}' is {arr.dtype}, expected uint8"
            raise ConversionError(msg)
    if blocks.ndim < 3 or blocks.shape[-1] != BLOCK_BYTES or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        msg = (
            f"MXFP4 tensors '{name}_blocks' {list(blocks.shape)} and '{name}_scales' "
            f"{list(scales.shape)} do not pair: expected [..., rows, groups, {BLOCK_BYTES}] "
            f"and [..., rows, groups]"
        )
        raise ConversionError(msg)
    *lead, groups, _ = blocks.shape
    words = mx.view(blocks.reshape(*lead, groups * BLOCK_BYTES), mx.uint32)
    return AffineQuantized(weight=words, scales=scales, biases=None, bits=4, group_size=GROUP, mode="mxfp4")


def check_pairs(names: set[str]) -> None:
    """Refuse, by name, an ``X_blocks`` tensor without its ``X_scales``."""
    for name in sorted(names):
        if name.endswith(BLOCKS_SUFFIX) and name[: -len(BLOCKS_SUFFIX)] + SCALES_SUFFIX not in names:
            msg = f"MXFP4 tensor {name!r} has no matching '_scales' tensor; the checkpoint is incomplete"
            raise ConversionError(msg)


def is_pair_part(name: str, names: set[str]) -> bool:
    """Whether ``name`` is the blocks or scales half of an MXFP4 pair in ``names``."""
    base = base_name(name)
    return base is not None and base + BLOCKS_SUFFIX in names and base + SCALES_SUFFIX in names
