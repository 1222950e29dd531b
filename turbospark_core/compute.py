"""Compute policy: how weights are held and multiplied, chosen by the core per backend."""

from __future__ import annotations

import attrs
import mlx.core as mx

from turbospark_core import native

GPU_COMPUTE_DTYPE = mx.bfloat16  # activations on a GPU: float16 overflows in some families (Gemma)


@attrs.frozen(kw_only=True)
class ComputePolicy:
    """How the core holds weights for the families' linear/embedding/expert objects.

    Attributes:
        unpack: Dequantize quantized matrices and widen half floats to
            ``compute_dtype`` at open (the CPU's fast path: MLX's CPU
            quantized/half kernels are slow and ``gather_mm`` is float32-only).
        compute_dtype: Activation dtype (and weight dtype when unpacking).
        reason: One line saying why, for ``turbospark inspect``.
        native: Quantized matrices whose layout the native kernels support stay
            quantized and multiply through them (see :mod:`turbospark_core.native`).
    """

    unpack: bool
    compute_dtype: mx.Dtype = attrs.field(eq=False)
    reason: str
    native: bool = False

    @classmethod
    def choose(cls, *, unpacked_bytes: int, stored_bytes: int, budget: int, unpack: bool = True) -> ComputePolicy:
        """Pick the policy for the default device within ``budget`` bytes.

        ``unpacked_bytes``: the weights held under the unpacking policy (float32,
        except the quantized matrices the native kernels multiply as stored).
        ``unpack=False`` keeps the stored form whatever fits (the ranks of a
        distributed open all hold weights alike, so one rank that cannot unpack
        decides for the group).
        """
        on_cpu = mx.default_device() == mx.cpu
        if not on_cpu:
            return cls(unpack=False, compute_dtype=GPU_COMPUTE_DTYPE, reason="gpu: stored weights, quantized kernels")
        kernels = _native_note()
        if unpack and unpacked_bytes <= budget:
            return cls(
                unpack=True,
                compute_dtype=mx.float32,
                native=native.available(),
                reason=(
                    f"cpu: float32 compute, {kernels}; weights as held ({unpacked_bytes / 1e9:.2f} GB) fit the budget"
                ),
            )
        return cls(
            unpack=False,
            compute_dtype=mx.float32,
            native=native.available(),
            reason=(
                f"cpu: float32 compute, {kernels}; unpacked weights ({unpacked_bytes / 1e9:.2f} GB) "
                f"{'exceed the budget' if unpack else 'exceed the budget of another rank'}, keeping stored form "
                f"({stored_bytes / 1e9:.2f} GB)"
            ),
        )


def _native_note() -> str:
    if native.available():
        return f"quantized matrices stay quantized ({native.STATUS})"
    return f"quantized matrices unpacked: {native.STATUS}"
