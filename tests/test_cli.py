"""Tests of the ``turbospark`` command line, run in-process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import turbospark_core
from turbospark_core.cli import main
from turbospark_core.manifest import MANIFEST, WEIGHTS


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("turbospark: error: ")
    assert "Traceback" not in err
    return lines[0]


def test_families_lists_llama_and_its_model_types(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["families"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.split()[0] == "llama")
    assert "turbospark-llama" in line
    assert "llama, qwen2, qwen3, qwen3_moe, minimax_m2, qwen3_vl" in line


def test_families_with_no_plugins(no_plugins, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["families"]) == 0
    assert "no family plugins installed" in capsys.readouterr().out


def test_inspect_prints_the_tensor_table_and_startup_stats(
    f32_install: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(f32_install)]) == 0
    out = capsys.readouterr().out
    assert "model type   llama (family llama, turbospark-llama)" in out
    assert "hadamard     not folded; the family accepts folded installs" in out
    assert "max context  256" in out
    assert "memory       weights on the pages MLX read them to (under 32 MiB of weights could move)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("model.", "lm_head"))}
    assert len(rows) == len(turbospark_core.open(f32_install).opened.index.tensors)
    assert rows["model.embed_tokens.weight"][1:3] == ["F32", "[512,"]
    stats = next(line for line in out.splitlines() if line.startswith("startup (ms)"))
    for phase in ("manifest_index=", "weights_mapping=", "family_state=", "total_open="):
        assert phase in stats


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        ([], "kv cache     unquantized (float32)"),
        (
            ["--kv-quant", "q4"],
            "kv cache     q4 (affine 4-bit), Hadamard-rotated where head dims are powers of two, "
            "each query's last 32 tokens read unquantized",
        ),
        (
            ["--kv-quant", "q8"],
            "kv cache     q8 (affine 8-bit), Hadamard-rotated where head dims are powers of two, "
            "every token read quantized",
        ),
    ],
)
def test_inspect_says_how_the_kv_cache_is_held(
    turbospark_install: Any, capsys: pytest.CaptureFixture[str], flags: list[str], line: str
) -> None:
    assert main(["inspect", str(turbospark_install("qwen3", "float32")), *flags]) == 0
    assert line in capsys.readouterr().out.splitlines()


def test_inspect_shows_quantized_storage(q4_install: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(q4_install)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("model.layers.0.self_attn.q_proj.weight"))
    assert "affine 4b g64" in row


def test_inspect_verify(install: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(install), "--verify"]) == 0
    assert "checksums    all files match their sha256" in capsys.readouterr().out

    path = install / WEIGHTS
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # same size: the table's size check cannot see it
    path.write_bytes(bytes(data))
    assert main(["inspect", str(install), "--verify"]) == 2
    captured = capsys.readouterr()
    line = _one_error_line(captured.err)
    assert "sha256 mismatch for model_weights.safetensors" in line and "turbospark convert" in line
    assert "all files match" not in captured.out


@pytest.mark.parametrize(
    "args", [["generate", "{missing}", "hello"], ["inspect", "{missing}"], ["chat", "{missing}", "hi"]]
)
def test_bad_path_is_one_error_line(tmp_path: Path, args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-install"
    assert main([a.format(missing=missing) for a in args]) == 2
    captured = capsys.readouterr()
    line = _one_error_line(captured.err)
    assert str(missing) in line and "turbospark convert" in line
    assert captured.out == ""


def test_generate_on_a_checkpoint_says_convert(llama_src: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(llama_src), "hello"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"turbospark convert {llama_src} DST" in line


def test_generate_with_a_bad_option_is_one_error_line(f32_install: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(f32_install), "hello", "--memory-budget", "lots"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "memory_budget='lots'" in line


def test_generate_with_max_context_zero_is_refused(f32_install: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(f32_install), "hello", "--max-tokens", "1", "--max-context", "0"]) == 2
    assert "max_context=0" in _one_error_line(capsys.readouterr().err)


def test_generate_past_max_context_is_one_error_line(f32_install: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(f32_install), "hello", "--max-tokens", "50", "--max-context", "8"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "max_context=8" in line


def test_generate_with_kv_quant_opens_with_it(
    turbospark_install: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--kv-quant`` / ``--kv-recent`` reach ``open()`` (as on chat, inspect, serve and bench): the same text
    as the API opened with them."""
    path = turbospark_install("qwen3", "float32")  # head dims that quantize
    opened: list[dict[str, Any]] = []
    real_open = turbospark_core.open

    def recording(*args: Any, **kwargs: Any) -> Any:
        opened.append(kwargs)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(turbospark_core, "open", recording)
    argv = ["generate", str(path), "The quick brown fox", "--max-tokens", "6", "--kv-quant", "q4", "--kv-recent", "2"]
    assert main(argv) == 0
    assert opened[0]["kv_quant"] == "q4" and opened[0]["kv_recent"] == 2
    want = real_open(path, kv_quant="q4", kv_recent=2).generate("The quick brown fox", max_tokens=6)
    assert capsys.readouterr().out == want.text + "\n"


@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--kv-recent", "4"], "kv_recent=4"), (["--kv-quant", "q8"], "kv_quant='q8'")],
)
def test_generate_with_a_bad_kv_option_is_one_error_line(
    f32_install: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    """--kv-recent without --kv-quant, and a quantized KV cache for heads of 16 (groups need 32): refused by name."""
    assert main(["generate", str(f32_install), "hello", "--max-tokens", "1", *flags]) == 2
    assert named in _one_error_line(capsys.readouterr().err)


def test_convert_then_generate(llama_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "inst"
    assert main(["convert", str(llama_src), str(dst), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {dst}: model type 'llama' (family llama), 0 quantized matrices" in out
    assert (dst / MANIFEST).is_file()

    assert main(["generate", str(dst), "The quick brown fox", "--max-tokens", "5", "-v"]) == 0
    captured = capsys.readouterr()
    expected = turbospark_core.open(dst).generate("The quick brown fox", max_tokens=5)
    assert len(expected.tokens) >= 1
    assert captured.out == expected.text + "\n"
    assert f"generation: {len(expected.tokens)} tokens" in captured.err


def test_convert_quantized_reports_the_matrices(
    llama_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["convert", str(llama_src), str(tmp_path / "q8"), "--quantize", "q8", "-q"]) == 0
    assert "14 quantized matrices" in capsys.readouterr().out


def test_convert_refusal_is_one_error_line(llama_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "taken"
    dst.mkdir()
    (dst / "x").write_text("x")
    assert main(["convert", str(llama_src), str(dst), "-q"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--force" in line


def test_convert_bad_choice_is_an_argparse_error(
    llama_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["convert", str(llama_src), str(tmp_path / "d"), "--quantize", "q5"])
    assert e.value.code == 2
    assert "invalid choice: 'q5'" in capsys.readouterr().err


def test_distributed_outside_mlx_launch_changes_nothing(f32_install: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(f32_install), "Once upon", "--max-tokens", "5", "--distributed", "pipeline"]) == 0
    split = capsys.readouterr().out
    assert main(["generate", str(f32_install), "Once upon", "--max-tokens", "5"]) == 0
    assert split == capsys.readouterr().out and split.strip()
    assert main(["inspect", str(f32_install), "--distributed", "tensor"]) == 0
    assert "distributed  " not in capsys.readouterr().out  # a group of one: a plain open
    with pytest.raises(SystemExit):
        main(["serve", str(f32_install), "--distributed", "data"])
    assert "invalid choice: 'data'" in capsys.readouterr().err
