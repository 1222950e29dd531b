# Copyright 2026 the turbospark authors. Apache-2.0.
"""Qwen3-VL's vision tower: preprocessing, ViT with 2-D rotary positions, patch merger, DeepStack, M-RoPE positions.

Follows transformers' ``Qwen2VLImageProcessorPil`` (``smart_resize``, rescale,
normalise, merge-block patch order) and ``Qwen3VLVisionModel``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core.family import (
    MAX_FLOAT,
    ArchConfigError,
    ConversionError,
    ImageError,
    ImageFeatures,
    InstallError,
    Linear,
    PreparedImage,
    TensorTarget,
    VisionContext,
    VisionSpec,
    WeightStore,
    bool_problem,
    float_problems,
    int_problems,
    is_number,
    resize_rgb,
)

VISION_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_vision")
MAX_ASPECT_RATIO = 200
_TOWER = "model.visual."


class ImageSizeError(ImageError):
    """An image the Qwen3-VL processor cannot take (aspect ratio past 200)."""


# ------------------------------------------------------------------ conversion


def vision_spec(hf_config: dict[str, Any]) -> VisionSpec | None:
    """The sidecar's description of a Qwen3-VL checkpoint's tower (``None`` without a ``vision_config``)."""
    vc = hf_config.get("vision_config")
    if hf_config.get("model_type") != "qwen3_vl" or not isinstance(vc, dict):
        return None
    if vc.get("model_type", "qwen3_vl") not in VISION_MODEL_TYPES:
        msg = f"vision_config.model_type {vc.get('model_type')!r} is not one of {VISION_MODEL_TYPES}"
        raise ArchConfigError(msg)
    rope = vc.get("rope_parameters") or {}
    vision = {
        "model_type": "qwen3_vl",
        "hidden_size": vc["hidden_size"],
        "depth": vc["depth"],
        "num_heads": vc["num_heads"],
        "intermediate_size": vc["intermediate_size"],
        "hidden_act": vc.get("hidden_act", "gelu_pytorch_tanh"),
        "patch_size": vc["patch_size"],
        "temporal_patch_size": vc["temporal_patch_size"],
        "spatial_merge_size": vc["spatial_merge_size"],
        "in_channels": vc.get("in_channels", 3),
        "out_hidden_size": vc["out_hidden_size"],
        "num_position_embeddings": vc["num_position_embeddings"],
        "deepstack_visual_indexes": list(vc.get("deepstack_visual_indexes") or []),
        "rope_theta": float(rope.get("rope_theta") or vc.get("rope_theta") or 10000.0),
    }
    tokens = {
        "image": hf_config["image_token_id"],
        "vision_start": hf_config["vision_start_token_id"],
        "vision_end": hf_config["vision_end_token_id"],
    }
    return VisionSpec(vision=vision, tokens=tokens, hidden_size=vc["out_hidden_size"])


def vision_target(name: str) -> TensorTarget:
    """Tower tensors keep their name under ``visual.``; everything else is the trunk's (dropped).

    Raises:
        ConversionError: An mlx-vlm tower (``vision_tower.*``: convolution weights channel-last).
    """
    if name.startswith(("vision_tower.", "model.vision_tower.")):
        msg = (
            f"tensor {name!r} is an mlx-vlm vision tower (its layout differs from transformers'); "
            "convert the Hugging Face checkpoint with --vision instead"
        )
        raise ConversionError(msg)
    for prefix in (_TOWER, "visual."):
        if name.startswith(prefix):
            return TensorTarget.to("visual." + name[len(prefix) :])
    return TensorTarget.drop()


_VISION_INTS = {
    "hidden_size": 1 << 14, "depth": 256, "num_heads": 256, "intermediate_size": 1 << 16, "patch_size": 64,
    "temporal_patch_size": 8, "spatial_merge_size": 8, "out_hidden_size": 1 << 16,
    "num_position_embeddings": 1 << 20, "in_channels": 4,
}  # fmt: skip


def vision_problems(vision: dict[str, Any]) -> list[str]:
    """The vision arch's keys, typed and bounded."""
    out = int_problems(vision, _VISION_INTS, where="vision.")
    if out:
        return out
    if vision["hidden_size"] % vision["num_heads"] or (vision["hidden_size"] // vision["num_heads"]) % 4:
        out.append("vision.hidden_size / num_heads must be a multiple of 4 (2-D rotary halves)")
    side = math.isqrt(vision["num_position_embeddings"])
    if side * side != vision["num_position_embeddings"]:
        out.append(f"vision.num_position_embeddings={vision['num_position_embeddings']} is not a square grid")
    ds = vision.get("deepstack_visual_indexes")
    if not isinstance(ds, list) or not all(isinstance(i, int) and 0 <= i < vision["depth"] for i in ds):
        out.append(f"vision.deepstack_visual_indexes must list block indexes in [0, {vision['depth']})")
    out += float_problems(vision, {"rope_theta": MAX_FLOAT}, where="vision.")
    if vision.get("hidden_act") != "gelu_pytorch_tanh":
        out.append(f"vision.hidden_act {vision.get('hidden_act')!r} is not served (gelu_pytorch_tanh)")
    return out


# ------------------------------------------------------------------ preprocessing
_PROCESSOR_INTS = {
    "patch_size": 64, "temporal_patch_size": 8, "merge_size": 8, "min_pixels": 1 << 26, "max_pixels": 1 << 26,
}  # fmt: skip


@attrs.frozen(kw_only=True)
class Processor:
    """``preprocessor_config.json`` of ``Qwen2VLImageProcessor``, read once."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    resample: int
    do_resize: bool
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Processor:
        """Read a processor config, every value typed and bounded.

        Raises:
            ArchConfigError: A missing, mistyped or out-of-range value, naming it.
        """
        if not isinstance(cfg, dict):
            raise ArchConfigError(
                f"the sidecar's Qwen3-VL processor config must be an object (got {type(cfg).__name__})"
            )
        size = cfg.get("size") or {}
        if not isinstance(size, dict):
            raise ArchConfigError(f"processor.size must be an object (got {type(size).__name__})")
        merged = {
            "patch_size": cfg.get("patch_size"),
            "temporal_patch_size": cfg.get("temporal_patch_size", 2),
            "merge_size": cfg.get("merge_size", 2),
            "min_pixels": size.get("shortest_edge", cfg.get("min_pixels", 56 * 56)),
            "max_pixels": size.get("longest_edge", cfg.get("max_pixels", 28 * 28 * 1280)),
            "resample": cfg.get("resample", 3),
            "rescale_factor": cfg.get("rescale_factor", 1 / 255),
            "image_mean": cfg.get("image_mean", [0.5, 0.5, 0.5]),
            "image_std": cfg.get("image_std", [0.5, 0.5, 0.5]),
        }
        problems = int_problems(merged, _PROCESSOR_INTS, where="processor.")
        problems += int_problems(merged, {"resample": 5}, low=0, where="processor.")
        problems += float_problems(merged, {"rescale_factor": 1.0}, where="processor.")
        problems += [
            p
            for key in ("do_resize", "do_rescale", "do_normalize")
            if (p := bool_problem(cfg, key, optional=True, where="processor."))
        ]
        for key, low in (("image_mean", -1e3), ("image_std", 0.0)):
            values = merged[key]
            if not (
                isinstance(values, list) and len(values) == 3 and all(is_number(v) and low < v < 1e3 for v in values)
            ):
                problems.append(f"'processor.{key}' must list 3 finite numbers in ({low:g}, 1000) (got {values!r:.60})")
        if not problems and merged["min_pixels"] > merged["max_pixels"]:
            problems.append(
                "'processor.min_pixels' (size.shortest_edge) must not exceed max_pixels (size.longest_edge)"
            )
        if problems:
            raise ArchConfigError("the sidecar's Qwen3-VL processor config is invalid: " + "; ".join(problems))
        return cls(
            patch_size=merged["patch_size"],
            temporal_patch_size=merged["temporal_patch_size"],
            merge_size=merged["merge_size"],
            min_pixels=merged["min_pixels"],
            max_pixels=merged["max_pixels"],
            resample=merged["resample"],
            do_resize=cfg.get("do_resize", True),
            do_rescale=cfg.get("do_rescale", True),
            rescale_factor=float(merged["rescale_factor"]),
            do_normalize=cfg.get("do_normalize", True),
            image_mean=tuple(float(x) for x in merged["image_mean"]),  # type: ignore[arg-type]
            image_std=tuple(float(x) for x in merged["image_std"]),  # type: ignore[arg-type]
        )

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """``smart_resize``: both sides multiples of patch x merge, pixels within [min_pixels, max_pixels]."""
        f = self.patch_size * self.merge_size
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            msg = f"an image of {height} x {width} has an aspect ratio over {MAX_ASPECT_RATIO}; crop or pad it"
            raise ImageSizeError(msg)
        h, w = round(height / f) * f, round(width / f) * f
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(f, math.floor(height / beta / f) * f)
            w = max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / f) * f
            w = math.ceil(width * beta / f) * f
        return h, w

    def pixel_values(self, rgb: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """The processor's ``pixel_values`` rows (merge-block order) and ``image_grid_thw`` of one image."""
        height, width = rgb.shape[:2]
        h, w = self.target_size(height, width) if self.do_resize else (height, width)
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        if h % (p * m) or w % (p * m):
            msg = f"an image of {h} x {w} is not a multiple of {p * m} pixels per side and do_resize is false"
            raise ImageSizeError(msg)
        x = resize_rgb(rgb, h, w, self.resample).astype(np.float64)
        if self.do_rescale:
            x = x * self.rescale_factor
        x = x.astype(np.float32)
        if self.do_normalize:
            x = (x - np.array(self.image_mean, np.float32)) / np.array(self.image_std, np.float32)
        gh, gw = h // p, w // p
        x = x.transpose(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        x = np.repeat(x[:, :, :, :, :, None], t, axis=5)
        return np.ascontiguousarray(x.reshape(gh * gw, 3 * t * p * p), dtype=np.float32), (1, gh, gw)


# ------------------------------------------------------------------ tower


def _layer_norm(x: mx.array, w: mx.array, b: mx.array) -> mx.array:
    return mx.fast.layer_norm(x, w, b, 1e-6)


def _gelu_tanh(x: mx.array) -> mx.array:
    return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _gelu(x: mx.array) -> mx.array:
    return 0.5 * x * (1 + mx.erf(x / math.sqrt(2)))


def _rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class _Merger:
    def __init__(self, w: WeightStore, prefix: str, group: int) -> None:
        self.norm_w, self.norm_b = w.tensor(f"{prefix}.norm.weight"), w.tensor(f"{prefix}.norm.bias")
        self.fc1: Linear = w.linear(f"{prefix}.linear_fc1")
        self.fc2: Linear = w.linear(f"{prefix}.linear_fc2")
        self.group = group

    def __call__(self, x: mx.array, *, postshuffle: bool) -> mx.array:
        if postshuffle:
            x = _layer_norm(x.reshape(-1, x.shape[-1] * self.group), self.norm_w, self.norm_b)
        else:
            x = _layer_norm(x, self.norm_w, self.norm_b).reshape(-1, x.shape[-1] * self.group)
        return self.fc2(_gelu(self.fc1(x)))


class _Block:
    def __init__(self, w: WeightStore, prefix: str, heads: int) -> None:
        self.norm1 = (w.tensor(f"{prefix}.norm1.weight"), w.tensor(f"{prefix}.norm1.bias"))
        self.norm2 = (w.tensor(f"{prefix}.norm2.weight"), w.tensor(f"{prefix}.norm2.bias"))
        self.qkv = w.linear(f"{prefix}.attn.qkv")
        self.proj = w.linear(f"{prefix}.attn.proj")
        self.fc1 = w.linear(f"{prefix}.mlp.linear_fc1")
        self.fc2 = w.linear(f"{prefix}.mlp.linear_fc2")
        self.heads = heads

    def attn(self, x: mx.array, cos: mx.array, sin: mx.array, segments: Sequence[tuple[int, int]]) -> mx.array:
        n, d = x.shape
        qkv = self.qkv(x).reshape(n, 3, self.heads, d // self.heads).transpose(1, 2, 0, 3)
        q, k, v = qkv[0], qkv[1], qkv[2]  # [heads, n, head_dim]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        scale = (d // self.heads) ** -0.5
        outs = [
            mx.fast.scaled_dot_product_attention(
                q[None, :, a:b], k[None, :, a:b], v[None, :, a:b], scale=scale, mask=None
            )[0]
            for a, b in segments  # each image attends only to itself
        ]
        out = mx.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
        return self.proj(out.transpose(1, 0, 2).reshape(n, d))

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, segments: Sequence[tuple[int, int]]) -> mx.array:
        x = x + self.attn(_layer_norm(x, *self.norm1), cos, sin, segments)
        return x + self.fc2(_gelu_tanh(self.fc1(_layer_norm(x, *self.norm2))))


class Qwen3VLTower:
    """The :class:`~turbospark_core.family.VisionTower` of Qwen3-VL."""

    def __init__(self, context: VisionContext) -> None:
        problems = vision_problems(context.vision)
        if problems:
            raise ArchConfigError("the sidecar's Qwen3-VL vision arch is invalid: " + "; ".join(problems))
        if not context.arch.get("mrope"):
            msg = (
                "the trunk install has no 'mrope' section (converted before image support); re-run "
                "`turbospark convert SRC DST --vision SIDECAR` to convert the trunk with its M-RoPE sections"
            )
            raise InstallError(msg)
        v = context.vision
        w = context.weights
        self.v = v
        self.processor = Processor.from_config(context.processor)
        p = self.processor
        if (p.patch_size, p.temporal_patch_size, p.merge_size) != (
            v["patch_size"],
            v["temporal_patch_size"],
            v["spatial_merge_size"],
        ):
            msg = (
                f"the sidecar's processor config (patch {p.patch_size}, temporal {p.temporal_patch_size}, merge "
                f"{p.merge_size}) does not match its vision config; re-run the sidecar conversion"
            )
            raise ArchConfigError(msg)
        self.placeholder_id = int(context.tokens["image"])
        self.soft_token_id = self.placeholder_id
        self.merge = int(v["spatial_merge_size"])
        self.hidden = int(v["hidden_size"])
        self.heads = int(v["num_heads"])
        self.side = math.isqrt(int(v["num_position_embeddings"]))
        self.deepstack = [int(i) for i in v["deepstack_visual_indexes"]]
        self.patch_w = w.tensor("visual.patch_embed.proj.weight").reshape(self.hidden, -1).T
        self.patch_b = w.tensor("visual.patch_embed.proj.bias")
        self.pos_embed = w.tensor("visual.pos_embed.weight")
        self.blocks = [_Block(w, f"visual.blocks.{i}", self.heads) for i in range(int(v["depth"]))]
        group = self.merge**2
        self.merger = _Merger(w, "visual.merger", group)
        self.deepstack_mergers = [
            _Merger(w, f"visual.deepstack_merger_list.{k}", group) for k in range(len(self.deepstack))
        ]
        head_dim = self.hidden // self.heads
        dim = head_dim // 2
        self.inv = 1.0 / (float(v["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float64) / dim))

    # -------------------------------------------------------------- protocol
    def prepare(self, rgb: np.ndarray) -> PreparedImage:
        pixel_values, grid = self.processor.pixel_values(rgb)
        tokens = grid[0] * grid[1] * grid[2] // self.merge**2
        return PreparedImage(pixel_values=pixel_values, grid=grid, expansion=(self.placeholder_id,) * tokens)

    def encode(self, images: Sequence[PreparedImage]) -> ImageFeatures:
        rows, feats = self.forward(
            mx.array(np.concatenate([im.pixel_values for im in images])), [im.grid for im in images]
        )
        return ImageFeatures(embeds=rows, layer_features=tuple(feats))

    def positions(self, ids: np.ndarray, images: Sequence[PreparedImage]) -> tuple[np.ndarray, int]:
        """M-RoPE (t, h, w) positions ``[3, T]`` and ``rope_delta``."""
        out = np.zeros((3, len(ids)), dtype=np.int64)
        soft = np.flatnonzero(ids == self.soft_token_id)
        spans = []
        used = 0
        for im in images:
            n = len(im.expansion)
            spans.append((int(soft[used]), im.grid))
            used += n
        s, j = 0, 0
        for start, (t, gh, gw) in spans:
            out[:, j:start] = s + np.arange(start - j)
            s += start - j
            mh, mw = gh // self.merge, gw // self.merge
            r, c = np.divmod(np.arange(t * mh * mw) % (mh * mw), mw)
            out[0, start : start + len(r)] = s
            out[1, start : start + len(r)] = s + r
            out[2, start : start + len(r)] = s + c
            s += max(mh, mw)
            j = start + len(r)
        out[:, j:] = s + np.arange(len(ids) - j)
        return out, int(out.max()) + 1 - len(ids)

    # -------------------------------------------------------------- tower
    def _grid_rows(self, grid: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
        """Patch (row, col) of every pixel_values row (merge-block order)."""
        t, gh, gw = grid
        m = self.merge
        R, C, r, c = np.meshgrid(np.arange(gh // m), np.arange(gw // m), np.arange(m), np.arange(m), indexing="ij")
        rows = np.tile((R * m + r).reshape(-1), t)
        cols = np.tile((C * m + c).reshape(-1), t)
        return rows, cols

    def _interpolation(self, rows: np.ndarray, cols: np.ndarray, gh: int, gw: int) -> tuple[np.ndarray, np.ndarray]:
        """Bilinear (align_corners) taps and weights of the learned position grid for each patch."""
        s = self.side
        y = rows * ((s - 1) / (gh - 1)) if gh > 1 else np.zeros(len(rows))
        x = cols * ((s - 1) / (gw - 1)) if gw > 1 else np.zeros(len(cols))
        y0, x0 = np.floor(y).astype(np.int64), np.floor(x).astype(np.int64)
        y1, x1 = np.minimum(y0 + 1, s - 1), np.minimum(x0 + 1, s - 1)
        dy, dx = y - y0, x - x0
        idx = np.stack([y0 * s + x0, y0 * s + x1, y1 * s + x0, y1 * s + x1], axis=1)
        wts = np.stack([(1 - dy) * (1 - dx), (1 - dy) * dx, dy * (1 - dx), dy * dx], axis=1)
        return idx, wts.astype(np.float32)

    def forward(self, pixel_values: mx.array, grids: Sequence[tuple[int, ...]]) -> tuple[mx.array, list[mx.array]]:
        """``image_embeds`` ``[tokens, out_hidden]`` and one DeepStack feature per index, from ``pixel_values``."""
        per_image = [self._grid_rows((g[0], g[1], g[2])) for g in grids]
        rows = np.concatenate([r for r, _ in per_image])
        cols = np.concatenate([c for _, c in per_image])
        taps = [self._interpolation(r, c, g[1], g[2]) for (r, c), g in zip(per_image, grids, strict=True)]
        idx = np.concatenate([i for i, _ in taps])
        wts = np.concatenate([w for _, w in taps])
        pos = (self.pos_embed[mx.array(idx)] * mx.array(wts)[..., None]).sum(axis=1)
        x = pixel_values.astype(self.patch_w.dtype) @ self.patch_w + self.patch_b + pos
        angles = np.concatenate([rows[:, None] * self.inv, cols[:, None] * self.inv], axis=1)
        emb = np.concatenate([angles, angles], axis=1)
        cos, sin = mx.array(np.cos(emb).astype(np.float32)), mx.array(np.sin(emb).astype(np.float32))
        bounds = np.cumsum([0] + [len(r) for r, _ in per_image])
        segments = [(int(a), int(b)) for a, b in itertools.pairwise(bounds)]
        feats = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, segments)
            if i in self.deepstack:
                feats.append(self.deepstack_mergers[self.deepstack.index(i)](x, postshuffle=True))
        return self.merger(x, postshuffle=False), feats
