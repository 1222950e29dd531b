"""The CLI's image flags: ``convert --vision`` and ``chat --vision --image``."""

from __future__ import annotations

from pathlib import Path

import pytest

from turbospark_core.cli import main
from turbospark_core.vision.sidecar import is_sidecar


def test_convert_and_chat_with_an_image(
    turbospark_fixtures: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = turbospark_fixtures / "qwen3_vl"
    assert main(["convert", str(src), str(tmp_path / "i"), "--vision", str(tmp_path / "s"), "-q"]) == 0
    assert "vision sidecar of family llama" in capsys.readouterr().out
    assert is_sidecar(tmp_path / "s")
    argv = ["chat", str(tmp_path / "i"), "--vision", str(tmp_path / "s"), "--image", str(src / "image_0.png")]
    assert main([*argv, "what is it?", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip()
    assert main([*argv[:-2], "--image", "https://example.com/a.png", "what?", "--max-tokens", "3"]) == 2
    assert "remote image URL" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--image needs --vision SIDECAR"):
        main(["chat", str(tmp_path / "i"), "--image", str(src / "image_0.png"), "what?"])


def test_serve_passes_the_sidecar_to_open() -> None:
    from turbospark_core.cli import _open_options, build_parser

    args = build_parser().parse_args(["serve", "INSTALL", "--vision", "SIDECAR"])
    assert _open_options(args)["vision"] == "SIDECAR"
    assert "vision" not in _open_options(build_parser().parse_args(["serve", "INSTALL"]))
