"""Tests of MoE expert streaming: experts.bin packing, layout validation, residency plans, bit identity, stats."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core import moe, plugins
from turbospark_core.cli import main
from turbospark_core.compute import ComputePolicy
from turbospark_core.convert import convert
from turbospark_core.convert.experts import split_experts, top_k_from_config
from turbospark_core.errors import (
    InstallError,
    ManifestError,
    MemoryBudgetError,
    OptionError,
    TensorStorageError,
)
from turbospark_core.manifest import EXPERTS, WEIGHTS, load_manifest
from turbospark_core.weights import ExpertBank

MOE_FIXTURES = ("qwen3_moe", "minimax_m2", "gpt_oss", "gpt_oss_mxfp4", "qwen3_5_moe", "gemma4_moe")
LAYER0 = "model.layers.0.mlp.experts"


def _source(fixtures: Path, name: str) -> Path:
    path = fixtures / name
    if not (path / "config.json").is_file():
        pytest.skip(f"reference fixture {path} is not available")
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    if not plugins.registry().serves(model_type):
        pytest.skip(f"no installed plugin serves {model_type!r}")
    return path


@pytest.fixture(scope="session")
def moe_install(tmp_path_factory: pytest.TempPathFactory, turbospark_fixtures: Path) -> Callable[..., Path]:
    """``make(fixture, **convert_options)`` -> an install converted once per session. Never modify it."""
    made: dict[tuple[Any, ...], Path] = {}

    def make(name: str, **options: Any) -> Path:
        key = (name, *sorted(options.items()))
        if key not in made:
            dst = tmp_path_factory.mktemp(name) / "install"
            convert(_source(turbospark_fixtures, name), dst, **options)
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


# ------------------------------------------------------------------ conversion: experts.bin
def test_moe_install_packs_experts_into_experts_bin(moe_install: Callable[..., Path]) -> None:
    root = moe_install("qwen3_moe")
    m = load_manifest(root)
    assert EXPERTS in m.files and m.experts is not None and m.experts["top_k"] == 2
    names = set(mx.load(str(root / WEIGHTS)))
    assert not {n for n in names if moe.EXPERT_TENSOR.match(n)}, "routed experts stay out of model_weights"
    assert "model.layers.0.mlp.gate.weight" in names  # the router is not an expert
    layout = moe.ExpertLayout.from_section(m.experts, m.files[EXPERTS].size, "test")
    for layer in layout.layers.values():
        assert layer.offset % moe.ALIGNMENT == 0 and layer.stride % moe.ALIGNMENT == 0
        assert set(layer.projections) == {"gate_proj", "up_proj", "down_proj"} and layer.num_experts == 8


@pytest.mark.parametrize("options", [{}, {"quantize": "q4"}, {"dtype": "bfloat16"}], ids=["f32", "q4", "bf16"])
def test_experts_bin_holds_exactly_the_stacked_tensors(moe_install: Callable[..., Path], options: dict) -> None:
    packed, plain = moe_install("qwen3_moe", **options), moe_install("qwen3_moe", experts_file=False, **options)
    want = {n: a for n, a in mx.load(str(plain / WEIGHTS)).items() if moe.EXPERT_TENSOR.match(n)}
    got = moe.read_expert_tensors(load_manifest(packed))
    assert set(got) == set(want) and want
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype and mx.array_equal(got[name], arr).item(), name
    quant_plain = load_manifest(plain).quantization
    quant_packed = load_manifest(packed).quantization
    assert not [b for b in quant_packed if moe.EXPERT_TENSOR.match(b + ".weight")]
    if options.get("quantize"):
        section = load_manifest(packed).experts["layers"][LAYER0]["projections"]["gate_proj"]
        assert section["quantization"] == quant_plain[f"{LAYER0}.gate_proj"]


def test_expert_biases_and_mxfp4_go_into_the_record(moe_install: Callable[..., Path]) -> None:
    m = load_manifest(moe_install("gpt_oss_mxfp4"))
    proj = m.experts["layers"][LAYER0]["projections"]["gate_proj"]
    assert proj["quantization"] == {"bits": 4, "group_size": 32, "mode": "mxfp4"}
    assert set(proj["tensors"]) == {"weight", "scales", "bias"}


def test_no_experts_file_keeps_the_old_layout(moe_install: Callable[..., Path], refs_of: Callable) -> None:
    root = moe_install("qwen3_moe", experts_file=False)
    m = load_manifest(root)
    assert EXPERTS not in m.files and m.experts is None
    assert f"{LAYER0}.gate_proj.weight" in mx.load(str(root / WEIGHTS))
    refs = refs_of("qwen3_moe")
    assert np.abs(turbospark_core.open(root).logits(refs["prompt_ids"].tolist()) - refs["logits"]).max() < 1e-4
    with pytest.raises(OptionError, match=r"residency='streamed' needs experts\.bin"):
        turbospark_core.open(root, residency="streamed")


def test_top_k_comes_from_the_hugging_face_config() -> None:
    assert top_k_from_config({"num_experts_per_tok": 4}) == 4
    assert top_k_from_config({"text_config": {"top_k_experts": 2}}) == 2
    assert top_k_from_config({"num_experts_per_tok": True}) is None
    assert top_k_from_config({}) is None


def test_dense_installs_have_no_experts_bin(f32_install: Path) -> None:
    assert EXPERTS not in load_manifest(f32_install).files
    runner = turbospark_core.open(f32_install, residency="streamed", expert_slots=2)
    assert runner.expert_stats() is None and runner.opened.estimate.experts == 0


def test_cli_convert_flag(tmp_path: Path, turbospark_fixtures: Path) -> None:
    src = _source(turbospark_fixtures, "qwen3_moe")
    assert main(["convert", str(src), str(tmp_path / "a"), "-q"]) == 0
    assert main(["convert", str(src), str(tmp_path / "b"), "-q", "--no-experts-file"]) == 0
    assert (tmp_path / "a" / EXPERTS).is_file() and not (tmp_path / "b" / EXPERTS).exists()


# ------------------------------------------------------------------ bit identity, resident vs streamed
@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_streamed_is_bit_identical_to_resident_for_every_slot_count(
    moe_install: Callable[..., Path], refs_of: Callable, name: str
) -> None:
    root = moe_install(name)
    refs = refs_of(name)
    ids = refs["prompt_ids"].tolist()
    layout = moe.ExpertLayout.from_section(load_manifest(root).experts, load_manifest(root).files[EXPERTS].size, "t")
    resident = turbospark_core.open(root, residency="resident")
    assert resident.expert_stats().residency == "resident"
    want_logits = resident.logits(ids)
    want_tokens = resident.generate(ids, max_tokens=len(refs["greedy_tokens"]), temperature=0.0).tokens
    assert want_tokens == refs["greedy_tokens"].tolist()
    for slots in range(layout.top_k, layout.max_experts + 1):
        runner = turbospark_core.open(root, residency="streamed", expert_slots=slots)
        assert runner.opened.policy.unpack == resident.opened.policy.unpack
        assert np.array_equal(runner.logits(ids), want_logits), f"{name}: logits differ with {slots} slots"
        got = runner.generate(ids, max_tokens=len(want_tokens), temperature=0.0)
        assert got.tokens == want_tokens, f"{name}: greedy tokens differ with {slots} slots"
        stats = runner.expert_stats()
        assert stats.residency == "streamed" and stats.slots == slots and stats.misses >= len(layout.layers)


def _synthetic(tmp_path: Path, kind: str, experts: int = 6, dim: int = 64, hidden: int = 64) -> moe.ExpertLayout:
    """A one-layer experts.bin with random experts stored as ``kind`` (f32, bf16+bias, q4, mxfp4+bias)."""
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
        if kind in ("q4", "mxfp4"):
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
    return moe.ExpertLayout.from_section(section, (tmp_path / EXPERTS).stat().st_size, "synthetic")


def _store(tmp_path: Path, layout: moe.ExpertLayout, residency: str, slots: int, unpack: bool) -> moe.ExpertStore:
    policy = ComputePolicy(unpack=unpack, compute_dtype=mx.float32, reason="test")
    plan = moe.ExpertPlan(residency=residency, slots=slots, unpack=unpack, held_bytes=0)
    store = moe.ExpertStore(tmp_path / EXPERTS, layout, plan, policy)
    store.setup()
    return store


def _silu_glu(gate: mx.array, up: mx.array) -> mx.array:
    return gate * mx.sigmoid(gate) * up


@pytest.mark.parametrize("kind", ["f32", "bf16", "q4", "mxfp4"])
@pytest.mark.parametrize(
    ("unpack", "in_place"),
    [(True, True), (True, False), (False, False)],
    ids=["float32-in-place", "float32-mlx-updates", "stored"],
)
def test_streamed_bank_equals_resident_bank_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, unpack: bool, in_place: bool
) -> None:
    if not in_place:  # the path for backends whose memory numpy cannot write (GPU)
        monkeypatch.setattr(moe, "_writable_views", lambda held: None)
    layout = _synthetic(tmp_path, kind)
    resident = _store(tmp_path, layout, moe.RESIDENT, 6, unpack).bank(LAYER0, "gate_proj", "up_proj", "down_proj")
    store = _store(tmp_path, layout, moe.STREAMED, 2, unpack)
    streamed = store.bank(LAYER0, "gate_proj", "up_proj", "down_proj")
    assert isinstance(resident, ExpertBank) and isinstance(streamed, moe.StreamedExpertBank)
    assert (streamed._views is not None) == (in_place and mx.default_device() == mx.cpu)
    assert resident.num_experts == streamed.num_experts == 6
    rng = np.random.default_rng(3)
    x = mx.array(rng.standard_normal((2, 5, 64)).astype(np.float32))
    for _ in range(4):  # decode-like (one token) and prefill-like (more experts than slots) batches
        idx = mx.array(rng.permuted(np.tile(np.arange(6), (2, 5, 1)), axis=-1)[..., :2].astype(np.uint32))
        for xs, ids in ((x[:1, :1], idx[:1, :1]), (x, idx)):
            want = resident.glu(xs, ids, _silu_glu)
            got = streamed.glu(xs, ids, _silu_glu)
            assert got.shape == want.shape and np.array_equal(np.array(got), np.array(want))
    assert store.stats().misses > 6  # the prefill batches reloaded experts


# ------------------------------------------------------------------ the LRU
def test_lru_keeps_the_most_recently_used_experts(tmp_path: Path) -> None:
    layout = _synthetic(tmp_path, "f32")
    store = _store(tmp_path, layout, moe.STREAMED, 3, unpack=True)
    bank = store.bank(LAYER0, "gate_proj", "up_proj", "down_proj")
    x = mx.zeros((1, 1, 64))

    def route(*experts: int) -> None:
        mx.eval(bank.glu(x, mx.array([[list(experts)]], dtype=mx.uint32), _silu_glu))

    route(0, 1)
    route(2, 0)  # 0 is a hit, 2 fills the free slot; 1 is now the least recently used
    assert bank.cached() == [1, 0, 2]
    route(3, 2)  # evicts 1
    assert bank.cached() == [0, 3, 2]
    stats = store.stats()
    assert (stats.hits, stats.misses) == (2, 4)
    assert stats.bytes_read == 4 * layout.layers[LAYER0].stride and stats.load_ms > 0 and stats.tokens == 3
    assert 0 < stats.hit_rate < 1


def test_router_out_of_range_and_too_few_slots_are_refused(tmp_path: Path) -> None:
    layout = _synthetic(tmp_path, "f32")
    bank = _store(tmp_path, layout, moe.STREAMED, 2, unpack=True).bank(LAYER0, "gate_proj", "up_proj", "down_proj")
    x = mx.zeros((1, 1, 64))
    with pytest.raises(OptionError, match=r"expert_slots=2 is below the 3 experts"):
        bank.glu(x, mx.array([[[0, 1, 2]]], dtype=mx.uint32), _silu_glu)
    with pytest.raises(ValueError, match="chose expert 9"):
        bank.glu(x, mx.array([[[0, 9]]], dtype=mx.uint32), _silu_glu)


# ------------------------------------------------------------------ open: options, plan, estimate
def test_slots_below_top_k_are_refused_by_name(moe_install: Callable[..., Path], names) -> None:
    root = moe_install("qwen3_moe")
    with pytest.raises(OptionError) as e:
        turbospark_core.open(root, residency="streamed", expert_slots=1)
    names(e, "expert_slots=1", "top_k=2")
    with pytest.raises(OptionError):
        turbospark_core.open(root, expert_slots=1)  # auto with explicit slots streams
    turbospark_core.open(root, residency="resident", expert_slots=1)  # resident ignores the slot count
    plan = turbospark_core.open(root, expert_slots=4).opened.experts.plan  # auto with explicit slots streams
    assert (plan.residency, plan.slots) == ("streamed", 4)
    plan = turbospark_core.open(root, residency="streamed", expert_slots=99).opened.experts.plan
    assert (plan.residency, plan.slots) == ("streamed", 8)  # capped at the expert count


def test_without_top_k_in_the_install_the_first_call_refuses(moe_copy: Path, tamper) -> None:
    tamper.edit(moe_copy, lambda raw: raw["experts"].__setitem__("top_k", None))
    runner = turbospark_core.open(moe_copy, residency="streamed", expert_slots=1)
    with pytest.raises(OptionError, match=r"expert_slots=1 is below the 2 experts the family routes"):
        runner.logits([1, 2, 3])


def test_auto_is_resident_when_the_experts_fit(moe_install: Callable[..., Path]) -> None:
    opened = turbospark_core.open(moe_install("qwen3_moe")).opened
    assert opened.experts.plan.residency == "resident" and opened.policy.unpack
    layout = opened.experts.layout
    assert opened.estimate.experts == layout.slot_bytes(layout.max_experts, unpack=True)


def test_auto_streams_with_the_most_slots_the_budget_allows(moe_install: Callable[..., Path]) -> None:
    root = moe_install("qwen3_moe")
    full = turbospark_core.open(root, max_context=64).opened
    layout = full.experts.layout
    non_expert = full.estimate.weights + full.estimate.kv
    per_slot = layout.slot_bytes(1, unpack=True)
    budget = non_expert + 5 * per_slot + layout.staging_bytes(5) + 1  # 6 slots, or all 8, would not fit
    opened = turbospark_core.open(root, max_context=64, memory_budget=budget).opened
    assert opened.policy.unpack and opened.experts.plan.residency == "streamed" and opened.experts.plan.slots == 5
    assert opened.estimate.experts == 5 * per_slot + layout.staging_bytes(5) and opened.estimate.total <= budget
    assert opened.startup_stats.expert_setup > 0


def test_over_budget_streamed_open_names_expert_slots(moe_install: Callable[..., Path], names) -> None:
    root = moe_install("qwen3_moe")
    with pytest.raises(MemoryBudgetError) as e:
        turbospark_core.open(root, residency="streamed", expert_slots=8, memory_budget=700_000, max_context=64)
    names(e, "lower expert_slots (now 8)", "memory_budget")
    with pytest.raises(MemoryBudgetError) as e:
        turbospark_core.open(root, residency="resident", memory_budget=300_000, max_context=64)
    names(e, "residency='streamed'")


def test_stored_policy_streams_quantized_experts_bit_identically(
    moe_install: Callable[..., Path], refs_of: Callable
) -> None:
    root = moe_install("gpt_oss_mxfp4")
    ids = refs_of("gpt_oss_mxfp4")["prompt_ids"].tolist()
    resident = turbospark_core.open(root, memory_budget=600_000, max_context=256, residency="resident")
    streamed = turbospark_core.open(root, memory_budget=600_000, max_context=256, residency="streamed", expert_slots=2)
    assert not resident.opened.policy.unpack and not streamed.opened.policy.unpack
    assert np.array_equal(resident.logits(ids), streamed.logits(ids))


# ------------------------------------------------------------------ layout validation at open
def _edit_layer(tamper, root: Path, fn: Callable[[dict], None]) -> None:
    tamper.edit(root, lambda raw: fn(raw["experts"]["layers"][LAYER0]))


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda layer: layer.__setitem__("offset", 1 << 30), "past the"),
        (lambda layer: layer.__setitem__("offset", 100), "multiples of 4096"),
        (lambda layer: layer.__setitem__("num_experts", 10**9), "'num_experts' must be an integer"),
        (lambda layer: layer.__setitem__("stride", 4096), "past the 4096-byte record"),
        (lambda layer: layer["projections"]["up_proj"]["tensors"]["weight"].__setitem__("offset", 0), "overlap"),
        (
            lambda layer: layer["projections"]["up_proj"]["tensors"]["weight"].__setitem__("shape", [31, 64]),
            "do not chain",
        ),
        (lambda layer: layer["projections"]["up_proj"]["tensors"].pop("weight"), "must include 'weight'"),
        (
            lambda layer: layer["projections"]["up_proj"].__setitem__("quantization", {"bits": 4, "group_size": 64}),
            "needs 'scales'",
        ),
        (lambda layer: layer["projections"].pop("up_proj"), "asks for projections"),
    ],
    ids=[
        "past-end",
        "unaligned",
        "huge-count",
        "short-stride",
        "overlap",
        "bad-shape",
        "no-weight",
        "quant-mismatch",
        "missing-proj",
    ],
)
def test_bad_layouts_are_refused_by_name(moe_copy: Path, tamper, edit: Callable, named: str) -> None:
    _edit_layer(tamper, moe_copy, edit)
    with pytest.raises(InstallError) as e:
        turbospark_core.open(moe_copy)
    assert named in str(e.value) and "re-run `turbospark convert`" in str(e.value)


def test_storage_with_no_kernel_is_refused_naming_the_tensor(moe_copy: Path, tamper) -> None:
    _edit_layer(
        tamper,
        moe_copy,
        lambda layer: layer["projections"]["gate_proj"]["tensors"]["weight"].__setitem__("dtype", "I8"),
    )
    with pytest.raises(TensorStorageError, match=r"model\.layers\.0\.mlp\.experts\.gate_proj\.weight"):
        turbospark_core.open(moe_copy)


def test_overlapping_layers_and_top_k_are_checked(moe_copy: Path, tamper) -> None:
    tamper.edit(moe_copy, lambda raw: raw["experts"]["layers"]["model.layers.1.mlp.experts"].__setitem__("offset", 0))
    with pytest.raises(InstallError, match=r"overlap in experts\.bin"):
        turbospark_core.open(moe_copy)
    tamper.edit(
        moe_copy, lambda raw: raw["experts"]["layers"]["model.layers.1.mlp.experts"].__setitem__("offset", 196608)
    )
    tamper.edit(moe_copy, lambda raw: raw["experts"].__setitem__("top_k", 9))
    with pytest.raises(InstallError, match="top_k=9 exceeds"):
        turbospark_core.open(moe_copy)


def test_section_and_file_come_together(moe_copy: Path, tamper) -> None:
    tamper.edit(moe_copy, lambda raw: raw["files"].pop(EXPERTS))
    with pytest.raises(ManifestError, match=r"'experts' section but no 'experts\.bin'"):
        turbospark_core.open(moe_copy)


def test_an_unused_routed_layer_is_refused(moe_copy: Path, tamper) -> None:
    blob = (moe_copy / EXPERTS).read_bytes()
    tamper.put_file(moe_copy, EXPERTS, blob + blob)  # room for a layer the family never asks for

    def add(raw: dict) -> None:
        layers = raw["experts"]["layers"]
        layers["model.layers.7.mlp.experts"] = {**layers[LAYER0], "offset": len(blob)}

    tamper.edit(moe_copy, add)
    with pytest.raises(
        InstallError, match=r"not used by family 'llama', first 'model\.layers\.7\.mlp\.experts \(experts\.bin\)'"
    ):
        turbospark_core.open(moe_copy)


def test_truncated_experts_bin_is_refused(moe_copy: Path) -> None:
    with (moe_copy / EXPERTS).open("r+b") as f:
        f.truncate(4096)
    with pytest.raises(InstallError, match=r"experts\.bin"):
        turbospark_core.open(moe_copy)


# ------------------------------------------------------------------ stats surfaces
def test_generation_stats_carry_the_expert_counters(moe_install: Callable[..., Path]) -> None:
    runner = turbospark_core.open(moe_install("qwen3_moe"), residency="streamed", expert_slots=2)
    first = runner.generate([1, 2, 3, 4], max_tokens=4, temperature=0.0).stats.experts
    second = runner.generate([1, 2, 3, 4], max_tokens=4, temperature=0.0).stats.experts
    total = runner.expert_stats()
    assert first.misses + second.misses == total.misses and first.hits + second.hits == total.hits
    assert first.tokens == 3 + 1 + 3 and total.load_ms_per_token > 0
    dense = turbospark_core.open(moe_install("qwen3_moe"), residency="resident")
    assert dense.generate([1, 2], max_tokens=2).stats.experts.residency == "resident"


def test_cli_prints_expert_stats(moe_install: Callable[..., Path], capsys: pytest.CaptureFixture[str]) -> None:
    root = str(moe_install("qwen3_moe"))
    assert (
        main(["inspect", root, "--stats", "--residency", "streamed", "--expert-slots", "3", "--stats-tokens", "4"]) == 0
    )
    out = capsys.readouterr().out
    assert "experts      experts.bin: 2 routed layers x 8 experts" in out
    assert "streamed: 3 slots per routed layer" in out
    assert "experts: streamed, 3 slots/layer | hits" in out and "ms/token" in out
    assert (
        main(["generate", root, "Hi", "--max-tokens", "3", "-v", "--residency", "streamed", "--expert-slots", "2"]) == 0
    )
    assert "experts: streamed, 2 slots/layer | hits" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", root, "Hi", "--expert-slots", "many"])
