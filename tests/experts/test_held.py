"""Expert records as arrays: experts.bin holds exactly the stacked tensors; the held form is the policy's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core import native
from turbospark_core.compute import ComputePolicy
from turbospark_core.experts.held import empty_slots, from_records, held_form, linear_of, read_expert_tensors
from turbospark_core.experts.layout import EXPERT_TENSOR, ExpertLayout
from turbospark_core.manifest import EXPERTS, WEIGHTS, load_manifest

LAYER0 = "model.layers.0.mlp.experts"


@pytest.mark.parametrize("options", [{}, {"quantize": "q4"}, {"dtype": "bfloat16"}], ids=["f32", "q4", "bf16"])
def test_experts_bin_holds_exactly_the_stacked_tensors(moe_install: Callable[..., Path], options: dict) -> None:
    packed, plain = moe_install("qwen3_moe", **options), moe_install("qwen3_moe", experts_file=False, **options)
    want = {n: a for n, a in mx.load(str(plain / WEIGHTS)).items() if EXPERT_TENSOR.match(n)}
    got = read_expert_tensors(load_manifest(packed))
    assert set(got) == set(want) and want
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype and mx.array_equal(got[name], arr).item(), name
    quant_plain = load_manifest(plain).quantization
    quant_packed = load_manifest(packed).quantization
    assert not [b for b in quant_packed if EXPERT_TENSOR.match(b + ".weight")]
    if options.get("quantize"):
        section = load_manifest(packed).experts["layers"][LAYER0]["projections"]["gate_proj"]
        assert section["quantization"] == quant_plain[f"{LAYER0}.gate_proj"]


@pytest.fixture(params=[True, False], ids=["native", "no-native"])
def native_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether the native kernels multiply quantized experts as stored (off: as without the extension)."""
    if request.param and not native.available():
        pytest.skip(f"native kernels unavailable: {native.STATUS}")
    if not request.param:
        monkeypatch.setattr(native, "keeps", lambda quant: False)
    return bool(request.param)


@pytest.mark.parametrize("kind", ["f32", "bf16", "q4", "mxfp4"])
def test_held_form_is_float32_when_unpacked_and_as_stored_otherwise(
    synthetic: Callable[[str], ExpertLayout], tmp_path: Path, kind: str, native_kernels: bool
) -> None:
    layout = synthetic(kind)
    layer = layout.layers[LAYER0]
    records = np.fromfile(tmp_path / EXPERTS, np.uint8)[layer.offset : layer.end].reshape(
        layer.num_experts, layer.stride
    )
    proj = layer.projections["gate_proj"]
    stored = from_records(proj, records)
    assert set(stored) == set(proj.tensors) and stored["weight"].shape[0] == 6
    unpack = ComputePolicy(unpack=True, compute_dtype=mx.float32, reason="test")
    unpacked = held_form(proj, stored, unpack)
    assert held_form(proj, stored, ComputePolicy(unpack=False, compute_dtype=mx.float32, reason="test")) is stored
    assert linear_of(proj, stored, unpack=False).quant == proj.quant
    slots = empty_slots(proj, 2, unpack)
    if proj.quant is not None and native_kernels:  # multiplied as stored: never unpacked
        assert unpacked is stored and linear_of(proj, unpacked, unpack=True).quant == proj.quant
        assert slots["weight"].shape == (2, *stored["weight"].shape[1:]) and slots["weight"].dtype == mx.uint32
        assert proj.held_bytes(True) == proj.held_bytes(False)
        return
    assert unpacked["weight"].dtype == mx.float32 and unpacked["weight"].shape == (6, 64, 64)
    assert linear_of(proj, unpacked, unpack=True).quant is None
    assert slots["weight"].shape == (2, 64, 64) and not mx.any(slots["weight"]).item()


def test_group_16_is_held_unpacked_under_every_policy(
    synthetic: Callable[[str], ExpertLayout], tmp_path: Path, native_kernels: bool
) -> None:
    """MLX's gather_qmm has no kernel for groups of 16: without the native kernels (which multiply them
    as stored) the experts are unpacked (exactly) whatever the policy."""
    from turbospark_core.dequant import dequantize

    layout = synthetic("g16")
    layer = layout.layers[LAYER0]
    records = np.fromfile(tmp_path / EXPERTS, np.uint8)[layer.offset : layer.end].reshape(
        layer.num_experts, layer.stride
    )
    proj = layer.projections["down_proj"]
    stored = from_records(proj, records)
    assert proj.quant is not None and not proj.quant.mlx_kernels
    if native_kernels:
        assert not proj.unpacked(True) and not proj.unpacked(False)
        assert held_form(proj, stored, ComputePolicy(unpack=True, compute_dtype=mx.float32, reason="test")) is stored
        return
    assert proj.unpacked(False)
    assert proj.held_bytes(False) == proj.held_bytes(True) == 4 * 64 * 64
    want = dequantize(stored["weight"], stored["scales"], stored["biases"], proj.quant, mx.float32)
    for unpack, dtype in ((True, mx.float32), (False, mx.float32), (False, mx.bfloat16)):
        policy = ComputePolicy(unpack=unpack, compute_dtype=dtype, reason="test")
        held = held_form(proj, stored, policy)
        assert mx.array_equal(held["weight"], want.astype(dtype)).item()
        assert linear_of(proj, held, unpack=unpack).quant is None
