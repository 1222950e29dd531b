"""Tests of the tensor index: bounded header read, storage checks, quantization table."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core.errors import InstallError, TensorStorageError
from turbospark_core.manifest import WEIGHTS, load_manifest
from turbospark_core.tensor_index import QuantSpec, TensorIndex, build_index, read_header


def _index(root: Path) -> TensorIndex:
    m = load_manifest(root)
    return build_index(root / WEIGHTS, m.files[WEIGHTS].size, m.quantization)


# ------------------------------------------------------------------ good installs
def test_index_of_a_float_install(f32_install: Path) -> None:
    index = _index(f32_install)
    loaded = mx.load(str(f32_install / WEIGHTS))
    assert set(index.tensors) == set(loaded)
    assert index.quantization == {}
    for name, info in index.tensors.items():
        assert info.dtype == "F32"
        assert info.shape == tuple(loaded[name].shape)
        assert info.nbytes == loaded[name].nbytes
    assert index.stored_bytes() == sum(a.nbytes for a in loaded.values())
    assert index.float_bytes(4) == index.stored_bytes()
    assert index.float_bytes(2) * 2 == index.stored_bytes()


def test_index_of_a_quantized_install(q4_install: Path, f32_install: Path) -> None:
    index = _index(q4_install)
    q = index.quantization["model.layers.0.self_attn.q_proj"]
    assert (q.bits, q.group_size, q.mode) == (4, 64, "affine")
    assert index.tensors["model.layers.0.self_attn.q_proj.weight"].dtype == "U32"
    assert index.logical_shape("model.layers.0.self_attn.q_proj") == (64, 64)
    assert index.logical_shape("model.embed_tokens") == (512, 64)
    assert index.logical_shape("model.layers.0.mlp.down_proj") == (64, 160)  # 160 % 64: kept float
    # Unpacked to float32, the q4 install is as large as the float32 one.
    assert index.float_bytes(4) == _index(f32_install).stored_bytes()
    assert index.stored_bytes() < _index(f32_install).stored_bytes()


def test_read_header_drops_metadata(f32_install: Path) -> None:
    size = (f32_install / WEIGHTS).stat().st_size
    header, data_bytes = read_header(f32_install / WEIGHTS, size)
    assert "__metadata__" not in header
    assert data_bytes == max(e["data_offsets"][1] for e in header.values())


# ------------------------------------------------------------------ quantization entries
@pytest.mark.parametrize(
    "raw",
    [
        {"bits": 7, "group_size": 64},
        {"bits": 4, "group_size": 64, "mode": "nf4"},
        {"bits": 4, "group_size": 48},
        {"bits": 1, "group_size": 32},
        {"bits": "4", "group_size": 64},
        {"bits": 8, "group_size": 32, "mode": "mxfp4"},
        {"group_size": 64},
    ],
)
def test_quant_spec_without_a_kernel_is_refused_by_name(raw, names) -> None:
    with pytest.raises(TensorStorageError) as e:
        QuantSpec.from_manifest("model.layers.3.mlp.up_proj", raw)
    names(e, "'model.layers.3.mlp.up_proj'", "no kernel", "turbospark convert --quantize")


def test_quant_spec_not_an_object(names) -> None:
    with pytest.raises(TensorStorageError) as e:
        QuantSpec.from_manifest("lm_head", [4, 64])
    names(e, "'lm_head'", "must be an object")


@pytest.mark.parametrize(("bits", "group"), [(2, 32), (3, 64), (4, 128), (5, 32), (6, 64), (8, 128)])
def test_quant_spec_with_a_kernel(bits: int, group: int) -> None:
    spec = QuantSpec.from_manifest("x", {"bits": bits, "group_size": group})
    assert (spec.bits, spec.group_size, spec.mode) == (bits, group, "affine")
    assert QuantSpec.from_manifest("x", {"bits": 4, "group_size": 32, "mode": "mxfp4"}).mode == "mxfp4"


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_narrow_groups_of_16_are_a_turbospark_storage(bits: int) -> None:
    """GGUF K-quants with 16-wide sub-blocks: the native CPU kernels multiply them, MLX's kernels do not."""
    spec = QuantSpec.from_manifest("x", {"bits": bits, "group_size": 16})
    assert (spec.bits, spec.group_size, spec.mode) == (bits, 16, "affine")
    assert not spec.mlx_kernels
    assert QuantSpec(bits=bits, group_size=32).mlx_kernels
    assert QuantSpec(bits=4, group_size=32, mode="mxfp4").mlx_kernels


@pytest.mark.parametrize(
    "raw",
    [{"bits": 4, "group_size": 16, "mode": "mxfp4"}, {"bits": 4, "group_size": 8}, {"bits": 6, "group_size": 24}],
)
def test_other_narrow_layouts_are_refused_naming_what_is_served(raw, names) -> None:
    with pytest.raises(TensorStorageError) as e:
        QuantSpec.from_manifest("model.layers.0.mlp.down_proj", raw)
    names(e, "'model.layers.0.mlp.down_proj'", "no kernel", "groups [16, 32, 64, 128]", "mxfp4 4-bit group 32")


def test_stored_bytes_count_the_matrices_held_unpacked(q4_install: Path) -> None:
    index = _index(q4_install)
    base = "model.layers.0.self_attn.q_proj"
    rows, cols = index.logical_shape(base)
    packed = sum(index.tensors[f"{base}.{leaf}"].nbytes for leaf in ("weight", "scales", "biases"))
    unpacked = index.stored_bytes(unpack=lambda b, spec: b == base, itemsize=2)
    assert unpacked == index.stored_bytes() - packed + rows * cols * 2
    assert index.stored_bytes(unpack=lambda b, spec: False) == index.stored_bytes()


@pytest.mark.parametrize(
    "entry", [{"bits": 7, "group_size": 64, "mode": "affine"}, {"bits": 4, "group_size": 64, "mode": "nf4"}]
)
def test_install_with_an_unservable_quantization_is_refused_at_open(q4_copy: Path, tamper, entry, names) -> None:
    base = "model.layers.1.self_attn.v_proj"
    tamper.edit(q4_copy, lambda raw: raw["quantization"].__setitem__(base, entry))
    with pytest.raises(TensorStorageError) as e:
        turbospark_core.open(q4_copy)
    names(e, repr(base), f"{entry['bits']}-bit", entry["mode"], "no kernel")


@pytest.mark.parametrize("group", [16, 32, 128])
def test_scales_that_do_not_fit_the_group_are_refused_at_open(q4_copy: Path, tamper, group: int, names) -> None:
    """A group entry that disagrees with the scales would otherwise broadcast silently (16) or fail deep in MLX."""
    base = "model.layers.0.self_attn.q_proj"
    tamper.edit(q4_copy, lambda raw: raw["quantization"][base].__setitem__("group_size", group))
    with pytest.raises(TensorStorageError) as e:
        turbospark_core.open(q4_copy)
    names(e, repr(base), "scales [64, 1]", f"groups of {group}", "turbospark convert")


def test_packed_weight_without_a_quantization_entry(q4_copy: Path, tamper, names) -> None:
    base = "model.layers.0.mlp.gate_proj"
    tamper.edit(q4_copy, lambda raw: raw["quantization"].pop(base))
    with pytest.raises(TensorStorageError) as e:
        turbospark_core.open(q4_copy)
    names(e, f"'{base}.weight'", "packed U32", f"no quantization for '{base}'", "turbospark convert")


def test_quantization_entry_for_a_matrix_without_scales(install: Path, tamper, names) -> None:
    tamper.edit(install, lambda raw: raw.__setitem__("quantization", {"model.norm": {"bits": 4, "group_size": 64}}))
    with pytest.raises(TensorStorageError) as e:
        turbospark_core.open(install)
    names(e, "'model.norm'", "'.scales'", "turbospark convert")


def test_affine_matrix_without_biases_is_refused_by_name(q4_copy: Path, tamper, names) -> None:
    base = "model.layers.0.mlp.up_proj"
    tensors = tamper.load_weights(q4_copy)
    del tensors[f"{base}.biases"]
    tamper.put_weights(q4_copy, tensors)
    with pytest.raises(TensorStorageError) as e:
        turbospark_core.open(q4_copy)
    names(e, f"'{base}'", "'.biases'", "turbospark convert")


# ------------------------------------------------------------------ dtypes with no kernel
@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.int32, np.int8])
def test_tensor_dtype_without_a_kernel_is_refused_by_name(install: Path, tamper, dtype, names) -> None:
    tensors = tamper.load_weights(install)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(dtype)
    tamper.put_weights(install, tensors)
    with pytest.raises(TensorStorageError) as e:
        turbospark_core.open(install)
    st = {np.float64: "F64", np.int64: "I64", np.int32: "I32", np.int8: "I8"}[dtype]
    names(e, "'model.norm.weight'", f"storage dtype {st}", "no kernel", "turbospark convert --dtype")


def test_the_first_offending_tensor_is_named(install: Path, tamper, names) -> None:
    tensors = tamper.load_weights(install)
    for name in ("model.norm.weight", "lm_head.weight"):
        tensors[name] = tensors[name].astype(np.float64)
    tamper.put_weights(install, tensors)
    with pytest.raises(TensorStorageError) as e:
        turbospark_core.open(install)
    names(e, "'lm_head.weight'")  # sorted first
    assert "model.norm.weight" not in str(e.value)


# ------------------------------------------------------------------ corrupt headers
def test_header_length_larger_than_the_file(install: Path, tamper, names) -> None:
    _header, data = tamper.weights_header(install)
    blob = struct.pack("<Q", 1 << 60) + b"{}" + data
    tamper.put_file(install, WEIGHTS, blob)
    with pytest.raises(InstallError) as e:
        turbospark_core.open(install)
    names(e, WEIGHTS, f"{1 << 60}-byte header", f"{len(blob)}-byte file", "turbospark convert")


def test_weights_shorter_than_a_header(install: Path, tamper, names) -> None:
    tamper.put_file(install, WEIGHTS, b"\x01\x02\x03")
    with pytest.raises(InstallError) as e:
        turbospark_core.open(install)
    names(e, WEIGHTS, "too short")


@pytest.mark.parametrize("body", [b"{garbage", b"\xff\xfe\xfd\xfc", b""])
def test_header_garbage_json(install: Path, tamper, body: bytes, names) -> None:
    _, data = tamper.weights_header(install)
    tamper.put_weights_raw(install, None, data, header_bytes=body)
    with pytest.raises(InstallError) as e:
        turbospark_core.open(install)
    names(e, WEIGHTS, "unreadable safetensors header", "turbospark convert")


def test_header_not_an_object(install: Path, tamper, names) -> None:
    _, data = tamper.weights_header(install)
    tamper.put_weights_raw(install, [1, 2], data)
    with pytest.raises(InstallError) as e:
        turbospark_core.open(install)
    names(e, WEIGHTS, "not a JSON object")


def _last(header: dict) -> str:
    return max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])


def test_data_offsets_run_past_the_data(install: Path, tamper, names) -> None:
    header, data = tamper.weights_header(install)
    name = _last(header)
    start, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [start + 8, end + 8]  # same length, 8 bytes past the end
    tamper.put_weights_raw(install, header, data)
    with pytest.raises(InstallError) as e:
        turbospark_core.open(install)
    names(e, repr(name), f"[{start + 8}, {end + 8})", f"{len(data)}-byte data section", "turbospark convert")


def test_data_offsets_disagree_with_the_shape(install: Path, tamper, names) -> None:
    header, data = tamper.weights_header(install)
    entry = header["model.norm.weight"]
    entry["shape"] = [entry["shape"][0] * 2]
    tamper.put_weights_raw(install, header, data)
    with pytest.raises(InstallError) as e:
        turbospark_core.open(install)
    names(e, "'model.norm.weight'", "F32[128]", "does not fit")


@pytest.mark.parametrize(
    "patch",
    [
        pytest.param({"dtype": None}, id="dtype-null"),
        pytest.param({"data_offsets": None}, id="offsets-null"),
        pytest.param("drop-shape", id="no-shape"),
        pytest.param("not-a-dict", id="entry-is-a-list"),
        pytest.param({"data_offsets": [0]}, id="offsets-one-number"),
        pytest.param({"data_offsets": [0, "x"]}, id="offsets-not-ints"),
        pytest.param({"shape": "ab"}, id="shape-a-string"),
        pytest.param({"shape": [-4]}, id="shape-negative"),
        pytest.param({"dtype": ["F32"]}, id="dtype-a-list"),
    ],
)
def test_malformed_header_entry_is_refused_by_name(install: Path, tamper, patch, names) -> None:
    header, data = tamper.weights_header(install)
    name = "model.norm.weight"
    if patch == "drop-shape":
        del header[name]["shape"]
    elif patch == "not-a-dict":
        header[name] = [header[name]["dtype"]]
    else:
        header[name].update(patch)
    tamper.put_weights_raw(install, header, data)
    with pytest.raises(InstallError) as e:
        turbospark_core.open(install)
    names(e, repr(name))


def test_header_bound_is_the_file_not_the_claim(tmp_path: Path) -> None:
    """A header length just over the file is refused before any allocation of that size."""
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<Q", 100) + b"{}")
    with pytest.raises(InstallError, match="declares a 100-byte header in a 10-byte file"):
        read_header(path, 10)


def test_logical_shape_round_trips_every_quantized_matrix(q4_install: Path) -> None:
    index = _index(q4_install)
    for base, spec in index.quantization.items():
        rows, cols = index.logical_shape(base)
        scales = index.tensors[f"{base}.scales"].shape
        assert scales == (rows, cols // spec.group_size)
        assert math.prod(index.tensors[f"{base}.weight"].shape) * 32 == rows * cols * spec.bits
