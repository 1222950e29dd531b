"""``convert --rotate``: a randomized Hadamard rotation folded into the weights, served by llama and qwen."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core import hadamard
from turbospark_core.cli import main
from turbospark_core.convert import convert
from turbospark_core.errors import ConversionError, FamilyRefusalError, FileTableError, InstallError
from turbospark_core.manifest import HADAMARD, load_manifest

FIXTURES = Path(os.environ.get("TURBOSPARK_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures"))
SERVED = ["llama", "qwen3", "qwen3_5", "qwen3_5_moe"]
REFUSED = ["gemma4_e", "gpt_oss", "spark2_5"]


def _src(name: str) -> Path:
    path = FIXTURES / name
    if not (path / "config.json").is_file():
        pytest.skip(f"reference fixture {path} is not available")
    return path


@pytest.fixture(scope="module")
def rotated_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llama fixture converted with --rotate (float32). Never modify it: copy it."""
    dst = tmp_path_factory.mktemp("rot") / "llama"
    convert(_src("llama"), dst, rotate=True, rotate_seed=7)
    return dst


@pytest.fixture
def rotated_copy(rotated_llama: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "install"
    shutil.copytree(rotated_llama, dst)
    return dst


# ------------------------------------------------------------------ the math


def test_rotation_is_orthogonal_and_seeded() -> None:
    for n in (64, 576, 96):
        signs = mx.array(hadamard.make_signs(n, 3).astype(np.float32))
        q = np.array(hadamard.rotate_last(mx.eye(n), signs))  # rows of Q
        np.testing.assert_allclose(q @ q.T, np.eye(n), atol=1e-5)
    assert hadamard.block_size(576) == 64 and hadamard.block_size(4096) == 4096 and hadamard.block_size(96) == 32
    np.testing.assert_array_equal(hadamard.make_signs(64, 1), hadamard.make_signs(64, 1))
    assert (hadamard.make_signs(64, 1) != hadamard.make_signs(64, 2)).any()


# ------------------------------------------------------------------ served families


@pytest.mark.parametrize("fixture", SERVED)
def test_rotated_install_computes_what_the_unrotated_one_does(fixture: str, tmp_path: Path) -> None:
    src = _src(fixture)
    plain, rotated = tmp_path / "plain", tmp_path / "rotated"
    convert(src, plain)
    manifest = convert(src, rotated, rotate=True, rotate_seed=11)
    section = manifest.hadamard
    assert section is not None and section["seed"] == 11 and section["online"] == []
    assert section["hidden_size"] == manifest.arch["hidden_size"]
    assert manifest.files[HADAMARD].size == section["size"] == manifest.arch["hidden_size"]
    assert manifest.provenance["options"]["rotate"] is True
    ids = np.load(src / "references.npz")["prompt_ids"].tolist()
    a, b = turbospark_core.open(plain), turbospark_core.open(rotated)
    assert b.opened.capabilities.accepts_hadamard
    la, lb = a.logits(ids), b.logits(ids)
    assert np.abs(la - lb).max() / np.abs(la).max() < 1e-4
    assert a.generate(ids, max_tokens=12).tokens == b.generate(ids, max_tokens=12).tokens


def test_rotation_really_changes_the_weights(rotated_llama: Path, f32_install: Path) -> None:
    from safetensors.numpy import load_file

    plain = load_file(str(f32_install / "model_weights.safetensors"))
    rot = load_file(str(rotated_llama / "model_weights.safetensors"))
    assert "lm_head.weight" in rot
    np.testing.assert_array_equal(rot["model.layers.0.input_layernorm.weight"], 1.0)  # folded into q/k/v
    assert not np.allclose(rot["model.embed_tokens.weight"], plain["model.embed_tokens.weight"], atol=1e-3)
    # rows keep their norms (orthogonal rotation)
    np.testing.assert_allclose(
        np.linalg.norm(rot["model.embed_tokens.weight"], axis=1),
        np.linalg.norm(plain["model.embed_tokens.weight"], axis=1),
        rtol=1e-5,
    )


def test_rotated_then_quantized_install_opens_and_agrees(tmp_path: Path, f32_install: Path) -> None:
    dst = tmp_path / "rq"
    manifest = convert(_src("llama"), dst, rotate=True, quantize="q8")
    assert manifest.hadamard is not None and manifest.quantization
    ids = np.load(_src("llama") / "references.npz")["prompt_ids"].tolist()
    ref = turbospark_core.open(f32_install).logits(ids)
    got = turbospark_core.open(dst).logits(ids)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 5e-2


def test_cli_convert_rotate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "cli"
    assert main(["convert", str(_src("llama")), str(dst), "--rotate", "--rotate-seed", "5", "-q"]) == 0
    assert load_manifest(dst).hadamard["seed"] == 5  # type: ignore[index]
    assert main(["inspect", str(dst)]) == 0
    assert "hadamard     folded; the family accepts folded installs" in capsys.readouterr().out


# ------------------------------------------------------------------ refused families


@pytest.mark.parametrize("fixture", REFUSED)
def test_rotate_refused_by_name_for_other_families(fixture: str, tmp_path: Path, names) -> None:
    with pytest.raises(ConversionError) as e:
        convert(_src(fixture), tmp_path / "x", rotate=True)
    names(e, "--rotate", "does not serve hadamard-rotated installs", "convert without --rotate")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("fixture", REFUSED)
def test_forged_hadamard_section_refused_by_other_families(
    fixture: str, rotated_llama: Path, tmp_path: Path, tamper, names
) -> None:
    dst = tmp_path / "forged"
    convert(_src(fixture), dst)
    tamper.put_file(dst, HADAMARD, (rotated_llama / HADAMARD).read_bytes())
    section = load_manifest(rotated_llama).hadamard
    tamper.edit(dst, lambda raw: raw.__setitem__("hadamard", section))
    with pytest.raises(FamilyRefusalError) as e:
        turbospark_core.open(dst)
    names(e, "hadamard-folded", "does not accept hadamard-folded installs")


# ------------------------------------------------------------------ hadamard.bin and the section, validated at open


@pytest.mark.parametrize(("data", "how"), [(b"\x01" * 63, "shorter"), (b"\x01" * 65, "longer")])
def test_truncated_or_oversized_hadamard_bin_refused_naming_the_sizes(
    rotated_copy: Path, data: bytes, how: str, names
) -> None:
    (rotated_copy / HADAMARD).write_bytes(data)  # the file table still says 64
    with pytest.raises(FileTableError) as e:
        turbospark_core.open(rotated_copy)
    names(e, repr(HADAMARD), f"{len(data)} bytes", how, "64 bytes")


@pytest.mark.parametrize("size", [63, 65])
def test_hadamard_bin_size_not_the_sections_refused_naming_the_sizes(
    rotated_copy: Path, size: int, tamper, names
) -> None:
    tamper.put_file(rotated_copy, HADAMARD, b"\x01" * size)  # file table agrees with the file, the section does not
    with pytest.raises(InstallError) as e:
        turbospark_core.open(rotated_copy)
    names(e, HADAMARD, "64 bytes", str(size))


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("hidden_size", 128, "hidden_size"),
        ("block", 16, "block"),
        ("online", ["before_down_proj"], "online"),
        ("scheme", "spinquant", "scheme"),
        ("signs", {"offset": 1, "length": 64, "dtype": "int8"}, "offset"),
        ("signs", {"offset": 0, "length": 10**9, "dtype": "int8"}, "signs"),
        ("size", 2**40, "size"),
    ],
)
def test_bad_hadamard_section_refused_by_name(rotated_copy: Path, key: str, value, said: str, tamper, names) -> None:
    tamper.edit(rotated_copy, lambda raw: raw["hadamard"].__setitem__(key, value))
    with pytest.raises(InstallError) as e:
        turbospark_core.open(rotated_copy)
    names(e, "hadamard", said)


def test_signs_that_are_not_signs_refused(rotated_copy: Path, tamper, names) -> None:
    tamper.put_file(rotated_copy, HADAMARD, b"\x02" * 64)
    with pytest.raises(InstallError) as e:
        turbospark_core.open(rotated_copy)
    names(e, HADAMARD, "not all +-1")


def test_q3_weights_convert_and_open(tmp_path: Path, f32_install: Path) -> None:
    manifest = convert(_src("llama"), tmp_path / "q3", quantize="q3", rotate=True)
    assert {q["bits"] for q in manifest.quantization.values()} == {3}
    ids = np.load(_src("llama") / "references.npz")["prompt_ids"].tolist()
    ref = turbospark_core.open(f32_install).logits(ids)
    got = turbospark_core.open(tmp_path / "q3").logits(ids)
    # random tiny weights at 3 bits correlate about 0.85 with float32
    assert np.isfinite(got).all() and np.corrcoef(got.ravel(), ref.ravel())[0, 1] > 0.7
