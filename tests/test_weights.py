"""The weight store: install tensors handed to families as layers, experts from the container or an ExpertSource."""

from __future__ import annotations

import gc
import io
import json
import subprocess
import sys
import weakref
from pathlib import Path

import attrs
import mlx.core as mx
import numpy as np
import pytest

from turbospark_core import native
from turbospark_core.compute import ComputePolicy
from turbospark_core.convert import convert
from turbospark_core.layers import Activation, ExpertBank, Experts, fuse_linears
from turbospark_core.manifest import MANIFEST, WEIGHTS, load_manifest
from turbospark_core.tensor_index import build_index
from turbospark_core.weights import ExpertSource, WeightStore


def _normal(shape: tuple[int, ...], seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).normal(size=shape).astype(np.float32))


def _close(a: mx.array, b: mx.array, atol: float = 1e-4) -> None:
    np.testing.assert_allclose(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)), atol=atol, rtol=1e-4)


# ------------------------------------------------------------------ WeightStore


@pytest.fixture(scope="module")
def q4_dir(llama_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("weights") / "q4"
    convert(llama_src, dst, quantize="q4")
    return dst


def _store(root: Path, unpack: bool, native_kernels: bool = False, dtype: mx.Dtype = mx.float32) -> WeightStore:
    manifest = load_manifest(root)
    index = build_index(manifest.path(WEIGHTS), manifest.files[WEIGHTS].size, manifest.quantization)
    policy = ComputePolicy(unpack=unpack, compute_dtype=dtype, reason="test", native=native_kernels)
    return WeightStore(manifest.path(WEIGHTS), index, policy)


def test_weight_store_hides_unpacking_from_families(q4_dir: Path) -> None:
    packed, unpacked = _store(q4_dir, unpack=False), _store(q4_dir, unpack=True)
    base = "model.layers.0.self_attn.q_proj"
    assert base in packed.index.quantization
    a, b = packed.linear(base), unpacked.linear(base)
    assert a.quant is not None and b.quant is None and b.weight.dtype == mx.float32
    x = _normal((1, 4, 64), 19)
    _close(a(x), b(x))
    ids = mx.array([[1, 2, 300]])
    _close(packed.embedding("model.embed_tokens")(ids), unpacked.embedding("model.embed_tokens")(ids), atol=1e-6)
    # a float tensor asked of a quantized matrix comes back dequantized either way
    _close(packed.tensor(base), unpacked.tensor(base), atol=1e-6)
    unpacked.materialize()


def _reads_the_file(*outputs: mx.array) -> bool:
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return 'label ="Load"' in dot.getvalue()


@pytest.mark.parametrize("unpack", [False, True], ids=["stored", "unpacked"])
def test_materialize_reads_every_handed_out_tensor_once(q4_dir: Path, unpack: bool) -> None:
    # a tensor left lazy is read from the file again by every graph that uses it (and by
    # every call of a compiled step that captured it before its first evaluation)
    store = _store(q4_dir, unpack=unpack, native_kernels=not unpack)
    base = "model.layers.0.self_attn.q_proj"
    linear, embedding = store.linear(base), store.embedding("model.embed_tokens")
    norm, dense = store.tensor("model.norm.weight"), store.tensor(base)
    x = _normal((1, 1, 64), 3)
    graph = (linear(x), embedding(mx.array([[1, 2]])), norm * 2, dense + 1)
    assert _reads_the_file(*graph)
    store.materialize()
    graph = (linear(x), embedding(mx.array([[1, 2]])), norm * 2, dense + 1)
    assert not _reads_the_file(*graph)


@pytest.mark.parametrize("unpack", [False, True], ids=["stored", "unpacked"])
def test_a_dropped_linear_is_not_held_until_materialize(q4_dir: Path, unpack: bool) -> None:
    # a family that fuses q/k/v drops the parts: their arrays leave with them, not with materialize
    store = _store(q4_dir, unpack=unpack, native_kernels=not unpack)
    parts = [store.linear(f"model.layers.0.self_attn.{p}_proj") for p in "qkv"]
    fused = fuse_linears(parts)
    assert fused is not None
    dropped = [weakref.ref(a) for p in parts for a in (p.weight, p.scales, p.biases) if a is not None]
    del parts
    gc.collect()
    assert all(r() is None for r in dropped)
    store.materialize()
    assert not _reads_the_file(fused(_normal((1, 1, 64), 5)))


_HELD_CHILD = """
import gc, sys
from pathlib import Path
import mlx.core as mx
from turbospark_core.compute import ComputePolicy
from turbospark_core.manifest import WEIGHTS, load_manifest
from turbospark_core.tensor_index import build_index
from turbospark_core.weights import WeightStore

manifest = load_manifest(Path(sys.argv[1]))
index = build_index(manifest.path(WEIGHTS), manifest.files[WEIGHTS].size, manifest.quantization)
policy = ComputePolicy(unpack=True, compute_dtype=mx.float32, reason="test", native=False)
store = WeightStore(manifest.path(WEIGHTS), index, policy)
linears = [store.linear(base) for base in sorted(index.quantization) if ".layers." in base]
gc.collect()
before = mx.get_active_memory()  # the linears are lazy reads so far
store.materialize()
gc.collect()
print(sum(lin.weight.nbytes for lin in linears), mx.get_active_memory() - before)
"""


def test_an_unpacked_matrix_is_held_without_its_stored_bytes(q4_dir: Path) -> None:
    # the store lets go of what it read: the packed bytes do not stay resident beside the float copy
    # (in a child: the process's other arrays would move its active memory)
    out = subprocess.run([sys.executable, "-c", _HELD_CHILD, str(q4_dir)], capture_output=True, text=True, check=True)
    held, grew = map(int, out.stdout.split())
    assert held > 0 and grew < held * 1.02, (held, grew)  # packed copies would add about 1/7


def test_a_tensor_stays_held_for_what_is_computed_from_it(q4_dir: Path) -> None:
    # a family may keep only a value computed from a tensor: the tensor is still read once, at materialize
    store = _store(q4_dir, unpack=True)
    scaled = store.tensor("model.norm.weight") * 2
    gc.collect()
    store.materialize()
    assert not _reads_the_file(scaled)


@pytest.mark.parametrize(
    ("unpack", "native_kernels", "dtype"),
    [(True, True, mx.float32), (True, False, mx.float32), (False, True, mx.float32), (False, False, mx.bfloat16)],
    ids=["cpu-native", "cpu-native-off", "stored-native", "stored-mlx-kernels (gpu-like)"],
)
def test_group_16_matrices_stay_quantized_only_where_native_kernels_multiply_them(
    k_quant_installs: dict[str, Path], unpack: bool, native_kernels: bool, dtype: mx.Dtype
) -> None:
    store = _store(k_quant_installs["quantized"], unpack, native_kernels and native.available(), dtype)
    reference = _store(k_quant_installs["float"], unpack=True)
    kept = native_kernels and native.available()
    x = _normal((1, 3, 512), 7)
    for base in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"):
        lin, want = store.linear(base), reference.linear(base)
        assert (lin.quant is not None) == kept, base
        if kept:  # the native kernel against the float reference's matmul
            xin = x[..., : want.weight.shape[1]]
            _close(lin(xin), want(xin))
        else:  # unpacked exactly, held in the compute dtype
            assert lin.weight.dtype == dtype
            assert mx.array_equal(lin.weight, want.weight.astype(dtype)).item()
        assert mx.array_equal(store.tensor(base), reference.tensor(f"{base}.weight").astype(dtype)).item()
        assert store.linear(base, native_ok=False).quant is None  # as expert stacks: they gather
    ids = mx.array([[0, 5, 259]])  # embedding rows gathered, then unpacked (or from the unpacked table)
    rows = store.embedding("model.embed_tokens")(ids)
    assert rows.dtype == dtype
    assert mx.array_equal(rows, reference.embedding("model.embed_tokens")(ids).astype(dtype)).item()
    store.materialize()


def _symmetric_copy(src: Path, dst: Path, bases: list[str]) -> dict[str, np.ndarray]:
    """A copy of install ``src`` whose matrices ``bases`` have every bias -8 * its scale (4-bit symmetric)."""
    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(dst / WEIGHTS))
    for base in bases:
        scales = tensors[f"{base}.scales"]
        tensors[f"{base}.biases"] = (scales.astype(np.float32) * -8).astype(scales.dtype)
    save_file(tensors, str(dst / WEIGHTS))
    raw = json.loads((dst / MANIFEST).read_text())
    raw["files"][WEIGHTS]["size"] = (dst / WEIGHTS).stat().st_size
    (dst / MANIFEST).write_text(json.dumps(raw))
    return tensors


@pytest.mark.skipif(not native.available(), reason="symmetric matrices drop their biases on the native path only")
def test_symmetric_matrices_are_held_without_biases(q4_dir: Path, tmp_path: Path) -> None:
    # GGUF's Q4_0/Q8_0 blocks: every bias is -2^(bits-1) * its scale; the native kernels derive them
    base, table = "model.layers.0.self_attn.o_proj", "model.embed_tokens"
    tensors = _symmetric_copy(q4_dir, tmp_path / "sym", [base, table])
    held, unpacked = _store(tmp_path / "sym", unpack=True, native_kernels=True), _store(tmp_path / "sym", unpack=True)
    sym, other = held.linear(base), held.linear("model.layers.0.mlp.up_proj")
    assert sym.quant is not None and sym.biases is None  # never read per token
    assert other.quant is not None and other.biases is not None  # an asymmetric matrix keeps its biases
    x = _normal((3, 64), 7)
    stored = mx.array(tensors[f"{base}.biases"])
    want = native.quantized_matmul(x, sym.weight, sym.scales, stored, sym.quant)
    np.testing.assert_array_equal(np.array(sym(x)), np.array(want))  # derived biases: bit for bit
    _close(sym(x), unpacked.linear(base)(x))
    # a symmetric table's gathered rows get derived biases too
    assert held.embedding(table).table.biases is None
    ids = mx.array([[3, 9]])
    _close(held.embedding(table)(ids), unpacked.embedding(table)(ids), atol=1e-6)


def test_experts_come_from_the_container_without_a_source(q4_dir: Path) -> None:
    store = _store(q4_dir, unpack=True)
    bank = store.experts("model.layers.0.mlp", "gate_proj", "up_proj", "down_proj")
    assert isinstance(bank, ExpertBank) and isinstance(bank, Experts)
    assert not [n for n in store.unused() if n.startswith("model.layers.0.mlp.")]


@attrs.define
class _Source:
    """An ExpertSource holding one routed layer."""

    prefix: str
    asked: list[str] = attrs.Factory(list)
    materialized: bool = False

    def has(self, prefix: str) -> bool:
        return prefix == self.prefix

    def bank(self, prefix: str, gate: str, up: str, down: str) -> Experts:
        self.asked.append(prefix)
        return _OneExpert()

    def materialize(self) -> None:
        self.materialized = True

    def unused(self) -> list[str]:
        return [] if self.asked else [self.prefix]


class _OneExpert:
    num_experts = 1

    def glu(self, x: mx.array, indices: mx.array, activation: Activation) -> mx.array:
        return mx.expand_dims(activation(x, x), -2)


def test_routed_layers_of_a_source_come_from_it(q4_dir: Path) -> None:
    store, source = _store(q4_dir, unpack=True), _Source("model.layers.9.mlp.experts")
    typed: ExpertSource = source
    store.use_experts(typed)
    assert "model.layers.9.mlp.experts (experts.bin)" in store.unused()
    bank = store.experts("model.layers.9.mlp.experts", "gate_proj", "up_proj", "down_proj")
    assert isinstance(bank, _OneExpert) and source.asked == ["model.layers.9.mlp.experts"]
    assert not [n for n in store.unused() if "experts.bin" in n]
    assert isinstance(store.experts("model.layers.0.mlp", "gate_proj", "up_proj", "down_proj"), ExpertBank)
    store.materialize()
    assert source.materialized
