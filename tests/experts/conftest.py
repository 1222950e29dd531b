"""Fixtures of the MoE expert tests: converted MoE installs, their references, synthetic experts.bin files."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core import plugins
from turbospark_core.compute import ComputePolicy
from turbospark_core.convert import convert
from turbospark_core.convert.experts import split_experts
from turbospark_core.experts.layout import ExpertLayout
from turbospark_core.experts.plan import ExpertPlan
from turbospark_core.experts.store import ExpertStore
from turbospark_core.manifest import EXPERTS

LAYER0 = "model.layers.0.mlp.experts"


@pytest.fixture(scope="session")
def moe_source(turbospark_fixtures: Path) -> Callable[[str], Path]:
    """``moe_source(fixture)`` -> the reference checkpoint, or a skip when it or its plugin is missing."""

    def find(name: str) -> Path:
        path = turbospark_fixtures / name
        if not (path / "config.json").is_file():
            pytest.skip(f"reference fixture {path} is not available")
        model_type = json.loads((path / "config.json").read_text())["model_type"]
        if not plugins.registry().serves(model_type):
            pytest.skip(f"no installed plugin serves {model_type!r}")
        return path

    return find


@pytest.fixture(scope="session")
def moe_install(tmp_path_factory: pytest.TempPathFactory, moe_source: Callable[[str], Path]) -> Callable[..., Path]:
    """``make(fixture, **convert_options)`` -> an install converted once per session. Never modify it."""
    made: dict[tuple[Any, ...], Path] = {}

    def make(name: str, **options: Any) -> Path:
        key = (name, *sorted(options.items()))
        if key not in made:
            dst = tmp_path_factory.mktemp(name) / "install"
            convert(moe_source(name), dst, **options)
            made[key] = dst
        return made[key]

    return make


@pytest.fixture
def moe_copy(moe_install: Callable[..., Path], tmp_path: Path) -> Path:
    """A private copy of the qwen3_moe install that the test may corrupt."""
    dst = tmp_path / "moe"
    shutil.copytree(moe_install("qwen3_moe"), dst)
    return dst


@pytest.fixture(scope="session")
def refs_of(turbospark_fixtures: Path) -> Callable[[str], dict[str, np.ndarray]]:
    """``refs_of(fixture)`` -> its references.npz arrays."""

    def load(name: str) -> dict[str, np.ndarray]:
        with np.load(turbospark_fixtures / name / "references.npz") as npz:
            return {k: npz[k] for k in npz.files}

    return load


def _synthetic(tmp_path: Path, kind: str, experts: int = 6, dim: int = 64, hidden: int = 64) -> ExpertLayout:
    """A one-layer experts.bin with random experts stored as ``kind`` (f32, bf16+bias, q4, mxfp4+bias, g16)."""
    rng = np.random.default_rng(7)
    shapes = {
        "gate_proj": (experts, hidden, dim),
        "up_proj": (experts, hidden, dim),
        "down_proj": (experts, dim, hidden),
    }
    tensors: dict[str, mx.array] = {}
    quantization: dict[str, Any] = {}
    for proj, shape in shapes.items():
        w = mx.array(rng.standard_normal(shape).astype(np.float32) * 0.3)
        base = f"{LAYER0}.{proj}"
        if kind == "g16":  # GGUF K-quant sub-blocks: an affine group MLX's kernels do not take
            tensors[f"{base}.weight"], tensors[f"{base}.scales"], tensors[f"{base}.biases"] = _quantize_16(w, bits=6)
            quantization[base] = {"bits": 6, "group_size": 16, "mode": "affine"}
        elif kind in ("q4", "mxfp4"):
            mode, gs = ("affine", 64) if kind == "q4" else ("mxfp4", 32)
            parts = mx.quantize(w, group_size=gs, bits=4, mode=mode)
            tensors[f"{base}.weight"], tensors[f"{base}.scales"] = parts[0], parts[1]
            if mode == "affine":
                tensors[f"{base}.biases"] = parts[2]
            quantization[base] = {"bits": 4, "group_size": gs, "mode": mode}
        else:
            tensors[f"{base}.weight"] = w.astype(mx.bfloat16) if kind == "bf16" else w
        if kind in ("bf16", "mxfp4"):
            tensors[f"{base}.bias"] = mx.array(rng.standard_normal(shape[:2]).astype(np.float32))
    resident, quant, pack = split_experts(tensors, quantization, top_k=2)
    assert not resident and not quant and pack is not None
    (tmp_path / EXPERTS).write_bytes(b"")
    section = pack.write(tmp_path / EXPERTS)
    return ExpertLayout.from_section(section, (tmp_path / EXPERTS).stat().st_size, "synthetic")


def _quantize_16(w: mx.array, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """Affine min/max quantization in groups of 16 (mx.quantize refuses the group), MLX's bit stream."""
    from turbospark_core.convert.gguf_reader import _pack

    groups = np.array(w).reshape(*w.shape[:-1], -1, 16)
    low, high = groups.min(-1), groups.max(-1)
    scales = ((high - low) / (2**bits - 1)).astype(np.float32)
    codes = np.clip(np.round((groups - low[..., None]) / scales[..., None]), 0, 2**bits - 1).astype(np.uint8)
    return mx.array(_pack(codes, bits)), mx.array(scales), mx.array(low.astype(np.float32))


@pytest.fixture
def synthetic(tmp_path: Path) -> Callable[[str], ExpertLayout]:
    """``synthetic(kind)`` -> the layout of a one-layer experts.bin written under ``tmp_path``."""
    return lambda kind: _synthetic(tmp_path, kind)


@pytest.fixture
def expert_store(tmp_path: Path) -> Callable[..., ExpertStore]:
    """``expert_store(layout, residency, slots, unpack)`` -> a set-up store over ``tmp_path``'s experts.bin."""

    def make(layout: ExpertLayout, residency: str, slots: int, unpack: bool) -> ExpertStore:
        policy = ComputePolicy(unpack=unpack, compute_dtype=mx.float32, reason="test")
        plan = ExpertPlan(residency=residency, slots=slots, unpack=unpack, held_bytes=0)
        store = ExpertStore(tmp_path / EXPERTS, layout, plan, policy)
        store.setup()
        return store

    return make


@pytest.fixture
def silu_glu() -> Callable[[mx.array, mx.array], mx.array]:
    """The SwiGLU activation the synthetic banks run."""
    return lambda gate, up: gate * mx.sigmoid(gate) * up
