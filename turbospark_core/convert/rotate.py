"""``turbospark convert --rotate``: fold a randomized Hadamard rotation into the install's weights."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from turbospark_core import plugins
from turbospark_core.dequant import dequantize
from turbospark_core.errors import ConversionError
from turbospark_core.hadamard import fold_rotation, section_for
from turbospark_core.tensor_index import QuantSpec


def refuse_unrotatable(hooks: plugins.FamilyHooks, arch: dict[str, Any]) -> None:
    """Refuse ``--rotate`` for a family that does not serve rotated installs (before any tensor is read)."""
    if not hooks.accepts_hadamard(arch):
        msg = (
            f"--rotate: family {hooks.spec.name!r} (model type {arch['model_type']!r}) does not serve "
            f"hadamard-rotated installs; convert without --rotate"
        )
        raise ConversionError(msg)


def dequantize_all(tensors: dict[str, mx.array], quantization: dict[str, Any]) -> None:
    """Turn every pre-quantized matrix back into float32 (the rotation needs the real values)."""
    for base, q in sorted(quantization.items()):
        if q.get("mode", "affine") != "affine":
            msg = f"--rotate: {base!r} is stored as {q.get('mode')!r}, which cannot be dequantized for rotation"
            raise ConversionError(msg)
        scales = tensors.pop(f"{base}.scales")
        biases = tensors.pop(f"{base}.biases", None)
        spec = QuantSpec(bits=q["bits"], group_size=q["group_size"])
        tensors[f"{base}.weight"] = dequantize(tensors[f"{base}.weight"], scales, biases, spec, mx.float32)
    quantization.clear()


class RotationStep:
    """The assembler's ``before_cast`` step for ``--rotate``; keeps the section and signs it made."""

    def __init__(self, hooks: plugins.FamilyHooks, arch: dict[str, Any], seed: int) -> None:
        self.hooks = hooks
        self.arch = arch
        self.seed = seed
        self.result: tuple[dict[str, Any], bytes] | None = None

    def __call__(self, tensors: dict[str, mx.array], quantization: dict[str, Any]) -> None:
        dequantize_all(tensors, quantization)
        rmap = self.hooks.hadamard_residual_map(self.arch, sorted(tensors))
        if rmap is None:
            msg = f"--rotate: family {self.hooks.spec.name!r} gives no hadamard residual map; convert without --rotate"
            raise ConversionError(msg)
        signs = fold_rotation(tensors, rmap, self.seed, self.hooks.spec.name)
        self.result = (section_for(rmap, self.seed), signs.tobytes())
