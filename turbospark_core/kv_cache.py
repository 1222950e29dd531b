"""Per-sequence caches: full KV (grown in steps), sliding-window rings, recurrent state."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core import native
from turbospark_core.cache_spec import CacheSpec, StateSpec
from turbospark_core.errors import ContextOverflowError


def _refuse_overflow(end: int, max_context: int) -> None:
    if end > max_context:
        msg = (
            f"context of {end} tokens exceeds max_context={max_context}; "
            f"shorten the prompt or max_tokens, or open with a larger max_context"
        )
        raise ContextOverflowError(msg)


KV_BITS = {"q8": 8, "q4": 4}


def causal_mask(n: int, window: int | None = None) -> mx.array | str | None:
    """The mask for ``n`` fresh tokens of a pass without a cache (a cached pass asks its cache).

    ``None`` for one token, ``"causal"`` when no window cuts in, else a boolean
    ``[n, n]`` mask: causal and at most ``window`` tokens back (the token itself included).
    """
    if n <= 1:
        return None
    if window is None or n <= window:
        return "causal"
    q, k = mx.arange(n)[:, None], mx.arange(n)[None, :]
    return (k <= q) & (k > q - window)


@functools.cache
def _visible_fn(window: int | None) -> Callable[[mx.array, mx.array], mx.array]:
    def visible(keys: mx.array, queries: mx.array) -> mx.array:
        seen = (keys >= 0) & (keys <= queries)
        return seen if window is None else seen & (keys > queries - window)

    return mx.compile(visible, shapeless=True)


def visible_keys(keys: mx.array, queries: mx.array, window: int | None = None) -> mx.array:
    """Boolean mask: key position ``k`` is visible to query position ``q`` when ``0 <= k <= q``
    (and ``k > q - window``); ``-1`` marks an empty slot. The two broadcast (e.g. ``[1, S]``
    keys against ``[L, 1]`` queries). One fused op per layer and step instead of about ten.
    """
    return _visible_fn(window)(keys, queries)


KV_Q4_GROUPS = (32,)  # q4 rows use group 32: measured on SmolLM2 (benchmarks/kv_quant_quality.py)


def kv_group_size(head_dim: int, bits: int | None = None) -> int | None:
    """The quantization group for KV rows of ``head_dim``: 64, else 32 (32 at 4 bits), or ``None``."""
    groups = KV_Q4_GROUPS if bits == 4 else (64, 32)
    return next((g for g in groups if head_dim % g == 0), None)


class _Rows:
    """Per-token rows along axis 2: one float array, or MLX affine-quantized parts."""

    def __init__(self, parts: tuple[mx.array, ...], bits: int | None, dtype: mx.Dtype) -> None:
        self.parts = parts
        self.bits = bits
        self.dtype = dtype

    @classmethod
    def encode(cls, x: mx.array, bits: int | None, dtype: mx.Dtype) -> _Rows:
        if bits is None or x.shape[-1] == 0:  # no values (a keys-only spec) stay unquantized
            return cls((x if x.dtype == dtype else x.astype(dtype),), None, dtype)
        group = kv_group_size(x.shape[-1], bits)
        return cls(tuple(mx.quantize(x.astype(dtype), group_size=group, bits=bits)), bits, dtype)

    def decode(self, rotated: bool = False) -> mx.array:
        """The rows as floats; ``rotated``: they are stored Hadamard-rotated, rotate them back.

        Quantized float32 rows on the CPU: one native op (dequantized and rotated
        back row by row) instead of MLX's composed dequantization and hadamard_transform.
        """
        if self.bits is None:
            return _wht(self.parts[0]) if rotated else self.parts[0]
        w, scales, biases = self.parts
        if self.dtype == mx.float32 and native.kv_rows_supported(w, scales):
            return native.kv_rows(w, scales, biases, self.bits, rotated)
        group = w.shape[-1] * 32 // self.bits // scales.shape[-1]
        out = mx.dequantize(w, scales, biases, group_size=group, bits=self.bits).astype(self.dtype)
        return _wht(out) if rotated else out

    def map(self, fn: Callable[[mx.array], mx.array]) -> _Rows:
        return _Rows(tuple(fn(p) for p in self.parts), self.bits, self.dtype)

    def concat(self, other: _Rows) -> _Rows:
        pairs = zip(self.parts, other.parts, strict=True)
        return _Rows(tuple(mx.concatenate([a, b], axis=2) for a, b in pairs), self.bits, self.dtype)

    def assign(self, start: int, end: int, other: _Rows) -> None:
        for part, new in zip(self.parts, other.parts, strict=True):
            part[..., start:end, :] = new

    @property
    def length(self) -> int:
        return self.parts[0].shape[2]


@attrs.frozen
class StepBuffers:
    """Where an op writes a step's keys and values itself (a cache's :meth:`step_buffers`).

    ``keys``/``values``: the float buffers ``[B, H, S, D]``; ``column``: where
    the step's rows go. A single sequence's column is its position and its
    queries attend causally to the first ``column + L`` columns. A batch's
    rows (each at its own position) give ``positions`` (each row's first new
    token's, int32 ``[B]``) and ``mask`` (which of the ``column + L`` columns
    each query sees, boolean ``[B, 1, L, column + L]``).
    """

    keys: mx.array
    values: mx.array
    column: int
    positions: mx.array | None = None
    mask: mx.array | None = None


class _KVBuffers:
    """The key/value row buffers shared by the full and the ring cache.

    ``rotate_keys`` / ``rotate_values``: rows are stored Hadamard-rotated (see
    :class:`RotatedKVCache`) and rotated back when fetched.
    """

    _k: _Rows | None
    _v: _Rows | None
    rotate_keys: bool = False
    rotate_values: bool = False

    @property
    def keys(self) -> mx.array | None:
        """The whole key buffer (all allocated rows; dequantized and rotated back when stored so)."""
        return None if self._k is None else self._k.decode(self.rotate_keys)

    @property
    def values(self) -> mx.array | None:
        """The whole value buffer."""
        return None if self._v is None else self._v.decode(self.rotate_values)

    def _fetch(self, keys: _Rows, values: _Rows) -> tuple[mx.array, mx.array]:
        """Fetched rows as the family reads them: floats, rotated back."""
        return keys.decode(self.rotate_keys), values.decode(self.rotate_values)

    def step_buffers(self, batch: int, n: int) -> StepBuffers | None:
        """The float key/value buffers ready for ``n`` new rows per sequence, and the row they go to.

        For ops that write a step's rows into the buffers themselves (:func:`native.cache_attention`,
        a fused layer); then :meth:`commit_step`. ``None`` where the rows are not stored as plain
        floats (quantized or rotated) or, for a ring, the step would not join its prefix.
        """
        raise NotImplementedError

    def commit_step(self, k_buf: mx.array, v_buf: mx.array, n: int) -> None:
        """Hold the buffers an op wrote ``n`` rows into (from :meth:`step_buffers`) and count the rows."""
        raise NotImplementedError

    def _float_buffers(self) -> tuple[mx.array, mx.array] | None:
        if self._k is None or self._v is None or self._k.bits is not None or self.rotate_keys or self.rotate_values:
            return None
        return self._k.parts[0], self._v.parts[0]

    def _hold(self, k_buf: mx.array, v_buf: mx.array) -> None:
        # the cache holds only the written buffers: the next step's op may write them in place
        assert self._k is not None and self._v is not None
        self._k, self._v = _Rows((k_buf,), None, self._k.dtype), _Rows((v_buf,), None, self._v.dtype)

    def attend(self, q: mx.array, keys: mx.array, values: mx.array, scale: float, merge_heads: bool) -> mx.array | None:
        """Append ``keys``/``values`` and attend ``q`` causally to everything held, as one native op.

        ``None`` (nothing appended) where the op does not apply (see
        :meth:`step_buffers`; or not float32 on the CPU); then
        :meth:`update_and_fetch` and :meth:`mask` do it in parts.
        """
        n = keys.shape[2]
        step = self.step_buffers(keys.shape[0], n)
        if step is None or not native.cache_attention_supported(q, keys, values, step.keys, step.values):
            return None
        out, k_buf, v_buf = native.cache_attention(
            q, keys, values, step.keys, step.values, step.column, scale, merge_heads
        )
        self.commit_step(k_buf, v_buf, n)
        return out


class KVCache(_KVBuffers):
    """Keys and values of one full-attention layer, grown ``step`` tokens at a time.

    Args:
        spec: The layer's cache requirement.
        max_context: The most tokens this cache may hold.
        dtype: Dtype of the keys and values handed back (and stored, unquantized).
        step: Growth granularity in tokens.
        kv_bits: Store keys/values affine-quantized to 8 or 4 bits (group 64,
            or 32 for narrow heads); fetched rows are dequantized.
    """

    def __init__(
        self, spec: CacheSpec, max_context: int, dtype: mx.Dtype, step: int = 256, kv_bits: int | None = None
    ) -> None:
        self.spec = spec
        self.max_context = max_context
        self.dtype = dtype
        self.step = step
        self.kv_bits = kv_bits
        self._k: _Rows | None = None
        self._v: _Rows | None = None
        self.offset = 0

    def _zeros(self, batch: int, rows: int, dim: int) -> _Rows:
        return _Rows.encode(mx.zeros((batch, self.spec.n_kv_heads, rows, dim), self.dtype), self.kv_bits, self.dtype)

    def _grow(self, batch: int, needed: int) -> None:
        capacity = 0 if self._k is None else self._k.length
        if needed <= capacity:
            return
        new_cap = min(self.max_context, ((needed + self.step - 1) // self.step) * self.step)
        v_dim = self.spec.value_dim
        k_new = self._zeros(batch, new_cap - self.offset, self.spec.head_dim)
        v_new = self._zeros(batch, new_cap - self.offset, v_dim)
        if self._k is None or self._v is None:
            self._k, self._v = k_new, v_new
        else:
            keep = self.offset
            self._k = self._k.map(lambda a: a[..., :keep, :]).concat(k_new)
            self._v = self._v.map(lambda a: a[..., :keep, :]).concat(v_new)

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` more tokens of one sequence at once (a prompt about to be prefilled): one
        buffer, where growing ``step`` tokens at a time copies everything held at each step (a
        6,000-token prompt's chunks had copied its cache twelve times over)."""
        batch = 1 if self._k is None else self._k.parts[0].shape[0]
        self._grow(batch, min(self.offset + tokens, self.max_context))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` ``[B, H, L, D]`` and return all cached so far."""
        n = keys.shape[2]
        end = self.offset + n
        _refuse_overflow(end, self.max_context)
        self._grow(keys.shape[0], end)
        assert self._k is not None and self._v is not None
        self._k.assign(self.offset, end, _Rows.encode(keys, self.kv_bits, self.dtype))
        self._v.assign(self.offset, end, _Rows.encode(values, self.kv_bits, self.dtype))
        self.offset = end
        return self._fetch(self._k.map(lambda a: a[..., :end, :]), self._v.map(lambda a: a[..., :end, :]))

    def step_buffers(self, batch: int, n: int) -> StepBuffers | None:
        end = self.offset + n
        _refuse_overflow(end, self.max_context)
        self._grow(batch, end)
        held = self._float_buffers()
        return None if held is None else StepBuffers(*held, self.offset)

    def commit_step(self, k_buf: mx.array, v_buf: mx.array, n: int) -> None:
        self._hold(k_buf, v_buf)
        self.offset += n

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens; returns how many were dropped."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    def mask(self, n_queries: int) -> mx.array | str | None:
        """The attention mask for the ``n_queries`` tokens just added."""
        return "causal" if n_queries > 1 else None

    def export_rows(self) -> tuple[_Rows | None, _Rows | None, mx.array]:
        """The held keys, values (stored form) and their positions, in order (for a batch to take)."""
        if self._k is None or self._v is None or self.offset == 0:
            return None, None, mx.zeros((0,), mx.int32)
        end = self.offset
        return (
            self._k.map(lambda a: a[..., :end, :]),
            self._v.map(lambda a: a[..., :end, :]),
            mx.arange(end, dtype=mx.int32),
        )

    def load_rows(self, keys: _Rows, values: _Rows, positions: mx.array, offset: int) -> None:
        """Hold ``keys``/``values`` (stored form) of positions ``0..offset-1`` (a batch row leaving)."""
        if positions.size != offset:
            msg = f"a full KV cache holds every position: got {positions.size} rows for offset {offset}"
            raise ValueError(msg)
        self._k, self._v, self.offset = keys, values, offset

    def snapshot(self) -> dict[str, Any]:
        """A checkpoint of this cache (append-only: the offset is enough)."""
        return {"offset": self.offset}

    def restore(self, snap: dict[str, Any]) -> None:
        """Return to a checkpoint taken by :meth:`snapshot` on this cache."""
        self.offset = snap["offset"]

    @property
    def state(self) -> list[mx.array]:
        """Arrays to evaluate together with the step's output."""
        return [] if self._k is None or self._v is None else [*self._k.parts, *self._v.parts]


class RingKVCache(_KVBuffers):
    """Keys and values of one sliding-window layer, in a ring bounded by its capacity.

    Memory stays flat as the context grows: at most ``capacity`` (default: the
    window) tokens are kept. A multi-token update returns the kept tokens plus
    the new ones in order (so a prefill chunk sees its whole window), then
    keeps only the last ``capacity``. Each slot remembers its absolute position
    (position ``p`` lives in slot ``p % capacity``), so :meth:`mask` is exact
    for any capacity >= window. ``kv_bits`` stores the ring quantized, as for
    :class:`KVCache`. ``slack`` extra slots let :meth:`trim` drop up to
    ``slack`` tokens (a speculative verify's rejected drafts) without losing
    any of the window.

    Until a sequence outgrows its window the ring is a prefix: slots
    ``[0, offset)`` hold positions ``[0, offset)`` and the rest are empty. The
    positions are then implicit (made only when asked for), and a one-token
    step reads the prefix without a mask, as a full cache does: no positions
    written and no mask built per layer and step.
    """

    def __init__(
        self,
        spec: CacheSpec,
        max_context: int,
        dtype: mx.Dtype,
        capacity: int | None = None,
        kv_bits: int | None = None,
        slack: int = 0,
    ) -> None:
        if spec.window is None or spec.window <= 0:
            raise ValueError("RingKVCache needs a CacheSpec with a positive window")
        self.spec = spec
        self.window = spec.window
        self.slack = slack
        self.capacity = max(capacity or spec.window, spec.window + slack)
        self.max_context = max_context
        self.dtype = dtype
        self.kv_bits = kv_bits
        self._k: _Rows | None = None
        self._v: _Rows | None = None
        self._positions: mx.array | None = None  # absolute position held by each slot (explicit form)
        self._prefix = False  # the positions are implicit: slot p holds position p below offset
        self.offset = 0
        self._fetched: mx.array | int | None = None  # positions of the rows last fetched (int n: the prefix of n)

    @property
    def positions(self) -> mx.array | None:
        """The absolute position held by each slot, ``-1`` where empty."""
        if self._prefix:
            slots = mx.arange(self.capacity, dtype=mx.int32)
            return mx.where(slots < self.offset, slots, -1)
        return self._positions

    def _hold_positions(self, positions: mx.array | None) -> None:
        self._positions, self._prefix = positions, False

    def fetched_positions(self) -> mx.array:
        """The positions of the rows the last :meth:`update_and_fetch` handed back."""
        assert self._fetched is not None, "fetched_positions() follows update_and_fetch()"
        return mx.arange(self._fetched, dtype=mx.int32) if isinstance(self._fetched, int) else self._fetched

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Add ``keys``/``values`` ``[B, H, L, D]``; return what the new queries may attend to."""
        n = keys.shape[2]
        _refuse_overflow(self.offset + n, self.max_context)
        k_new = _Rows.encode(keys, self.kv_bits, self.dtype)
        v_new = _Rows.encode(values, self.kv_bits, self.dtype)
        k, v = self._k, self._v
        if n == 1 and k is not None and v is not None and self._joins_prefix():
            # every held token is within the new one's window: it joins the prefix, read unmasked
            end = self.offset + 1
            k.assign(self.offset, end, k_new)
            v.assign(self.offset, end, v_new)
            self.offset = self._fetched = end
            return self._fetch(k.map(lambda a: a[..., :end, :]), v.map(lambda a: a[..., :end, :]))
        new_pos = mx.arange(self.offset, self.offset + n)
        positions = self.positions
        self.offset += n
        if n == 1 and k is not None and v is not None and positions is not None and k.length == self.capacity:
            self._hold_positions(positions)
            slot = (self.offset - 1) % self.capacity
            k.assign(slot, slot + 1, k_new)
            v.assign(slot, slot + 1, v_new)
            positions[slot : slot + 1] = new_pos
            self._fetched = positions
            return self._fetch(k, v)
        k_all, v_all, p_all = self._ordered_with(k_new, v_new, new_pos)
        self._fetched = p_all
        self._keep_last(k_all, v_all, p_all)
        return self._fetch(k_all, v_all)

    def step_buffers(self, batch: int, n: int) -> StepBuffers | None:
        """As :meth:`KVCache.step_buffers`, for one token joining the prefix (else ``None``)."""
        if n != 1 or not self._joins_prefix():
            return None
        _refuse_overflow(self.offset + 1, self.max_context)
        held = self._float_buffers()
        return None if held is None else StepBuffers(*held, self.offset)

    def commit_step(self, k_buf: mx.array, v_buf: mx.array, n: int) -> None:
        self._hold(k_buf, v_buf)
        self.offset = self._fetched = self.offset + n

    def _joins_prefix(self) -> bool:
        """Whether one more token stays a prefix: a slot is free after it and it sees every held token."""
        return self._prefix and self._k is not None and self.offset < min(self.window, self._k.length)

    def _ordered_with(self, keys: _Rows, values: _Rows, pos: mx.array) -> tuple[_Rows, _Rows, mx.array]:
        held = self.positions
        if self._k is None or self._v is None or held is None:
            return keys, values, pos
        if self._prefix:  # already in order: the first offset - len(pos) slots
            kept = self.offset - pos.size
            return (
                self._k.map(lambda a: a[..., :kept, :]).concat(keys),
                self._v.map(lambda a: a[..., :kept, :]).concat(values),
                mx.concatenate([held[:kept], pos]),
            )
        order = mx.argsort(held)
        n_kept = int((held >= 0).sum())
        order = order[order.size - n_kept :] if n_kept else order[:0]
        return (
            self._k.map(lambda a: a[..., order, :]).concat(keys),
            self._v.map(lambda a: a[..., order, :]).concat(values),
            mx.concatenate([held[order], pos]),
        )

    def _keep_last(self, k_all: _Rows, v_all: _Rows, p_all: mx.array) -> None:
        total = k_all.length
        if total >= self.capacity:
            start = total - self.capacity
            # the ring's next write goes to the slot of the oldest token
            shift = self.offset % self.capacity
            self._k = k_all.map(lambda a: mx.roll(a[..., start:, :], shift, 2))
            self._v = v_all.map(lambda a: mx.roll(a[..., start:, :], shift, 2))
            self._hold_positions(mx.roll(p_all[start:], shift))
            return
        pad = self.capacity - total
        B, H, _, _ = k_all.parts[0].shape
        k_pad = k_all.concat(self._pad(B, H, pad, self.spec.head_dim))
        v_pad = v_all.concat(self._pad(B, H, pad, self.spec.value_dim))
        p_pad = mx.concatenate([p_all, mx.full((pad,), -1, mx.int32)]).astype(mx.int32)
        first = int(np.array(p_all[:1]).sum()) if total else 0
        if first % self.capacity == 0:  # already slot == position % capacity (a ring filled from 0)
            self._k, self._v = k_pad, v_pad
            # positions 0..offset-1 in slots 0..offset-1 (the tokens run contiguous up to the newest): implicit
            prefix = first == 0 and total == self.offset
            self._hold_positions(None if prefix else p_pad)
            self._prefix = prefix
            return
        # after a trim the kept tokens need not start at slot 0: put each at position % capacity
        slots = (np.arange(total) + first) % self.capacity
        src = np.full(self.capacity, -1, np.int64)
        src[slots] = np.arange(total)
        free = np.flatnonzero(src < 0)
        src[free] = total + np.arange(free.size)
        order = mx.array(src.astype(np.int32))
        self._k = k_pad.map(lambda a: a[..., order, :])
        self._v = v_pad.map(lambda a: a[..., order, :])
        self._hold_positions(p_pad[order])

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (at most ``slack`` lose nothing of the window); returns how many.

        The dropped slots are marked empty: the next tokens are written into
        them, and the window of the kept tokens is intact while ``n`` is at
        most the tokens added since the ring last held ``window`` older ones
        (``slack`` slots guarantee it for a verify of ``slack`` tokens).
        """
        n = min(self.offset, n)
        if n <= 0:
            return 0
        self.offset -= n
        if self._prefix:  # the prefix just got shorter
            self._fetched = self.positions
        elif self._positions is not None:
            self._positions = mx.where(self._positions >= self.offset, -1, self._positions)
            self._fetched = self._positions
        return n

    def _pad(self, batch: int, heads: int, rows: int, dim: int) -> _Rows:
        return _Rows.encode(mx.zeros((batch, heads, rows, dim), self.dtype), self.kv_bits, self.dtype)

    def snapshot(self) -> dict[str, Any]:
        """A checkpoint of this ring (copies: later writes overwrite slots)."""

        def copy(rows: _Rows | None) -> _Rows | None:
            return None if rows is None else rows.map(mx.array)

        def copy_array(a: mx.array | None) -> mx.array | None:
            return None if a is None else mx.array(a)

        fetched = self._fetched
        return {
            "offset": self.offset,
            "k": copy(self._k),
            "v": copy(self._v),
            "positions": copy_array(self._positions),
            "prefix": self._prefix,
            "fetched": fetched if isinstance(fetched, int) else copy_array(fetched),
        }

    def restore(self, snap: dict[str, Any]) -> None:
        """Return to a checkpoint taken by :meth:`snapshot` on this cache."""
        self.offset = snap["offset"]
        self._k = None if snap["k"] is None else snap["k"].map(mx.array)
        self._v = None if snap["v"] is None else snap["v"].map(mx.array)
        self._hold_positions(None if snap["positions"] is None else mx.array(snap["positions"]))
        self._prefix = snap.get("prefix", False)
        fetched = snap["fetched"]
        self._fetched = fetched if fetched is None or isinstance(fetched, int) else mx.array(fetched)

    def export_rows(self) -> tuple[_Rows | None, _Rows | None, mx.array]:
        """The kept keys, values (stored form) and their positions, in position order."""
        positions = self.positions
        if self._k is None or self._v is None or positions is None:
            return None, None, mx.zeros((0,), mx.int32)
        pos = np.array(positions)
        sorted_pos = np.argsort(pos, kind="stable")
        order = mx.array(sorted_pos[pos[sorted_pos] >= 0].astype(np.int32))
        return (
            self._k.map(lambda a: a[..., order, :]),
            self._v.map(lambda a: a[..., order, :]),
            positions[order],
        )

    def load_rows(self, keys: _Rows, values: _Rows, positions: mx.array, offset: int) -> None:
        """Hold the given tokens (stored form, ascending ``positions``), each in slot ``position % capacity``."""
        pos = np.array(positions)[-self.capacity :]
        keys = keys.map(lambda a: a[..., a.shape[2] - pos.size :, :])
        values = values.map(lambda a: a[..., a.shape[2] - pos.size :, :])
        slots = mx.array((pos % self.capacity).astype(np.int32))
        B, H = keys.parts[0].shape[:2]
        self._k = self._pad(B, H, self.capacity, self.spec.head_dim)
        self._v = self._pad(B, H, self.capacity, self.spec.value_dim)
        for part, new in zip(self._k.parts + self._v.parts, keys.parts + values.parts, strict=False):
            part[..., slots, :] = new
        positions = mx.full((self.capacity,), -1, mx.int32)
        positions[slots] = mx.array(pos.astype(np.int32))
        self._hold_positions(positions)
        self._fetched = positions
        self.offset = offset

    def mask(self, n_queries: int) -> mx.array | None:
        """Boolean ``[L, S]`` mask: causal and within the window, by absolute position.

        ``None`` for one query over a prefix (every row it reads is visible).
        """
        if isinstance(self._fetched, int) and n_queries == 1:
            return None
        q = mx.arange(self.offset - n_queries, self.offset, dtype=mx.int32)[:, None]
        return visible_keys(self.fetched_positions()[None, :], q, self.window)

    @property
    def state(self) -> list[mx.array]:
        """Arrays to evaluate together with the step's output."""
        if self._k is None or self._v is None:
            return []
        held = [*self._k.parts, *self._v.parts]
        if self._prefix:  # implicit positions: nothing to evaluate
            return held
        return [] if self._positions is None else [*held, self._positions]


class RecurrentState:
    """A layer's recurrent state (declared by a :class:`StateSpec`), held by the core.

    Families read a named array with :meth:`get` (zeros before the first
    write), compute the next state, and :meth:`set` it; ``offset`` counts the
    tokens consumed so far.
    """

    def __init__(self, spec: StateSpec, max_context: int) -> None:
        self.spec = spec
        self.max_context = max_context
        self.dtype = getattr(mx, spec.dtype)
        self.arrays: dict[str, mx.array] = {}
        self.offset = 0

    def get(self, name: str, batch: int) -> mx.array:
        """The state ``name`` for ``batch`` rows (zeros when not yet written)."""
        arr = self.arrays.get(name)
        if arr is None:
            return mx.zeros((batch, *self.spec.shapes[name]), self.dtype)
        return arr

    def set(self, name: str, value: mx.array) -> None:
        """Store the new state ``name``."""
        self.arrays[name] = value.astype(self.dtype)

    def advance(self, n: int) -> None:
        """Count ``n`` consumed tokens (refusing a context overflow)."""
        _refuse_overflow(self.offset + n, self.max_context)
        self.offset += n

    def snapshot(self) -> dict[str, Any]:
        """A checkpoint of the state."""
        return {"offset": self.offset, "arrays": {n: mx.array(a) for n, a in self.arrays.items()}}

    def restore(self, snap: dict[str, Any]) -> None:
        """Return to a checkpoint taken by :meth:`snapshot` on this state."""
        self.offset = snap["offset"]
        self.arrays = {n: mx.array(a) for n, a in snap["arrays"].items()}

    def mask(self, n_queries: int) -> None:
        """Recurrent layers need no attention mask."""
        return None

    @property
    def state(self) -> list[mx.array]:
        """Arrays to evaluate together with the step's output."""
        return list(self.arrays.values())


# --- rotated quantized KV (issue 18) -------------------------------------------------
# Keys (and values) are rotated by a normalized Walsh-Hadamard transform of the head
# dimension before they are quantized, and rotated back after they are dequantized. The
# transform is orthonormal and its own inverse, so in exact math the attention scores and
# outputs are unchanged (the same as rotating Q and K, and the inverse on the output for V);
# the rotation spreads outlier channels over the whole quantization group, which is what
# keeps 4-bit KV close to unquantized.


def kv_rotatable(dim: int) -> bool:
    """Whether rows of ``dim`` can be rotated: a power of two (its normalized transform is its own inverse)."""
    return dim >= 2 and dim & (dim - 1) == 0


def _wht(x: mx.array) -> mx.array:
    return mx.hadamard_transform(x)


def stored_rotation(cache: object) -> tuple[bool, bool]:
    """Whether ``cache`` stores its keys and its values Hadamard-rotated (a batch joining its rows must too)."""
    if isinstance(cache, (RotatedKVCache, RotatedRingKVCache)):
        return True, cache.rotate_values
    return False, False


class RotatedKVCache(KVCache):
    """A quantized :class:`KVCache` that stores keys and values Hadamard-rotated per head.

    ``rotate_values`` rotates values too (both are rotated back when fetched).
    """

    rotate_keys = True
    rotate_values = True

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """As :meth:`KVCache.update_and_fetch`; the rows are stored rotated and handed back unrotated."""
        return super().update_and_fetch(_wht(keys), _wht(values) if self.rotate_values else values)


class RotatedRingKVCache(RingKVCache):
    """A quantized :class:`RingKVCache` that stores keys and values Hadamard-rotated per head."""

    rotate_keys = True
    rotate_values = True

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """As :meth:`RingKVCache.update_and_fetch`; the rows are stored rotated and handed back unrotated."""
        return super().update_and_fetch(_wht(keys), _wht(values) if self.rotate_values else values)


def _rotated_kv_class(spec: CacheSpec) -> type[KVCache] | type[RingKVCache] | None:
    """The rotated class for ``spec``, or ``None`` when its head dims cannot be rotated."""
    if not (kv_rotatable(spec.head_dim) and kv_rotatable(spec.value_dim)):
        return None
    return RotatedKVCache if spec.window is None else RotatedRingKVCache


# --- end rotated quantized KV ----------------------------------------------------------

# --- the most recent tokens read exact beside quantized KV (issue 18) -------------------
# Every token is quantized as it is written, and the last ``recent`` tokens are also kept
# unquantized in a small ring. Attention reads both sets: each query position ``q`` sees
# the keys at ``p <= q - recent`` quantized and those at ``q - recent < p <= q`` exact. The
# rule is per query, so a prefill chunk, a speculative verify, a batched step and a
# one-token decode read the same keys for the same query (what KIVI's full-precision
# residual does, without making results depend on how tokens were grouped into steps).


KV_RECENT_DEFAULT = {4: 32}  # kv bits -> recent tokens kept exact by default (measured: docs/rotation-quality.md)


def kv_recent_default(kv_bits: int | None) -> int:
    """How many recent tokens stay exact by default beside ``kv_bits`` KV (``0``: none)."""
    return 0 if kv_bits is None else KV_RECENT_DEFAULT.get(kv_bits, 0)


@functools.cache
def _split_fn(recent: int, window: int | None) -> Callable[..., tuple[mx.array, mx.array]]:
    def split(quantized: mx.array, exact: mx.array, queries: mx.array, held: mx.array) -> tuple[mx.array, mx.array]:
        cut = mx.minimum(queries, mx.maximum(queries - recent, held - 1))
        q_seen = (quantized >= 0) & (quantized <= cut)
        e_seen = (exact > cut) & (exact <= queries)
        if window is not None:
            q_seen = q_seen & (quantized > queries - window)
            e_seen = e_seen & (exact > queries - window)
        return q_seen, e_seen

    return mx.compile(split, shapeless=True)


def recent_split_mask(
    quantized: mx.array, exact: mx.array, queries: mx.array, recent: int, window: int | None
) -> mx.array:
    """The mask over quantized keys then exact keys (positions, ``-1`` empty) for ``queries``.

    Each visible key appears once: quantized at ``p <= q - recent``, exact above. The
    arrays broadcast (``[1, S]``/``[1, T]`` keys against ``[L, 1]`` queries, or a batch's
    ``[B, 1, S]`` against ``[B, L, 1]``).
    """
    # the lowest position the exact rows still hold (they hold a contiguous run up to the newest):
    # a rewind deeper than their spare slots leaves the older recent keys read quantized, never dropped
    held = mx.min(mx.where(exact >= 0, exact, mx.iinfo(mx.int32).max), axis=-1, keepdims=True)
    q_seen, e_seen = _split_fn(recent, window)(quantized, exact, queries, held)
    return mx.concatenate([q_seen, e_seen], axis=-1)


class ExactRecentKVCache:
    """Quantized keys/values (a :class:`KVCache` or :class:`RingKVCache`, rotated or not) whose
    most recent ``recent`` tokens attention reads unquantized.

    ``quantized`` holds every token; ``exact`` is an unquantized ring of window ``recent``
    with ``slack`` spare slots, so a speculative verify's rejected drafts are trimmed without
    losing any recent token (a deeper trim leaves the lost ones quantized: still attended,
    never dropped). :meth:`update_and_fetch` hands back the quantized rows followed by the
    exact ones, and :meth:`mask` picks, per query, which copy of each key it reads.
    """

    def __init__(self, quantized: KVCache | RingKVCache, recent: int, slack: int = 0) -> None:
        if recent < 1:
            raise ValueError(f"ExactRecentKVCache needs recent >= 1, got {recent}")
        self.quantized = quantized
        self.recent = recent
        spec = attrs.evolve(quantized.spec, window=recent)
        self.exact = RingKVCache(spec, quantized.max_context, quantized.dtype, slack=slack)

    @property
    def spec(self) -> CacheSpec:
        """The layer's cache requirement."""
        return self.quantized.spec

    @property
    def dtype(self) -> mx.Dtype:
        """Dtype of the keys and values handed back."""
        return self.quantized.dtype

    @property
    def kv_bits(self) -> int | None:
        """The quantized rows' bits."""
        return self.quantized.kv_bits

    @property
    def offset(self) -> int:
        """Tokens consumed so far."""
        return self.quantized.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Add ``keys``/``values`` ``[B, H, L, D]``; the quantized rows, then the exact recent ones."""
        k_q, v_q = self.quantized.update_and_fetch(keys, values)
        k_e, v_e = self.exact.update_and_fetch(keys, values)
        return mx.concatenate([k_q, k_e], axis=2), mx.concatenate([v_q, v_e], axis=2)

    def mask(self, n_queries: int) -> mx.array:
        """Boolean ``[L, S + T]``: each query's keys, quantized below its recent window, exact within."""
        q = self.quantized
        held = q.fetched_positions() if isinstance(q, RingKVCache) else mx.arange(q.offset, dtype=mx.int32)
        exact = self.exact.fetched_positions()
        queries = mx.arange(self.offset - n_queries, self.offset, dtype=mx.int32)[:, None]
        return recent_split_mask(held[None, :], exact[None, :], queries, self.recent, self.spec.window)

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (see :meth:`RingKVCache.trim` for the exact ring); returns how many."""
        self.exact.trim(n)
        return self.quantized.trim(n)

    def snapshot(self) -> dict[str, Any]:
        """A checkpoint of both parts."""
        return {"quantized": self.quantized.snapshot(), "exact": self.exact.snapshot()}

    def restore(self, snap: dict[str, Any]) -> None:
        """Return to a checkpoint taken by :meth:`snapshot` on this cache."""
        self.quantized.restore(snap["quantized"])
        self.exact.restore(snap["exact"])

    @property
    def state(self) -> list[mx.array]:
        """Arrays to evaluate together with the step's output."""
        return [*self.quantized.state, *self.exact.state]


# --- end exact recent tokens -------------------------------------------------------------


Cache = KVCache | RingKVCache | ExactRecentKVCache | RecurrentState


class AttentionCache(Protocol):
    """What an attention layer uses of its cache (a :class:`KVCache` or a :class:`RingKVCache`)."""

    offset: int

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append the step's keys/values; the rows attention reads."""
        ...

    def mask(self, n_queries: int) -> mx.array | str | None:
        """The mask for the last ``n_queries`` tokens over the fetched rows."""
        ...


def make_cache(
    spec: CacheSpec | StateSpec,
    max_context: int,
    dtype: mx.Dtype,
    ring_capacity: int | None = None,
    kv_bits: int | None = None,
    kv_rotate: bool = False,
    ring_slack: int = 0,
    kv_recent: int = 0,
) -> Cache:
    """The cache object a layer's spec asks for (``kv_rotate``: quantized KV stored Hadamard-rotated).

    ``ring_slack``: extra ring slots so a speculative verify of that many
    tokens can be trimmed without losing the window (see :meth:`RingKVCache.trim`).
    ``kv_recent``: with ``kv_bits``, attention reads the last that many tokens
    unquantized (:class:`ExactRecentKVCache`).
    """
    if isinstance(spec, StateSpec):
        return RecurrentState(spec, max_context)
    rotated = _rotated_kv_class(spec) if kv_rotate and kv_bits is not None else None
    cache: KVCache | RingKVCache
    if spec.window is None:
        full = KVCache if rotated is None else RotatedKVCache
        cache = full(spec, max_context, dtype, kv_bits=kv_bits)
    else:
        ring = RingKVCache if rotated is None else RotatedRingKVCache
        cache = ring(spec, max_context, dtype, capacity=ring_capacity, kv_bits=kv_bits, slack=ring_slack)
    if kv_bits is None or kv_recent == 0:
        return cache
    return ExactRecentKVCache(cache, kv_recent, ring_slack)


def make_caches(
    specs: list[CacheSpec | StateSpec],
    max_context: int,
    dtype: mx.Dtype,
    ring_capacity: int | None = None,
    kv_bits: int | None = None,
    kv_rotate: bool = False,
    ring_slack: int = 0,
    kv_recent: int = 0,
) -> list[Cache]:
    """One cache per layer, as the family's layout asks."""
    return [
        make_cache(spec, max_context, dtype, ring_capacity, kv_bits, kv_rotate, ring_slack, kv_recent)
        for spec in specs
    ]


def trimmable(caches: list[Cache]) -> bool:
    """Whether every cache can drop its last tokens in place (KV and rings; recurrent state cannot)."""
    return not any(isinstance(c, RecurrentState) for c in caches)


def trim_caches(caches: list[Cache], n: int) -> None:
    """Drop the last ``n`` tokens of every KV cache and ring (recurrent state is restored, not trimmed)."""
    for cache in caches:
        if not isinstance(cache, RecurrentState):
            cache.trim(n)


def reserve_caches(caches: list[Cache], tokens: int) -> None:
    """Room for ``tokens`` more tokens in every full-attention KV cache (:meth:`KVCache.reserve`;
    rings and recurrent state have a fixed size)."""
    for cache in caches:
        if isinstance(cache, ExactRecentKVCache):
            cache = cache.quantized
        if isinstance(cache, KVCache):
            cache.reserve(tokens)


def snapshot_caches(caches: list[Cache]) -> list[dict[str, Any]]:
    """Checkpoint every layer's cache (KV offsets, ring copies, recurrent state)."""
    return [c.snapshot() for c in caches]


def restore_caches(caches: list[Cache], snaps: list[dict[str, Any]]) -> None:
    """Restore every layer's cache from :func:`snapshot_caches`."""
    for cache, snap in zip(caches, snaps, strict=True):
        cache.restore(snap)
