"""The CLI: ``turbospark convert`` of a drafter, ``--dflash`` on generate, and its refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from turbospark_core.cli import main


def test_convert_says_it_wrote_a_drafter(fx: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", str(fx.source / "dflash"), str(tmp_path / "d")]) == 0
    assert "model type 'dflash' (a dflash drafter install)" in capsys.readouterr().out


def test_generate_with_dflash_prints_acceptance(fx: Any, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", str(fx.target), "hello world", "--max-tokens", "6", "--dflash", str(fx.drafter), "-v"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "speculative: 0 of " in err and "mean acceptance length 1.00 tokens per verify" in err


def test_a_model_install_as_dflash_exits_2_naming_it(fx: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(fx.target), "hello", "--max-tokens", "2", "--dflash", str(fx.target)]) == 2
    assert "is a 'model' install" in capsys.readouterr().err


def test_the_drafter_as_a_model_exits_2_naming_it(fx: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(fx.drafter), "hello", "--max-tokens", "2"]) == 2
    assert "is a 'dflash' drafter install, not a language model" in capsys.readouterr().err
