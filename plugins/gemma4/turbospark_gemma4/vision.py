# Copyright 2026 the turbospark authors. Apache-2.0.
"""The Gemma 4 vision tower and its projection into the text model (``embed_vision``).

Per image: patches ``[N, p*p*3]`` in raster order over a ``rows x cols`` grid.

* patch embedding ``(2 * (pv - 0.5)) @ input_proj.T`` plus learned per-axis
  positions ``table[0][x] + table[1][y]``;
* encoder layers with sandwich RMSNorms (plain ``w``, not ``1 + w``), q/k RMSNorms
  over the head, a weightless v RMSNorm, 2-D RoPE (first half of each head rotated by
  the column, second half by the row), attention scale 1, bidirectional over the
  image's patches, and a GeGLU MLP;
* ``k x k`` average pooling times ``sqrt(hidden)`` (raster order of the pooled grid),
  optionally standardized, then a weightless RMSNorm and ``embedding_projection``.

Padding patches of a processor's fixed-length ``pixel_values`` are masked out of
attention and dropped by the pooling, so the tower runs on the real patches only.
Everything is computed in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from turbospark_core.family import InstallError, rms_norm

from turbospark_gemma4.errors import ImageInputError
from turbospark_gemma4.family import gelu_tanh
from turbospark_gemma4.image_processing import ImagePatches
from turbospark_gemma4.vision_config import PROJECTOR, TOWER, VisionArgs

Tensors = Callable[[str], mx.array]  # install name -> tensor (a WeightStore's ``tensor``, a dict's ``__getitem__``)


class ClippedLinear:
    """``x @ W.T`` (no bias); with clipping, input and output clamped to stored scalar bounds."""

    def __init__(self, get: Tensors, base: str, clipped: bool) -> None:
        self.weight = get(f"{base}.linear.weight").astype(mx.float32)
        self.bounds: tuple[mx.array, ...] | None = None
        if clipped:
            self.bounds = tuple(get(f"{base}.{n}").astype(mx.float32)
                                for n in ("input_min", "input_max", "output_min", "output_max"))  # fmt: skip

    def __call__(self, x: mx.array) -> mx.array:
        if self.bounds is None:
            return x @ self.weight.T
        lo, hi, out_lo, out_hi = self.bounds
        return mx.clip(mx.clip(x, lo, hi) @ self.weight.T, out_lo, out_hi)


def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return x * cos + mx.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


class Rope2D:
    """Axial RoPE over one image's grid: head dims ``[0, d/2)`` turn with the column, ``[d/2, d)`` with the row."""

    def __init__(self, head_dim: int, theta: float, rows: int, cols: int) -> None:
        part = head_dim // 2
        inv = 1.0 / theta ** (np.arange(0, part, 2, dtype=np.float64) / part)
        gx, gy = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
        self.tables = []
        for pos in (gx.reshape(-1), gy.reshape(-1)):
            angles = (pos[:, None] * inv[None, :]).astype(np.float32)
            angles = np.concatenate([angles, angles], axis=-1)  # [N, part]
            self.tables.append((mx.array(np.cos(angles))[:, None], mx.array(np.sin(angles))[:, None]))
        self.part = part

    def __call__(self, x: mx.array) -> mx.array:
        """``x``: ``[N, heads, head_dim]``."""
        (cx, sx), (cy, sy) = self.tables
        p = self.part
        return mx.concatenate([_rotate(x[..., :p], cx, sx), _rotate(x[..., p:], cy, sy)], axis=-1)


class VisionLayer:
    def __init__(self, args: VisionArgs, get: Tensors, prefix: str) -> None:
        def norm(name: str) -> mx.array:
            return get(f"{prefix}.{name}.weight").astype(mx.float32)

        def linear(name: str) -> ClippedLinear:
            return ClippedLinear(get, f"{prefix}.{name}", args.use_clipped_linears)

        self.eps = args.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.input_layernorm = norm("input_layernorm")
        self.post_attention_layernorm = norm("post_attention_layernorm")
        self.pre_feedforward_layernorm = norm("pre_feedforward_layernorm")
        self.post_feedforward_layernorm = norm("post_feedforward_layernorm")
        self.q_proj, self.k_proj = linear("self_attn.q_proj"), linear("self_attn.k_proj")
        self.v_proj, self.o_proj = linear("self_attn.v_proj"), linear("self_attn.o_proj")
        self.q_norm, self.k_norm = norm("self_attn.q_norm"), norm("self_attn.k_norm")
        self.gate_proj, self.up_proj = linear("mlp.gate_proj"), linear("mlp.up_proj")
        self.down_proj = linear("mlp.down_proj")

    def _norm(self, x: mx.array, w: mx.array | None) -> mx.array:
        return rms_norm(x, w, self.eps)

    def _attention(self, x: mx.array, rope: Rope2D) -> mx.array:
        n = x.shape[0]
        q = rope(self._norm(self.q_proj(x).reshape(n, self.heads, self.head_dim), self.q_norm))
        k = rope(self._norm(self.k_proj(x).reshape(n, self.kv_heads, self.head_dim), self.k_norm))
        v = self._norm(self.v_proj(x).reshape(n, self.kv_heads, self.head_dim), None)
        q, k, v = (t.transpose(1, 0, 2)[None] for t in (q, k, v))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0)
        return self.o_proj(out[0].transpose(1, 0, 2).reshape(n, -1))

    def __call__(self, x: mx.array, rope: Rope2D) -> mx.array:
        h = x + self._norm(self._attention(self._norm(x, self.input_layernorm), rope), self.post_attention_layernorm)
        y = self._norm(h, self.pre_feedforward_layernorm)
        y = self.down_proj(gelu_tanh(self.gate_proj(y)) * self.up_proj(y))
        return h + self._norm(y, self.post_feedforward_layernorm)


class Encoder:
    """The encoder plus ``embed_vision``: one image's patches in, its soft-token embeddings out.

    ``get`` reads tensors by name; ``prefix`` is what precedes ``vision_tower.`` and
    ``embed_vision.`` in those names (``"model."`` in a Hugging Face checkpoint).
    """

    def __init__(self, args: VisionArgs, get: Tensors, prefix: str = "") -> None:
        """Read the tower's tensors.

        Raises:
            InstallError: The patch embedding, position table or projection has another
                shape than the tower config says (named, with both shapes).
        """
        self.args = args
        tower = f"{prefix}{TOWER}"

        def shaped(name: str, shape: tuple[int, ...]) -> mx.array:
            arr = get(name).astype(mx.float32)
            if tuple(arr.shape) != shape:
                msg = (f"{name} has shape {tuple(arr.shape)}, but the tower config says {shape}; "
                       "re-run the sidecar conversion from the checkpoint")  # fmt: skip
                raise InstallError(msg)
            return arr

        a = args
        self.input_proj = shaped(f"{tower}.patch_embedder.input_proj.weight", (a.hidden_size, 3 * a.patch_size**2))
        self.positions = shaped(
            f"{tower}.patch_embedder.position_embedding_table", (2, a.position_embedding_size, a.hidden_size)
        )
        self.layers = [VisionLayer(args, get, f"{tower}.encoder.layers.{i}") for i in range(args.num_hidden_layers)]
        self.std: tuple[mx.array, mx.array] | None = None
        if args.standardize:
            self.std = (shaped(f"{tower}.std_bias", (a.hidden_size,)), shaped(f"{tower}.std_scale", (a.hidden_size,)))
        projection = f"{prefix}{PROJECTOR}.embedding_projection.weight"
        self.projection = shaped(projection, (a.text_hidden_size, a.hidden_size))

    def check_grid(self, rows: int, cols: int) -> None:
        """Refuse a patch grid the learned positions or the pooling cannot cover.

        Raises:
            ImageInputError: A side over ``position_embedding_size`` patches, or not a
                multiple of ``pooling_kernel_size``.
        """
        size, k = self.args.position_embedding_size, self.args.pooling_kernel_size
        if rows > size or cols > size:
            msg = (f"image of {rows}x{cols} patches: the tower's position table covers at most "
                   f"{size} patches per side (position_embedding_size); use a smaller image")  # fmt: skip
            raise ImageInputError(msg)
        if rows % k or cols % k:
            msg = f"image of {rows}x{cols} patches: both sides must be multiples of pooling_kernel_size={k}"
            raise ImageInputError(msg)

    def hidden(self, patches: mx.array, rows: int, cols: int) -> mx.array:
        """Pooled, scaled tower output ``[rows*cols / k^2, hidden]`` (before ``embed_vision``)."""
        self.check_grid(rows, cols)
        a = self.args
        x = (2.0 * (patches.astype(mx.float32) - 0.5)) @ self.input_proj.T
        x = x + mx.repeat(self.positions[1, :rows], cols, axis=0) + mx.tile(self.positions[0, :cols], (rows, 1))
        rope = Rope2D(a.head_dim, a.rope_theta, rows, cols)
        for layer in self.layers:
            x = layer(x, rope)
        k = a.pooling_kernel_size
        pooled = x.reshape(rows // k, k, cols // k, k, a.hidden_size).mean(axis=(1, 3)).reshape(-1, a.hidden_size)
        pooled = pooled * math.sqrt(a.hidden_size)
        if self.std is not None:
            pooled = (pooled - self.std[0]) * self.std[1]
        return pooled

    def project(self, hidden: mx.array) -> mx.array:
        """``embed_vision``: weightless RMSNorm, then ``embedding_projection`` into the text width."""
        return rms_norm(hidden, None, self.args.rms_norm_eps) @ self.projection.T

    def __call__(self, image: ImagePatches) -> mx.array:
        """One image's soft-token embeddings, ``[num_soft_tokens, text hidden]``."""
        return self.project(self.hidden(mx.array(image.patches), image.rows, image.cols))

    def embed_images(self, images: list[ImagePatches]) -> mx.array:
        """Every image's soft tokens, in order, ``[sum of num_soft_tokens, text hidden]``."""
        return mx.concatenate([self(image) for image in images], axis=0)
