"""The per-layout choice between the native kernels and float32, by measured speed, and its cache file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import turbospark_core as ts
from turbospark_core import kernel_speed, native
from turbospark_core.convert import convert
from turbospark_core.errors import OptionError
from turbospark_core.tensor_index import QuantSpec

Q4 = QuantSpec(bits=4, group_size=32)
needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: {native.STATUS}")


@pytest.fixture
def measuring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Choose by measurement, with a private cache file and no timings remembered by the process."""
    monkeypatch.setenv(kernel_speed.CHOICE_ENV, "measure")
    monkeypatch.setenv(kernel_speed.CACHE_ENV, str(tmp_path))
    saved = dict(kernel_speed._SPEEDS)
    kernel_speed._SPEEDS.clear()
    yield tmp_path / "kernel-speed.json"
    kernel_speed._SPEEDS.clear()
    kernel_speed._SPEEDS.update(saved)


def _fake_measure(monkeypatch: pytest.MonkeyPatch, native_ms: float, float_ms: float) -> list[QuantSpec]:
    calls: list[QuantSpec] = []

    def fake(quant: QuantSpec) -> kernel_speed.LayoutSpeed:
        calls.append(quant)
        return kernel_speed.LayoutSpeed(quant, native_ms, float_ms)

    monkeypatch.setattr(kernel_speed, "measure", fake)
    return calls


def test_a_layout_stays_quantized_unless_float32_is_more_than_the_margin_faster() -> None:
    assert kernel_speed.LayoutSpeed(Q4, native_ms=1.0, float_ms=2.0).native
    assert kernel_speed.LayoutSpeed(Q4, native_ms=1.2, float_ms=1.0).native  # a close call keeps the stored form
    assert not kernel_speed.LayoutSpeed(Q4, native_ms=1.3, float_ms=1.0).native
    assert "unpacked to float32" in kernel_speed.LayoutSpeed(Q4, native_ms=9.0, float_ms=1.0).describe()


@needs_native
@pytest.mark.parametrize(
    "quant",
    [Q4, QuantSpec(bits=6, group_size=16), QuantSpec(bits=4, group_size=32, mode="mxfp4")],
    ids=["affine-4-g32", "affine-6-g16", "mxfp4"],
)
def test_measure_times_both_products_of_a_layout(quant: QuantSpec) -> None:
    speed = kernel_speed.measure(quant, rows=64, cols=256)
    assert speed.quant == quant and speed.native_ms > 0 and speed.float_ms > 0


@needs_native
def test_the_first_measurement_is_saved_and_later_ones_read_it(
    measuring: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _fake_measure(monkeypatch, native_ms=5.0, float_ms=1.0)
    assert not kernel_speed.stays_quantized(Q4)
    assert kernel_speed.stays_quantized(QuantSpec(bits=8, group_size=32)) is False
    assert len(calls) == 2
    saved = json.loads(measuring.read_text())[kernel_speed.machine_key()]
    want = {"bits": 4, "group_size": 32, "mode": "affine", "native_ms": 5.0, "float_ms": 1.0}
    assert saved["affine 4-bit g32"] == want
    kernel_speed._SPEEDS.clear()  # a new process: reads the file, measures nothing
    assert not kernel_speed.stays_quantized(Q4)
    assert len(calls) == 2
    assert [s.describe() for s in kernel_speed.measured()] == [
        "affine 4-bit g32: native 5.00 ms, float32 1.00 ms, unpacked to float32"
    ]


@needs_native
def test_timings_of_another_build_of_the_kernels_are_measured_over(
    measuring: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_measure(monkeypatch, native_ms=5.0, float_ms=1.0)
    assert not kernel_speed.stays_quantized(Q4)
    monkeypatch.setattr(native, "BUILD", native.BUILD + "-rebuilt")  # a reinstall: the extension file changed
    kernel_speed._SPEEDS.clear()
    calls = _fake_measure(monkeypatch, native_ms=1.0, float_ms=5.0)
    assert kernel_speed.stays_quantized(Q4)
    assert calls == [Q4]
    assert len(json.loads(measuring.read_text())) == 2  # each build's timings under its own key


def test_the_build_id_is_the_extension_files_size_and_time(tmp_path: Path) -> None:
    assert native._build_id(None) == "none"
    fake = tmp_path / "_qmm.so"
    fake.write_bytes(b"x" * 7)
    module = type(native)("fake")
    module.__file__ = str(fake)
    assert native._build_id(module) == f"7-{fake.stat().st_mtime_ns}"
    fake.unlink()
    assert native._build_id(module) == "none"


@needs_native
@pytest.mark.parametrize(
    "content",
    [
        b"\xff\x00 not json",
        b"[1, 2]",
        b'{"%KEY%": [1]}',
        b'{"%KEY%": {"affine 4-bit g32": {"bits": "x"}}}',
        b'{"%KEY%": {"affine 4-bit g32": {"bits": 4, "group_size": 32, "mode": "affine", '
        b'"native_ms": NaN, "float_ms": 1.0}}}',
    ],
    ids=["bytes", "a-list", "machine-not-a-table", "entry-malformed", "entry-not-a-time"],
)
def test_a_corrupt_cache_file_is_measured_over(
    measuring: Path, monkeypatch: pytest.MonkeyPatch, content: bytes
) -> None:
    measuring.write_bytes(content.replace(b"%KEY%", kernel_speed.machine_key().encode()))
    calls = _fake_measure(monkeypatch, native_ms=1.0, float_ms=3.0)
    assert kernel_speed.stays_quantized(Q4)
    assert calls == [Q4]
    assert json.loads(measuring.read_text())[kernel_speed.machine_key()]["affine 4-bit g32"]["native_ms"] == 1.0


@needs_native
def test_an_unwritable_cache_still_chooses(tmp_path: Path, measuring: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(kernel_speed.CACHE_ENV, str(blocker / "below-a-file"))
    _fake_measure(monkeypatch, native_ms=1.0, float_ms=3.0)
    assert kernel_speed.stays_quantized(Q4)


def test_the_environment_decides_without_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_measure(monkeypatch, native_ms=1.0, float_ms=1.0)
    monkeypatch.setattr(kernel_speed, "measure", None)  # never called
    monkeypatch.setenv(kernel_speed.CHOICE_ENV, "float")
    assert not kernel_speed.stays_quantized(Q4)
    monkeypatch.setenv(kernel_speed.CHOICE_ENV, "native")
    assert kernel_speed.stays_quantized(Q4) == native.available()


def test_an_unknown_choice_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernel_speed.CHOICE_ENV, "fastest")
    with pytest.raises(OptionError, match=r"TURBOSPARK_KERNEL_CHOICE='fastest' is not one of measure, native, float"):
        kernel_speed.stays_quantized(Q4)


@pytest.fixture(scope="module")
def q4_install(llama_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("kernel-speed") / "q4"
    convert(llama_src, dst, quantize="q4")
    return dst


@needs_native
def test_an_open_holds_each_layout_as_measured(
    q4_install: Path, measuring: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Native measured slower: the open unpacks to float32 (and its estimate says so); same logits within rounding."""
    ids = [1, 5, 9, 300, 42]
    _fake_measure(monkeypatch, native_ms=1.0, float_ms=3.0)
    kept = ts.open(q4_install)
    kernel_speed._SPEEDS.clear()
    measuring.unlink()  # another machine
    _fake_measure(monkeypatch, native_ms=9.0, float_ms=1.0)
    unpacked = ts.open(q4_install)
    assert unpacked.opened.estimate.weights > 3 * kept.opened.estimate.weights
    assert unpacked.opened.estimate.weights == unpacked.opened.index.float_bytes(4, keep=lambda base, spec: False)
    np.testing.assert_allclose(kept.logits(ids), unpacked.logits(ids), atol=2e-4)
