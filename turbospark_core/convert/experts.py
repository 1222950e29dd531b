"""Pack routed experts into ``experts.bin``: one aligned, contiguous record per (layer, expert)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core.errors import ConversionError
from turbospark_core.experts.layout import (
    ALIGNMENT,
    EXPERT_TENSOR,
    LEAVES,
    ExpertLayout,
    ExpertTensor,
    LayerLayout,
    ProjectionLayout,
)
from turbospark_core.tensor_index import QuantSpec

# Hugging Face config keys for "experts per token" (checked at the top level and in text_config)
HF_TOP_K_KEYS = ("num_experts_per_tok", "top_k_experts")
_DTYPE_NAMES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32", mx.uint8: "U8"}
_RAW_VIEW = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}
_TENSOR_ALIGN = 64  # each tensor inside a record starts on a 64-byte boundary
_CHUNK_BYTES = 256 << 20  # experts written per chunk: bounds the staging memory


def top_k_from_config(config: dict[str, Any]) -> int | None:
    """Experts per token from a Hugging Face config (``None`` when it does not say)."""
    for where in (config, config.get("text_config")):
        if not isinstance(where, dict):
            continue
        for key in HF_TOP_K_KEYS:
            value = where.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


@attrs.define
class ExpertPack:
    """Routed-expert tensors split out of the install tensors, ready to write to ``experts.bin``."""

    layout: ExpertLayout
    tensors: dict[str, dict[str, mx.array]] = attrs.field(eq=False)  # prefix -> "proj.leaf" -> [E, ...]

    def write(self, path: Path) -> dict[str, Any]:
        """Write ``experts.bin``; returns the manifest's ``experts`` section."""
        with path.open("wb") as f:
            for prefix, layer in self.layout.layers.items():
                if f.tell() != layer.offset:
                    f.write(b"\0" * (layer.offset - f.tell()))
                _write_layer(f, layer, self.tensors.pop(prefix))  # written layers are let go
        return self.layout.to_section()


def _raw(arr: mx.array) -> np.ndarray:
    """The tensor's bytes as an unsigned-integer numpy array (bfloat16 has no numpy dtype)."""
    return np.asarray(arr.view(_RAW_VIEW[arr.dtype.size]))


def _write_layer(f: Any, layer: LayerLayout, tensors: dict[str, mx.array]) -> None:
    per_chunk = max(1, _CHUNK_BYTES // layer.stride)
    raw = {key: _raw(arr) for key, arr in tensors.items()}
    for start in range(0, layer.num_experts, per_chunk):
        stop = min(start + per_chunk, layer.num_experts)
        buf = np.zeros((stop - start, layer.stride), dtype=np.uint8)
        for proj in layer.projections.values():
            for leaf, t in proj.tensors.items():
                part = np.ascontiguousarray(raw[f"{proj.name}.{leaf}"][start:stop]).reshape(stop - start, -1)
                buf[:, t.offset : t.offset + t.nbytes] = part.view(np.uint8).reshape(stop - start, -1)
        f.write(buf.data)


def _groups(tensors: dict[str, mx.array]) -> dict[str, dict[str, mx.array]]:
    """Prefix -> "proj.leaf" -> tensor, for names shaped like routed experts."""
    found: dict[str, dict[str, mx.array]] = {}
    for name, arr in tensors.items():
        m = EXPERT_TENSOR.match(name)
        if m:
            found.setdefault(m["prefix"], {})[f"{m['proj']}.{m['leaf']}"] = arr
    return {prefix: parts for prefix, parts in found.items() if _stacked(parts)}


def _stacked(parts: dict[str, mx.array]) -> bool:
    """Every part has one leading expert axis of the same length (matrices 3-D, biases 2-D)."""
    rank = {key: (2 if key.endswith(".bias") else 3) for key in parts}
    if any(arr.ndim != rank[key] for key, arr in parts.items()):
        return False
    return len({arr.shape[0] for arr in parts.values()}) == 1 and any(k.endswith(".weight") for k in parts)


def _projection(prefix: str, proj: str, parts: dict[str, mx.array], quant: Any, start: int) -> ProjectionLayout:
    tensors: dict[str, ExpertTensor] = {}
    offset = start
    for leaf in LEAVES:
        arr = parts.get(f"{proj}.{leaf}")
        if arr is None:
            continue
        dtype = _DTYPE_NAMES.get(arr.dtype)
        if dtype is None:
            msg = f"expert tensor {prefix}.{proj}.{leaf} has dtype {arr.dtype}, which experts.bin cannot hold"
            raise ConversionError(msg)
        offset = -(-offset // _TENSOR_ALIGN) * _TENSOR_ALIGN
        tensors[leaf] = ExpertTensor(offset=offset, dtype=dtype, shape=tuple(arr.shape[1:]))
        offset += tensors[leaf].nbytes
    spec = None if quant is None else QuantSpec.from_manifest(f"{prefix}.{proj}", quant)
    return ProjectionLayout(name=proj, quant=spec, tensors=tensors)


def _layer(prefix: str, parts: dict[str, mx.array], quantization: dict[str, Any], offset: int) -> LayerLayout:
    projections: dict[str, ProjectionLayout] = {}
    end = 0
    for proj in sorted({key.rpartition(".")[0] for key in parts}):
        layout = _projection(prefix, proj, parts, quantization.get(f"{prefix}.{proj}"), end)
        projections[proj] = layout
        end = max(t.offset + t.nbytes for t in layout.tensors.values())
    num_experts = next(iter(parts.values())).shape[0]
    stride = -(-end // ALIGNMENT) * ALIGNMENT
    return LayerLayout(prefix=prefix, offset=offset, num_experts=num_experts, stride=stride, projections=projections)


def split_experts(
    tensors: dict[str, mx.array], quantization: dict[str, Any], *, top_k: int | None = None
) -> tuple[dict[str, mx.array], dict[str, Any], ExpertPack | None]:
    """Move every stacked routed-expert tensor (``*.experts.<proj>.<leaf>``, leading expert axis) out.

    Returns:
        The tensors and quantization table left for ``model_weights.safetensors``,
        and the pack for ``experts.bin`` (``None`` when the install has no routed experts).
    """
    groups = _groups(tensors)
    if not groups:
        return tensors, quantization, None
    layers: dict[str, LayerLayout] = {}
    offset = 0
    for prefix in sorted(groups, key=_natural):
        layers[prefix] = _layer(prefix, groups[prefix], quantization, offset)
        offset += layers[prefix].num_experts * layers[prefix].stride
    moved = {f"{p}.{key}" for p, parts in groups.items() for key in parts}
    bases = {name.rpartition(".")[0] for name in moved}
    resident = {n: a for n, a in tensors.items() if n not in moved}
    quant = {b: q for b, q in quantization.items() if b not in bases}
    layout = ExpertLayout(alignment=ALIGNMENT, top_k=_checked_top_k(top_k, layers), layers=layers)
    return resident, quant, ExpertPack(layout=layout, tensors=groups)


def _checked_top_k(top_k: int | None, layers: dict[str, LayerLayout]) -> int | None:
    if top_k is None:
        return None
    fewest = min(layer.num_experts for layer in layers.values())
    if top_k > fewest:
        msg = f"the config routes each token to {top_k} experts but a layer has only {fewest}"
        raise ConversionError(msg)
    return top_k


def _natural(prefix: str) -> list[Any]:
    """``model.layers.10`` after ``model.layers.9``."""
    return [int(p) if p.isdigit() else p for p in prefix.split(".")]


def total_bytes(layout: ExpertLayout) -> int:
    """Size of ``experts.bin`` for ``layout``."""
    return max((layer.offset + layer.num_experts * layer.stride for layer in layout.layers.values()), default=0)


__all__ = ["ExpertPack", "split_experts", "top_k_from_config", "total_bytes"]
