"""The streamed bank: a routed layer's experts in an LRU of slots, loaded from ``experts.bin`` on a miss."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from turbospark_core.errors import OptionError
from turbospark_core.experts.held import from_records, held_form, linear_of
from turbospark_core.experts.layout import LayerLayout
from turbospark_core.layers import Activation, ExpertBank

if TYPE_CHECKING:  # the store hands out streamed banks, which read through it
    from turbospark_core.experts.store import ExpertStore


class StreamedExpertBank:
    """A routed layer's experts held in an LRU of slots, loaded from ``experts.bin`` on a miss.

    An :class:`~turbospark_core.layers.Experts`, like the resident
    :class:`~turbospark_core.layers.ExpertBank`. For a batch, the experts the
    router chose are put in slots (misses read with ``os.preadv``), indices are
    remapped to slot ids and ``gather_mm`` runs over the slot tensors.
    """

    pins_memory = True  # numpy views write the slots in place: the open must not move them (placement)

    def __init__(
        self, store: ExpertStore, layer: LayerLayout, roles: tuple[str, str, str], held: dict[str, dict[str, mx.array]]
    ) -> None:
        self.store, self.layer, self.roles = store, layer, roles
        self.slots = min(store.plan.slots, layer.num_experts)
        unpack = store.plan.unpack
        self._held = held
        # CPU float32 slots are written in place (one pass from the read buffer); elsewhere by MLX slice updates
        self._views = _writable_views(held) if unpack else None
        self._bank = ExpertBank(*(linear_of(layer.projections[n], self._held[n], unpack) for n in roles))
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

    def glu(
        self, x: mx.array, indices: mx.array, activation: Activation, weights: mx.array | None = None
    ) -> mx.array:
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
            msg = (
                f"router of {self.layer.prefix!r} chose expert {int(idx.max())}, outside [0, {self.layer.num_experts})"
            )
            raise ValueError(msg)

    def _glu_grouped(self, x: mx.array, idx: np.ndarray, uniq: np.ndarray, activation: Activation) -> mx.array:
        """More distinct experts than slots (a long prefill): a slot-full at a time, per (token, expert) pair."""
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
                held = held_form(proj, from_records(proj, records), self.store.policy)
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
            held = held_form(proj, from_records(proj, records), self.store.policy)
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


def _writable_views(held: dict[str, dict[str, mx.array]]) -> dict[str, dict[str, np.ndarray]] | None:
    """numpy views sharing the slot tensors' memory (CPU), or ``None`` where MLX memory is not host memory."""
    if mx.default_device() != mx.cpu:
        return None
    views: dict[str, dict[str, np.ndarray]] = {}
    for name, leaves in held.items():
        views[name] = {}
        for leaf, arr in leaves.items():
            if arr.dtype != mx.float32:  # stored-form slots (the native kernels multiply them): MLX slice updates
                return None
            view = np.asarray(arr)
            if not (view.flags.writeable and view.flags.c_contiguous):
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
