"""The ``mtp`` drafter's refusals, on installs of a family without a head flow (llama) and without a head."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

import turbospark_core
from turbospark_core.errors import DrafterError, ManifestError, OptionError
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
    with pytest.raises(DrafterError, match="no multi-token-prediction head"):
        mtp.load_head(runner.opened)
    with pytest.raises(DrafterError, match=r"mtp\.safetensors"):
        runner.draft_logits([1, 2, 3])


def test_family_without_a_head_flow_is_refused_naming_the_hook(install: Path) -> None:
    _add_head(install)
    runner = turbospark_core.open(install)  # a plain open never reads the head
    assert mtp.has_head(runner.opened)
    with pytest.raises(DrafterError, match="build_mtp_head"):
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


@pytest.mark.parametrize("value", [0, -1, 33, 2.0, True, "3", "AUTO"])
def test_bad_depth_option_is_refused_naming_it(install: Path, value: object) -> None:
    with pytest.raises(OptionError, match=r"mtp=.*draft depth in \[1, 32\]"):
        turbospark_core.open(install, mtp=value)  # type: ignore[arg-type]


def test_mtp_with_another_drafter_is_refused_naming_both(install: Path) -> None:
    with pytest.raises(OptionError, match=r"ngram=2 and mtp='auto'"):
        turbospark_core.open(install, ngram=2, mtp="auto")


def test_auto_without_a_head_decodes_plainly(install: Path) -> None:
    runner = turbospark_core.open(install, mtp="auto")
    assert runner.opened.drafter is None
    plain = turbospark_core.open(install).generate([1, 2, 3], max_tokens=8)
    out = runner.generate([1, 2, 3], max_tokens=8)
    assert out.tokens == plain.tokens and out.stats.draft_tokens == 0


def test_depth_without_a_head_is_refused_naming_it(install: Path) -> None:
    with pytest.raises(DrafterError, match="no multi-token-prediction head"):
        turbospark_core.open(install, mtp=2)


def test_depth_on_a_family_without_a_head_flow_is_refused_naming_the_hook(install: Path) -> None:
    _add_head(install)
    assert turbospark_core.open(install, mtp="auto").opened.drafter is None
    with pytest.raises(DrafterError, match="build_mtp_head"):
        turbospark_core.open(install, mtp=1)


def test_cli_mtp_on_an_install_without_a_head_is_one_error_line(
    f32_install: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from turbospark_core.cli import main

    assert main(["generate", str(f32_install), "hello", "--max-tokens", "2", "--mtp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no multi-token-prediction head" in err and len(err.splitlines()) == 1


def test_cli_mtp_auto_without_a_head_decodes_plainly(f32_install: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from turbospark_core.cli import main

    assert main(["generate", str(f32_install), "hello", "--max-tokens", "4", "--mtp", "auto"]) == 0
    with_auto = capsys.readouterr().out
    assert main(["generate", str(f32_install), "hello", "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out == with_auto


def test_cli_mtp_value_must_be_auto_or_a_depth(f32_install: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from turbospark_core.cli import main

    with pytest.raises(SystemExit):
        main(["generate", str(f32_install), "hello", "--mtp", "deep"])
    assert "neither 'auto' nor a draft depth" in capsys.readouterr().err
