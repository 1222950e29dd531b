"""Steering: direction sets that edit the residual stream at the output of decoder layers.

A :class:`DirectionSet` holds one float32 vector per steered decoder layer
``L`` (0-based) and a mode:

* ``add``: ``h <- h + scale * d_L``;
* ``ablate``: ``h <- h - scale * (h . d^_L) d^_L`` (``d^`` the unit vector;
  ``scale`` 1, the default, removes the component entirely).

``h`` is the hidden state decoder layer ``L`` hands to layer ``L + 1`` (or,
for the last layer, to the final norm), at every position, computed in
float32. Families apply the edits by calling :func:`steer` on each layer's
output in their layer loop (``turbospark_core.family.steer``); with no
steering active it returns ``h`` untouched and computes nothing.

On disk a set is a safetensors file: one float32 tensor ``direction.{L}`` of
shape ``[hidden_size]`` per layer and string metadata ``mode``, ``scale``,
``model_type``, ``hidden_size``. llama.cpp / repeng control vectors (GGUF,
``general.architecture = controlvector``) are imported as ``add`` sets
exactly where llama.cpp applies them: ``direction.{k}`` is added to the
output of 0-based block ``k`` (``build_cvec(cur, il)`` after the block's last
residual add); ``k = 0`` is refused as llama.cpp refuses it. The strength
llama.cpp takes with ``--control-vector-scaled FILE:S`` is the set's scale.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import re
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core.errors import TurbosparkError

Mode = Literal["add", "ablate"]
MODES: tuple[Mode, ...] = ("add", "ablate")
GGUF_MAGIC = b"GGUF"
CONTROL_VECTOR_ARCH = "controlvector"
MAX_HEADER = 16 << 20  # a direction file's safetensors header: bytes, at most
_NAME = re.compile(r"direction\.(\d+)")


class SteeringError(TurbosparkError, ValueError):
    """A direction set that cannot be used."""


class DirectionFileError(SteeringError):
    """A direction file that is missing, truncated, corrupt or malformed."""


class DirectionValueError(SteeringError):
    """Directions or options with bad values: non-finite numbers, a zero vector, a bad mode or scale."""


class DirectionMismatchError(SteeringError):
    """A direction set that does not fit the opened model (hidden size, layer range, model type)."""


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        msg = f"steering {name}={value!r} is invalid; pass a finite number"
        raise DirectionValueError(msg)
    return float(value)


def _mode(value: object) -> Mode:
    for mode in MODES:
        if value == mode:
            return mode
    msg = f"steering mode {value!r} is invalid; use 'add' or 'ablate'"
    raise DirectionValueError(msg)


def _directions(value: Mapping[int, Any]) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for layer, vec in sorted(value.items()):
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
            msg = f"steering layer {layer!r} is invalid; layers are 0-based decoder layer indices"
            raise DirectionValueError(msg)
        arr = np.array(vec, dtype=np.float32)
        if arr.ndim != 1 or arr.size == 0:
            msg = f"steering direction for layer {layer} has shape {arr.shape}; pass one vector [hidden_size]"
            raise DirectionValueError(msg)
        if not np.isfinite(arr).all():
            msg = f"steering direction for layer {layer} holds NaN or infinite values; recompute it"
            raise DirectionValueError(msg)
        arr.setflags(write=False)
        out[int(layer)] = arr
    if not out:
        raise DirectionValueError("a steering set needs at least one layer's direction")
    sizes = {v.size for v in out.values()}
    if len(sizes) > 1:
        msg = f"steering directions have different sizes {sorted(sizes)}; every layer's vector is [hidden_size]"
        raise DirectionValueError(msg)
    return out


def _scale(value: object) -> float:
    return _finite("scale", value)


@attrs.frozen(kw_only=True)
class DirectionSet:
    """Per-layer residual-stream directions and how to apply them.

    Attributes:
        mode: ``"add"`` or ``"ablate"``.
        scale: ``add``: the multiplier of ``d``; ``ablate``: the fraction of
            the component removed (1 = all). 0 turns the set off.
        directions: 0-based decoder layer -> float32 vector ``[hidden_size]``
            (read-only arrays).
        model_type: The model type the set was computed on (``None``: unknown).
        source: Where the set came from (a path, or ``"memory"``).
    """

    mode: Mode = attrs.field(converter=_mode)
    scale: float = attrs.field(default=1.0, converter=_scale)
    directions: Mapping[int, np.ndarray] = attrs.field(converter=_directions, eq=False, repr=False)
    model_type: str | None = None
    source: str = "memory"

    @property
    def hidden_size(self) -> int:
        """The size of every direction vector."""
        return int(next(iter(self.directions.values())).size)

    @property
    def layers(self) -> tuple[int, ...]:
        """The steered layers, ascending."""
        return tuple(self.directions)

    # ------------------------------------------------------------ building
    @classmethod
    def from_arrays(
        cls,
        directions: Mapping[int, Any] | np.ndarray,
        *,
        mode: Mode,
        scale: float = 1.0,
        model_type: str | None = None,
    ) -> DirectionSet:
        """The in-memory form: ``{layer: vector}``, or a ``[num_layers, hidden]`` array (row ``L`` for layer ``L``)."""
        if not isinstance(directions, Mapping):
            arr = np.asarray(directions, dtype=np.float32)
            if arr.ndim != 2:
                msg = f"steering directions array has shape {arr.shape}; pass [num_layers, hidden_size] or a dict"
                raise DirectionValueError(msg)
            directions = dict(enumerate(arr))
        return cls(mode=mode, scale=scale, directions=directions, model_type=model_type)

    @classmethod
    def load(cls, path: str | Path) -> DirectionSet:
        """Read a safetensors direction file or a llama.cpp / repeng GGUF control vector (bounded reads)."""
        path = Path(path)
        if not path.is_file():
            msg = f"steering file {path} does not exist; pass a .safetensors direction set or a .gguf control vector"
            raise DirectionFileError(msg)
        with path.open("rb") as fh:
            magic = fh.read(4)
        if magic == GGUF_MAGIC:
            return _load_gguf(path)
        return _load_safetensors(path)

    def save(self, path: str | Path) -> Path:
        """Write the safetensors form (``direction.{L}`` float32 + metadata)."""
        from safetensors.numpy import save_file

        metadata = {"mode": self.mode, "scale": repr(self.scale), "hidden_size": str(self.hidden_size)}
        if self.model_type is not None:
            metadata["model_type"] = self.model_type
        tensors = {f"direction.{layer}": np.ascontiguousarray(v) for layer, v in self.directions.items()}
        save_file(tensors, str(path), metadata=metadata)
        return Path(path)

    def with_scale(self, scale: float) -> DirectionSet:
        """The same directions with another scale."""
        return attrs.evolve(self, scale=scale)

    def with_layers(self, start: int, stop: int) -> DirectionSet:
        """Only the layers in ``[start, stop)``.

        Raises:
            DirectionMismatchError: No direction of the set falls in the range.
        """
        kept = {layer: v for layer, v in self.directions.items() if start <= layer < stop}
        if not kept:
            msg = f"steering layers {start}:{stop} keep none of the set's layers {list(self.layers)}; widen the range"
            raise DirectionMismatchError(msg)
        return attrs.evolve(self, directions=kept)

    def check(self, arch: Mapping[str, Any]) -> None:
        """Refuse a set that does not fit the model of ``arch`` (hidden size, layer range, model type).

        Raises:
            DirectionMismatchError: Naming the mismatch and the model's values.
        """
        hidden, n_layers = int(arch["hidden_size"]), int(arch["num_hidden_layers"])
        if self.hidden_size != hidden:
            msg = (
                f"steering set {self.source} has {self.hidden_size}-dim directions but model type "
                f"{arch.get('model_type')!r} has hidden_size {hidden}; compute the set on this model"
            )
            raise DirectionMismatchError(msg)
        outside = [layer for layer in self.layers if layer >= n_layers]
        if outside:
            msg = (
                f"steering set {self.source} steers layer {outside[0]} but the model has {n_layers} decoder "
                f"layers (0..{n_layers - 1}); restrict it with --steering-layers or DirectionSet.with_layers"
            )
            raise DirectionMismatchError(msg)
        if self.model_type is not None and self.model_type != arch.get("model_type"):
            msg = (
                f"steering set {self.source} was computed on model type {self.model_type!r}, not "
                f"{arch.get('model_type')!r}; compute the set on this model"
            )
            raise DirectionMismatchError(msg)

    def edit(self) -> Edit:
        """The runtime form (float32 MLX arrays); empty when ``scale`` is 0."""
        return Edit.of_rows([self])


def parse_layers(text: str) -> tuple[int, int]:
    """``"A:B"`` -> ``(A, B)`` (``A`` or ``B`` may be omitted: 0 and no bound)."""
    m = re.fullmatch(r"\s*(\d*)\s*:\s*(\d*)\s*", text)
    if m is None:
        msg = f"steering layers {text!r} are invalid; write A:B (0-based, B excluded), e.g. 4:12"
        raise DirectionValueError(msg)
    start = int(m.group(1) or 0)
    stop = int(m.group(2)) if m.group(2) else 1 << 30
    if stop <= start:
        msg = f"steering layers {text!r} are empty; B must exceed A"
        raise DirectionValueError(msg)
    return start, stop


# ------------------------------------------------------------------ safetensors
def _load_safetensors(path: Path) -> DirectionSet:
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise DirectionFileError(f"steering file {path} is {size} bytes, too short for safetensors")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_HEADER):
            msg = f"steering file {path} declares a {n}-byte header in a {size}-byte file; it is not a direction set"
            raise DirectionFileError(msg)
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DirectionFileError(f"steering file {path} has an unreadable safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise DirectionFileError(f"steering file {path} has a header that is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        data_start, data_bytes = 8 + n, size - 8 - n
        directions = {_layer_of(path, name): _read_f32(fh, path, name, entry, data_start, data_bytes)
                      for name, entry in header.items()}  # fmt: skip
    meta = meta if isinstance(meta, dict) else {}
    if "mode" not in meta:
        msg = f"steering file {path} has no 'mode' metadata; write 'add' or 'ablate' (DirectionSet.save does)"
        raise DirectionFileError(msg)
    scale = _meta_float(path, meta.get("scale", "1.0"))
    hidden = meta.get("hidden_size")
    found = DirectionSet(
        mode=meta["mode"], scale=scale, directions=directions, model_type=meta.get("model_type"), source=str(path)
    )
    if hidden is not None and str(found.hidden_size) != str(hidden):
        msg = f"steering file {path} says hidden_size {hidden} but its directions have {found.hidden_size} values"
        raise DirectionFileError(msg)
    return found


def _meta_float(path: Path, raw: object) -> float:
    try:
        return float(str(raw))
    except ValueError:
        raise DirectionFileError(f"steering file {path} has scale metadata {raw!r}, not a number") from None


def _layer_of(path: Path, name: str) -> int:
    m = _NAME.fullmatch(name)
    if m is None:
        msg = f"steering file {path} holds tensor {name!r}; a direction set holds only direction.{{L}} tensors"
        raise DirectionFileError(msg)
    return int(m.group(1))


def _read_f32(fh: Any, path: Path, name: str, entry: Any, start: int, data_bytes: int) -> np.ndarray:
    ok = isinstance(entry, dict) and entry.get("dtype") == "F32" and isinstance(entry.get("shape"), list)
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not ok or len(entry["shape"]) != 1 or not isinstance(offsets, list) or len(offsets) != 2:
        msg = f"steering file {path}: tensor {name!r} must be float32 of shape [hidden_size] (got {entry!r})"
        raise DirectionFileError(msg)
    lo, hi = offsets
    count = entry["shape"][0]
    if not (isinstance(count, int) and isinstance(lo, int) and isinstance(hi, int)) or not (
        0 <= lo <= hi <= data_bytes and hi - lo == 4 * count and count > 0
    ):
        msg = f"steering file {path}: tensor {name!r} has offsets {offsets} outside the data or not {count} floats"
        raise DirectionFileError(msg)
    fh.seek(start + lo)
    raw = fh.read(hi - lo)
    return np.frombuffer(raw, dtype="<f4").astype(np.float32)


# ------------------------------------------------------------------ GGUF control vectors
def _load_gguf(path: Path) -> DirectionSet:
    from turbospark_core.convert.gguf_reader import open_gguf
    from turbospark_core.errors import ConversionError

    try:
        source = open_gguf(path)
    except ConversionError as e:
        raise DirectionFileError(f"steering file {path}: {e}") from None
    if source.architecture != CONTROL_VECTOR_ARCH:
        msg = (
            f"steering file {path} is a GGUF of architecture {source.architecture!r}, not a control vector "
            f"({CONTROL_VECTOR_ARCH!r}); pass a llama.cpp / repeng control vector"
        )
        raise DirectionFileError(msg)
    found: dict[int, np.ndarray] = {}
    for name, kind in source.tensor_types().items():
        layer = _layer_of(path, name)
        if layer == 0:
            msg = (
                f"steering file {path} holds direction.0; llama.cpp control vectors start at layer 1 (it refuses 0 too)"
            )
            raise DirectionFileError(msg)
        if kind != "F32":
            raise DirectionFileError(f"steering file {path}: {name!r} is {kind}; control vector tensors are F32")
        data = np.asarray(source.read_tensor(name).data, dtype=np.float32)
        if data.ndim != 1:
            raise DirectionFileError(f"steering file {path}: {name!r} has shape {data.shape}; it must be 1-D")
        found[layer] = data
    if not found:
        raise DirectionFileError(f"steering file {path} holds no direction tensors")
    # llama.cpp reads no metadata; controlvector.model_hint names an architecture, not a model type
    return DirectionSet(mode="add", scale=1.0, directions=found, source=str(path))


# ------------------------------------------------------------------ the runtime edit
@attrs.frozen
class LayerEdit:
    """One layer's edit in float32: ``h - (h . unit) weighted + add`` (``None`` parts skipped).

    Shapes are ``[H]`` for one set, ``[B, 1, H]`` for per-row sets in a batch
    (zero rows leave their ``h`` bit-identical).
    """

    add: mx.array | None = attrs.field(eq=False)
    unit: mx.array | None = attrs.field(eq=False)
    weighted: mx.array | None = attrs.field(eq=False)

    def __call__(self, h: mx.array) -> mx.array:
        x = h.astype(mx.float32)
        if self.unit is not None and self.weighted is not None:
            x = x - (x * self.unit).sum(axis=-1, keepdims=True) * self.weighted
        if self.add is not None:
            x = x + self.add
        return x.astype(h.dtype)


@attrs.frozen
class Edit:
    """The edits of one forward: layer -> :class:`LayerEdit`."""

    layers: Mapping[int, LayerEdit] = attrs.field(eq=False)

    @classmethod
    def of_rows(cls, sets: list[DirectionSet | None]) -> Edit:
        """One edit for a batch whose row ``r`` is steered by ``sets[r]`` (``None``: unsteered).

        One set for every row gives ``[H]`` vectors; different sets give
        ``[B, 1, H]`` vectors with zeros for the rows a layer leaves alone.
        """
        active = [s if s is not None and s.scale != 0.0 else None for s in sets]
        if not any(active):
            return cls({})
        shared = all(s is active[0] for s in active)
        rows = active[:1] if shared else active
        layers = sorted({layer for s in rows if s is not None for layer in s.layers})
        return cls({layer: _layer_edit(rows, layer, stacked=not shared) for layer in layers})

    def __bool__(self) -> bool:
        return bool(self.layers)


def _layer_edit(rows: list[DirectionSet | None], layer: int, *, stacked: bool) -> LayerEdit:
    hidden = next(s.hidden_size for s in rows if s is not None)
    add = np.zeros((len(rows), hidden), np.float32)
    unit = np.zeros((len(rows), hidden), np.float32)
    weighted = np.zeros((len(rows), hidden), np.float32)
    for r, s in enumerate(rows):
        if s is None or layer not in s.directions:
            continue
        d = s.directions[layer].astype(np.float32)
        if s.mode == "add":
            add[r] = np.float32(s.scale) * d
        else:
            norm = np.linalg.norm(d.astype(np.float64))
            if norm == 0.0:
                msg = f"steering set {s.source}: layer {layer}'s direction is zero; an ablation needs a direction"
                raise DirectionValueError(msg)
            unit[r] = (d / norm).astype(np.float32)
            weighted[r] = np.float32(s.scale) * unit[r]
    has_add = bool(add.any())
    has_ablate = bool(unit.any())
    shape = (len(rows), 1, hidden) if stacked else (hidden,)

    def as_mx(a: np.ndarray) -> mx.array:
        return mx.array(a.reshape(shape))

    return LayerEdit(
        add=as_mx(add) if has_add else None,
        unit=as_mx(unit) if has_ablate else None,
        weighted=as_mx(weighted) if has_ablate else None,
    )


# ------------------------------------------------------------------ the active forward
@attrs.define
class _Active:
    edit: Edit
    capture: dict[int, mx.array] | None = None
    capture_layers: frozenset[int] | None = None
    seen: set[int] = attrs.Factory(set)


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("turbospark_steering", default=None)


class LayerStage(Protocol):
    """A pipeline rank's hand-over point at decoder-layer outputs (:mod:`turbospark_core.distributed.pipeline`)."""

    def exchange(self, h: mx.array, layer: int) -> mx.array:
        """The hidden state the flow continues with after layer ``layer`` (received, sent or shared)."""
        ...

    def owned(self, h: mx.array, layer: int) -> mx.array:
        """Layer ``layer``'s output as the rank running it computed it, on every rank (residual capture)."""
        ...


_STAGE: contextvars.ContextVar[LayerStage | None] = contextvars.ContextVar("turbospark_stage", default=None)


def steer(h: mx.array, layer: int) -> mx.array:
    """Apply the active steering edit to decoder layer ``layer``'s output ``h`` ``[B, L, hidden]``.

    Families call it once per decoder layer, on the hidden state the layer
    hands on (after its last residual add and anything else the layer does),
    outside any ``mx.compile``d function::

        for i, block in enumerate(self.blocks):
            h = steer(block(h, cache[i]), i)

    With no steering (and no residual capture) active it returns ``h`` as is.
    Under pipeline parallelism it is also where a rank receives and hands on
    the hidden state (an active :class:`LayerStage`).
    """
    active, stage = _ACTIVE.get(), _STAGE.get()
    if active is None:
        return h if stage is None else stage.exchange(h, layer)
    active.seen.add(layer)
    edit = active.edit.layers.get(layer)
    if edit is not None:
        h = edit(h)
    if active.capture is not None and (active.capture_layers is None or layer in active.capture_layers):
        active.capture[layer] = h if stage is None else stage.owned(h, layer)
    return h if stage is None else stage.exchange(h, layer)


@contextlib.contextmanager
def staging(stage: LayerStage) -> Iterator[None]:
    """Make ``stage`` the hand-over point of the forwards run inside (pipeline parallelism)."""
    token = _STAGE.set(stage)
    try:
        yield
    finally:
        _STAGE.reset(token)


@contextlib.contextmanager
def applying(edit: Edit, *, family: str = "?", capture: dict[int, mx.array] | None = None,
             capture_layers: frozenset[int] | None = None) -> Iterator[None]:  # fmt: skip
    """Make ``edit`` (and residual capture into ``capture``) active for the forwards run inside.

    Does nothing when there is neither an edit nor a capture (zero overhead).

    Raises:
        SteeringError: The forward never reached a steered layer through
            :func:`steer` (the family's flow does not apply edits).
    """
    if not edit and capture is None:
        yield
        return
    state = _Active(edit=edit, capture=capture, capture_layers=capture_layers)
    token = _ACTIVE.set(state)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
    wanted = set(edit.layers) | (set(capture_layers or ()) if capture is not None else set())
    missed = sorted(wanted - state.seen)
    if missed:
        msg = (
            f"family {family!r} never passed decoder layer {missed[0]}'s output through "
            f"turbospark_core.family.steer, so steering and capture cannot be applied; the plugin must call it "
            f"in its layer loop (or answer steering_supported with a refusal)"
        )
        raise SteeringError(msg)


# ------------------------------------------------------------------ difference of means
@attrs.frozen(kw_only=True)
class LayerSeparation:
    """How well one layer's direction separates the two prompt sets.

    Attributes:
        layer: The 0-based decoder layer.
        gap: ``|mean(positive) - mean(negative)|`` (the unnormalized direction's length).
        effect: The projections' mean gap in pooled standard deviations (Cohen's d).
        accuracy: Prompts on the right side of the projections' midpoint.
    """

    layer: int
    gap: float
    effect: float
    accuracy: float


def difference_of_means(
    positive: np.ndarray,
    negative: np.ndarray,
    layers: list[int],
    *,
    mode: Mode,
    model_type: str | None = None,
) -> tuple[DirectionSet, list[LayerSeparation]]:
    """Per-layer ``normalize(mean(positive) - mean(negative))`` and a separation report.

    Args:
        positive: Residuals ``[n_positive, len(layers), hidden]`` (``Runner.capture``).
        negative: Residuals ``[n_negative, len(layers), hidden]``.
        layers: The decoder layer of each column.
        mode: The set's mode; ``add`` sets get the mean gap as their scale
            (adding pushes the stream from the negative set toward the positive).
        model_type: Recorded in the set.

    Raises:
        DirectionValueError: An empty prompt set, or identical means at a layer.
    """
    if len(positive) == 0 or len(negative) == 0:
        raise DirectionValueError("difference of means needs at least one positive and one negative prompt")
    pos, neg = positive.astype(np.float64), negative.astype(np.float64)
    diff = pos.mean(axis=0) - neg.mean(axis=0)  # [layers, hidden]
    gaps = np.linalg.norm(diff, axis=-1)
    if (gaps == 0).any():
        layer = layers[int(np.argmin(gaps))]
        raise DirectionValueError(f"the two prompt sets have identical mean residuals at layer {layer}")
    unit = diff / gaps[:, None]
    report = [
        _separation(layer, pos[:, i] @ unit[i], neg[:, i] @ unit[i], float(gaps[i])) for i, layer in enumerate(layers)
    ]
    scale = float(gaps.mean()) if mode == "add" else 1.0
    found = DirectionSet(
        mode=mode, scale=scale, directions={layer: unit[i].astype(np.float32) for i, layer in enumerate(layers)},
        model_type=model_type,
    )  # fmt: skip
    return found, report


def _separation(layer: int, p: np.ndarray, n: np.ndarray, gap: float) -> LayerSeparation:
    pooled = math.sqrt((float(p.var()) + float(n.var())) / 2)
    mid = (float(p.mean()) + float(n.mean())) / 2
    right = int((p > mid).sum() + (n <= mid).sum())
    effect = (float(p.mean()) - float(n.mean())) / pooled if pooled > 0 else math.inf
    return LayerSeparation(layer=layer, gap=gap, effect=effect, accuracy=right / (len(p) + len(n)))


def fingerprint(found: DirectionSet | None) -> str | None:
    """What a cache computed under ``found`` depends on (``None``: unsteered, or a set at scale 0)."""
    import hashlib

    if found is None or found.scale == 0.0:
        return None
    h = hashlib.sha256(f"{found.mode}:{found.scale!r}".encode())
    for layer, vec in found.directions.items():
        h.update(layer.to_bytes(4, "little"))
        h.update(np.ascontiguousarray(vec).tobytes())
    return h.hexdigest()
