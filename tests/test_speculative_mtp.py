"""The ``mtp`` drafter's refusals, on installs of a family without a head flow (llama) and without a head."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

import turbospark_core
from turbospark_core.errors import FamilyRefusalError, ManifestError, OptionError
from turbospark_core.manifest import MTP_HEAD, sha256_file
from turbospark_core.speculative import mtp


def _add_head(install: Path, *, section: bool = True, file: bool = True) -> None:
    """Give an install an ``mtp.safetensors`` and/or an ``mtp`` section (as convert writes them)."""
    raw = json.loads((install / "manifest.json").read_text())
    if file:
        mx.save_safetensors(str(install / MTP_HEAD), {"mtp.fc.weight": mx.zeros((4, 8))})
        size = (install / MTP_HEAD).stat().st_size
        raw["files"][MTP_HEAD] = {"size": size, "sha256": sha256_file(install / MTP_HEAD, size)}
    if section:
        raw["mtp"] = {"quantization": {}}
    (install / "manifest.json").write_text(json.dumps(raw))


def test_install_without_a_head_is_refused_naming_it(install: Path) -> None:
    runner = turbospark_core.open(install)
    assert not mtp.has_head(runner.opened)
    with pytest.raises(OptionError, match="no multi-token-prediction head"):
        mtp.load_head(runner.opened)
    with pytest.raises(OptionError, match=r"mtp\.safetensors"):
        runner.draft_logits([1, 2, 3])


def test_family_without_a_head_flow_is_refused_naming_the_hook(install: Path) -> None:
    _add_head(install)
    runner = turbospark_core.open(install)  # a plain open never reads the head
    assert mtp.has_head(runner.opened)
    with pytest.raises(FamilyRefusalError, match="build_mtp_head"):
        runner.draft_logits([1, 2, 3])


@pytest.mark.parametrize(("section", "file"), [(True, False), (False, True)])
def test_head_section_and_file_come_together(install: Path, section: bool, file: bool) -> None:
    _add_head(install, section=section, file=file)
    with pytest.raises(ManifestError, match="mtp"):
        turbospark_core.open(install)


def test_draft_logits_needs_two_tokens(install: Path) -> None:
    runner = turbospark_core.open(install)
    with pytest.raises(OptionError, match="at least two"):
        mtp.draft_logits(runner.opened, object(), [1])  # type: ignore[arg-type]


def test_depth_must_be_positive(install: Path) -> None:
    runner = turbospark_core.open(install)
    with pytest.raises(OptionError, match="positive"):
        mtp.MtpDrafter(runner.opened, object(), depth=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, -1, 17, 2.0, True, "3", "AUTO"])
def test_bad_depth_option_is_refused_naming_it(value: object) -> None:
    with pytest.raises(OptionError, match=r"mtp=.*draft depth in \[1, 16\]"):
        mtp.check_depth(value)


@pytest.mark.parametrize("value", [None, "auto", 1, 16])
def test_depth_option_values(value: object) -> None:
    assert mtp.check_depth(value) == value


def test_auto_without_a_head_decodes_plainly(install: Path) -> None:
    opened = turbospark_core.open(install).opened
    assert mtp.open_mtp(opened, "auto") is None
    assert mtp.head_bytes(opened) == 0
    with pytest.raises(OptionError, match="no multi-token-prediction head"):
        mtp.open_mtp(opened, 2)


def test_auto_on_a_family_without_a_head_flow_decodes_plainly(install: Path) -> None:
    _add_head(install)
    opened = turbospark_core.open(install).opened
    assert mtp.open_mtp(opened, "auto") is None
    with pytest.raises(FamilyRefusalError, match="build_mtp_head"):
        mtp.open_mtp(opened, 1)
