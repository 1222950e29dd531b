"""`turbospark generate --router-hist`, `turbospark plot` and `turbospark bench` from the command line."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from turbospark_core import bench
from turbospark_core.cli import main
from turbospark_core.diagnostics import FFN_BINS
from turbospark_core.errors import OptionError

PNG = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


@pytest.fixture(scope="module")
def moe(turbospark_install: Any) -> Path:
    return turbospark_install("qwen3_moe")


@pytest.fixture(scope="module")
def dense(turbospark_install: Any) -> Path:
    return turbospark_install("llama")


@pytest.fixture(scope="module")
def histograms(moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hist") / "h.npz"
    argv = ["generate", str(moe), "hello", "--max-tokens", "4", "--router-hist", str(out), "--ffn-hist", str(out)]
    assert main(argv) == 0
    return out


def test_generate_writes_both_histograms_into_one_npz(histograms: Path) -> None:
    with np.load(histograms) as data:
        counts, k, tokens = data["router_counts"], data["router_top_k"], data["router_tokens"]
        np.testing.assert_array_equal(counts.sum(axis=1), tokens * k)
        assert data["ffn_counts"].shape == (len(data["ffn_layers"]), FFN_BINS)
        assert {"router_weight_mass", "router_hit_rate", "ffn_edges", "router_residency"} <= set(data.files)


def test_plot_draws_a_png_of_the_expected_size(histograms: Path, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "h.png"
    assert main(["plot", str(histograms), "-o", str(out)]) == 0
    assert png_size(out) == (1000, 900)  # 10 x 4.5 inches per panel, two panels, at 100 dpi
    assert out.stat().st_size > 20_000  # a heatmap and curves, not an empty canvas
    assert str(out) in capsys.readouterr().out


def test_router_only_npz_draws_one_panel(moe: Path, tmp_path: Path) -> None:
    npz, png = tmp_path / "r.npz", tmp_path / "r.png"
    assert main(["generate", str(moe), "hi", "--max-tokens", "2", "--router-hist", str(npz)]) == 0
    with np.load(npz) as data:
        assert not any(k.startswith("ffn_") for k in data.files)
    assert main(["plot", str(npz), "-o", str(png)]) == 0
    assert png_size(png) == (1000, 450)


def _hide_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # also when it was never imported


def test_plot_without_matplotlib_names_the_extra(
    histograms: Path, tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    _hide_matplotlib(monkeypatch)
    out = tmp_path / "never.png"
    assert main(["plot", str(histograms), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "pip install 'turbospark[plot]'" in err and "Traceback" not in err
    assert not out.exists()


def test_bench_plot_without_matplotlib_fails_before_the_run(
    dense: Path, tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    _hide_matplotlib(monkeypatch)
    assert main(["bench", str(dense), "--plot", str(tmp_path / "b.png"), "-q"]) == 2
    captured = capsys.readouterr()
    assert "turbospark[plot]" in captured.err and captured.out == ""


def test_plot_refuses_a_file_that_is_not_histograms(tmp_path: Path, capsys: Any) -> None:
    other = tmp_path / "other.npz"
    np.savez(other, something=np.zeros(3))
    assert main(["plot", str(other), "-o", str(tmp_path / "x.png")]) == 2
    assert "--router-hist" in capsys.readouterr().err


def test_router_hist_on_a_dense_install_is_refused(dense: Path, tmp_path: Path, capsys: Any) -> None:
    assert main(["generate", str(dense), "hi", "--router-hist", str(tmp_path / "r.npz")]) == 2
    assert "router_histogram=True cannot observe model type 'llama'" in capsys.readouterr().err


# ------------------------------------------------------------------ bench
def test_bench_json_table_and_plot(dense: Path, tmp_path: Path, capsys: Any) -> None:
    png = tmp_path / "bench.png"
    argv = ["bench", str(dense), "--lengths", "8", "32", "--decode-tokens", "4", "--json", "--plot", str(png), "-q"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["rows"]
    assert [r["prompt_tokens"] for r in rows] == [8, 32] and result["model_type"] == "llama"
    for r in rows:
        assert r["decode_tokens"] == 4 and r["prefill_tps"] > 0 and r["decode_tps"] > 0 and r["peak_memory_gb"] > 0
        assert r["expert_hit_rate"] is None
    assert png_size(png) == (800, 450)
    assert main(["bench", str(dense), "--lengths", "8", "--decode-tokens", "2", "-q"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["prompt", "prefill", "tok/s"] and table[1].split()[0] == "8"


def test_bench_clips_lengths_to_max_context(dense: Path, capsys: Any) -> None:
    argv = [
        "bench",
        str(dense),
        "--lengths",
        "16",
        "4096",
        "--decode-tokens",
        "4",
        "--max-context",
        "64",
        "--json",
        "-q",
    ]
    assert main(argv) == 0
    assert [r["prompt_tokens"] for r in json.loads(capsys.readouterr().out)["rows"]] == [16, 60]


def test_bench_streamed_moe_reports_the_expert_hit_rate(moe: Path, capsys: Any) -> None:
    argv = [
        "bench",
        str(moe),
        "--lengths",
        "16",
        "--decode-tokens",
        "4",
        "--residency",
        "streamed",
        "--expert-slots",
        "3",
    ]
    assert main([*argv, "--json", "-q"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert 0.0 <= row["expert_hit_rate"] <= 1.0


def test_bench_lengths_are_checked() -> None:
    assert bench.prompt_lengths([128, 512, 2048], 600, 32) == [128, 512, 568]
    with pytest.raises(OptionError, match="decode-tokens"):
        bench.prompt_lengths([8], 16, 16)
    with pytest.raises(OptionError, match="positive"):
        bench.prompt_lengths([0], 64, 4)


def test_bench_batch_sizes_report_aggregate_throughput(dense: Path, capsys: Any) -> None:
    argv = ["bench", str(dense), "--lengths", "8", "--decode-tokens", "4", "--batch-sizes", "1", "3", "--json", "-q"]
    assert main(argv) == 0
    batches = json.loads(capsys.readouterr().out)["batches"]
    assert [b["rows"] for b in batches] == [1, 3]
    for b in batches:
        assert b["prompt_tokens"] == 8 and 0 < b["generated"] <= 4 * b["rows"] and b["aggregate_tps"] > 0
    assert main(["bench", str(dense), "--lengths", "8", "--decode-tokens", "2", "--batch-sizes", "2", "-q"]) == 0
    assert "aggregate tok/s" in capsys.readouterr().out
    assert main(["bench", str(dense), "--lengths", "8", "--batch-sizes", "0", "-q"]) == 2
    assert "batch size 0" in capsys.readouterr().err
