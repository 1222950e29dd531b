"""Expert records as arrays: ``experts.bin`` bytes, their stored-form MLX arrays, and the form the policy holds.

Resident and streamed banks both go through these functions, which is what
makes them bit-identical: a slot holds exactly what the resident bank holds.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from turbospark_core.compute import ComputePolicy
from turbospark_core.dequant import dequantize
from turbospark_core.experts.layout import ExpertLayout, ProjectionLayout
from turbospark_core.layers import Linear
from turbospark_core.manifest import EXPERTS, Manifest

_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32, "U8": np.uint8}


def from_records(proj: ProjectionLayout, records: np.ndarray) -> dict[str, mx.array]:
    """The projection's tensors out of ``records`` (``[n, stride]`` bytes), as MLX arrays ``[n, ...]``."""
    n = records.shape[0]
    out: dict[str, mx.array] = {}
    for leaf, t in proj.tensors.items():
        part = np.ascontiguousarray(records[:, t.offset : t.offset + t.nbytes])
        arr = mx.array(part.view(_NUMPY[t.dtype]).reshape(n, *t.shape))
        out[leaf] = arr.view(mx.bfloat16) if t.dtype == "BF16" else arr
    return out


def read_expert_tensors(manifest: Manifest) -> dict[str, mx.array]:
    """Every routed-expert tensor of an install as stored, ``[E, ...]`` under its install name (tools, tests)."""
    path = manifest.path(EXPERTS)
    layout = ExpertLayout.from_section(manifest.experts or {}, manifest.files[EXPERTS].size, str(path))
    out: dict[str, mx.array] = {}
    with path.open("rb") as f:
        for prefix, layer in layout.layers.items():
            f.seek(layer.offset)
            records = np.frombuffer(f.read(layer.end - layer.offset), np.uint8).reshape(layer.num_experts, layer.stride)
            for name, proj in layer.projections.items():
                out.update({f"{prefix}.{name}.{leaf}": arr for leaf, arr in from_records(proj, records).items()})
    return out


def held_form(proj: ProjectionLayout, raw: dict[str, mx.array], policy: ComputePolicy) -> dict[str, mx.array]:
    """A projection's tensors ``[n, ...]`` as the policy holds them (unpacked to the compute dtype, or as stored)."""
    if not proj.unpacked(policy.unpack):
        return raw
    dtype = policy.compute_dtype
    out: dict[str, mx.array] = {}
    if proj.quant is None:
        out["weight"] = raw["weight"].astype(dtype)
    else:
        out["weight"] = dequantize(raw["weight"], raw["scales"], raw.get("biases"), proj.quant, dtype)
    if "bias" in raw:
        out["bias"] = raw["bias"].astype(dtype)
    return out


def linear_of(proj: ProjectionLayout, held: dict[str, mx.array], unpack: bool) -> Linear:
    """The :class:`Linear` over a projection's held tensors (quantized kernels only for a stored-form quantized one)."""
    if proj.quant is None or proj.unpacked(unpack):
        return Linear(held["weight"], held.get("bias"))
    return Linear(held["weight"], held.get("bias"), quant=proj.quant, scales=held["scales"], biases=held.get("biases"))


def empty_slots(proj: ProjectionLayout, slots: int, policy: ComputePolicy) -> dict[str, mx.array]:
    """Slot tensors ``[slots, ...]`` in held form (zeros until an expert is loaded)."""
    if proj.unpacked(policy.unpack):  # a real buffer (mx.zeros may broadcast a scalar): slots written in place
        dtype = policy.compute_dtype
        held = {"weight": mx.array(np.zeros((slots, proj.out_features, proj.in_features), np.float32)).astype(dtype)}
        if "bias" in proj.tensors:
            held["bias"] = mx.array(np.zeros((slots, proj.out_features), np.float32)).astype(dtype)
    else:
        end = max(t.offset + t.nbytes for t in proj.tensors.values())
        held = from_records(proj, np.zeros((slots, end), np.uint8))
    mx.eval(held)
    return held
