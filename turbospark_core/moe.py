"""MoE experts held by the core: the ``experts.bin`` layout, its residency plan, resident and streamed banks.

``experts.bin`` holds one contiguous, aligned record per (layer, expert) with
every projection of that expert (weights, scales, biases, expert biases); the
manifest's ``experts`` section describes it (:class:`ExpertLayout`). At open the
core either reads every expert (``resident``) or keeps ``expert_slots`` experts
per routed layer in memory and loads misses with positional reads
(``streamed``, :class:`StreamedExpertBank`). Both give bit-identical results:
slots hold exactly what the resident bank holds, and the same kernels run.
"""

from __future__ import annotations

import math
import os
import re
import time
import weakref
from itertools import pairwise
from pathlib import Path
from typing import Any, Callable

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core.compute import ComputePolicy
from turbospark_core.errors import InstallError, OptionError, TensorStorageError
from turbospark_core.manifest import EXPERTS, Manifest
from turbospark_core.stats import ExpertStats
from turbospark_core.tensor_index import FLOAT_DTYPES, PACKED_DTYPES, QuantSpec
from turbospark_core.weights import ExpertBank, Linear

ALIGNMENT = 4096
LEAVES = ("weight", "scales", "biases", "bias")
RESIDENT, STREAMED = "resident", "streamed"
SECTION_VERSION = 1
MAX_LAYERS = 1 << 16
MAX_EXPERTS = 1 << 16
MAX_DIM = 1 << 24
STAGING_RECORDS = 8  # records read per batch of misses
_ITEMSIZE = {**FLOAT_DTYPES, **PACKED_DTYPES}
_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32, "U8": np.uint8}
_READ_CHUNK = 64 << 20
# Install names of routed-expert tensors: <layer prefix ending in ".experts">.<projection>.<leaf>
EXPERT_TENSOR = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>[^.]+)\.(?P<leaf>weight|scales|biases|bias)$")


def _fail(where: str, what: str) -> InstallError:
    return InstallError(f"{where}: {what}; the install is corrupt, re-run `turbospark convert`")


def _count(raw: Any, key: str, where: str, *, lo: int = 0, hi: int = 1 << 62) -> int:
    value = raw.get(key) if isinstance(raw, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise _fail(where, f"{key!r} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


# ------------------------------------------------------------------ layout records
@attrs.frozen(kw_only=True)
class ExpertTensor:
    """One tensor of an expert record: where it starts in the record, its dtype and per-expert shape."""

    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes it takes in the record."""
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]

    def to_json(self) -> dict[str, Any]:
        """The entry as written in the manifest."""
        return {"offset": self.offset, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, raw: Any, where: str) -> ExpertTensor:
        """Read and bound-check one tensor entry."""
        dtype = raw.get("dtype") if isinstance(raw, dict) else None
        if dtype not in _ITEMSIZE:
            msg = f"{where} has storage dtype {dtype!r}, which has no kernel here (supported: {sorted(_ITEMSIZE)})"
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

    def held_bytes(self, unpack: bool) -> int:
        """Bytes one expert's projection takes in memory (float32 when unpacked, else as stored)."""
        if not unpack:
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
        spans = sorted((t.offset, t.offset + t.nbytes, f"{p.name}.{leaf}") for p in layer.projections.values() for leaf, t in p.tensors.items())
        for (_, end, a), (start, _, b) in pairwise(spans):
            if start < end:
                raise _fail(where, f"tensors {a} and {b} overlap in the expert record")
        if spans[-1][1] > layer.stride:
            raise _fail(where, f"tensor {spans[-1][2]} ends at byte {spans[-1][1]}, past the {layer.stride}-byte record")
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
            raise _fail(where, f"layer {spans[-1][2]!r} ends at byte {spans[-1][1]}, past the {file_size}-byte experts.bin")
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


# ------------------------------------------------------------------ residency plan
@attrs.frozen(kw_only=True)
class ExpertPlan:
    """How the experts are held: every expert (``resident``) or ``slots`` per routed layer (``streamed``)."""

    residency: str
    slots: int
    unpack: bool
    held_bytes: int

    def describe(self) -> str:
        """One line for ``turbospark inspect`` and refusals."""
        form = "float32" if self.unpack else "stored form"
        what = "all experts" if self.residency == RESIDENT else f"{self.slots} slots per routed layer"
        return f"{self.residency}: {what}, {form}, {self.held_bytes / 1e9:.3f} GB"


def refuse_streaming_without_file(tensor_names: Any, residency: str) -> None:
    """``residency='streamed'`` on an install whose experts live in model_weights.safetensors."""
    stacked = sorted(n for n in tensor_names if EXPERT_TENSOR.match(n))
    if residency == STREAMED and stacked:
        msg = (
            f"residency='streamed' needs experts.bin, but this install keeps its routed experts (e.g. "
            f"{stacked[0]!r}) in model_weights.safetensors; re-convert with `turbospark convert --experts-file` "
            f"or open with residency='resident'"
        )
        raise OptionError(msg)


def check_slots(layout: ExpertLayout, expert_slots: int | str) -> None:
    """Open step 10: explicit slots must hold one token's experts (``top_k``, when the install records it)."""
    if isinstance(expert_slots, int) and layout.top_k is not None and expert_slots < layout.top_k:
        msg = (
            f"expert_slots={expert_slots} is below the model's top_k={layout.top_k} (experts routed per "
            f"token): one token could not have all its experts in memory; use expert_slots>={layout.top_k} or 'auto'"
        )
        raise OptionError(msg)


def plan_experts(layout: ExpertLayout, residency: str, expert_slots: int | str, room: int, unpack: bool) -> ExpertPlan | None:
    """The plan for ``residency`` in ``room`` bytes with experts held unpacked or not; ``None`` if it does not fit."""
    if residency == RESIDENT:
        need = layout.slot_bytes(layout.max_experts, unpack)
        return ExpertPlan(residency=RESIDENT, slots=layout.max_experts, unpack=unpack, held_bytes=need) if need <= room else None
    fewest = layout.top_k or 1
    need_for = lambda n: layout.slot_bytes(n, unpack) + layout.staging_bytes(n)
    if isinstance(expert_slots, int):
        slots = min(expert_slots, layout.max_experts)
    else:  # the most slots that fit: bisect, the need grows with the slot count
        lo, hi = 0, layout.max_experts
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if need_for(mid) <= room else (lo, mid - 1)
        slots = lo
    need = need_for(slots)
    if slots < fewest or need > room:
        return None
    return ExpertPlan(residency=STREAMED, slots=slots, unpack=unpack, held_bytes=need)


def residencies(residency: str, expert_slots: int | str, layout: ExpertLayout) -> tuple[str, ...]:
    """Residencies to try, preferred first. ``auto`` with an explicit slot count below the expert count streams."""
    if residency == "auto" and isinstance(expert_slots, int) and expert_slots < layout.max_experts:
        return (STREAMED,)
    return {"auto": (RESIDENT, STREAMED), RESIDENT: (RESIDENT,), STREAMED: (STREAMED,)}[residency]


def minimal_plan(layout: ExpertLayout, residency: str, expert_slots: int | str, unpack: bool) -> ExpertPlan:
    """The smallest plan for ``residency`` (for the over-budget refusal's figures)."""
    if residency == RESIDENT:
        return ExpertPlan(residency=RESIDENT, slots=layout.max_experts, unpack=unpack, held_bytes=layout.slot_bytes(layout.max_experts, unpack))
    slots = min(expert_slots if isinstance(expert_slots, int) else (layout.top_k or 1), layout.max_experts)
    need = layout.slot_bytes(slots, unpack) + layout.staging_bytes(slots)
    return ExpertPlan(residency=STREAMED, slots=slots, unpack=unpack, held_bytes=need)


# ------------------------------------------------------------------ held form
def _held(proj: ProjectionLayout, raw: dict[str, mx.array], policy: ComputePolicy) -> dict[str, mx.array]:
    """A projection's tensors ``[n, ...]`` as the policy holds them (float32 unpacked, or as stored)."""
    if not policy.unpack:
        return raw
    dtype = policy.compute_dtype
    out = {}
    if proj.quant is None:
        out["weight"] = raw["weight"].astype(dtype)
    else:
        q = proj.quant
        scales = raw["scales"].astype(dtype) if q.mode == "affine" else raw["scales"]
        biases = raw["biases"].astype(dtype) if "biases" in raw else None
        w = mx.dequantize(raw["weight"], scales, biases, group_size=q.group_size, bits=q.bits, mode=q.mode)
        out["weight"] = w.astype(dtype)
    if "bias" in raw:
        out["bias"] = raw["bias"].astype(dtype)
    return out


def _linear(proj: ProjectionLayout, held: dict[str, mx.array], unpack: bool) -> Linear:
    if unpack or proj.quant is None:
        return Linear(held["weight"], held.get("bias"))
    return Linear(held["weight"], held.get("bias"), quant=proj.quant, scales=held["scales"], biases=held.get("biases"))


def _empty_slots(proj: ProjectionLayout, slots: int, policy: ComputePolicy) -> dict[str, mx.array]:
    """Slot tensors ``[slots, ...]`` in held form (zeros until an expert is loaded)."""
    if policy.unpack:  # from a real buffer (mx.zeros may broadcast a scalar), so slots can be written in place
        dtype = policy.compute_dtype
        held = {"weight": mx.array(np.zeros((slots, proj.out_features, proj.in_features), np.float32)).astype(dtype)}
        if "bias" in proj.tensors:
            held["bias"] = mx.array(np.zeros((slots, proj.out_features), np.float32)).astype(dtype)
    else:
        end = max(t.offset + t.nbytes for t in proj.tensors.values())
        held = _from_records(proj, np.zeros((slots, end), np.uint8))
    mx.eval(held)
    return held


def _writable_views(held: dict[str, dict[str, mx.array]]) -> dict[str, dict[str, np.ndarray]] | None:
    """numpy views sharing the slot tensors' memory (CPU), or ``None`` where MLX memory is not host memory."""
    if mx.default_device() != mx.cpu:
        return None
    views: dict[str, dict[str, np.ndarray]] = {}
    for name, leaves in held.items():
        views[name] = {}
        for leaf, arr in leaves.items():
            view = np.asarray(arr)
            if arr.dtype != mx.float32 or not (view.flags.writeable and view.flags.c_contiguous):
                return None
            view.flat[0] = 1.0  # probe: a write through the view must be what MLX reads
            shared = arr.reshape(-1)[0].item() == 1.0
            view.flat[0] = 0.0
            if not shared:
                return None
            views[name][leaf] = view
    return views


def _widen_into(raw: np.ndarray, dtype: str, out: np.ndarray) -> None:
    """One stored float tensor (bytes) into a float32 slot, exactly as ``astype(float32)`` would."""
    flat = out.reshape(-1)
    if dtype == "F32":
        flat.view(np.uint8)[:] = raw
    elif dtype == "F16":
        flat[:] = raw.view(np.float16)
    else:  # BF16 is the high half of a float32
        bits = flat.view(np.uint32)
        bits[:] = raw.view(np.uint16)
        bits <<= 16


def _from_records(proj: ProjectionLayout, records: np.ndarray) -> dict[str, mx.array]:
    """The projection's tensors out of ``records`` (``[n, stride]`` bytes), as MLX arrays ``[n, ...]``."""
    n = records.shape[0]
    out = {}
    for leaf, t in proj.tensors.items():
        part = np.ascontiguousarray(records[:, t.offset : t.offset + t.nbytes])
        arr = mx.array(part.view(_NUMPY[t.dtype]).reshape(n, *t.shape))
        out[leaf] = arr.view(mx.bfloat16) if t.dtype == "BF16" else arr
    return out


def read_expert_tensors(manifest: Manifest) -> dict[str, mx.array]:
    """Every routed-expert tensor of an install as stored, ``[E, ...]`` under its install name (tools, tests)."""
    path = manifest.path(EXPERTS)
    layout = ExpertLayout.from_section(manifest.experts or {}, manifest.files[EXPERTS].size, str(path))
    out = {}
    with path.open("rb") as f:
        for prefix, layer in layout.layers.items():
            f.seek(layer.offset)
            records = np.frombuffer(f.read(layer.end - layer.offset), np.uint8).reshape(layer.num_experts, layer.stride)
            for name, proj in layer.projections.items():
                out.update({f"{prefix}.{name}.{leaf}": arr for leaf, arr in _from_records(proj, records).items()})
    return out


# ------------------------------------------------------------------ the store
class ExpertStore:
    """``experts.bin`` opened for one install: resident arrays or streamed banks, and their stats."""

    def __init__(self, path: Path, layout: ExpertLayout, plan: ExpertPlan, policy: ComputePolicy) -> None:
        self.path, self.layout, self.plan, self.policy = path, layout, plan, policy
        self._fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)
        self._resident: dict[str, dict[str, dict[str, mx.array]]] = {}  # prefix -> projection -> leaf -> [E, ...]
        self._slots: dict[str, dict[str, dict[str, mx.array]]] = {}  # prefix -> projection -> leaf -> [slots, ...]
        self._banks: dict[str, ExpertBank | StreamedExpertBank] = {}
        self._pending: list[mx.array] = []
        self.counters = _Counters(first=next(iter(layout.layers)))
        self.staging = np.empty(0, np.uint8)

    def setup(self) -> None:
        """Open step 10: read every expert (resident), or allocate the slots and the read buffer (streamed)."""
        for prefix, layer in self.layout.layers.items():
            if self.plan.residency == RESIDENT:
                records = self.read(layer.offset, layer.num_experts * layer.stride).reshape(layer.num_experts, layer.stride)
                self._resident[prefix] = {name: _from_records(p, records) for name, p in layer.projections.items()}
                mx.eval(self._resident[prefix])
            else:
                slots = min(self.plan.slots, layer.num_experts)
                self._slots[prefix] = {name: _empty_slots(p, slots, self.policy) for name, p in layer.projections.items()}
        if self.plan.residency == STREAMED:
            self.staging = np.empty(self.layout.staging_bytes(self.plan.slots), np.uint8)

    def read(self, offset: int, size: int, into: np.ndarray | None = None) -> np.ndarray:
        """``size`` bytes at ``offset`` with positional reads (bounded by the validated layout)."""
        buf = np.empty(size, np.uint8) if into is None else into[:size]
        view, done = memoryview(buf), 0
        while done < size:
            got = os.preadv(self._fd, [view[done : done + _READ_CHUNK]], offset + done)
            if got <= 0:
                msg = f"{self.path}: read past its end at byte {offset + done}; the file shrank after open, re-run `turbospark convert`"
                raise InstallError(msg)
            done += got
        return buf

    def has(self, prefix: str) -> bool:
        """Whether ``prefix`` is a routed layer of experts.bin."""
        return prefix in self.layout.layers

    def bank(self, prefix: str, gate: str, up: str, down: str) -> ExpertBank | StreamedExpertBank:
        """The bank of layer ``prefix`` with the family's projection names; each layer is asked for once."""
        layer = self.layout.layers[prefix]
        _check_roles(layer, (gate, up, down))
        if self.plan.residency == STREAMED:
            bank: ExpertBank | StreamedExpertBank = StreamedExpertBank(self, layer, (gate, up, down), self._slots.pop(prefix))
        else:
            raw = self._resident.pop(prefix)
            held = {name: _held(layer.projections[name], raw[name], self.policy) for name in (gate, up, down)}
            self._pending.extend(a for h in held.values() for a in h.values())
            bank = ExpertBank(*(_linear(layer.projections[n], held[n], self.plan.unpack) for n in (gate, up, down)))
        self._banks[prefix] = bank
        return bank

    def materialize(self) -> None:
        """Evaluate the resident experts' float32 form once (open step 11's end)."""
        if self._pending:
            mx.eval(self._pending)
            self._pending.clear()

    def unused(self) -> list[str]:
        """Routed layers the family never asked for."""
        return sorted(set(self.layout.layers) - set(self._banks))

    def stats(self) -> ExpertStats:
        """Counters since open."""
        return self.counters.snapshot(self.plan)


@attrs.define
class _Counters:
    first: str
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    load_s: float = 0.0
    tokens: int = 0

    def snapshot(self, plan: ExpertPlan) -> ExpertStats:
        return ExpertStats(
            residency=plan.residency,
            slots=plan.slots,
            hits=self.hits,
            misses=self.misses,
            bytes_read=self.bytes_read,
            load_ms=self.load_s * 1e3,
            tokens=self.tokens,
        )


def _check_roles(layer: LayerLayout, roles: tuple[str, str, str]) -> None:
    missing = [r for r in roles if r not in layer.projections]
    extra = sorted(set(layer.projections) - set(roles))
    if missing or extra:
        msg = (
            f"experts of {layer.prefix!r}: the family asks for projections {list(roles)}, experts.bin holds "
            f"{sorted(layer.projections)}; the install was made for another config, re-run `turbospark convert`"
        )
        raise InstallError(msg)
    gate, up, down = (layer.projections[r] for r in roles)
    if not (gate.out_features == up.out_features == down.in_features and gate.in_features == up.in_features == down.out_features):
        msg = f"experts of {layer.prefix!r}: gate/up/down shapes do not chain; re-run `turbospark convert`"
        raise InstallError(msg)


# ------------------------------------------------------------------ streamed bank
class StreamedExpertBank:
    """A routed layer's experts held in an LRU of slots, loaded from ``experts.bin`` on a miss.

    Same API as :class:`~turbospark_core.weights.ExpertBank`. For a batch, the
    experts the router chose are put in slots (misses read with ``os.preadv``),
    indices are remapped to slot ids and ``gather_mm`` runs over the slot tensors.
    """

    def __init__(
        self, store: ExpertStore, layer: LayerLayout, roles: tuple[str, str, str], held: dict[str, dict[str, mx.array]]
    ) -> None:
        self.store, self.layer, self.roles = store, layer, roles
        self.slots = min(store.plan.slots, layer.num_experts)
        unpack = store.plan.unpack
        self._held = held
        # CPU float32 slots are written in place (one pass from the read buffer); elsewhere by MLX slice updates
        self._views = _writable_views(held) if unpack else None
        self._bank = ExpertBank(*(_linear(layer.projections[n], self._held[n], unpack) for n in roles))
        self._slot_of = np.full(layer.num_experts, -1, np.int64)
        self._expert_in = np.full(self.slots, -1, np.int64)
        self._used = np.full(self.slots, -1, np.int64)
        self._tick = 0

    @property
    def num_experts(self) -> int:
        """How many experts the layer has."""
        return self.layer.num_experts

    def cached(self) -> list[int]:
        """Experts now in slots, least recently used first."""
        held = np.nonzero(self._expert_in >= 0)[0]
        return [int(self._expert_in[s]) for s in held[np.argsort(self._used[held], kind="stable")]]

    def glu(self, x: mx.array, indices: mx.array, activation: Callable[[mx.array, mx.array], mx.array]) -> mx.array:
        """Gated expert MLP for each chosen expert (see :meth:`ExpertBank.glu`); loads missing experts."""
        idx = np.asarray(indices).astype(np.int64)
        self._check(idx)
        if self.layer.prefix == self.store.counters.first:
            self.store.counters.tokens += idx.size // max(idx.shape[-1], 1)
        uniq = np.unique(idx)
        if len(uniq) <= self.slots:
            self._ensure(uniq)
            y = self._bank.glu(x, mx.array(self._slot_of[idx].astype(np.uint32)), activation)
        else:
            y = self._glu_grouped(x, idx, uniq, activation)
        if self._views is not None:
            mx.eval(y)  # nothing may still read a slot when the next call writes it in place
        return y

    def _check(self, idx: np.ndarray) -> None:
        k = idx.shape[-1] if idx.ndim else 0
        if k > self.slots:
            msg = (
                f"expert_slots={self.slots} is below the {k} experts the family routes each token to "
                f"(layer {self.layer.prefix!r}); open with expert_slots>={k} or 'auto'"
            )
            raise OptionError(msg)
        if idx.size and (idx.min() < 0 or idx.max() >= self.layer.num_experts):
            msg = f"router of {self.layer.prefix!r} chose expert {int(idx.max())}, outside [0, {self.layer.num_experts})"
            raise ValueError(msg)

    def _glu_grouped(self, x: mx.array, idx: np.ndarray, uniq: np.ndarray, activation: Any) -> mx.array:
        """More distinct experts than slots (a long prefill): run them a slot-full at a time, per (token, expert) pair."""
        k = idx.shape[-1]
        flat, xf = idx.reshape(-1), x.reshape(-1, x.shape[-1])
        present = self._slot_of[uniq] >= 0
        order = np.concatenate([uniq[present], uniq[~present]])  # hits first, before they are evicted
        pieces, positions = [], []
        for start in range(0, len(order), self.slots):
            group = order[start : start + self.slots]
            self._ensure(group)
            pos = np.nonzero(np.isin(flat, group))[0]
            local = mx.array(self._slot_of[flat[pos]].astype(np.uint32)[:, None])
            y = self._bank.glu(xf[mx.array((pos // k).astype(np.uint32))], local, activation)[:, 0]
            mx.eval(y)  # the next group's loads reuse these slots
            pieces.append(y)
            positions.append(pos)
        inverse = np.argsort(np.concatenate(positions), kind="stable").astype(np.uint32)
        return mx.concatenate(pieces)[mx.array(inverse)].reshape(*idx.shape, -1)

    def _ensure(self, experts: np.ndarray) -> None:
        """Put ``experts`` (distinct, at most ``slots``) in slots, evicting the least recently used others."""
        self._tick += 1
        slots = self._slot_of[experts]
        hit = slots >= 0
        self._used[slots[hit]] = self._tick
        misses = experts[~hit]
        counters = self.store.counters
        counters.hits += int(hit.sum())
        if not misses.size:
            return
        keep = np.zeros(self.slots, bool)
        keep[slots[hit]] = True
        free = np.nonzero(~keep)[0]
        victims = free[np.argsort(self._used[free], kind="stable")[: misses.size]]
        old = self._expert_in[victims]
        self._slot_of[old[old >= 0]] = -1
        self._expert_in[victims] = misses
        self._slot_of[misses] = victims
        self._used[victims] = self._tick
        t0 = time.perf_counter()
        self._load(misses, victims)
        counters.misses += int(misses.size)
        counters.load_s += time.perf_counter() - t0

    def _load(self, experts: np.ndarray, slots: np.ndarray) -> None:
        order = np.argsort(experts)
        experts, slots = experts[order], slots[order]
        stride, batch = self.layer.stride, max(1, self.store.staging.size // self.layer.stride)
        for start in range(0, experts.size, batch):
            part, into = experts[start : start + batch], slots[start : start + batch]
            records = self._read(part)
            if self._views is not None:
                self._write_in_place(records, into.tolist())
            else:
                self._write_functional(records, into.tolist())
            self.store.counters.bytes_read += part.size * stride

    def _write_in_place(self, records: np.ndarray, into: list[int]) -> None:
        for name in self.roles:
            proj, views = self.layer.projections[name], self._views[name]  # type: ignore[index]
            if proj.quant is not None:  # MLX dequantizes (bit-identical to the resident bank), then copy
                held = _held(proj, _from_records(proj, records), self.store.policy)
                mx.eval(held)
                for leaf, arr in held.items():
                    src = np.asarray(arr)
                    for i, s in enumerate(into):
                        views[leaf][s] = src[i]
                continue
            for leaf, t in proj.tensors.items():
                for i, s in enumerate(into):
                    _widen_into(records[i, t.offset : t.offset + t.nbytes], t.dtype, views[leaf][s])

    def _write_functional(self, records: np.ndarray, into: list[int]) -> None:
        for name in self.roles:
            proj = self.layer.projections[name]
            held = _held(proj, _from_records(proj, records), self.store.policy)
            for leaf, arr in held.items():
                target = self._held[name][leaf]
                for i, s in enumerate(into):
                    target[s : s + 1] = arr[i : i + 1]
        mx.eval([a for h in self._held.values() for a in h.values()])

    def _read(self, experts: np.ndarray) -> np.ndarray:
        """Records of ``experts`` (sorted) into the staging buffer, one read per run of neighbours."""
        stride = self.layer.stride
        records = self.store.staging[: experts.size * stride].reshape(experts.size, stride)
        i = 0
        while i < experts.size:
            j = i + 1
            while j < experts.size and experts[j] == experts[j - 1] + 1:
                j += 1
            offset = self.layer.offset + int(experts[i]) * stride
            self.store.read(offset, (j - i) * stride, into=records[i:j].reshape(-1))
            i = j
        return records
