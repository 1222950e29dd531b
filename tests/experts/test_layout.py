"""The experts.bin layout: what conversion packs, and what the open refuses by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest

import turbospark_core
from turbospark_core import native
from turbospark_core.cli import main
from turbospark_core.convert.experts import top_k_from_config
from turbospark_core.errors import InstallError, ManifestError, TensorStorageError
from turbospark_core.experts.layout import ALIGNMENT, EXPERT_TENSOR, ExpertLayout
from turbospark_core.manifest import EXPERTS, WEIGHTS, load_manifest

LAYER0 = "model.layers.0.mlp.experts"


# ------------------------------------------------------------------ conversion: experts.bin
def test_moe_install_packs_experts_into_experts_bin(moe_install: Callable[..., Path]) -> None:
    root = moe_install("qwen3_moe")
    m = load_manifest(root)
    assert EXPERTS in m.files and m.experts is not None and m.experts["top_k"] == 2
    names = set(mx.load(str(root / WEIGHTS)))
    assert not {n for n in names if EXPERT_TENSOR.match(n)}, "routed experts stay out of model_weights"
    assert "model.layers.0.mlp.gate.weight" in names  # the router is not an expert
    layout = ExpertLayout.from_section(m.experts, m.files[EXPERTS].size, "test")
    for layer in layout.layers.values():
        assert layer.offset % ALIGNMENT == 0 and layer.stride % ALIGNMENT == 0
        assert set(layer.projections) == {"gate_proj", "up_proj", "down_proj"} and layer.num_experts == 8


def test_expert_biases_and_mxfp4_go_into_the_record(moe_install: Callable[..., Path]) -> None:
    m = load_manifest(moe_install("gpt_oss_mxfp4"))
    proj = m.experts["layers"][LAYER0]["projections"]["gate_proj"]
    assert proj["quantization"] == {"bits": 4, "group_size": 32, "mode": "mxfp4"}
    assert set(proj["tensors"]) == {"weight", "scales", "bias"}


def test_top_k_comes_from_the_hugging_face_config() -> None:
    assert top_k_from_config({"num_experts_per_tok": 4}) == 4
    assert top_k_from_config({"text_config": {"top_k_experts": 2}}) == 2
    assert top_k_from_config({"num_experts_per_tok": True}) is None
    assert top_k_from_config({}) is None


def test_cli_convert_flag(tmp_path: Path, moe_source: Callable[[str], Path]) -> None:
    src = moe_source("qwen3_moe")
    assert main(["convert", str(src), str(tmp_path / "a"), "-q"]) == 0
    assert main(["convert", str(src), str(tmp_path / "b"), "-q", "--no-experts-file"]) == 0
    assert (tmp_path / "a" / EXPERTS).is_file() and not (tmp_path / "b" / EXPERTS).exists()


def test_the_section_round_trips(synthetic: Callable[[str], ExpertLayout], tmp_path: Path) -> None:
    layout = synthetic("q4")
    again = ExpertLayout.from_section(layout.to_section(), (tmp_path / EXPERTS).stat().st_size, "again")
    assert again == layout and layout.top_k == 2 and layout.max_experts == 6
    gate = layout.layers[LAYER0].projections["gate_proj"]
    assert (gate.out_features, gate.in_features) == (64, 64)
    stored = sum(t.nbytes for t in gate.tensors.values())
    assert gate.held_bytes(unpack=False) == stored
    # unpacked to float32 unless the native kernels multiply the layout as stored
    assert gate.held_bytes(unpack=True) == (stored if native.keeps(gate.quant) else 4 * 64 * 64)


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


def test_truncated_experts_bin_is_refused(moe_copy: Path) -> None:
    with (moe_copy / EXPERTS).open("r+b") as f:
        f.truncate(4096)
    with pytest.raises(InstallError, match=r"experts\.bin"):
        turbospark_core.open(moe_copy)
