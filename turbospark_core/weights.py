"""Mapped weights: the install's tensors, handed to families as the objects of :mod:`turbospark_core.layers`."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Protocol, cast

import mlx.core as mx

from turbospark_core import dequant, kernel_speed, native
from turbospark_core.compute import ComputePolicy
from turbospark_core.errors import InstallError
from turbospark_core.layers import Embedding, ExpertBank, Experts, Linear
from turbospark_core.tensor_index import TensorIndex


class ExpertSource(Protocol):
    """Where routed experts live when not in this container (``experts.bin``, open step 10)."""

    def has(self, prefix: str) -> bool:
        """Whether ``prefix`` is a routed layer it holds."""
        ...

    def bank(self, prefix: str, gate: str, up: str, down: str) -> Experts:
        """The experts of layer ``prefix``; each layer is asked for once."""
        ...

    def materialize(self) -> None:
        """Evaluate what it holds once, at the end of the open."""
        ...

    def unused(self) -> list[str]:
        """Routed layers the family never asked for."""
        ...


class WeightStore:
    """The install's tensors, held as the compute policy says.

    Families ask for objects by install name; the store decides whether a
    matrix stays quantized or is unpacked to float, so families never see it.
    """

    def __init__(self, path: Path, index: TensorIndex, policy: ComputePolicy) -> None:
        self.index = index
        self.policy = policy
        self._path = path
        self._raw = self._load()
        self._names = frozenset(self._raw)
        self._used: set[str] = set()
        self._pending: list[mx.array | weakref.ref[mx.array]] = []
        self._experts: ExpertSource | None = None

    def use_experts(self, store: ExpertSource | None) -> None:
        """Serve routed experts from ``experts.bin`` (open step 10) instead of this container."""
        self._experts = store

    def _load(self) -> dict[str, mx.array]:
        return cast(dict[str, mx.array], mx.load(str(self._path)))  # lazily: a safetensors file loads as a dict

    def has(self, name: str) -> bool:
        """Whether tensor (or quantized matrix base) ``name`` exists."""
        return name in self._names or name in self.index.quantization

    def _claim(self, name: str) -> None:
        """Mark tensor ``name`` used; refuse it by name where the install has none."""
        if name not in self._names:
            msg = (
                f"the install has no tensor {name!r}, which the family's flow needs; "
                f"the install is incomplete or was made for another config, re-run "
                f"`turbospark convert`"
            )
            raise InstallError(msg)
        self._used.add(name)

    def _take(self, name: str) -> mx.array:
        """Tensor ``name`` as a lazy read of the file, once :meth:`_claim` has marked it.

        The store lets go of it: a read it kept would keep its bytes once evaluated
        (a bfloat16 matrix beside its float32 copy); a tensor taken twice is read
        lazily again.
        """
        self._claim(name)
        arr = self._raw.pop(name, None)
        return self._load()[name] if arr is None else arr

    def _held(self, arr: mx.array, *, weak: bool = False) -> mx.array:
        """``arr``, read (or computed) once at :meth:`materialize`.

        A tensor left lazy would be read from the file again by every compiled
        step that captured it before its first evaluation. ``weak``: only while
        something else still holds it (a :class:`Linear`'s arrays: a family that
        fuses matrices drops the parts, whose copies would otherwise stay
        resident until :meth:`materialize`, beside the fused one); a tensor
        handed out bare stays held, as a family may keep only what it computes
        from it.
        """
        self._pending.append(weakref.ref(arr) if weak else arr)
        return arr

    def _float(self, arr: mx.array, *, weak: bool = False) -> mx.array:
        if self.policy.unpack and arr.dtype != self.policy.compute_dtype:
            arr = arr.astype(self.policy.compute_dtype)
        return self._held(arr, weak=weak)

    def tensor(self, name: str) -> mx.array:
        """A float tensor (norm weights, biases, router matrices)."""
        if name in self.index.quantization:
            return self._held(self._dequantized(name))
        return self._float(self._take(name))

    def optional(self, name: str) -> mx.array | None:
        """A float tensor, or ``None`` when the install does not have it."""
        return self.tensor(name) if self.has(name) else None

    def _dequantized(self, base: str) -> mx.array:
        # Affine scales/biases are widened first: exact, and float32 dequantization
        # is both more accurate and faster on the CPU than half precision.
        biases = self._take(f"{base}.biases") if f"{base}.biases" in self._names else None
        return dequant.dequantize(
            self._take(f"{base}.weight"),
            self._take(f"{base}.scales"),
            biases,
            self.index.quantization[base],
            self.policy.compute_dtype,
        )

    def linear(self, base: str, *, native_ok: bool = True) -> Linear:
        """The matrix ``<base>.weight`` (and ``<base>.bias`` when present).

        Quantized matrices stay quantized when the policy has native kernels for
        their layout (``native_ok=False`` for expert stacks, which gather). Narrow
        groups that MLX's kernels do not take are unpacked where the native kernels
        do not multiply them, whatever the policy.
        """
        bias_name = f"{base}.bias"
        bias = self._float(self._take(bias_name), weak=True) if bias_name in self._names else None
        quant = self.index.quantization.get(base)
        if quant is None:
            return Linear(self._float(self._take(f"{base}.weight"), weak=True), bias)
        takes = kernel_speed.stays_quantized(quant) if self.policy.unpack else native.supports(quant)
        native_here = native_ok and self.policy.native and takes
        if not native_here and (self.policy.unpack or not quant.mlx_kernels):
            return Linear(self._held(self._dequantized(base), weak=True), bias)
        scales = self._take(f"{base}.scales")
        biases = self._take(f"{base}.biases") if f"{base}.biases" in self._names else None
        affine = native_here and biases is not None and quant.mode == "affine"
        if affine and dequant.is_symmetric(scales, biases, quant.bits):  # type: ignore[arg-type]  # not None
            biases = None  # the kernels derive them: a symmetric matrix's biases are never read per token
        weight, scales = self._held(self._take(f"{base}.weight"), weak=True), self._held(scales, weak=True)
        held_biases = None if biases is None else self._held(biases, weak=True)
        return Linear(weight, bias, quant=quant, scales=scales, biases=held_biases)

    def embedding(self, base: str) -> Embedding:
        """The embedding table ``<base>.weight``."""
        return Embedding(self.linear(base), self.policy.compute_dtype)

    def experts(self, prefix: str, gate: str, up: str, down: str) -> Experts:
        """The routed experts under ``prefix`` (stacked ``[E, out, in]`` matrices).

        From ``experts.bin`` when the install has one: resident or streamed as
        the open's residency plan says; both answer ``glu`` and ``num_experts``.
        """
        if self._experts is not None and self._experts.has(prefix):
            return self._experts.bank(prefix, gate, up, down)
        return ExpertBank(
            self.linear(f"{prefix}.{gate}"), self.linear(f"{prefix}.{up}"), self.linear(f"{prefix}.{down}")
        )

    def materialize(self) -> None:
        """Evaluate every unpacked weight once, so no forward pass redoes it."""
        held = [a() if isinstance(a, weakref.ref) else a for a in self._pending]
        self._pending.clear()
        if alive := [a for a in held if a is not None]:
            mx.eval(alive)
        if self._experts is not None:
            self._experts.materialize()

    def unused(self) -> list[str]:
        """Tensors the family never asked for (a sign of a mismatched install)."""
        layers = [] if self._experts is None else [f"{p} (experts.bin)" for p in self._experts.unused()]
        return sorted(self._names - self._used) + layers
