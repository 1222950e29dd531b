"""Bounded reads of tensor slices: the bytes of the rank's share, exactly what MLX loads of the whole tensor."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core.distributed.reader import ShardReader
from turbospark_core.errors import InstallError
from turbospark_core.manifest import WEIGHTS, load_manifest
from turbospark_core.tensor_index import TensorInfo, build_index


def _reader(path: Path) -> tuple[ShardReader, dict[str, mx.array], dict[str, TensorInfo]]:
    m = load_manifest(path)
    index = build_index(m.path(WEIGHTS), m.files[WEIGHTS].size, m.quantization)
    whole = cast(dict[str, mx.array], mx.load(str(m.path(WEIGHTS))))
    return ShardReader(m.path(WEIGHTS), m.files[WEIGHTS].size), whole, index.tensors


@pytest.mark.parametrize("variant", ["float32", "bf16"])
def test_slices_equal_the_whole_tensor_sliced(turbospark_install: Callable[..., Path], variant: str) -> None:
    reader, whole, infos = _reader(turbospark_install("qwen3_5", variant))
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"  # [128, 64]
    full = whole[name]
    read = reader.read(infos[name])
    assert read.dtype == full.dtype and mx.array_equal(read, full)
    rows = reader.read(infos[name], 0, [(0, 16), (32, 48), (64, 96)])
    assert mx.array_equal(rows, mx.concatenate([full[0:16], full[32:48], full[64:96]]))
    cols = reader.read(infos[name], 1, [(32, 64)])
    assert mx.array_equal(cols, full[:, 32:64])
    conv = "model.layers.0.linear_attn.conv1d.weight"  # [128, 1, 4]
    assert mx.array_equal(reader.read(infos[conv], 0, [(64, 128)]), whole[conv][64:128])
    itemsize = full.itemsize
    assert reader.bytes_read == (128 * 64 + 64 * 64 + 128 * 32) * itemsize + 64 * 4 * whole[conv].itemsize


def test_a_file_shorter_than_its_table_is_refused(turbospark_install: Callable[..., Path], tmp_path: Path) -> None:
    m = load_manifest(turbospark_install("llama"))
    short = tmp_path / WEIGHTS
    short.write_bytes(m.path(WEIGHTS).read_bytes())
    with pytest.raises(InstallError, match=r"cannot map \d+ bytes"):
        ShardReader(short, m.files[WEIGHTS].size + 4096)


def test_shapes_and_bytes_of_a_slice(turbospark_install: Callable[..., Path]) -> None:
    reader, _, infos = _reader(turbospark_install("llama"))
    info = infos["model.layers.0.mlp.down_proj.weight"]  # [64, 160] float32
    shape = ShardReader.shape_of(info, 1, [(80, 160)])
    assert shape == (64, 80) and ShardReader.nbytes_of(info, shape) == 64 * 80 * 4
    assert np.array(reader.read(info, 1, [(80, 160)])).shape == shape
