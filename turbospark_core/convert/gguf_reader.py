"""Read GGUF files as Hugging Face-oriented tensors, mapping block quants exactly onto affine groups."""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import overload

import attrs
import mlx.core as mx
import numpy as np
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from turbospark_core.convert.records import AffineQuantized, SourceTensor
from turbospark_core.errors import ConversionError

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4

# GGUF metadata value types: scalar numpy dtypes (little-endian), then string and array.
_SCALAR_DTYPES: dict[int, np.dtype] = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("?"),
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
_STRING = 8
_ARRAY = 9

_MISSING = object()


# ---------------------------------------------------------------------------
# Header parsing
# ---------------------------------------------------------------------------


class _Cursor:
    """A bounds-checked little-endian reader over the file's bytes."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.path = path
        self.pos = 0

    def take(self, n: int, what: str) -> int:
        """Reserve ``n`` bytes at the cursor and return their start offset."""
        if n < 0 or self.pos + n > len(self.buf):
            msg = (
                f"GGUF file {self.path} is truncated or corrupt: {what} needs {n} bytes at "
                f"offset {self.pos} but the file has {len(self.buf)}; re-download or re-export it"
            )
            raise ConversionError(msg)
        start = self.pos
        self.pos += n
        return start

    def scalar(self, dtype: np.dtype, what: str) -> object:
        """Read one scalar of ``dtype`` as a plain Python value."""
        start = self.take(dtype.itemsize, what)
        return np.frombuffer(self.buf[start : start + dtype.itemsize], dtype=dtype)[0].item()

    def u32(self, what: str) -> int:
        """Read a uint32."""
        return int(struct.unpack_from("<I", self.buf, self.take(4, what))[0])

    def u64(self, what: str) -> int:
        """Read a uint64."""
        return int(struct.unpack_from("<Q", self.buf, self.take(8, what))[0])

    def string(self, what: str) -> str:
        """Read a length-prefixed UTF-8 string."""
        n = self.u64(what)
        start = self.take(n, what)
        try:
            return self.buf[start : start + n].decode("utf-8")
        except UnicodeDecodeError as exc:
            msg = f"GGUF file {self.path}: {what} at offset {start} is not valid UTF-8 ({exc}); the file is corrupt"
            raise ConversionError(msg) from exc

    def value(self, vtype: int, what: str) -> object:
        """Read one metadata value of GGUF value type ``vtype``."""
        if vtype in _SCALAR_DTYPES:
            return self.scalar(_SCALAR_DTYPES[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            return self.array(what)
        msg = f"GGUF file {self.path}: {what} has unknown value type {vtype}; the file is corrupt or too new"
        raise ConversionError(msg)

    def array(self, what: str) -> list[object]:
        """Read a typed array; numeric arrays are decoded in one vectorised step."""
        vtype = self.u32(what)
        count = self.u64(what)
        if vtype in _SCALAR_DTYPES:
            dtype = _SCALAR_DTYPES[vtype]
            start = self.take(count * dtype.itemsize, what)
            raw = self.buf[start : start + count * dtype.itemsize]
            values: list[object] = np.frombuffer(raw, dtype=dtype).tolist()
            return values
        # Every string or nested array takes at least 8 bytes: bound the count first.
        return [self.value(vtype, what) for _ in self.bounded_range(count, 8, what)]

    def bounded_range(self, count: int, min_size: int, what: str) -> range:
        """range(count), once the rest of the file can hold ``count`` items of ``min_size`` bytes."""
        self.take(count * min_size, what)
        self.pos -= count * min_size
        return range(count)


@attrs.frozen(kw_only=True)
class _TensorInfo:
    """Where a tensor lives in the file and how it is encoded."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]  # ggml order: dims[0] is the contiguous one
    offset: int  # absolute byte offset in the file

    @property
    def type_name(self) -> str:
        """The GGML type name, e.g. ``"Q4_1"``."""
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"UNKNOWN_{self.ggml_type}"

    @property
    def shape(self) -> tuple[int, ...]:
        """The numpy (row-major, Hugging Face) shape."""
        return tuple(reversed(self.dims))

    @property
    def n_bytes(self) -> int | None:
        """Bytes of data, or None when the type is unknown."""
        sizes = _quant_sizes(self.ggml_type)
        if sizes is None:
            return None
        block, type_size = sizes
        return math.prod(self.dims) // block * type_size


def _quant_sizes(ggml_type: int) -> tuple[int, int] | None:
    """(block size, bytes per block) of a GGML type, or None if unknown."""
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None


def _read_header(cur: _Cursor) -> tuple[dict[str, object], list[tuple[str, int, tuple[int, ...], int]]]:
    """Parse magic, version, metadata and tensor infos (offsets relative to the data section)."""
    if len(cur.buf) < 4 or cur.buf[:4] != _MAGIC:
        msg = f"{cur.path} is not a GGUF file (no 'GGUF' magic); pass a .gguf file"
        raise ConversionError(msg)
    cur.pos = 4
    version = cur.u32("the version")
    if version not in _SUPPORTED_VERSIONS:
        msg = f"GGUF file {cur.path} has version {version}; only versions 2 and 3 (little-endian) are supported"
        raise ConversionError(msg)
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the metadata count")
    metadata = _read_metadata(cur, n_kv)
    infos = [_read_tensor_info(cur, i) for i in cur.bounded_range(n_tensors, 24, "tensor infos")]
    return metadata, infos


def _read_metadata(cur: _Cursor, count: int) -> dict[str, object]:
    """Read ``count`` key/value pairs."""
    metadata: dict[str, object] = {}
    for _ in cur.bounded_range(count, 12, "metadata"):
        key = cur.string("a metadata key")
        if key in metadata:
            msg = f"GGUF file {cur.path} repeats metadata key {key!r}; the file is corrupt"
            raise ConversionError(msg)
        metadata[key] = cur.value(cur.u32(f"metadata {key!r}"), f"metadata {key!r}")
    return metadata


def _read_tensor_info(cur: _Cursor, index: int) -> tuple[str, int, tuple[int, ...], int]:
    """Read one tensor info: (name, ggml type, ggml dims, relative offset)."""
    name = cur.string(f"tensor info #{index}")
    n_dims = cur.u32(f"tensor {name!r}")
    if not 1 <= n_dims <= _MAX_DIMS:
        msg = (
            f"GGUF file {cur.path}: tensor {name!r} claims {n_dims} dimensions (1..{_MAX_DIMS} allowed);"
            " the file is corrupt"
        )
        raise ConversionError(msg)
    dims = tuple(cur.u64(f"tensor {name!r}") for _ in range(n_dims))
    return name, cur.u32(f"tensor {name!r}"), dims, cur.u64(f"tensor {name!r}")


def _data_start(cur: _Cursor, metadata: dict[str, object]) -> int:
    """Offset of the tensor data section (the header end, aligned)."""
    align = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        msg = f"GGUF file {cur.path} has general.alignment={align!r}; it must be a positive power of two"
        raise ConversionError(msg)
    return -(-cur.pos // align) * align


def _check_extent(info: _TensorInfo, path: Path, file_size: int) -> None:
    """Refuse a tensor whose data would run past the end of the file."""
    sizes = _quant_sizes(info.ggml_type)
    if sizes is not None and info.dims[0] % sizes[0]:
        msg = (
            f"GGUF file {path}: tensor {info.name!r} ({info.type_name}) has row length {info.dims[0]}, not a "
            f"multiple of its block size {sizes[0]}"
        )
        raise ConversionError(msg)
    n_bytes = info.n_bytes
    if n_bytes is not None and info.offset + n_bytes > file_size:
        msg = (
            f"GGUF file {path} is truncated: tensor {info.name!r} ends at byte {info.offset + n_bytes} "
            f"but the file has {file_size} bytes; re-download or re-export it"
        )
        raise ConversionError(msg)


# ---------------------------------------------------------------------------
# Public source
# ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class GGUFSource:
    """An opened GGUF file: its metadata, and its tensors read on demand.

    Attributes:
        path: The file.
        architecture: ``general.architecture``; arch-scoped keys are prefixed with it.
        metadata: Every key/value field as plain Python values (lists for arrays).
    """

    path: Path
    architecture: str
    metadata: dict[str, object] = attrs.field(repr=False)
    _infos: dict[str, _TensorInfo] = attrs.field(repr=False)

    def arch_value(self, key: str, default: object = _MISSING) -> object:
        """Return ``metadata[f"{architecture}.{key}"]``.

        Args:
            key: The key without the architecture prefix, e.g. ``"block_count"``.
            default: Returned when the key is absent; without it, absence raises.

        Returns:
            The metadata value.

        Raises:
            ConversionError: The key is absent and no default was given.
        """
        full = f"{self.architecture}.{key}"
        if full in self.metadata:
            return self.metadata[full]
        if default is _MISSING:
            msg = f"GGUF file {self.path} lacks metadata key {full!r}; re-export it with a newer llama.cpp converter"
            raise ConversionError(msg)
        return default

    def tensor_names(self) -> list[str]:
        """Tensor names in file order."""
        return list(self._infos)

    def needs_dequantize(self, name: str) -> bool:
        """Whether tensor ``name`` has no exact affine form (reading it needs ``dequantize``)."""
        return self._infos[name].type_name not in EXACT_TYPES

    def tensor_types(self) -> dict[str, str]:
        """Map each tensor name to its GGML type name (e.g. ``"Q4_1"``)."""
        return {name: info.type_name for name, info in self._infos.items()}

    def read_tensor(self, name: str, *, dequantize: bool = False) -> SourceTensor:
        """Read one tensor in Hugging Face orientation (ggml ``[ne0, ne1]`` -> ``(ne1, ne0)``).

        Args:
            name: The GGUF tensor name.
            dequantize: Convert types with no exact affine form to float32
                instead of refusing them.

        Returns:
            F32/F16 as numpy arrays, BF16 as an ``mx.array``, the block types of
            :data:`EXACT_TYPES` as exact :class:`AffineQuantized` matrices (groups of
            32; of 16 for Q6_K/Q3_K/Q2_K), others (with ``dequantize``) as float32 numpy arrays.

        Raises:
            ConversionError: Unknown name, unreadable data, or a type that needs
                ``dequantize``.
        """
        info = self._infos.get(name)
        if info is None:
            msg = f"GGUF file {self.path} has no tensor {name!r}; see tensor_names() for what it holds"
            raise ConversionError(msg)
        return SourceTensor(name=name, data=_decode(info, self._read_raw(info), self.path, dequantize))

    def read_raw(self, name: str) -> np.ndarray:
        """A tensor's stored bytes as uint8 rows ``(..., rows, bytes_per_row)`` (for checks with gguf.quants).

        Raises:
            ConversionError: Unknown name or unreadable data.
        """
        info = self._infos.get(name)
        if info is None:
            msg = f"GGUF file {self.path} has no tensor {name!r}; see tensor_names() for what it holds"
            raise ConversionError(msg)
        return self._read_raw(info).reshape(_byte_shape(info))

    def tensors(self, *, dequantize: bool = False) -> Iterator[SourceTensor]:
        """Yield every tensor in file order (see :meth:`read_tensor`).

        Args:
            dequantize: Passed to :meth:`read_tensor`.

        Yields:
            One :class:`SourceTensor` per tensor.
        """
        for name in self._infos:
            yield self.read_tensor(name, dequantize=dequantize)

    def _read_raw(self, info: _TensorInfo) -> np.ndarray:
        """The tensor's bytes as a flat uint8 array."""
        n_bytes = info.n_bytes
        if n_bytes is None:
            msg = (
                f"GGUF tensor {info.name!r} in {self.path} has GGML type {info.ggml_type}, unknown to this gguf "
                "library; it cannot be converted"
            )
            raise ConversionError(msg)
        buf = np.empty(n_bytes, dtype=np.uint8)
        with self.path.open("rb") as fh:
            fh.seek(info.offset)
            got = fh.readinto(buf.data)
        if got != n_bytes:
            msg = (
                f"GGUF file {self.path} is truncated: tensor {info.name!r} has {got} of {n_bytes} bytes; re-download it"
            )
            raise ConversionError(msg)
        return buf


def open_gguf(path: str | Path) -> GGUFSource:
    """Open a GGUF file and parse its header (tensor data is read lazily).

    Args:
        path: The ``.gguf`` file.

    Returns:
        The parsed source.

    Raises:
        ConversionError: The path is missing, not a GGUF file, truncated or corrupt.
    """
    path = Path(path)
    try:
        with path.open("rb") as fh:
            size = path.stat().st_size
            if size < 4:
                msg = f"{path} is not a GGUF file ({size} bytes); pass a .gguf file"
                raise ConversionError(msg)
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(_Cursor(buf, path), size)
    except OSError as exc:
        msg = f"cannot read GGUF file {path}: {exc}"
        raise ConversionError(msg) from exc
    except RecursionError as exc:
        msg = f"GGUF file {path} nests metadata arrays too deeply; the file is corrupt"
        raise ConversionError(msg) from exc


def _parse(cur: _Cursor, size: int) -> GGUFSource:
    """Build a GGUFSource from the header at ``cur``."""
    metadata, raw_infos = _read_header(cur)
    start = _data_start(cur, metadata)
    infos: dict[str, _TensorInfo] = {}
    for name, ggml_type, dims, rel in raw_infos:
        if name in infos:
            msg = f"GGUF file {cur.path} has two tensors named {name!r}; the file is corrupt"
            raise ConversionError(msg)
        infos[name] = _TensorInfo(name=name, ggml_type=ggml_type, dims=dims, offset=start + rel)
        _check_extent(infos[name], cur.path, size)
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        msg = f"GGUF file {cur.path} lacks a string general.architecture; it cannot be converted"
        raise ConversionError(msg)
    return GGUFSource(path=cur.path, architecture=arch, metadata=metadata, infos=infos)


# ---------------------------------------------------------------------------
# Tensor decoding
# ---------------------------------------------------------------------------

_NUMPY_TYPES: dict[str, str] = {
    "F64": "<f8",
    "I8": "<i1",
    "I16": "<i2",
    "I32": "<i4",
    "I64": "<i8",
}


def _decode(
    info: _TensorInfo, raw: np.ndarray, path: Path, dequantize: bool
) -> np.ndarray | mx.array | AffineQuantized:
    """Turn a tensor's raw bytes into its SourceTensor payload."""
    kind = info.type_name
    if kind in _FLOAT_DECODERS:
        return _FLOAT_DECODERS[kind](raw, info.shape)
    if kind in _AFFINE_DECODERS:  # a quantized vector reads as its exact float32 values
        return _AFFINE_DECODERS[kind](_blocks(info, raw)) if len(info.shape) >= 2 else _dequantize(info, raw, path)
    if not dequantize:
        msg = (
            f"GGUF tensor {info.name!r} in {path} is stored as {kind}, which has no exact affine "
            f"form (exact: {', '.join(sorted(EXACT_TYPES))}); convert without --strict "
            "to dequantize it to float"
        )
        raise ConversionError(msg)
    if kind in _NUMPY_TYPES:
        return raw.view(_NUMPY_TYPES[kind]).astype(np.float32).reshape(info.shape)
    return _dequantize(info, raw, path)


def _from_f32(raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """F32 bytes as a float32 array."""
    return raw.view("<f4").astype(np.float32, copy=False).reshape(shape)


def _from_f16(raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """F16 bytes as a float16 array."""
    return raw.view("<f2").astype(np.float16, copy=False).reshape(shape)


def _from_bf16(raw: np.ndarray, shape: tuple[int, ...]) -> mx.array:
    """BF16 bytes as an MLX bfloat16 array (numpy has no bfloat16)."""
    return mx.array(raw.view("<u2").astype(np.uint16, copy=False).reshape(shape)).view(mx.bfloat16)


_FLOAT_DECODERS: dict[str, Callable[[np.ndarray, tuple[int, ...]], np.ndarray | mx.array]] = {
    "F32": _from_f32,
    "F16": _from_f16,
    "BF16": _from_bf16,
}


def _dequantize(info: _TensorInfo, raw: np.ndarray, path: Path) -> np.ndarray:
    """Float32 values of a block-quantized tensor via gguf.quants."""
    qtype = GGMLQuantizationType(info.ggml_type)
    try:
        values = quants.dequantize(raw.reshape(_byte_shape(info)), qtype)
    except NotImplementedError as exc:
        msg = (
            f"GGUF tensor {info.name!r} in {path} is stored as {info.type_name}, which the installed gguf "
            "library cannot dequantize; upgrade gguf"
        )
        raise ConversionError(msg) from exc
    return np.asarray(values, dtype=np.float32).reshape(info.shape)


def _byte_shape(info: _TensorInfo) -> tuple[int, ...]:
    """Numpy shape of the raw bytes: rows of whole blocks."""
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
    return (*info.shape[:-1], info.shape[-1] // block * type_size)


def _blocks(info: _TensorInfo, raw: np.ndarray) -> np.ndarray:
    """Raw bytes as ``(..., rows, blocks_per_row, bytes_per_block)``."""
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
    return raw.reshape(*info.shape[:-1], info.shape[-1] // block, type_size)


def _f16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 stored at byte ``start`` of every block, shape ``(..., blocks)``."""
    return np.ascontiguousarray(blocks[..., start : start + 2]).view("<f2")[..., 0].astype(np.float16, copy=False)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """GGML 4-bit block order: byte j low nibble = element j, high nibble = element j + 16."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack ``(..., rows, groups, group_size)`` codes into MLX uint32 words.

    MLX reads each row as one little-endian bit stream: element ``i`` occupies
    bits ``[i * bits, (i + 1) * bits)`` (so 3-, 5- and 6-bit codes straddle words).
    """
    flat = q.reshape(*q.shape[:-2], -1).astype(np.uint8, copy=False)
    packed: np.ndarray
    if bits == 8:
        packed = flat
    elif bits == 4:
        packed = flat[..., 0::2] | (flat[..., 1::2] << 4)
    else:
        stream = np.unpackbits(flat[..., None], axis=-1, bitorder="little")[..., :bits]
        packed = np.packbits(stream.reshape(*flat.shape[:-1], -1), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32, copy=False)


def _exact_in_f16(values: np.ndarray) -> bool:
    """Whether every float32 value survives a round trip through float16."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.array_equal(values.astype(np.float16).astype(np.float32), values))


def _affine(q: np.ndarray, scale: np.ndarray, bias: np.ndarray, bits: int) -> AffineQuantized:
    """Assemble an AffineQuantized from codes ``(..., rows, groups, group_size)`` and per-group scale and bias.

    Scales/biases are float16 when every value is exact there, else float32.
    """
    scale32, bias32 = scale.astype(np.float32), bias.astype(np.float32)
    dtype = np.float16 if _exact_in_f16(scale32) and _exact_in_f16(bias32) else np.float32
    return AffineQuantized(
        weight=_pack(q, bits),
        scales=scale32.astype(dtype),
        biases=bias32.astype(dtype),
        bits=bits,
        group_size=q.shape[-1],
    )


def _from_q8_0(blocks: np.ndarray) -> AffineQuantized:
    """Q8_0 (d, 32 x int8): value = d * q  ->  8-bit, q + 128, scale d, bias -128 d."""
    d = _f16_field(blocks, 0)
    return _affine(blocks[..., 2:] ^ np.uint8(0x80), d, d.astype(np.float32) * -128, bits=8)


def _from_q4_0(blocks: np.ndarray) -> AffineQuantized:
    """Q4_0 (d, 16 bytes of nibbles): value = d * (q - 8)  ->  4-bit, scale d, bias -8 d."""
    d = _f16_field(blocks, 0)
    return _affine(_nibbles(blocks[..., 2:]), d, d.astype(np.float32) * -8, bits=4)


def _from_q4_1(blocks: np.ndarray) -> AffineQuantized:
    """Q4_1 (d, m, 16 bytes of nibbles): value = d * q + m  ->  4-bit, scale d, bias m."""
    return _affine(_nibbles(blocks[..., 4:]), _f16_field(blocks, 0), _f16_field(blocks, 2), bits=4)


def _from_q5_0(blocks: np.ndarray) -> AffineQuantized:
    """Q5_0 (d, 32 high bits, 16 bytes of nibbles): value = d * (q - 16)  ->  5-bit, scale d, bias -16 d.

    Element j takes its fifth bit from bit j of the little-endian uint32 ``qh``.
    """
    d = _f16_field(blocks, 0)
    qh = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")  # (..., blocks, 1)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return _affine(_nibbles(blocks[..., 6:]) | (high << 4), d, d.astype(np.float32) * -16, bits=5)


def _from_q5_1(blocks: np.ndarray) -> AffineQuantized:
    """Q5_1 (d, m, 32 high bits, 16 bytes of nibbles): value = d * q + m  ->  5-bit, scale d, bias m."""
    qh = np.ascontiguousarray(blocks[..., 4:8]).view("<u4")
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return _affine(_nibbles(blocks[..., 8:]) | (high << 4), _f16_field(blocks, 0), _f16_field(blocks, 2), bits=5)


def _q4_k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs of a Q4_K super-block from its 12 packed bytes.

    Sub-blocks 0-3 keep them in the low 6 bits of bytes 0-3 / 4-7; sub-blocks 4-7 take
    their low 4 bits from bytes 8-11 and their top 2 bits from the spare bits of bytes 0-7.
    """
    lo, mid, tail = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([lo & 0x3F, (tail & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([mid & 0x3F, (tail >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scales, mins


def _from_q4_k(blocks: np.ndarray) -> AffineQuantized:
    """Q4_K super-blocks of 256 (d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles).

    Sub-block j (32 values) is ``d * sc_j * q - dmin * m_j``: an affine group of 32 with
    scale ``d * sc_j`` and bias ``-dmin * m_j``, both exact in float32 (11 x 6 bits).
    Within each 64-value chunk, the low nibbles of its 32 bytes come first, then the high.
    """
    qs = blocks[..., 16:144].reshape(*blocks.shape[:-1], 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*blocks.shape[:-1], 8, 32)
    return _k_groups_of_32(blocks, q, bits=4)


def _k_groups_of_32(blocks: np.ndarray, q: np.ndarray, bits: int) -> AffineQuantized:
    """Q4_K/Q5_K codes ``(..., rows, blocks, 8, 32)`` with the super-blocks' d, dmin and 6-bit scales/mins."""
    d = _f16_field(blocks, 0).astype(np.float32)[..., None]
    dmin = _f16_field(blocks, 2).astype(np.float32)[..., None]
    sc, m = _q4_k_scales_mins(blocks[..., 4:16])
    rows = blocks.shape[:-2]
    groups = blocks.shape[-2] * 8
    scale = (d * sc.astype(np.float32)).reshape(*rows, groups)
    bias = -(dmin * m.astype(np.float32)).reshape(*rows, groups)
    return _affine(q.reshape(*rows, groups, 32), scale, bias, bits=bits)


def _crumbs(packed: np.ndarray) -> np.ndarray:
    """2-bit fields of 32-byte runs, K-quant order: ``(..., runs, 32)`` bytes -> ``(..., runs * 4, 32)`` codes.

    Run ``r``'s byte ``l`` holds element ``l`` of chunks ``4r .. 4r + 3`` in its bit pairs 0-1, 2-3, 4-5, 6-7.
    """
    fields = np.stack([(packed >> shift) & 0x03 for shift in (0, 2, 4, 6)], axis=-2)
    return fields.reshape(*packed.shape[:-2], -1, 32)


def _sub_blocks_of_16(q: np.ndarray, scale: np.ndarray, bias: np.ndarray, bits: int) -> AffineQuantized:
    """Codes ``(..., rows, blocks, 256)`` with per-16 ``scale``/``bias`` ``(..., rows, blocks, 16)`` as groups of 16."""
    rows = q.shape[:-2]
    groups = q.shape[-2] * 16
    return _affine(q.reshape(*rows, groups, 16), scale.reshape(*rows, groups), bias.reshape(*rows, groups), bits)


def _from_q6_k(blocks: np.ndarray) -> AffineQuantized:
    """Q6_K super-blocks of 256 (128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d).

    Sub-block j (16 values) is ``d * sc_j * (q - 32)`` with 6-bit ``q``: an affine group of 16
    with scale ``d * sc_j`` and bias ``-32 d sc_j`` (float16 d x int8: exact in float32).
    Each 128-value half takes its low nibbles from 64 bytes (low nibbles first, then high)
    and its top two bits from 32 bytes (bit pairs 0-1, 2-3, 4-5, 6-7 for its four 32-value chunks).
    """
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*lead, 2, 1, 64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-2).reshape(*lead, 8, 32)
    high = _crumbs(blocks[..., 128:192].reshape(*lead, 2, 32))
    q = (low | (high << 4)).reshape(*lead, 256)
    d = _f16_field(blocks, 208).astype(np.float32)[..., None]
    scale = d * np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    return _sub_blocks_of_16(q, scale, scale * -32, bits=6)


def _from_q3_k(blocks: np.ndarray) -> AffineQuantized:
    """Q3_K super-blocks of 256 (32 bytes of high bits, 64 of low bit pairs, 12 bytes of 6-bit scales, d).

    Sub-block j is ``d * (sc_j - 32) * (q - 4)`` with 3-bit ``q`` (its third bit from bit ``j // 2``
    of ``hmask``): scale ``d * (sc_j - 32)``, bias ``-4`` times that. The scales' low nibbles are
    bytes 0-7 (low nibbles for sub-blocks 0-7, high for 8-15), their top bit pairs bytes 8-11.
    """
    lead = blocks.shape[:-1]
    hmask = blocks[..., 0:32].reshape(*lead, 1, 32)
    high = np.concatenate([(hmask >> bit) & 1 for bit in range(8)], axis=-2)  # (..., 8, 32)
    q = (_crumbs(blocks[..., 32:96].reshape(*lead, 2, 32)) | (high << 2)).reshape(*lead, 256)
    packed = blocks[..., 96:108]
    low = np.concatenate([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], axis=-1)
    top = np.concatenate([(packed[..., 8:12] >> shift) & 0x03 for shift in (0, 2, 4, 6)], axis=-1)
    sc = low | (top << 4)
    d = _f16_field(blocks, 108).astype(np.float32)[..., None]
    scale = d * (sc.astype(np.float32) - 32)
    return _sub_blocks_of_16(q, scale, scale * -4, bits=3)


def _from_q2_k(blocks: np.ndarray) -> AffineQuantized:
    """Q2_K super-blocks of 256 (16 bytes of 4-bit scale / 4-bit min, 64 of bit pairs, d, dmin).

    Sub-block j is ``d * sc_j * q - dmin * m_j`` with 2-bit ``q``: scale ``d * sc_j``,
    bias ``-dmin * m_j`` (both exact in float32).
    """
    lead = blocks.shape[:-1]
    q = _crumbs(blocks[..., 16:80].reshape(*lead, 2, 32)).reshape(*lead, 256)
    packed = blocks[..., 0:16]
    d = _f16_field(blocks, 80).astype(np.float32)[..., None]
    dmin = _f16_field(blocks, 82).astype(np.float32)[..., None]
    return _sub_blocks_of_16(q, d * (packed & 0x0F), -(dmin * (packed >> 4)), bits=2)


def _from_q5_k(blocks: np.ndarray) -> AffineQuantized:
    """Q5_K super-blocks of 256 (d, dmin, 12 bytes of 6-bit scales/mins, 32 bytes of high bits, 128 of nibbles).

    As Q4_K (groups of 32, scale ``d * sc_j``, bias ``-dmin * m_j``) with a fifth bit:
    element ``l`` of sub-block ``j`` takes it from bit ``j`` of high-bit byte ``l``.
    """
    lead = blocks.shape[:-1]
    qh = blocks[..., 16:48].reshape(*lead, 1, 32)
    high = np.concatenate([(qh >> bit) & 1 for bit in range(8)], axis=-2)
    qs = blocks[..., 48:176].reshape(*lead, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*lead, 8, 32)
    return _k_groups_of_32(blocks, low | (high << 4), bits=5)


_AFFINE_DECODERS: dict[str, Callable[[np.ndarray], AffineQuantized]] = {
    "Q8_0": _from_q8_0,
    "Q4_0": _from_q4_0,
    "Q4_1": _from_q4_1,
    "Q5_0": _from_q5_0,
    "Q5_1": _from_q5_1,
    "Q4_K": _from_q4_k,
    "Q5_K": _from_q5_k,
    "Q6_K": _from_q6_k,
    "Q3_K": _from_q3_k,
    "Q2_K": _from_q2_k,
}

#: GGML types read exactly: floats as they are, block types as affine groups of 32
#: (MLX's) or, for the K-quants with 16-wide sub-blocks, 16 (turbospark's narrow groups).
EXACT_TYPES = frozenset(("F32", "F16", "BF16", *_AFFINE_DECODERS))


# ---------------------------------------------------------------------------
# Rotary row order
# ---------------------------------------------------------------------------


@overload
def unpermute_rotary_rows(t: np.ndarray, n_heads: int) -> np.ndarray: ...
@overload
def unpermute_rotary_rows(t: mx.array, n_heads: int) -> mx.array: ...
@overload
def unpermute_rotary_rows(t: AffineQuantized, n_heads: int) -> AffineQuantized: ...


def unpermute_rotary_rows(
    t: np.ndarray | mx.array | AffineQuantized, n_heads: int
) -> np.ndarray | mx.array | AffineQuantized:
    """Undo the GGUF converters' rotary row permutation of a q/k projection.

    GGUF exporters reorder each head's rows from the Hugging Face "rotate half"
    layout (first half, second half) into interleaved pairs; this restores the
    Hugging Face order. Rows are the first axis.

    Args:
        t: The projection weight (or bias) as read from the GGUF file.
        n_heads: Heads sharing the rows (query heads for q, KV heads for k).

    Returns:
        The same kind of object with its rows in Hugging Face order.

    Raises:
        ConversionError: The row count does not split into ``n_heads`` even halves.
    """
    rows = t.shape[0]
    if n_heads <= 0 or rows % (2 * n_heads):
        msg = (
            f"cannot unpermute rotary rows: {rows} rows do not split into {n_heads} heads of even size;"
            " check the head count"
        )
        raise ConversionError(msg)
    order = np.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).swapaxes(1, 2).reshape(-1)
    if isinstance(t, AffineQuantized):
        return t.take_rows(order)
    if isinstance(t, mx.array):
        return t[mx.array(order)]
    reordered: np.ndarray = t[order]
    return reordered
