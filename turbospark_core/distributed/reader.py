"""Bounded reads of one rank's share of ``model_weights.safetensors``: only the bytes it holds are read.

The file is mapped read-only with the length the manifest's file table gives
(a shorter file is refused), and each tensor's byte range comes from the
header the tensor index already validated. A share along the first axis is
one contiguous range; along the last axis it is one slice of every row.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np

from turbospark_core.errors import InstallError
from turbospark_core.tensor_index import TensorInfo, read_header

_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32, "U8": np.uint8}
Range = tuple[int, int]


class ShardReader:
    """Reads whole tensors or row / column ranges of them, counting the bytes read.

    Args:
        path: ``model_weights.safetensors``.
        file_size: Its size from the manifest's file table (already checked against the file).
    """

    def __init__(self, path: Path, file_size: int) -> None:
        header, data_bytes = read_header(path, file_size)
        self._offsets = {name: int(entry["data_offsets"][0]) for name, entry in header.items()}
        self._data_start = file_size - data_bytes
        try:
            self._map = np.memmap(path, dtype=np.uint8, mode="r", shape=(file_size,))
        except (OSError, ValueError) as e:
            msg = f"{path}: cannot map {file_size} bytes ({e}); the file shrank after open, re-run `turbospark convert`"
            raise InstallError(msg) from None
        self.bytes_read = 0

    def _view(self, info: TensorInfo) -> np.ndarray:
        start = self._data_start + self._offsets[info.name]
        raw = self._map[start : start + info.nbytes]
        return raw.view(_NUMPY[info.dtype]).reshape(info.shape)

    def read(self, info: TensorInfo, axis: int = 0, ranges: list[Range] | None = None) -> mx.array:
        """Tensor ``info`` (or only ``ranges`` along ``axis``) as an MLX array in its stored dtype."""
        view = self._view(info)
        if ranges is None:
            parts = [view]
        else:
            index: list[slice] = [slice(None)] * view.ndim
            parts = []
            for a, b in ranges:
                index[axis] = slice(a, b)
                parts.append(view[tuple(index)])
        data = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)
        data = np.ascontiguousarray(data)  # the bytes are read here
        self.bytes_read += data.nbytes
        arr = mx.array(data)
        return arr.view(mx.bfloat16) if info.dtype == "BF16" else arr

    @staticmethod
    def shape_of(info: TensorInfo, axis: int, ranges: list[Range]) -> tuple[int, ...]:
        """The shape ``read(info, axis, ranges)`` returns."""
        shape = list(info.shape)
        shape[axis] = sum(b - a for a, b in ranges)
        return tuple(shape)

    @staticmethod
    def nbytes_of(info: TensorInfo, shape: tuple[int, ...]) -> int:
        """Bytes a slice of ``info`` shaped ``shape`` takes."""
        return math.prod(shape) * np.dtype(_NUMPY[info.dtype]).itemsize
