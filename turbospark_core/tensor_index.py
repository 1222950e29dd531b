"""The tensor index: the safetensors header read with a byte bound, and each tensor's storage checked."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from turbospark_core.errors import InstallError, TensorStorageError

MAX_HEADER_BYTES = 64 * 1024 * 1024

# safetensors dtype -> bytes per element, for the storages this runtime reads.
FLOAT_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
PACKED_DTYPES = {"U32": 4, "U8": 1}
QUANT_BITS = {2, 3, 4, 5, 6, 8}
QUANT_GROUPS = {32, 64, 128}  # MLX's own affine groups
# Affine groups narrower than MLX's: GGUF K-quants with 16-wide sub-blocks (Q6_K, Q3_K, Q2_K) stored
# exactly. Same bit stream as MLX's affine layout; the native CPU kernels multiply them, and
# everywhere MLX does the work they are unpacked (turbospark_core.dequant).
NARROW_GROUPS = {16}
MAX_NDIM = 8  # bounds the shape arithmetic of a hostile header


@attrs.frozen(kw_only=True)
class QuantSpec:
    """How a quantized matrix is stored (MLX's quantized kernels)."""

    bits: int
    group_size: int
    mode: str = "affine"

    @property
    def mlx_kernels(self) -> bool:
        """Whether MLX's own quantized kernels (``quantized_matmul``, ``gather_qmm``) take this layout.

        False for the narrow affine groups (:data:`NARROW_GROUPS`), which only
        the native CPU kernels multiply; elsewhere they are unpacked to floats.
        """
        return self.mode != "affine" or self.group_size in QUANT_GROUPS

    @classmethod
    def from_manifest(cls, name: str, raw: Any) -> QuantSpec:
        """Read and check one ``quantization`` entry, refusing by name."""
        if not isinstance(raw, dict):
            msg = f"quantization entry for {name!r} must be an object, got {raw!r}"
            raise TensorStorageError(msg)
        bits, group_size, mode = raw.get("bits"), raw.get("group_size"), raw.get("mode", "affine")
        if not (
            isinstance(bits, int)
            and isinstance(group_size, int)
            and isinstance(mode, str)
            and _has_kernel(mode, bits, group_size)
        ):
            msg = (
                f"tensor {name!r} is stored as {mode!r:.40} {bits!r:.40}-bit with group "
                f"size {group_size!r:.40}, which has no kernel here (affine "
                f"{sorted(QUANT_BITS)}-bit, groups {sorted(NARROW_GROUPS | QUANT_GROUPS)}; mxfp4 4-bit "
                f"group 32); re-convert with `turbospark convert --quantize q4|q8`"
            )
            raise TensorStorageError(msg)
        return cls(bits=bits, group_size=group_size, mode=mode)


def _has_kernel(mode: str, bits: int, group_size: int) -> bool:
    if mode == "affine":
        return bits in QUANT_BITS and group_size in QUANT_GROUPS | NARROW_GROUPS
    return mode == "mxfp4" and (bits, group_size) == (4, 32)


@attrs.frozen(kw_only=True)
class TensorInfo:
    """One tensor in ``model_weights.safetensors``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@attrs.frozen(kw_only=True)
class TensorIndex:
    """Every tensor of the install, and the quantized matrices among them."""

    tensors: dict[str, TensorInfo]
    quantization: dict[str, QuantSpec]

    def logical_shape(self, base: str) -> tuple[int, ...]:
        """Shape of matrix ``base`` (``<base>.weight``) once dequantized."""
        info = self.tensors[f"{base}.weight"]
        quant = self.quantization.get(base)
        if quant is None:
            return info.shape
        return (*info.shape[:-1], info.shape[-1] * 32 // quant.bits)

    def float_bytes(self, itemsize: int = 4, keep: Callable[[str, QuantSpec], bool] | None = None) -> int:
        """Bytes every weight takes once unpacked to ``itemsize``-byte floats.

        ``keep(base, spec)`` says which quantized matrices stay in their stored
        form (counted as stored) rather than being unpacked.
        """
        return self._held_bytes(itemsize, floats=True, unpack=lambda base, spec: keep is None or not keep(base, spec))

    def stored_bytes(self, unpack: Callable[[str, QuantSpec], bool] | None = None, itemsize: int = 4) -> int:
        """Bytes as stored.

        ``unpack(base, spec)`` says which quantized matrices are held unpacked
        to ``itemsize``-byte floats instead (narrow groups where MLX does the work).
        """
        if unpack is None:
            return sum(t.nbytes for t in self.tensors.values())
        return self._held_bytes(itemsize, floats=False, unpack=unpack)

    def _held_bytes(self, itemsize: int, *, floats: bool, unpack: Callable[[str, QuantSpec], bool]) -> int:
        total = 0
        for name, info in self.tensors.items():
            base, _, leaf = name.rpartition(".")
            spec = self.quantization.get(base)
            if spec is None:
                total += math.prod(info.shape) * itemsize if floats else info.nbytes
            elif not unpack(base, spec):
                total += info.nbytes
            elif leaf == "weight":
                total += math.prod(self.logical_shape(base)) * itemsize
        return total


def read_header(path: Path, file_size: int) -> tuple[dict[str, Any], int]:
    """Read a safetensors header, bounded by the file's size.

    Returns:
        The header (without ``__metadata__``) and the data section's size.

    Raises:
        InstallError: The header length is impossible or the JSON is invalid.
    """
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            msg = f"{path.name} is {file_size} bytes, too short for a safetensors header"
            raise InstallError(msg)
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, file_size - 8):
            msg = (
                f"{path.name} declares a {n}-byte header in a {file_size}-byte file; "
                f"the file is corrupt, re-run `turbospark convert`"
            )
            raise InstallError(msg)
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, a 5000-digit integer, a nesting bomb
        msg = f"{path.name} has an unreadable safetensors header ({str(e)[:200]}); re-run `turbospark convert`"
        raise InstallError(msg) from None
    if not isinstance(header, dict):
        msg = f"{path.name} header is not a JSON object; re-run `turbospark convert`"
        raise InstallError(msg)
    header.pop("__metadata__", None)
    return header, file_size - 8 - n


def _is_count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _tensor_info(path: Path, name: str, entry: Any, data_bytes: int) -> TensorInfo:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        msg = f"tensor {name!r:.100} in {path.name} has a malformed header entry: {entry!r:.200}"
        raise InstallError(msg)
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not (
        isinstance(dtype, str)
        and isinstance(shape, list)
        and len(shape) <= MAX_NDIM
        and all(_is_count(n) for n in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_count(n) for n in offsets)
    ):
        msg = (
            f"tensor {name!r:.100} in {path.name} has a malformed header entry: {entry!r:.200} "
            f"(dtype a string, shape a list of at most {MAX_NDIM} counts, data_offsets two counts); "
            f"re-run `turbospark convert`"
        )
        raise InstallError(msg)
    shape, (start, end) = tuple(shape), offsets
    itemsize = FLOAT_DTYPES.get(dtype) or PACKED_DTYPES.get(dtype)
    if itemsize is None:
        msg = (
            f"tensor {name!r} has storage dtype {dtype}, which has no kernel here "
            f"(supported: {sorted(FLOAT_DTYPES)} floats, quantized U32/U8); "
            f"re-convert with `turbospark convert --dtype bfloat16`"
        )
        raise TensorStorageError(msg)
    if not (0 <= start <= end <= data_bytes) or end - start != math.prod(shape) * itemsize:
        msg = (
            f"tensor {name!r} in {path.name}: byte range [{start}, {end}) does not fit "
            f"{dtype}{list(shape)} inside the {data_bytes}-byte data section; the "
            f"install is corrupt, re-run `turbospark convert`"
        )
        raise InstallError(msg)
    return TensorInfo(name=name, dtype=dtype, shape=shape, nbytes=end - start)


def build_index(path: Path, file_size: int, quantization: dict[str, Any]) -> TensorIndex:
    """Index ``model_weights.safetensors`` and check every tensor's storage.

    Args:
        path: The weights file.
        file_size: Its size from the manifest's file table (already checked).
        quantization: The manifest's ``quantization`` section.

    Raises:
        TensorStorageError: Naming the first tensor whose storage has no kernel.
        InstallError: The header is corrupt.
    """
    header, data_bytes = read_header(path, file_size)
    tensors = {n: _tensor_info(path, n, e, data_bytes) for n, e in sorted(header.items())}
    quant = {n: QuantSpec.from_manifest(n, q) for n, q in sorted(quantization.items())}
    _check_quantized(tensors, quant)
    return TensorIndex(tensors=tensors, quantization=quant)


def _check_quantized(tensors: dict[str, TensorInfo], quant: dict[str, QuantSpec]) -> None:
    for name, info in tensors.items():
        base, _, leaf = name.rpartition(".")
        packed = info.dtype in PACKED_DTYPES
        if leaf == "weight" and packed and base not in quant:
            msg = (
                f"tensor {name!r} is packed {info.dtype} but the manifest gives no "
                f"quantization for {base!r}; no kernel can read it, re-run `turbospark convert`"
            )
            raise TensorStorageError(msg)
    for base, spec in quant.items():
        needed = ("weight", "scales", "biases") if spec.mode == "affine" else ("weight", "scales")
        if any(f"{base}.{leaf}" not in tensors for leaf in needed):
            msg = (
                f"quantized matrix {base!r} ({spec.mode} {spec.bits}-bit) lacks one of its "
                f"{', '.join(repr('.' + leaf) for leaf in needed)} tensors; re-run `turbospark convert`"
            )
            raise TensorStorageError(msg)
        flat = [f"{base}.{leaf}" for leaf in ("weight", "scales") if len(tensors[f"{base}.{leaf}"].shape) < 2]
        if flat:
            msg = (
                f"quantized matrix {base!r}: {flat[0]!r} has shape {list(tensors[flat[0]].shape)}, "
                f"but packed matrices have at least two dimensions; re-run `turbospark convert`"
            )
            raise TensorStorageError(msg)
        _check_groups(base, spec, tensors)


def _check_groups(base: str, spec: QuantSpec, tensors: dict[str, TensorInfo]) -> None:
    """Scales (and biases) hold one value per group of the packed rows (a mismatch would broadcast silently)."""
    *rows, words = tensors[f"{base}.weight"].shape
    bits_per_row = words * 32
    expected = (*rows, bits_per_row // spec.bits // spec.group_size)
    for leaf in ("scales", "biases"):
        info = tensors.get(f"{base}.{leaf}")
        if info is None:
            continue
        if bits_per_row % (spec.bits * spec.group_size) or info.shape != expected:
            msg = (
                f"quantized matrix {base!r}: {leaf} {list(info.shape)} do not fit {spec.bits}-bit weights "
                f"{[*rows, words]} in groups of {spec.group_size} (expected {list(expected)}); the install is "
                f"corrupt or its quantization entry was altered, re-run `turbospark convert`"
            )
            raise TensorStorageError(msg)
