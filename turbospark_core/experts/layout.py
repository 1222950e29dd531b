"""The ``experts.bin`` layout: what the converter writes and the open validates.

``experts.bin`` holds one contiguous, aligned record per (layer, expert) with
every projection of that expert (weights, scales, biases, expert biases); the
manifest's ``experts`` section describes it (:class:`ExpertLayout`).
"""

from __future__ import annotations

import math
import re
from itertools import pairwise
from typing import Any

import attrs

from turbospark_core import native
from turbospark_core.errors import InstallError, TensorStorageError
from turbospark_core.tensor_index import FLOAT_DTYPES, PACKED_DTYPES, QuantSpec

ALIGNMENT = 4096
LEAVES = ("weight", "scales", "biases", "bias")
SECTION_VERSION = 1
MAX_LAYERS = 1 << 16
MAX_EXPERTS = 1 << 16
MAX_DIM = 1 << 24
STAGING_RECORDS = 8  # records a streamed store reads per batch of misses
ITEMSIZE = {**FLOAT_DTYPES, **PACKED_DTYPES}
# Install names of routed-expert tensors: <layer prefix ending in ".experts">.<projection>.<leaf>
EXPERT_TENSOR = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>[^.]+)\.(?P<leaf>weight|scales|biases|bias)$")


def _fail(where: str, what: str) -> InstallError:
    return InstallError(f"{where}: {what}; the install is corrupt, re-run `turbospark convert`")


def _count(raw: Any, key: str, where: str, *, lo: int = 0, hi: int = 1 << 62) -> int:
    value = raw.get(key) if isinstance(raw, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise _fail(where, f"{key!r} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


@attrs.frozen(kw_only=True)
class ExpertTensor:
    """One tensor of an expert record: where it starts in the record, its dtype and per-expert shape."""

    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes it takes in the record."""
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    def to_json(self) -> dict[str, Any]:
        """The entry as written in the manifest."""
        return {"offset": self.offset, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, raw: Any, where: str) -> ExpertTensor:
        """Read and bound-check one tensor entry."""
        dtype = raw.get("dtype") if isinstance(raw, dict) else None
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            msg = f"{where} has storage dtype {dtype!r}, which has no kernel here (supported: {sorted(ITEMSIZE)})"
            raise TensorStorageError(msg)
        shape = raw.get("shape")
        if not isinstance(shape, list) or not 1 <= len(shape) <= 2:
            raise _fail(where, f"'shape' must be a list of 1 or 2 sizes, got {shape!r}")
        dims = tuple(_count({"n": n}, "n", f"{where} shape", lo=1, hi=MAX_DIM) for n in shape)
        return cls(offset=_count(raw, "offset", where), dtype=dtype, shape=dims)


@attrs.frozen(kw_only=True)
class ProjectionLayout:
    """One projection (``gate_proj``...) of every expert in a layer."""

    name: str
    quant: QuantSpec | None
    tensors: dict[str, ExpertTensor]

    @property
    def out_features(self) -> int:
        """Rows of the matrix."""
        return self.tensors["weight"].shape[0]

    @property
    def in_features(self) -> int:
        """Columns of the matrix once dequantized."""
        cols = self.tensors["weight"].shape[-1]
        return cols if self.quant is None else cols * 32 // self.quant.bits

    def unpacked(self, unpack: bool) -> bool:
        """Whether the projection is held unpacked: never where the native kernels multiply
        its layout as stored (the CPU); else when the policy unpacks, and always at a narrow
        group (MLX's ``gather_qmm`` has no kernel for it)."""
        if self.quant is None:
            return unpack
        return not native.keeps(self.quant) and (unpack or not self.quant.mlx_kernels)

    def held_bytes(self, unpack: bool) -> int:
        """Bytes one expert's projection takes in memory (float32 when unpacked, else as stored)."""
        if not self.unpacked(unpack):
            return sum(t.nbytes for t in self.tensors.values())
        bias = self.tensors.get("bias")
        return 4 * (self.out_features * self.in_features + (0 if bias is None else math.prod(bias.shape)))

    def to_json(self) -> dict[str, Any]:
        """The entry as written in the manifest."""
        quant = None if self.quant is None else attrs.asdict(self.quant)
        return {"quantization": quant, "tensors": {leaf: t.to_json() for leaf, t in self.tensors.items()}}

    @classmethod
    def from_json(cls, name: str, raw: Any, where: str) -> ProjectionLayout:
        """Read one projection and check its tensors agree with each other."""
        if not isinstance(raw, dict) or not isinstance(raw.get("tensors"), dict):
            raise _fail(where, f"projection entry must hold a 'tensors' object, got {raw!r}")
        unknown = sorted(set(raw["tensors"]) - set(LEAVES))
        if unknown or "weight" not in raw["tensors"]:
            raise _fail(where, f"tensors must include 'weight' and be among {LEAVES}, got {sorted(raw['tensors'])}")
        quant = raw.get("quantization")
        spec = None if quant is None else QuantSpec.from_manifest(where, quant)
        tensors = {leaf: ExpertTensor.from_json(t, f"{where}.{leaf}") for leaf, t in raw["tensors"].items()}
        layout = cls(name=name, quant=spec, tensors=tensors)
        layout.check(where)
        return layout

    def check(self, where: str) -> None:
        """Shapes and dtypes fit a (quantized) matrix ``[out, in]`` and a bias ``[out]``."""
        w, out = self.tensors["weight"], self.out_features
        expected: dict[str, tuple[tuple[int, ...], set[str]]] = {"bias": ((out,), set(FLOAT_DTYPES))}
        if self.quant is None:
            expected["weight"] = ((out, w.shape[-1]), set(FLOAT_DTYPES))
        else:
            groups = (self.in_features // self.quant.group_size,)
            expected["weight"] = ((out, w.shape[-1]), {"U32"})
            scale_types = {"U8"} if self.quant.mode == "mxfp4" else set(FLOAT_DTYPES)
            expected["scales"] = ((out, *groups), scale_types)
            if self.quant.mode == "affine":
                expected["biases"] = ((out, *groups), set(FLOAT_DTYPES))
            if "scales" not in self.tensors or (self.quant.mode == "affine") != ("biases" in self.tensors):
                needs = "'scales' and 'biases'" if self.quant.mode == "affine" else "'scales' and no 'biases'"
                raise _fail(where, f"{self.quant.mode} quantization needs {needs}")
        for leaf, t in self.tensors.items():
            shape, dtypes = expected.get(leaf, ((), set()))
            if t.shape != shape or t.dtype not in dtypes:
                raise _fail(f"{where}.{leaf}", f"{t.dtype}{list(t.shape)} does not fit {sorted(dtypes)}{list(shape)}")


@attrs.frozen(kw_only=True)
class LayerLayout:
    """Every expert of one routed layer: ``num_experts`` records of ``stride`` bytes from ``offset``."""

    prefix: str
    offset: int
    num_experts: int
    stride: int
    projections: dict[str, ProjectionLayout]

    @property
    def end(self) -> int:
        """The byte after the layer's last record."""
        return self.offset + self.num_experts * self.stride

    def held_bytes(self, unpack: bool) -> int:
        """Bytes one expert of this layer takes in memory."""
        return sum(p.held_bytes(unpack) for p in self.projections.values())

    def to_json(self) -> dict[str, Any]:
        """The entry as written in the manifest."""
        return {
            "offset": self.offset,
            "num_experts": self.num_experts,
            "stride": self.stride,
            "projections": {name: p.to_json() for name, p in self.projections.items()},
        }

    @classmethod
    def from_json(cls, prefix: str, raw: Any, alignment: int, where: str) -> LayerLayout:
        """Read one layer and check its records: aligned, in bounds, tensors inside and apart."""
        where = f"{where} layer {prefix!r}"
        projections = raw.get("projections") if isinstance(raw, dict) else None
        if not isinstance(projections, dict) or not projections:
            raise _fail(where, f"'projections' must be a non-empty object, got {projections!r}")
        layer = cls(
            prefix=prefix,
            offset=_count(raw, "offset", where),
            num_experts=_count(raw, "num_experts", where, lo=1, hi=MAX_EXPERTS),
            stride=_count(raw, "stride", where, lo=1, hi=1 << 40),
            projections={n: ProjectionLayout.from_json(n, p, f"{prefix}.{n}") for n, p in projections.items()},
        )
        if layer.offset % alignment or layer.stride % alignment:
            raise _fail(where, f"offset {layer.offset} and stride {layer.stride} must be multiples of {alignment}")
        spans = sorted(
            (t.offset, t.offset + t.nbytes, f"{p.name}.{leaf}")
            for p in layer.projections.values()
            for leaf, t in p.tensors.items()
        )
        for (_, end, a), (start, _, b) in pairwise(spans):
            if start < end:
                raise _fail(where, f"tensors {a} and {b} overlap in the expert record")
        if spans[-1][1] > layer.stride:
            raise _fail(
                where, f"tensor {spans[-1][2]} ends at byte {spans[-1][1]}, past the {layer.stride}-byte record"
            )
        return layer


@attrs.frozen(kw_only=True)
class ExpertLayout:
    """The manifest's ``experts`` section: where each routed layer's experts live in ``experts.bin``."""

    alignment: int
    top_k: int | None
    layers: dict[str, LayerLayout]

    def to_section(self) -> dict[str, Any]:
        """The manifest's ``experts`` section."""
        return {
            "version": SECTION_VERSION,
            "alignment": self.alignment,
            "top_k": self.top_k,
            "layers": {prefix: layer.to_json() for prefix, layer in self.layers.items()},
        }

    @classmethod
    def from_section(cls, section: dict[str, Any], file_size: int, where: str) -> ExpertLayout:
        """Read and validate the section against ``experts.bin``'s size from the file table.

        Raises:
            InstallError: A malformed entry, a record outside the file, overlapping layers,
                or a ``top_k`` larger than a layer's expert count.
            TensorStorageError: A storage type with no kernel, named.
        """
        where = f"{where} experts section"
        if section.get("version") != SECTION_VERSION:
            raise _fail(where, f"version {section.get('version')!r} is not {SECTION_VERSION}")
        alignment = _count(section, "alignment", where, lo=1, hi=1 << 20)
        top_k = section.get("top_k")
        if top_k is not None:
            top_k = _count(section, "top_k", where, lo=1, hi=MAX_EXPERTS)
        raw_layers = section.get("layers")
        if not isinstance(raw_layers, dict) or not 0 < len(raw_layers) <= MAX_LAYERS:
            raise _fail(where, f"'layers' must be an object with 1 to {MAX_LAYERS} entries")
        layers = {p: LayerLayout.from_json(p, raw, alignment, where) for p, raw in raw_layers.items()}
        layout = cls(alignment=alignment, top_k=top_k, layers=layers)
        layout._check_bounds(file_size, where)
        return layout

    def _check_bounds(self, file_size: int, where: str) -> None:
        spans = sorted((layer.offset, layer.end, prefix) for prefix, layer in self.layers.items())
        for (_, end, a), (start, _, b) in pairwise(spans):
            if start < end:
                raise _fail(where, f"layers {a!r} and {b!r} overlap in experts.bin")
        if spans[-1][1] > file_size:
            raise _fail(
                where, f"layer {spans[-1][2]!r} ends at byte {spans[-1][1]}, past the {file_size}-byte experts.bin"
            )
        fewest = min(layer.num_experts for layer in self.layers.values())
        if self.top_k is not None and self.top_k > fewest:
            raise _fail(where, f"top_k={self.top_k} exceeds the {fewest} experts of a layer")

    @property
    def max_experts(self) -> int:
        """The most experts any routed layer has."""
        return max(layer.num_experts for layer in self.layers.values())

    def slot_bytes(self, slots: int, unpack: bool) -> int:
        """Memory for ``slots`` experts per layer (each layer capped at its expert count)."""
        return sum(min(slots, layer.num_experts) * layer.held_bytes(unpack) for layer in self.layers.values())

    def staging_bytes(self, slots: int) -> int:
        """The read buffer of a streamed store."""
        return min(slots, STAGING_RECORDS) * max(layer.stride for layer in self.layers.values())
