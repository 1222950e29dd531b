"""Tensors in flight between a conversion source and the install writer."""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np


@attrs.frozen(kw_only=True)
class AffineQuantized:
    """An MLX affine-quantized matrix: ``w = scales * q + biases`` per group.

    Attributes:
        weight: uint32 array (numpy or mx) ``[..., rows, cols * bits // 32]``, MLX packing (element
            ``i`` of a word at bits ``i * bits``, low bits first).
        scales: ``[rows, cols // group_size]`` float array (float16/float32).
        biases: same shape and dtype as ``scales``.
        bits: 2, 3, 4, 5, 6 or 8.
        group_size: 32, 64 or 128 (MLX's groups), or 16 (GGUF K-quants' sub-blocks;
            see :data:`turbospark_core.tensor_index.NARROW_GROUPS`).
        mode: ``"affine"`` (MLX's default mode).
    """

    weight: np.ndarray | mx.array = attrs.field(eq=False)
    scales: np.ndarray | mx.array = attrs.field(eq=False)
    biases: np.ndarray | mx.array | None = attrs.field(eq=False)
    bits: int
    group_size: int
    mode: str = "affine"

    @property
    def shape(self) -> tuple[int, int]:
        """The logical (dequantized) shape ``(rows, cols)``."""
        rows, words = self.weight.shape[-2], self.weight.shape[-1]
        return (rows, words * 32 // self.bits)

    def take_rows(self, order: np.ndarray | mx.array | slice) -> AffineQuantized:
        """Reorder (or select: an index array or a slice) rows along the row axis,
        ``-2`` (groups run along a row, so this is exact); a leading expert axis is kept."""
        return attrs.evolve(
            self,
            weight=self.weight[..., order, :],
            scales=self.scales[..., order, :],
            biases=None if self.biases is None else self.biases[..., order, :],
        )


@attrs.frozen(kw_only=True)
class SourceTensor:
    """One tensor read from a source, already in Hugging Face orientation.

    Attributes:
        name: The source's name for it (Hugging Face name, or GGUF name).
        data: A float array (numpy, or ``mx.array`` for bfloat16 sources;
            ``[out, in]`` for matrices) or an :class:`AffineQuantized` matrix.
    """

    name: str
    data: np.ndarray | mx.array | AffineQuantized = attrs.field(eq=False)


@attrs.frozen(kw_only=True)
class TensorTarget:
    """Where a source tensor goes in the install.

    Attributes:
        name: The install name, or ``None`` to drop the tensor.
        expert: For per-expert source tensors, the expert index within the
            stacked install tensor ``name`` (shape ``[num_experts, ...]``).
        unpermute_heads: GGUF rotary projections only: undo the interleaved
            rotary row permutation over this many heads.
        keep_dtype: Never cast this tensor with ``--dtype`` (e.g. state
            parameters that released checkpoints keep in float32).
    """

    name: str | None
    expert: int | None = None
    unpermute_heads: int | None = None
    keep_dtype: bool = False

    @classmethod
    def drop(cls) -> TensorTarget:
        """A target that ignores the tensor (vision towers, unused buffers)."""
        return cls(name=None)

    @classmethod
    def to(cls, name: str, *, expert: int | None = None, keep_dtype: bool = False) -> TensorTarget:
        """A target that stores the tensor as ``name``."""
        return cls(name=name, expert=expert, keep_dtype=keep_dtype)
