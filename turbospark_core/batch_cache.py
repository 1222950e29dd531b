"""Batched caches: B rows (sequences) of different lengths and positions in one forward.

The layout (the core's bookkeeping; families never see it):

* Every layer cache holds ``[B, H, S, D]`` key/value columns. A step of ``L``
  tokens writes columns ``[S, S + L)`` of every row at once, so rows stay
  right-aligned: a shorter row has empty columns on the left.
* Each layer also holds ``positions`` ``[B, S]`` (int32): the absolute
  position of the token in each column of each row, ``-1`` for an empty
  column (left padding, or a token dropped by :meth:`BatchCaches.truncate`).
  The mask is computed from positions, never from column indices, so holes,
  padding and sliding windows are one rule: key ``k`` is visible to query
  ``q`` when ``0 <= k <= q`` (and ``k > q - window`` for a sliding layer).
* ``offset`` is a ``[B]`` int32 array: the position of each row's first new
  token, which is what ``mx.fast.rope`` takes for per-row positions.

Exactness: a masked key contributes an exact zero to the softmax sum and to
the weighted value sum, so the bookkeeping itself is exact: under MLX's own
BLAS (``TURBOSPARK_BLAS=reference``) a row decoded in a batch, with padding
and rewind holes, is bit-identical to the row decoded alone (tested). With
OpenBLAS (the default shim) float32 results differ by ~1e-6 relative: its
sgemm reduces an ``M > 1`` product in another order than its ``M = 1`` path,
and a padded key length changes its blocking of ``P @ V``. The tests hold
batched logits within 1e-5 of the lone row and greedy tokens equal.

Rows join from single-sequence caches (a prompt is prefilled alone, in
chunks, then its caches are merged in) and leave back into them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from turbospark_core import native
from turbospark_core.cache_spec import CacheSpec, StateSpec
from turbospark_core.errors import OptionError
from turbospark_core.kv_cache import (
    Cache,
    ExactRecentKVCache,
    KVCache,
    RecurrentState,
    RingKVCache,
    StepBuffers,
    _Rows,
    _wht,
    recent_split_mask,
    stored_rotation,
    visible_keys,
)


class BatchRows:
    """The per-row positions one batch's layer caches share.

    ``offsets[b]`` is the position of row ``b``'s next token; ``offset`` is
    the same as a ``[B]`` int32 array (what the families hand to rope).
    """

    def __init__(self, offsets: Sequence[int] = ()) -> None:
        self.offsets: list[int] = [int(o) for o in offsets]
        self.offset = mx.array(self.offsets, dtype=mx.int32)
        self.steps = 0  # forwards completed (a step's start is where rewinds may return)
        self._queries: dict[int, mx.array] = {}
        self._host_queries: dict[int, np.ndarray] = {}
        self._masks: dict[tuple[int | None, int, int], mx.array] = {}

    def set(self, offsets: Sequence[int]) -> None:
        """Replace every row's position."""
        self.offsets = [int(o) for o in offsets]
        self.offset = mx.array(self.offsets, dtype=mx.int32)
        self._queries = {}
        self._host_queries = {}
        self._masks = {}

    def queries(self, n: int) -> mx.array:
        """``[B, n]`` int32: the positions of each row's ``n`` new tokens (one array for every layer)."""
        if n not in self._queries:
            self._queries[n] = self.offset[:, None] + mx.arange(n, dtype=mx.int32)[None, :]
        return self._queries[n]

    def host_queries(self, n: int) -> np.ndarray:
        """:meth:`queries` on the host (what each layer's host copy of its positions takes)."""
        if n not in self._host_queries:
            self._host_queries[n] = np.array(self.offsets, dtype=np.int32)[:, None] + np.arange(n, dtype=np.int32)
        return self._host_queries[n]

    def mask(self, window: int | None, length: int, n: int, positions: Callable[[], mx.array]) -> mx.array:
        """This step's ``[B, 1, n, length]`` mask of the layers of ``window`` holding ``length`` columns.

        One array for all of them: every layer of one window holds the same
        positions (each step writes, rewinds, compacts and drops the same
        columns in all of them), so ``positions()`` is read from the first.
        """
        key = (window, length, n)
        if key not in self._masks:
            q = self.queries(n)[:, :, None]
            self._masks[key] = visible_keys(positions()[:, None, :length], q, window)[:, None]
        return self._masks[key]

    def advance(self, n: int) -> None:
        """Every row consumed ``n`` tokens (one forward completed)."""
        self.set([o + n for o in self.offsets])
        self.steps += 1

    def __len__(self) -> int:
        return len(self.offsets)


def _empty_like(rows: _Rows, batch: int, columns: int) -> _Rows:
    """Zero columns shaped like ``rows`` (any quantization): padding, never attended."""
    parts = tuple(mx.zeros((batch, p.shape[1], columns, p.shape[3]), p.dtype) for p in rows.parts)
    return _Rows(parts, rows.bits, rows.dtype)


_Move = tuple[int, int, int, int, int, int]


def _lay_out(sources: Sequence[_Rows], moves: Sequence[_Move], rows: int, capacity: int) -> _Rows:
    """Rows laid out anew: ``rows`` rows of ``capacity`` columns, zero but where ``moves`` copy columns in.

    Each move ``(to, source, row, begin, end, dst)`` copies columns ``[begin, end)`` of row
    ``row`` of ``sources[source]`` to row ``to`` from column ``dst`` (every part alike: a
    quantized row's codes, scales and biases share the column axis). On the CPU each part
    is one native op (:func:`native.kv_place`: its zeros' whole pages left unwritten);
    elsewhere (or without the native module) slice updates of zeros.
    """
    first = sources[0]
    parts = []
    for i, part in enumerate(first.parts):
        given = [s.parts[i] for s in sources]
        if native.kv_place_supported(*given):
            parts.append(native.kv_place(given, moves, rows, capacity))
            continue
        out = mx.zeros((rows, part.shape[1], capacity, part.shape[3]), part.dtype)
        for to, source, row, begin, end, dst in moves:
            out[to : to + 1, :, dst : dst + end - begin, :] = given[source][row : row + 1, :, begin:end, :]
        parts.append(out)
    return _Rows(tuple(parts), first.bits, first.dtype)


def _first_held(held: np.ndarray) -> list[int]:
    """Each row's first column holding a token (its left padding before it; all columns if none)."""
    used = held >= 0
    if used.size == 0:
        return [held.shape[1]] * held.shape[0]
    return [int(c) for c in np.where(used.any(axis=1), used.argmax(axis=1), held.shape[1])]


def _held_moves(held: np.ndarray, shift: int) -> list[_Move]:
    """Each row's held columns (``held``: its positions) moved ``shift`` columns right, from source 0."""
    return [(b, 0, b, first, held.shape[1], first + shift) for b, first in enumerate(_first_held(held))]


def _positions(held: np.ndarray, start: int, capacity: int) -> np.ndarray:
    """``held`` ``[B, S]`` positions from column ``start`` of ``capacity`` columns, ``-1`` elsewhere."""
    out = np.full((held.shape[0], capacity), -1, dtype=np.int32)
    out[:, start : start + held.shape[1]] = held
    return out


class BatchKVCache:
    """One attention layer's keys/values for every row of a batch (full, sliding, quantized).

    A sliding layer (``window`` set) keeps every column until no row can see
    it any more, then drops whole leading columns (memory stays bounded by
    the window plus one growth step); a full layer keeps all.
    """

    def __init__(
        self,
        rows: BatchRows,
        spec: CacheSpec,
        dtype: mx.Dtype,
        kv_bits: int | None,
        step: int = 256,
        rotation: tuple[bool, bool] = (False, False),
    ) -> None:
        self.rows = rows
        self.rotation = rotation  # keys, values stored Hadamard-rotated (as the rows' own caches store them)
        self.spec = spec
        self.window = spec.window
        self.dtype = dtype
        self.kv_bits = kv_bits
        self.step = step
        self._k: _Rows | None = None
        self._v: _Rows | None = None
        self.positions: mx.array | None = None  # [B, capacity] int32, -1 = empty
        self._host: np.ndarray | None = None  # the same on the host, kept alike: layouts read it without a sync
        self.length = 0

    # ------------------------------------------------------------ the family's interface
    @property
    def offset(self) -> mx.array:
        """Each row's position of its first new token, ``[B]`` int32."""
        return self.rows.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write ``keys``/``values`` ``[B, H, L, D]`` as the next columns; return every column."""
        start, end = self._take_columns(keys.shape[0], keys.shape[2], keys.shape[1])
        assert self._k is not None and self._v is not None
        if self.kv_bits is None and self.rotation == (False, False):  # plain float rows: no _Rows wrapping per layer
            k_all, v_all = self._k.parts[0], self._v.parts[0]
            k_all[..., start:end, :] = keys if keys.dtype == self.dtype else keys.astype(self.dtype)
            v_all[..., start:end, :] = values if values.dtype == self.dtype else values.astype(self.dtype)
            return k_all[..., :end, :], v_all[..., :end, :]
        rot_k, rot_v = self.rotation
        keys, values = (_wht(keys) if rot_k else keys), (_wht(values) if rot_v else values)
        self._k.assign(start, end, _Rows.encode(keys, self.kv_bits, self.dtype))
        self._v.assign(start, end, _Rows.encode(values, self.kv_bits, self.dtype))
        k, v = self._k.map(lambda a: a[..., :end, :]), self._v.map(lambda a: a[..., :end, :])
        return k.decode(rot_k), v.decode(rot_v)

    def step_buffers(self, batch: int, n: int) -> StepBuffers | None:
        """As :meth:`KVCache.step_buffers`, for every row at once: float32 rows only (else ``None``).

        The step's columns and their positions are taken here (as
        :meth:`update_and_fetch` takes them), so the op must follow: the
        answer carries each row's positions and the step's mask (padding,
        rewind holes and the window are the mask's, as for the separate ops).
        """
        if self.kv_bits is not None or self.rotation != (False, False) or self.dtype != mx.float32 or self._k is None:
            return None
        start, _ = self._take_columns(batch, n, self.spec.n_kv_heads)
        assert self._k is not None and self._v is not None
        return StepBuffers(self._k.parts[0], self._v.parts[0], start, self.rows.offset, self.mask(n))

    def _take_columns(self, batch: int, n: int, heads: int) -> tuple[int, int]:
        """The step's ``n`` next columns ``[start, end)``, room made and their positions written."""
        self._drop_unseen()
        start, end = self.length, self.length + n
        self._grow(batch, end, heads)
        assert self.positions is not None and self._host is not None
        self.positions[:, start:end] = self.rows.queries(n)
        self._host[:, start:end] = self.rows.host_queries(n)
        self.length = end
        return start, end

    def commit_step(self, k_buf: mx.array, v_buf: mx.array, n: int) -> None:
        """Hold the buffers an op wrote the step's columns into (from :meth:`step_buffers`)."""
        assert self._k is not None and self._v is not None
        self._k, self._v = _Rows((k_buf,), None, self._k.dtype), _Rows((v_buf,), None, self._v.dtype)

    def mask(self, n_queries: int) -> mx.array:
        """Boolean ``[B, 1, L, S]``: each row's keys at or before each query (and within the window)."""
        positions = self.positions
        assert positions is not None
        return self.rows.mask(self.window, self.length, n_queries, lambda: positions)

    @property
    def state(self) -> list[mx.array]:
        """Arrays to evaluate together with the step's output."""
        if self._k is None or self._v is None or self.positions is None:
            return []
        return [*self._k.parts, *self._v.parts, self.positions]

    @property
    def step_state(self) -> list[mx.array]:
        """What a pipelined decode step evaluates besides its output: float rows' positions only.

        The next step's attention reads this layer's float key/value buffers
        anyway, and an array handed to ``mx.async_eval`` stays held while the
        next step is built, so a fused step (:meth:`step_buffers`) would have
        to copy the buffers instead of writing them in place.
        """
        if self.kv_bits is None and self.rotation == (False, False):
            return [] if self.positions is None else [self.positions]
        return self.state

    # ------------------------------------------------------------ storage
    def _grow(self, batch: int, needed: int, heads: int) -> None:
        capacity = 0 if self._k is None else self._k.length
        if needed <= capacity:
            return
        new_cap = ((needed + self.step - 1) // self.step) * self.step
        if self._k is None or self._v is None or self.positions is None:

            def zeros(d: int) -> _Rows:
                return _Rows.encode(mx.zeros((batch, heads, new_cap, d), self.dtype), self.kv_bits, self.dtype)

            self._k, self._v = zeros(self.spec.head_dim), zeros(self.spec.value_dim)
            self._set_positions(np.full((batch, new_cap), -1, dtype=np.int32))
            return
        held = self._held()
        self._place(_held_moves(held, 0), None, batch, new_cap)
        self._set_positions(_positions(held, 0, new_cap))

    def _held(self) -> np.ndarray:
        """Each row's positions in the columns in use (the host copy: no wait for the step in flight)."""
        assert self._host is not None
        return self._host[:, : self.length]

    def _set_positions(self, host: np.ndarray | None) -> None:
        """Hold ``host`` ``[B, capacity]`` as the positions (and an MLX copy of them)."""
        self._host = host
        self.positions = None if host is None else mx.array(host)

    def _place(self, moves: list[_Move], joining: tuple[_Rows, _Rows] | None, rows: int, capacity: int) -> None:
        """New key and value buffers (:func:`_lay_out`): source 0 this layer's, source 1 a joining row's."""
        assert self._k is not None and self._v is not None
        moves = [m for m in moves if m[4] > m[3]]  # rows holding nothing move nothing
        keys, values = [self._k], [self._v]
        if joining is not None:
            keys.append(joining[0])
            values.append(joining[1])
        self._k, self._v = _lay_out(keys, moves, rows, capacity), _lay_out(values, moves, rows, capacity)

    def _drop_unseen(self) -> None:
        """Sliding layers: drop leading columns no row's present or future query can see."""
        if self.window is None or self.positions is None or self.length < self.window + self.step:
            return
        pos = self._held()
        first_query = np.array(self.rows.offsets)[:, None]
        seen = (pos >= 0) & (pos > first_query - self.window)
        cut = int(seen.any(axis=0).argmax()) if seen.any() else self.length
        if cut > 0:
            self._cut_columns(cut)

    def _cut_columns(self, cut: int) -> None:
        assert self._k is not None and self._v is not None and self.positions is not None and self._host is not None
        self._k = self._k.map(lambda a: a[..., cut : self.length, :])
        self._v = self._v.map(lambda a: a[..., cut : self.length, :])
        self.positions, self._host = self.positions[:, cut : self.length], self._host[:, cut : self.length]
        self.length -= cut

    # ------------------------------------------------------------ rows joining and leaving
    def add_row(self, cache: Cache) -> None:
        """Append one sequence's cache (a single-sequence :class:`KVCache`/:class:`RingKVCache`).

        The new layout leaves room to the next growth step, so the first step after a join does not grow.
        """
        if not isinstance(cache, (KVCache, RingKVCache)):
            raise TypeError(f"a batched attention layer cannot take a {type(cache).__name__}")
        k, v, pos = cache.export_rows()
        if k is None or v is None:
            return self._add_empty_row()
        if self._k is None or self._v is None or self.positions is None:
            empty = len(self.rows) - 1  # rows already here hold nothing (e.g. fresh prompts prefilled together)
            self._k, self._v = _empty_like(k, empty, 0), _empty_like(v, empty, 0)
            self._set_positions(np.full((empty, 0), -1, dtype=np.int32))
        n, held = pos.size, self._held()
        width = max(self.length, n)
        pad, capacity = width - self.length, (width + self.step) // self.step * self.step
        joining = (len(held), 1, 0, 0, n, width - n)
        self._place([*_held_moves(held, pad), joining], (k, v), len(held) + 1, capacity)
        joined = [_positions(held, pad, capacity), _positions(np.array(pos)[None], width - n, capacity)]
        self._set_positions(np.concatenate(joined))
        self.length = width
        return None

    def _add_empty_row(self) -> None:
        if self._k is None or self._v is None or self.positions is None:
            return
        held = self._held()
        self._place(_held_moves(held, 0), None, len(held) + 1, self._k.length)
        empty = np.full((1, self.length), -1, np.int32)
        self._set_positions(_positions(np.concatenate([held, empty]), 0, self._k.length))

    def keep_rows(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (in that order), then drop leading columns left empty."""
        if self._k is None or self._v is None or self.positions is None:
            return
        if not keep:
            self._k = self._v = None
            self._set_positions(None)
            self.length = 0
            return
        held = self._held()[list(keep)]
        firsts = _first_held(held)
        cut = min(firsts)
        moves = [(i, 0, b, f, self.length, f - cut) for i, (b, f) in enumerate(zip(keep, firsts, strict=True))]
        self._place(moves, None, len(moves), self._k.length)
        self.length -= cut
        self._set_positions(_positions(held[:, cut:], 0, self._k.length))

    def export_row(self, row: int, into: Cache) -> None:
        """Load row ``row``'s tokens (in position order) into a fresh single-sequence cache."""
        if not isinstance(into, (KVCache, RingKVCache)):
            raise TypeError(f"a batched attention layer cannot fill a {type(into).__name__}")
        if self._k is None or self._v is None or self.positions is None:
            return
        pos = self._held()[row]
        cols = np.nonzero(pos >= 0)[0]
        cols = cols[np.argsort(pos[cols], kind="stable")]
        idx = mx.array(cols.astype(np.int32))
        k = self._k.map(lambda a: a[row : row + 1][:, :, idx, :])
        v = self._v.map(lambda a: a[row : row + 1][:, :, idx, :])
        into.load_rows(k, v, mx.array(pos[cols].astype(np.int32)), self.rows.offsets[row])

    def rewind_rows(self, keep: Sequence[int]) -> None:
        """Forget each row ``b``'s tokens at position ``keep[b]`` and after (their columns become holes)."""
        if self.positions is None:
            return
        assert self._host is not None
        self._set_positions(np.where(self._host >= np.array(keep, dtype=np.int32)[:, None], -1, self._host))

    def holes(self) -> int:
        """Columns a full layer could drop by :meth:`compact` (rewound tokens): a bound from the row positions."""
        return 0 if self.window is not None else self.length - max(self.rows.offsets, default=0)

    def compact(self) -> None:
        """Drop the holes rewinds left: each row's tokens move right, in order, over its holes (exact)."""
        if self.positions is None or self._k is None or self._v is None:
            return
        pos = self._held()
        valid = pos >= 0
        counts = valid.sum(axis=1)
        width = int(counts.max(initial=0))
        if width == self.length:
            return
        order = np.argsort(~valid, axis=1, kind="stable")  # each row's held columns first, in column order
        rank = np.arange(width)[None, :] - (width - counts)[:, None]  # right-aligned: padding first
        source = np.take_along_axis(order, np.maximum(rank, 0), axis=1)
        moved = np.where(rank >= 0, np.take_along_axis(pos, source, axis=1), -1)
        moves = []  # each row's runs of held columns moved right, in order, over its holes
        for b, row in enumerate(valid):
            cols, at = np.nonzero(row)[0], width - int(counts[b])
            for run in np.split(cols, np.nonzero(np.diff(cols) != 1)[0] + 1) if cols.size else []:
                moves.append((b, 0, b, int(run[0]), int(run[-1]) + 1, at))
                at += run.size
        self._place(moves, None, len(valid), self._k.length)
        self._set_positions(_positions(moved, 0, self._k.length))
        self.length = width

    def truncate(self, row: int, position: int) -> None:
        """Forget row ``row``'s tokens at ``position`` and after (their columns become holes)."""
        offsets = list(self.rows.offsets)
        offsets[row] = position
        self.rewind_rows(offsets)


class BatchExactRecentKVCache:
    """:class:`ExactRecentKVCache` for every row: a quantized :class:`BatchKVCache` holding every
    token and an unquantized one holding the recent tokens (a sliding layer of window ``recent``).
    """

    def __init__(self, rows: BatchRows, template: ExactRecentKVCache) -> None:
        self.rows = rows
        self.recent = template.recent
        q, e = template.quantized, template.exact
        self.quantized = BatchKVCache(rows, q.spec, q.dtype, q.kv_bits, rotation=stored_rotation(q))
        self.exact = BatchKVCache(rows, e.spec, e.dtype, None, step=max(self.recent, 16))

    @property
    def offset(self) -> mx.array:
        """Each row's position of its first new token, ``[B]`` int32."""
        return self.rows.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write ``keys``/``values`` ``[B, H, L, D]`` to both parts; the quantized columns, then the exact ones."""
        k_q, v_q = self.quantized.update_and_fetch(keys, values)
        k_e, v_e = self.exact.update_and_fetch(keys, values)
        return mx.concatenate([k_q, k_e], axis=2), mx.concatenate([v_q, v_e], axis=2)

    def mask(self, n_queries: int) -> mx.array:
        """Boolean ``[B, 1, L, S + T]``: as :meth:`ExactRecentKVCache.mask`, per row."""
        q, e = self.quantized, self.exact
        assert q.positions is not None and e.positions is not None
        queries = self.rows.queries(n_queries)[:, :, None]
        held, recent = q.positions[:, None, : q.length], e.positions[:, None, : e.length]
        return recent_split_mask(held, recent, queries, self.recent, q.window)[:, None]

    @property
    def state(self) -> list[mx.array]:
        """Arrays to evaluate together with the step's output."""
        return [*self.quantized.state, *self.exact.state]

    @property
    def step_state(self) -> list[mx.array]:
        """As :attr:`BatchKVCache.step_state`."""
        return [*self.quantized.step_state, *self.exact.step_state]

    def add_row(self, cache: Cache) -> None:
        """Append one sequence's :class:`ExactRecentKVCache`."""
        if not isinstance(cache, ExactRecentKVCache):
            raise TypeError(f"a batched exact-recent layer cannot take a {type(cache).__name__}")
        self.quantized.add_row(cache.quantized)
        self.exact.add_row(cache.exact)

    def keep_rows(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (in that order)."""
        self.quantized.keep_rows(keep)
        self.exact.keep_rows(keep)

    def export_row(self, row: int, into: Cache) -> None:
        """Load row ``row`` into a fresh single-sequence :class:`ExactRecentKVCache`."""
        if not isinstance(into, ExactRecentKVCache):
            raise TypeError(f"a batched exact-recent layer cannot fill a {type(into).__name__}")
        self.quantized.export_row(row, into.quantized)
        self.exact.export_row(row, into.exact)
        into.quantized.offset = into.exact.offset = self.rows.offsets[row]

    def rewind_rows(self, keep: Sequence[int]) -> None:
        """Forget each row ``b``'s tokens at position ``keep[b]`` and after, in both parts (holes)."""
        self.quantized.rewind_rows(keep)
        self.exact.rewind_rows(keep)

    def truncate(self, row: int, position: int) -> None:
        """Forget row ``row``'s tokens at ``position`` and after, in both parts."""
        self.quantized.truncate(row, position)
        self.exact.truncate(row, position)


class BatchRecurrentState:
    """One recurrent layer's state for every row: each named array gets a leading row axis.

    :meth:`truncate` can go back to the start of the latest step (the state
    before it is kept until the next step writes), which is exact; a position
    inside a step needs the per-token states, which the families do not hand out.
    """

    def __init__(self, rows: BatchRows, spec: StateSpec) -> None:
        self.rows = rows
        self.spec = spec
        self.dtype = getattr(mx, spec.dtype)
        self.arrays: dict[str, mx.array] = {}
        self._before: tuple[int, list[int], dict[str, mx.array]] | None = None

    @property
    def offset(self) -> mx.array:
        """Each row's position of its first new token, ``[B]`` int32."""
        return self.rows.offset

    def get(self, name: str, batch: int) -> mx.array:
        """The state ``name`` of every row (zeros when not yet written)."""
        arr = self.arrays.get(name)
        if arr is None:
            return mx.zeros((batch, *self.spec.shapes[name]), self.dtype)
        return arr

    def set(self, name: str, value: mx.array) -> None:
        """Store every row's new state ``name``."""
        if self._before is None or self._before[0] != self.rows.steps:
            self._before = (self.rows.steps, list(self.rows.offsets), dict(self.arrays))
        self.arrays[name] = value.astype(self.dtype)

    def advance(self, n: int) -> None:
        """The engine advances the shared positions; nothing to count here."""
        del n

    def mask(self, n_queries: int) -> None:
        """Recurrent layers need no attention mask."""
        return None

    @property
    def state(self) -> list[mx.array]:
        """Arrays to evaluate together with the step's output."""
        return list(self.arrays.values())

    @property
    def step_state(self) -> list[mx.array]:
        """As :attr:`BatchKVCache.step_state`: every array."""
        return self.state

    def add_row(self, cache: Cache) -> None:
        """Append one sequence's :class:`RecurrentState`."""
        if not isinstance(cache, RecurrentState):
            raise TypeError(f"a batched recurrent layer cannot take a {type(cache).__name__}")
        batch = len(self.rows) - 1  # rows already here (the new row's position is already listed)
        for name in self.spec.shapes:
            mine = self.arrays.get(name)
            theirs = cache.arrays.get(name)
            if mine is None and theirs is None:
                continue
            if mine is None:
                mine = mx.zeros((batch, *self.spec.shapes[name]), self.dtype)
            if theirs is None:
                theirs = mx.zeros((1, *self.spec.shapes[name]), self.dtype)
            self.arrays[name] = mx.concatenate([mine, theirs.astype(self.dtype)], axis=0)
        self._before = None

    def keep_rows(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep``."""
        idx = mx.array(list(keep), dtype=mx.int32)
        self.arrays = {} if not keep else {n: a[idx] for n, a in self.arrays.items()}
        self._before = None

    def export_row(self, row: int, into: Cache) -> None:
        """Copy row ``row``'s state into a fresh single-sequence :class:`RecurrentState`."""
        if not isinstance(into, RecurrentState):
            raise TypeError(f"a batched recurrent layer cannot fill a {type(into).__name__}")
        into.arrays = {n: mx.array(a[row : row + 1]) for n, a in self.arrays.items()}
        into.offset = self.rows.offsets[row]

    def rewind_rows(self, keep: Sequence[int]) -> None:
        """Return each row ``b`` with ``keep[b]`` short of its position to the start of the latest step.

        The only exact point kept: ``keep[b]`` must be that start (or the row's position: nothing to do).

        Raises:
            OptionError: A row asked to go anywhere else (nothing is changed then).
        """
        back = [b for b, k in enumerate(keep) if k != self.rows.offsets[b]]
        if not back:
            return
        latest = self._before is not None and self._before[0] == self.rows.steps - 1
        for b in back:
            if self._before is None or not latest or self._before[1][b] != keep[b]:
                start = self._before[1][b] if self._before is not None and latest else None
                msg = (
                    f"a recurrent layer can rewind row {b} only to the start of the latest step "
                    f"(position {start}), not to {keep[b]}"
                )
                raise OptionError(msg)
        assert self._before is not None
        before = self._before[2]
        rows = np.zeros(len(keep), dtype=bool)
        rows[back] = True
        for name, arr in self.arrays.items():
            old = before.get(name)
            if old is None:
                old = mx.zeros_like(arr)
            restore = mx.array(rows).reshape((-1,) + (1,) * (arr.ndim - 1))
            self.arrays[name] = mx.where(restore, old, arr)

    def truncate(self, row: int, position: int) -> None:
        """Return row ``row`` to the start of the latest step (the only exact point kept)."""
        offsets = list(self.rows.offsets)
        offsets[row] = position
        self.rewind_rows(offsets)


BatchCache = BatchKVCache | BatchExactRecentKVCache | BatchRecurrentState


class BatchCaches:
    """Every layer's batched cache plus the shared row positions (a ``list`` for the family).

    ``caches`` is handed to the family's forward in place of one sequence's
    cache list. Built from one sequence's fresh caches (a template: specs,
    dtype, KV quantization).
    """

    def __init__(self, template: Sequence[Cache]) -> None:
        self.rows = BatchRows()
        self.caches: list[Any] = [self._make(c) for c in template]

    def _make(self, cache: Cache) -> BatchCache:
        if isinstance(cache, RecurrentState):
            return BatchRecurrentState(self.rows, cache.spec)
        if isinstance(cache, ExactRecentKVCache):
            return BatchExactRecentKVCache(self.rows, cache)
        return BatchKVCache(self.rows, cache.spec, cache.dtype, cache.kv_bits, rotation=stored_rotation(cache))

    def __len__(self) -> int:
        return len(self.rows)

    def add_row(self, caches: Sequence[Cache], offset: int) -> int:
        """Append a sequence (its single-sequence caches, ``offset`` tokens consumed); returns its row."""
        self.rows.set([*self.rows.offsets, offset])
        for batch_cache, cache in zip(self.caches, caches, strict=True):
            batch_cache.add_row(cache)
        return len(self.rows) - 1

    def keep_rows(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (the others leave), in that order."""
        offsets = self.rows.offsets
        for cache in self.caches:
            cache.keep_rows(keep)
        self.rows.set([offsets[i] for i in keep])

    def export_row(self, row: int, fresh: Sequence[Cache]) -> None:
        """Fill ``fresh`` single-sequence caches with row ``row`` (e.g. to park it in a session)."""
        for batch_cache, cache in zip(self.caches, fresh, strict=True):
            batch_cache.export_row(row, cache)
            if isinstance(cache, KVCache):
                cache.offset = self.rows.offsets[row]

    def truncate(self, row: int, position: int) -> None:
        """Rewind row ``row`` to ``position`` (drop its later tokens), exactly, in every layer."""
        keep = list(self.rows.offsets)
        keep[row] = position
        self.rewind(keep)

    def rewind(self, keep: Sequence[int]) -> None:
        """Each row ``b`` keeps its first ``keep[b]`` tokens, exactly, in every layer (one pass for all rows).

        Attention layers cut anywhere; a recurrent layer only back to the start
        of the latest step (see :attr:`cuts_anywhere`).

        Raises:
            OptionError: A position a row never held, or one a recurrent layer cannot return to
                (nothing is changed then).
        """
        for row, (position, held) in enumerate(zip(keep, self.rows.offsets, strict=True)):
            if not 0 <= position <= held:
                msg = f"row {row} holds {held} tokens; cannot rewind it to position {position}"
                raise OptionError(msg)
        # recurrent layers first: they may refuse, and then nothing has changed
        for cache in sorted(self.caches, key=lambda c: not isinstance(c, BatchRecurrentState)):
            cache.rewind_rows(keep)
        self.rows.set(keep)

    @property
    def cuts_anywhere(self) -> bool:
        """Whether every layer can rewind a row to any position of the latest step (no recurrent layer)."""
        return not any(isinstance(c, BatchRecurrentState) for c in self.caches)

    def compact(self, slack: int) -> None:
        """Drop the holes rewinds left in full-attention layers (an exact-recent layer's two parts
        among them) once they exceed ``slack`` columns."""
        for cache in self.caches:
            parts = (cache.quantized, cache.exact) if isinstance(cache, BatchExactRecentKVCache) else (cache,)
            for part in parts:
                if isinstance(part, BatchKVCache) and part.holes() > slack:
                    part.compact()

    def step_done(self, n: int) -> None:
        """After a forward of ``n`` tokens per row: advance the positions."""
        self.rows.advance(n)

    @property
    def state(self) -> list[mx.array]:
        """Every array to evaluate with a step's output."""
        return [a for c in self.caches for a in c.state]

    @property
    def step_state(self) -> list[mx.array]:
        """The arrays a pipelined decode step evaluates with its output (see :attr:`BatchKVCache.step_state`)."""
        return [a for c in self.caches for a in c.step_state]
