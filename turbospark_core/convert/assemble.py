"""Turn mapped source tensors into install tensors: stack experts, cast, quantize."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core.convert.records import AffineQuantized, SourceTensor, TensorTarget
from turbospark_core.errors import ConversionError

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
QUANTIZE = {"q3": 3, "q4": 4, "q8": 8}
MIN_CALIBRATION_TOKENS = 128  # --calibrate-tokens below this is refused (and a text shorter than it)
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


@attrs.frozen(kw_only=True)
class ConvertOptions:
    """What ``turbospark convert`` was asked."""

    dtype: str | None = None
    quantize: str | None = None
    group_size: int = 64
    strict: bool = False  # GGUF: refuse block types with no exact affine form
    experts_file: bool = True  # MoE: routed experts go to experts.bin
    rotate: bool = False  # fold a randomized Hadamard rotation of the residual stream (before quantizing)
    rotate_seed: int = 0
    calibrate: str | None = None  # a text file: quantize with GPTQ from the model's inputs on it
    calibrate_tokens: int | None = None  # tokens of that text used (None: the default)
    calibrate_sequential: bool = False  # GPTQ inputs through the layers already quantized (one pass per layer)

    def __attrs_post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            msg = f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}"
            raise ConversionError(msg)
        if self.quantize is not None and self.quantize not in QUANTIZE:
            msg = f"--quantize {self.quantize!r} is not one of {', '.join(QUANTIZE)}"
            raise ConversionError(msg)
        if self.group_size not in (32, 64, 128):
            msg = f"--group-size {self.group_size} is not one of 32, 64, 128"
            raise ConversionError(msg)
        if self.calibrate is not None and self.quantize is None:
            msg = "--calibrate chooses how --quantize rounds each matrix; add --quantize q3|q4|q8 or drop --calibrate"
            raise ConversionError(msg)
        if self.calibrate_tokens is not None and self.calibrate is None:
            msg = "--calibrate-tokens sets how much of the --calibrate text is used; add --calibrate or drop it"
            raise ConversionError(msg)
        if self.calibrate_sequential and self.calibrate is None:
            msg = "--calibrate-sequential sets how --calibrate computes its inputs; add --calibrate or drop it"
            raise ConversionError(msg)
        if self.calibrate_tokens is not None and self.calibrate_tokens < MIN_CALIBRATION_TOKENS:
            msg = f"--calibrate-tokens {self.calibrate_tokens} is below {MIN_CALIBRATION_TOKENS}; pass more tokens"
            raise ConversionError(msg)


def _as_mx(data: np.ndarray | mx.array) -> mx.array:
    return data if isinstance(data, mx.array) else mx.array(data)


@attrs.define
class Assembler:
    """Collects targets and produces the install's tensors and quantization table."""

    options: ConvertOptions
    tensors: dict[str, mx.array] = attrs.Factory(dict)
    quantization: dict[str, Any] = attrs.Factory(dict)
    keep_dtype: set[str] = attrs.Factory(set)
    _experts: dict[str, dict[int, mx.array]] = attrs.Factory(dict)
    # runs on the float tensors and the quantization table after experts are stacked, before cast/quantize
    before_cast: Callable[[dict[str, mx.array], dict[str, Any]], None] | None = None

    def add(self, target: TensorTarget, tensor: SourceTensor, quant: dict[str, Any] | None = None) -> None:
        """Place one source tensor; ``quant`` is given for pre-quantized (mlx-lm) parts."""
        name = target.name
        assert name is not None  # dropped tensors never reach here
        if target.keep_dtype:
            self.keep_dtype.add(name)
        data = tensor.data
        if isinstance(data, AffineQuantized):
            self._add_quantized(name, data)
            return
        arr = _as_mx(data)
        if quant is not None:
            self.quantization[name.rpartition(".")[0]] = quant
        if target.expert is not None:
            self._experts.setdefault(name, {})[target.expert] = arr
        else:
            self._put(name, arr)

    def _put(self, name: str, arr: mx.array) -> None:
        if name in self.tensors:
            msg = f"two source tensors map onto install tensor {name!r}; the checkpoint has duplicates"
            raise ConversionError(msg)
        self.tensors[name] = arr

    def _add_quantized(self, name: str, q: AffineQuantized) -> None:
        base = name.rpartition(".")[0]
        self._put(f"{base}.weight", mx.array(q.weight))
        self._put(f"{base}.scales", mx.array(q.scales))
        if q.biases is not None:
            self._put(f"{base}.biases", mx.array(q.biases))
        self.quantization[base] = {"bits": q.bits, "group_size": q.group_size, "mode": q.mode}

    def finish(self, *, quantize: bool = True) -> tuple[dict[str, mx.array], dict[str, Any]]:
        """Stack experts, cast floats, quantize (unless not ``quantize``: then call :meth:`quantize` later);
        returns tensors and the quantization table."""
        for name, parts in sorted(self._experts.items()):
            missing = sorted(set(range(max(parts) + 1)) - set(parts))
            if missing:
                msg = f"stacked expert tensor {name!r} lacks expert(s) {missing}; the checkpoint is incomplete"
                raise ConversionError(msg)
            self._put(name, mx.stack([parts[i] for i in range(len(parts))]))
        self._experts.clear()
        if self.before_cast is not None:
            self.before_cast(self.tensors, self.quantization)
        self._cast()
        if quantize:
            self.quantize()
        return self.tensors, self.quantization

    def _cast(self) -> None:
        if self.options.dtype is None:
            return
        dtype = DTYPES[self.options.dtype]
        packed = {f"{b}.weight" for b in self.quantization}
        for name, arr in self.tensors.items():
            if name not in packed and name not in self.keep_dtype and arr.dtype in _FLOATS:
                self.tensors[name] = arr.astype(dtype)

    def quantizable(self) -> list[str]:
        """The bases of the float matrices ``--quantize`` quantizes (input width a multiple of the group)."""
        gs = self.options.group_size
        out = []
        for name in sorted(self.tensors):
            base, _, leaf = name.rpartition(".")
            arr = self.tensors[name]
            skip = leaf != "weight" or base in self.quantization or name in self.keep_dtype
            if not (skip or arr.ndim < 2 or arr.shape[-1] % gs):
                out.append(base)
        return out

    def quantize(self, solved: Mapping[str, AffineQuantized] | None = None) -> None:
        """Quantize every :meth:`quantizable` matrix (nothing without ``--quantize``): the ``solved``
        ones as given (GPTQ), the others by round-to-nearest (``mx.quantize``)."""
        if not self.options.quantize:
            return
        bits, gs = QUANTIZE[self.options.quantize], self.options.group_size
        for base in self.quantizable():
            arr = self.tensors[f"{base}.weight"]
            q = (solved or {}).get(base)
            if q is None:
                w, scales, biases = mx.quantize(arr, group_size=gs, bits=bits)
            else:  # values exact in the weight's dtype (GPTQ rounds them so)
                assert q.biases is not None  # affine results always carry biases
                w, scales, biases = _as_mx(q.weight), _as_mx(q.scales), _as_mx(q.biases)
                scales, biases = scales.astype(arr.dtype), biases.astype(arr.dtype)
            self.tensors[f"{base}.weight"] = w
            self.tensors[f"{base}.scales"] = scales
            self.tensors[f"{base}.biases"] = biases
            self.quantization[base] = {"bits": bits, "group_size": gs, "mode": "affine"}


def map_all(
    assembler: Assembler,
    items: Iterable[tuple[TensorTarget | None, SourceTensor, dict[str, Any] | None]],
) -> None:
    """Feed mapped tensors to ``assembler``; a ``None`` target means no plugin claimed it."""
    for target, tensor, quant in items:
        if target is None:
            msg = f"no plugin maps source tensor {tensor.name!r}; the family plugin is incomplete"
            raise ConversionError(msg)
        if target.name is not None:
            assembler.add(target, tensor, quant)
