"""Diagnostics built at open: the router histogram and the FFN activation histogram.

Both are off by default, and then nothing here exists: the weight store,
the expert banks and the family's flow are the plain objects. With an option
on, open installs recording wrappers in the core, never in a family:

* :class:`ObservedWeights` hands out the family's objects: a routed layer's
  bank wrapped in :class:`ObservedExperts` (it sees the chosen experts and,
  when the family passes them, the routing weights, in ``glu``), and each
  ``*.down_proj`` matrix wrapped in :class:`ObservedLinear` (its input is the
  FFN intermediate). Inside ``glu`` the intermediate is the activation's
  output, recorded by wrapping the activation.
* Counting stays on the device: each record is one scatter-add into a
  per-layer accumulator, evaluated asynchronously every few records and
  folded into host integers only when read (or before int32 could overflow).
* An ``mx.compile`` trace cannot record (its arrays would escape the trace),
  so the flow runs with compilation off while a diagnostic is on
  (:class:`UncompiledModel`).
* A diagnostic that cannot observe the model is refused by name at open
  (:meth:`Diagnostics.attach`), never returned empty.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core.errors import OptionError
from turbospark_core.experts.streamed import StreamedExpertBank
from turbospark_core.layers import Activation, Experts, Linear
from turbospark_core.weights import WeightStore

if TYPE_CHECKING:
    from turbospark_core.compute import ComputePolicy
    from turbospark_core.context import FamilyModel
    from turbospark_core.experts.store import ExpertStore
    from turbospark_core.options import OpenOptions
    from turbospark_core.tensor_index import TensorIndex

# FFN bins: signed log-magnitude, PER_DECADE bins per decade from FLOOR to CEILING on each side,
# one centre bin for |x| < FLOOR; the outermost bins also take everything beyond CEILING
FLOOR_DECADE, CEILING_DECADE, PER_DECADE = -4, 3, 8
MAGNITUDE_BINS = (CEILING_DECADE - FLOOR_DECADE) * PER_DECADE
FFN_BINS = 2 * MAGNITUDE_BINS + 1
CENTRE = MAGNITUDE_BINS
_FLUSH_EVERY = 32  # records between asynchronous evaluations of an accumulator (bounds its lazy graph)
_FLUSH_ELEMENTS = 1 << 20  # ... or sooner once this many values wait: the lazy graph keeps its inputs alive
_FOLD_AT = 1 << 30  # elements added since the last fold at which an int32 accumulator is folded to the host
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_DOWN = re.compile(r"(?:^|\.)down_proj$")


def ffn_edges() -> np.ndarray:
    """The ``FFN_BINS + 1`` bin edges (the outermost are ``-inf``/``inf``).

    Bins are mirrored in magnitude: a positive bin is ``[lower, upper)``, its
    negative twin ``(-upper, -lower]``; the centre bin is ``|x| < 1e-4``.
    """
    mags = 10.0 ** (FLOOR_DECADE + np.arange(1, MAGNITUDE_BINS) / PER_DECADE)
    floor = 10.0**FLOOR_DECADE
    return np.concatenate([[-np.inf], -mags[::-1], [-floor, floor], mags, [np.inf]])


def ffn_bins(h: mx.array) -> mx.array:
    """The FFN bin of every element of ``h`` (int32, same shape)."""
    a = mx.abs(h).astype(mx.float32)
    mag = mx.floor((mx.log10(mx.maximum(a, 10.0**FLOOR_DECADE)) - FLOOR_DECADE) * PER_DECADE)
    j = mx.clip(mag.astype(mx.int32), 0, MAGNITUDE_BINS - 1)  # NaN lands in range too: totals stay exact
    side = mx.where(h > 0, CENTRE + 1 + j, CENTRE - 1 - j)
    return mx.where(a < 10.0**FLOOR_DECADE, CENTRE, side)


class Tally:
    """Per-bin totals accumulated on the device, read back as host int64/float64.

    Each :meth:`add` is one scatter-add into a device array; every few adds,
    or once many values wait, the array is evaluated asynchronously (its lazy
    graph, and the activations it reads, stay small), and it is folded into
    the host totals when read or before int32 could wrap.
    """

    def __init__(self, size: int, dtype: mx.Dtype) -> None:
        self.size, self.dtype = size, dtype
        self._device: mx.array | None = None
        self._host: np.ndarray = np.zeros(size, np.float64 if dtype == mx.float32 else np.int64)
        self._since_fold = 0
        self._depth = 0
        self._waiting = 0

    def add(self, index: mx.array, values: mx.array | int, elements: int) -> None:
        """Add ``values`` (or a constant) at bins ``index``; ``elements`` bounds what this adds."""
        base = mx.zeros((self.size,), self.dtype) if self._device is None else self._device
        self._device = base.at[index.reshape(-1)].add(values if isinstance(values, int) else values.reshape(-1))
        self._since_fold += elements
        self._depth += 1
        self._waiting += elements
        if self._since_fold >= _FOLD_AT:
            self.fold()
        elif self._depth >= _FLUSH_EVERY or self._waiting >= _FLUSH_ELEMENTS:
            mx.async_eval(self._device)  # type: ignore[no-untyped-call]  # mlx's stub leaves it unannotated
            self._depth = self._waiting = 0

    def fold(self) -> None:
        """Move the device totals into the host totals (a synchronisation)."""
        if self._device is not None:
            self._host += np.array(self._device)
        self._device, self._since_fold, self._depth, self._waiting = None, 0, 0, 0

    def read(self) -> np.ndarray:
        """The totals so far."""
        self.fold()
        out: np.ndarray = self._host.copy()
        return out

    def reset(self) -> None:
        """Forget everything counted."""
        self._device, self._since_fold, self._depth, self._waiting = None, 0, 0, 0
        self._host[:] = 0


@attrs.define(eq=False)
class RouterLayer:
    """What one routed layer's router chose since the histogram was switched on (or reset)."""

    layer: int
    num_experts: int
    counts: Tally
    mass: Tally
    tokens: int = 0
    top_k: int = 0
    weighted: bool = False  # the family passed routing weights
    hits: int = 0
    misses: int = 0

    @classmethod
    def of(cls, layer: int, num_experts: int) -> RouterLayer:
        return cls(layer, num_experts, Tally(num_experts, mx.int32), Tally(num_experts, mx.float32))

    def record(self, indices: mx.array, weights: mx.array | None) -> None:
        k = indices.shape[-1] if indices.ndim else 1
        pairs = indices.size
        self.tokens += pairs // max(k, 1)
        self.top_k = k
        self.counts.add(indices, 1, pairs)
        if weights is not None:
            self.weighted = True
            self.mass.add(indices, weights.astype(mx.float32), pairs)

    def reset(self) -> None:
        self.counts.reset()
        self.mass.reset()
        self.tokens = self.hits = self.misses = 0
        self.weighted = False


class ObservedExperts:
    """An :class:`~turbospark_core.layers.Experts` that records one layer's routing and FFN intermediates.

    The bank it wraps does the work; its results are unchanged.
    """

    def __init__(self, inner: Experts, router: RouterLayer | None, ffn: Tally | None) -> None:
        self.inner, self.router, self.ffn = inner, router, ffn
        self._store = inner.store if isinstance(inner, StreamedExpertBank) else None

    @property
    def num_experts(self) -> int:
        """How many experts the layer has."""
        return self.inner.num_experts

    def glu(self, x: mx.array, indices: mx.array, activation: Activation, weights: mx.array | None = None) -> mx.array:
        """The wrapped bank's ``glu``, recorded (see :meth:`~turbospark_core.layers.Experts.glu`)."""
        if self.router is not None:
            self.router.record(indices, weights)
        act = activation if self.ffn is None else _recording(activation, self.ffn)
        if self._store is None or self.router is None:
            return self.inner.glu(x, indices, act, weights=weights)
        counters = self._store.counters
        hits, misses = counters.hits, counters.misses
        y = self.inner.glu(x, indices, act, weights=weights)
        self.router.hits += counters.hits - hits
        self.router.misses += counters.misses - misses
        return y


def _recording(activation: Activation, tally: Tally) -> Activation:
    def act(gate: mx.array, up: mx.array) -> mx.array:
        h = activation(gate, up)
        tally.add(ffn_bins(h), 1, h.size)
        return h

    return act


class ObservedLinear:
    """A down projection that records its input (the FFN intermediate), then multiplies as the plain one."""

    def __init__(self, inner: Linear, tally: Tally) -> None:
        self.inner, self.tally = inner, tally

    def __call__(self, x: mx.array) -> mx.array:
        self.tally.add(ffn_bins(x), 1, x.size)
        return self.inner(x)

    def __getattr__(self, name: str) -> Any:  # weight, bias, quant, out_features...
        return getattr(self.inner, name)


class ObservedWeights(WeightStore):
    """The weight store, handing out recording wrappers where a diagnostic observes."""

    def __init__(self, path: Path, index: TensorIndex, policy: ComputePolicy, diagnostics: Diagnostics) -> None:
        super().__init__(path, index, policy)
        self.diagnostics = diagnostics

    def linear(self, base: str, *, native_ok: bool = True) -> Linear:
        """As :meth:`WeightStore.linear`; a ``layers.N. ... down_proj`` is recorded when the FFN histogram is on."""
        lin = super().linear(base, native_ok=native_ok)
        layer = _layer_of(base)
        if not self.diagnostics.ffn or layer is None or not _DOWN.search(base):
            return lin
        return ObservedLinear(lin, self.diagnostics.ffn_tally(layer))  # type: ignore[return-value]

    def experts(self, prefix: str, gate: str, up: str, down: str) -> Experts:
        """As :meth:`WeightStore.experts`, wrapped in :class:`ObservedExperts`."""
        bank = super().experts(prefix, gate, up, down)
        layer = _layer_of(prefix + ".")
        if layer is None:  # no "layers.N." in the name: negative ids, apart from every numbered layer
            self.diagnostics.unnumbered.append(prefix)
            layer = -len(self.diagnostics.unnumbered)
        d = self.diagnostics
        router = d.router_layer(layer, bank.num_experts) if d.router else None
        ffn = d.ffn_tally(layer) if d.ffn else None
        return ObservedExperts(bank, router, ffn)


def _layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return None if m is None else int(m.group(1))


@attrs.frozen(kw_only=True)
class RouterHistogram:
    """Per routed layer and expert: how often the router chose it, and the routing weight it got.

    Attributes:
        layers: ``[L]`` decoder-layer index of each routed layer.
        counts: ``[L, E]`` selections (each row sums to ``tokens * top_k``).
        weight_mass: ``[L, E]`` summed routing weights; NaN rows where the
            family passed no weights to ``glu``.
        tokens: ``[L]`` token rows routed through each layer.
        top_k: ``[L]`` experts chosen per token.
        hits, misses: ``[L]`` streamed residency: experts found in / loaded
            into a slot (zeros when resident).
        residency: ``"resident"`` or ``"streamed"``.
    """

    layers: np.ndarray
    counts: np.ndarray
    weight_mass: np.ndarray
    tokens: np.ndarray
    top_k: np.ndarray
    hits: np.ndarray
    misses: np.ndarray
    residency: str

    @property
    def hit_rate(self) -> np.ndarray:
        """``[L]`` slot hits over lookups (NaN where nothing was looked up, e.g. resident)."""
        lookups = self.hits + self.misses
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(lookups > 0, self.hits / np.maximum(lookups, 1), np.nan)

    def arrays(self) -> dict[str, np.ndarray]:
        """For ``np.savez``: each field under ``router_<name>`` (and the hit rate)."""
        out = {f"router_{f.name}": np.asarray(getattr(self, f.name)) for f in attrs.fields(type(self))}
        out["router_hit_rate"] = self.hit_rate
        return out


@attrs.frozen(kw_only=True)
class FFNHistogram:
    """Per layer, a fixed-bin histogram of the FFN intermediate (the down projection's input).

    Attributes:
        layers: ``[L]`` decoder-layer index of each observed layer.
        edges: ``[B + 1]`` bin edges (:func:`ffn_edges`; signed, log-spaced).
        counts: ``[L, B]`` values per bin (a row sums to tokens x the layer's
            intermediate width, routed experts counting ``top_k`` times).
    """

    layers: np.ndarray
    edges: np.ndarray
    counts: np.ndarray

    def arrays(self) -> dict[str, np.ndarray]:
        """For ``np.savez``: each field under ``ffn_<name>``."""
        return {f"ffn_{f.name}": np.asarray(getattr(self, f.name)) for f in attrs.fields(type(self))}


class Diagnostics:
    """The diagnostics an open switched on, and their records (see the module docstring)."""

    def __init__(self, *, router: bool, ffn: bool) -> None:
        self.router, self.ffn = router, ffn
        self._router: dict[int, RouterLayer] = {}
        self._ffn: dict[int, Tally] = {}
        self.unnumbered: list[str] = []
        self.residency = "resident"

    @classmethod
    def from_options(cls, options: OpenOptions) -> Diagnostics | None:
        """The diagnostics ``options`` ask for, or ``None`` when none is on."""
        if not (options.router_histogram or options.ffn_histogram):
            return None
        return cls(router=options.router_histogram, ffn=options.ffn_histogram)

    def weights(self, path: Path, index: TensorIndex, policy: ComputePolicy) -> WeightStore:
        """The open's weight store (step 8), handing out recording objects."""
        return ObservedWeights(path, index, policy, self)

    def router_layer(self, layer: int, num_experts: int) -> RouterLayer:
        if layer not in self._router:
            self._router[layer] = RouterLayer.of(layer, num_experts)
        return self._router[layer]

    def ffn_tally(self, layer: int) -> Tally:
        if layer not in self._ffn:
            self._ffn[layer] = Tally(FFN_BINS, mx.int32)
        return self._ffn[layer]

    def attach(self, model: FamilyModel, model_type: str, experts: ExpertStore | None) -> FamilyModel:
        """After the family is built: refuse what nothing observes; the flow, uncompiled while it runs."""
        if self.router and not self._router:
            msg = (
                f"router_histogram=True cannot observe model type {model_type!r}: its family asked for no routed "
                f"experts (a dense model has no router); open without router_histogram"
            )
            raise OptionError(msg)
        if self.ffn and not self._ffn:
            msg = (
                f"ffn_histogram=True cannot observe model type {model_type!r}: its family asked for no "
                f"'layers.N.*.down_proj' matrix and no routed experts; open without ffn_histogram"
            )
            raise OptionError(msg)
        if experts is not None:
            self.residency = experts.plan.residency
        return UncompiledModel(model)

    def reset(self, *, router: bool = True, ffn: bool = True) -> None:
        """Forget what was recorded (open does so after its warm-up token)."""
        for r in self._router.values() if router else ():
            r.reset()
        for t in self._ffn.values() if ffn else ():
            t.reset()

    def router_histogram(self) -> RouterHistogram:
        """The router records so far (one synchronisation)."""
        if not self.router:
            raise OptionError("the router histogram is off; open with router_histogram=True")
        rows = [self._router[k] for k in sorted(self._router)]
        width = max(r.num_experts for r in rows)
        counts = np.zeros((len(rows), width), np.int64)
        mass = np.zeros((len(rows), width), np.float64)
        for i, r in enumerate(rows):
            counts[i, : r.num_experts] = r.counts.read()
            mass[i, : r.num_experts] = r.mass.read() if r.weighted else np.nan
        return RouterHistogram(
            layers=np.array([r.layer for r in rows], np.int64),
            counts=counts,
            weight_mass=mass,
            tokens=np.array([r.tokens for r in rows], np.int64),
            top_k=np.array([r.top_k for r in rows], np.int64),
            hits=np.array([r.hits for r in rows], np.int64),
            misses=np.array([r.misses for r in rows], np.int64),
            residency=self.residency,
        )

    def ffn_histogram(self) -> FFNHistogram:
        """The FFN records so far (one synchronisation)."""
        if not self.ffn:
            raise OptionError("the FFN histogram is off; open with ffn_histogram=True")
        layers = sorted(self._ffn)
        counts = np.stack([self._ffn[k].read() for k in layers])
        return FFNHistogram(layers=np.array(layers, np.int64), edges=ffn_edges(), counts=counts)


@contextlib.contextmanager
def compile_off() -> Iterator[None]:
    """``mx.compile`` off while inside (kept off when ``MLX_DISABLE_COMPILE`` says so)."""
    if os.environ.get("MLX_DISABLE_COMPILE"):
        yield
        return
    mx.disable_compile()
    try:
        yield
    finally:
        mx.enable_compile()


class UncompiledModel:
    """The family's flow, run with ``mx.compile`` off: a compiled trace would not record.

    Compilation is a process-wide MLX switch, so another model run by
    another thread during a call also runs uncompiled (results are the same).
    """

    def __init__(self, model: FamilyModel) -> None:
        self.model = model

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **vision: Any) -> mx.array:
        with compile_off():
            return self.model(inputs, cache, **vision)

    @property
    def layers(self) -> list[Any]:
        """The family's decoder blocks."""
        return self.model.layers

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def save_npz(path: str | Path, *histograms: RouterHistogram | FFNHistogram) -> Path:
    """Write the histograms' arrays to one ``.npz`` (what ``turbospark plot`` reads)."""
    arrays: dict[str, np.ndarray] = {}
    for h in histograms:
        arrays.update(h.arrays())
    out = Path(path)
    with out.open("wb") as f:
        np.savez(f, allow_pickle=False, **arrays)
    return out
