"""Mapped weights and the linear / embedding / expert objects families call."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

import mlx.core as mx

from turbospark_core import native
from turbospark_core.compute import ComputePolicy
from turbospark_core.errors import InstallError
from turbospark_core.tensor_index import QuantSpec, TensorIndex

if TYPE_CHECKING:
    from turbospark_core.moe import ExpertStore, StreamedExpertBank


class Linear:
    """``y = x @ W.T (+ b)``, dense or through MLX's quantized matmul."""

    def __init__(
        self,
        weight: mx.array,
        bias: mx.array | None = None,
        *,
        quant: QuantSpec | None = None,
        scales: mx.array | None = None,
        biases: mx.array | None = None,
    ) -> None:
        self.weight = weight
        self.bias = bias
        self.quant = quant
        self.scales = scales
        self.biases = biases

    @property
    def out_features(self) -> int:
        """Rows of the weight matrix."""
        return self.weight.shape[-2]

    def __call__(self, x: mx.array) -> mx.array:
        if self.quant is None:
            y = x @ self.weight.T if self.bias is None else mx.addmm(self.bias, x, self.weight.T)
            return y
        y = native.quantized_matmul(x, self.weight, self.scales, self.biases, self.quant)
        return y if self.bias is None else y + self.bias


class Embedding:
    """Token embedding table, also usable as a tied output head.

    Rows come back in ``dtype`` (the compute dtype), whatever the storage.
    """

    def __init__(self, table: Linear, dtype: mx.Dtype | None = None) -> None:
        self.table = table
        self.dtype = dtype

    def __call__(self, ids: mx.array) -> mx.array:
        rows = self._rows(ids)
        return rows if self.dtype is None or rows.dtype == self.dtype else rows.astype(self.dtype)

    def _rows(self, ids: mx.array) -> mx.array:
        t = self.table
        if t.quant is None:
            return t.weight[ids]
        # only the gathered rows are dequantized; affine scales widened first, as at unpacking
        widen = self.dtype is not None and t.quant.mode == "affine"
        scales, biases = t.scales[ids], None if t.biases is None else t.biases[ids]
        return mx.dequantize(
            t.weight[ids],
            scales.astype(self.dtype) if widen else scales,
            biases.astype(self.dtype) if widen and biases is not None else biases,
            group_size=t.quant.group_size,
            bits=t.quant.bits,
            mode=t.quant.mode,
        )

    def as_linear(self, x: mx.array) -> mx.array:
        """Project hidden states onto the vocabulary (tied head)."""
        return self.table(x)


class ExpertBank:
    """Routed experts of one MoE layer, held by the core.

    Each projection is a stacked ``[num_experts, out, in]`` matrix. Families
    route, then call :meth:`glu` with the chosen expert indices; how experts
    are held (resident now, streamed later) is the core's business.
    """

    def __init__(self, gate: Linear, up: Linear, down: Linear) -> None:
        self.gate, self.up, self.down = gate, up, down

    @property
    def num_experts(self) -> int:
        """How many experts the layer has."""
        return self.gate.weight.shape[0]

    def glu(
        self,
        x: mx.array,
        indices: mx.array,
        activation: Callable[[mx.array, mx.array], mx.array],
    ) -> mx.array:
        """Gated expert MLP for each chosen expert.

        Args:
            x: Hidden states ``[..., D]``.
            indices: Chosen experts ``[..., k]`` (integer).
            activation: ``(gate, up) -> hidden``, e.g. ``silu(gate) * up``.

        Returns:
            ``[..., k, D]``: each chosen expert's output (unweighted).
        """
        if indices.size >= SORT_THRESHOLD:
            return self._glu_sorted(x, indices, activation)
        xe = mx.expand_dims(x, (-2, -3))
        h = activation(_gather(self.gate, xe, indices), _gather(self.up, xe, indices))
        return _gather(self.down, h, indices).squeeze(-2)

    def _glu_sorted(
        self, x: mx.array, indices: mx.array, activation: Callable[[mx.array, mx.array], mx.array]
    ) -> mx.array:
        # Many (token, expert) pairs: group them by expert so each expert's rows are contiguous
        k = indices.shape[-1]
        flat = indices.flatten()
        order = mx.argsort(flat)
        rows = mx.expand_dims(x.reshape(-1, x.shape[-1])[order // k], -2)
        idx = flat[order]
        h = activation(_gather(self.gate, rows, idx, True), _gather(self.up, rows, idx, True))
        y = _gather(self.down, h, idx, True).squeeze(-2)
        return y[mx.argsort(order)].reshape(*indices.shape, y.shape[-1])


SORT_THRESHOLD = 64


def _gather(proj: Linear, x: mx.array, indices: mx.array, is_sorted: bool = False) -> mx.array:
    if proj.quant is None:
        y = mx.gather_mm(x, proj.weight.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=is_sorted)
    else:
        y = mx.gather_qmm(
            x,
            proj.weight,
            proj.scales,
            proj.biases,
            rhs_indices=indices,
            sorted_indices=is_sorted,
            transpose=True,
            group_size=proj.quant.group_size,
            bits=proj.quant.bits,
            mode=proj.quant.mode,
        )
    if proj.bias is not None:
        y = y + mx.expand_dims(proj.bias[indices], -2)
    return y


class WeightStore:
    """The install's tensors, held as the compute policy says.

    Families ask for objects by install name; the store decides whether a
    matrix stays quantized or is unpacked to float, so families never see it.
    """

    def __init__(self, path: Path, index: TensorIndex, policy: ComputePolicy) -> None:
        self.index = index
        self.policy = policy
        self._raw = mx.load(str(path))
        self._used: set[str] = set()
        self._pending: list[mx.array] = []
        self._experts: ExpertStore | None = None

    def use_experts(self, store: ExpertStore | None) -> None:
        """Serve routed experts from ``experts.bin`` (open step 10) instead of this container."""
        self._experts = store

    def has(self, name: str) -> bool:
        """Whether tensor (or quantized matrix base) ``name`` exists."""
        return name in self._raw or name in self.index.quantization

    def _take(self, name: str) -> mx.array:
        try:
            arr = self._raw[name]
        except KeyError:
            msg = (
                f"the install has no tensor {name!r}, which the family's flow needs; "
                f"the install is incomplete or was made for another config, re-run "
                f"`turbospark convert`"
            )
            raise InstallError(msg) from None
        self._used.add(name)
        return arr

    def _float(self, arr: mx.array) -> mx.array:
        if self.policy.unpack and arr.dtype != self.policy.compute_dtype:
            arr = arr.astype(self.policy.compute_dtype)
            self._pending.append(arr)
        return arr

    def tensor(self, name: str) -> mx.array:
        """A float tensor (norm weights, biases, router matrices)."""
        if name in self.index.quantization:
            return self._unpacked(name) if self.policy.unpack else self._dequantized(name)
        return self._float(self._take(name))

    def optional(self, name: str) -> mx.array | None:
        """A float tensor, or ``None`` when the install does not have it."""
        return self.tensor(name) if self.has(name) else None

    def _dequantized(self, base: str) -> mx.array:
        # Widen scales/biases first: exact, and float32 dequantization is both
        # more accurate and faster on the CPU than half precision.
        dtype = self.policy.compute_dtype
        quant = self.index.quantization[base]
        biases = self._take(f"{base}.biases") if f"{base}.biases" in self._raw else None
        w = mx.dequantize(
            self._take(f"{base}.weight"),
            self._take(f"{base}.scales").astype(dtype) if quant.mode == "affine" else self._take(f"{base}.scales"),
            None if biases is None else biases.astype(dtype),
            group_size=quant.group_size,
            bits=quant.bits,
            mode=quant.mode,
        )
        return w.astype(dtype)

    def _unpacked(self, base: str) -> mx.array:
        w = self._dequantized(base)
        self._pending.append(w)
        return w

    def linear(self, base: str, *, native_ok: bool = True) -> Linear:
        """The matrix ``<base>.weight`` (and ``<base>.bias`` when present).

        Quantized matrices stay quantized when the policy has native kernels for
        their layout (``native_ok=False`` for expert stacks, which gather).
        """
        bias_name = f"{base}.bias"
        bias = self._float(self._take(bias_name)) if bias_name in self._raw else None
        quant = self.index.quantization.get(base)
        if quant is None:
            return Linear(self._float(self._take(f"{base}.weight")), bias)
        if self.policy.unpack and not (native_ok and self.policy.native and native.supports(quant)):
            return Linear(self._unpacked(base), bias)
        biases = self._take(f"{base}.biases") if f"{base}.biases" in self._raw else None
        return Linear(
            self._take(f"{base}.weight"),
            bias,
            quant=quant,
            scales=self._take(f"{base}.scales"),
            biases=biases,
        )

    def embedding(self, base: str) -> Embedding:
        """The embedding table ``<base>.weight``."""
        return Embedding(self.linear(base), self.policy.compute_dtype)

    def experts(self, prefix: str, gate: str, up: str, down: str) -> ExpertBank | StreamedExpertBank:
        """The routed experts under ``prefix`` (stacked ``[E, out, in]`` matrices).

        From ``experts.bin`` when the install has one: resident or streamed as
        the open's residency plan says; both answer ``glu`` and ``num_experts``.
        """
        if self._experts is not None and self._experts.has(prefix):
            return self._experts.bank(prefix, gate, up, down)
        return ExpertBank(
            self.linear(f"{prefix}.{gate}", native_ok=False),
            self.linear(f"{prefix}.{up}", native_ok=False),
            self.linear(f"{prefix}.{down}", native_ok=False),
        )

    def materialize(self) -> None:
        """Evaluate every unpacked weight once, so no forward pass redoes it."""
        if self._pending:
            mx.eval(self._pending)
            self._pending.clear()
        if self._experts is not None:
            self._experts.materialize()

    def unused(self) -> list[str]:
        """Tensors the family never asked for (a sign of a mismatched install)."""
        layers = [] if self._experts is None else [f"{p} (experts.bin)" for p in self._experts.unused()]
        return sorted(set(self._raw) - self._used) + layers
