"""Weights on huge pages: moved arrays keep their identity and values, views move with their buffer,
shared buffers stay, and a placed model decodes exactly as one left where MLX read it."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core import native, placement

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: {native.STATUS}")
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")


def _address(a: mx.array) -> int:
    return int(np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data)


def _vm_flags(address: int) -> list[str]:
    """The flags of the mapping that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not line.startswith("VmFlags"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@attrs.frozen
class _Slotted:
    weight: mx.array
    parts: tuple[mx.array, ...]


def test_held_arrays_walks_attributes_slots_and_containers() -> None:
    a, b, c, d = (mx.array([float(i)]) for i in range(4))
    holder = types.SimpleNamespace(a=a, nested={"k": [b, (c,)]}, slotted=_Slotted(d, (a,)), module=np, n=3)
    holder.again = holder  # a cycle
    holder.pinned = _Pinned(mx.array([9.0]))
    found = placement.held_arrays(holder)
    assert sorted(id(x) for x in found) == sorted(id(x) for x in (a, b, c, d))


class _Pinned:
    pins_memory = True

    def __init__(self, slots: mx.array) -> None:
        self.slots = slots


@needs_native
def test_moved_arrays_keep_identity_and_values_in_one_buffer() -> None:
    arrays = [mx.random.normal((300, 40), key=mx.random.key(i)) for i in range(3)] + [mx.arange(1000, dtype=mx.uint32)]
    mx.eval(arrays)
    want = [np.array(a) for a in arrays]
    moved = native.place_on_huge_pages(arrays, 1 << 20, 0.0)[0]
    assert moved == sum(a.nbytes for a in arrays)
    for a, w in zip(arrays, want, strict=True):
        np.testing.assert_array_equal(np.array(a), w)
        assert _address(a) % 64 == 0
    starts = sorted(_address(a) for a in arrays)
    assert starts[-1] - starts[0] < sum(a.nbytes for a in arrays) + 64 * len(arrays)  # one buffer, in order
    assert np.array(arrays[0] @ arrays[1].T).shape == (300, 300)  # MLX computes from the moved data


@needs_native
def test_views_move_with_their_buffer_and_shared_buffers_stay() -> None:
    fused = mx.random.normal((64, 32), key=mx.random.key(7))
    mx.eval(fused)
    top, bottom = fused[:16], fused[16:]
    mx.eval(top, bottom)  # views of the fused buffer, as fused_parts makes them
    lonely = mx.random.normal((8, 8), key=mx.random.key(8))
    mx.eval(lonely)
    kept_view = lonely[2:]
    mx.eval(kept_view)
    before = _address(lonely)
    # lonely's buffer is also read by kept_view, which is not passed: it stays, not held twice
    moved = native.place_on_huge_pages([fused, top, bottom, lonely], 1 << 20, 0.0)[0]
    assert moved == fused.nbytes
    assert _address(top) == _address(fused) and _address(bottom) == _address(fused) + 16 * 32 * 4
    np.testing.assert_array_equal(np.array(bottom), np.array(fused)[16:])
    assert _address(lonely) == before


@needs_native
def test_arrays_not_evaluated_stay_lazy() -> None:
    base = mx.ones((16, 16))
    mx.eval(base)
    lazy = base * 3
    assert native.place_on_huge_pages([base, lazy], 1 << 20, 0.0)[0] == base.nbytes
    np.testing.assert_array_equal(np.array(lazy), np.full((16, 16), 3.0, dtype=np.float32))


@needs_native
@linux
@pytest.mark.skipif(placement.huge_page_setting() not in {"always", "madvise"}, reason="no transparent huge pages")
def test_the_buffer_is_advised_onto_huge_pages() -> None:
    big = mx.zeros((3 << 20,), dtype=mx.uint32)  # 12 MiB: whole huge pages inside
    mx.eval(big)
    native.place_on_huge_pages([big], 1 << 20, 0.0)
    assert "hg" in _vm_flags(_address(big) + (4 << 20))


@needs_native
def test_placed_models_decode_exactly_as_one_left_in_place(q4_install: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Wholly moved, partly moved (the budget ran out after the largest buffer) or forced: the same logits."""
    prompt = [1, 5, 9, 14, 2, 7]
    monkeypatch.setenv(placement.ENV, "0")
    plain = turbospark_core.open(q4_install)
    assert plain.opened.placement.moved == 0
    want_logits = np.array(plain.logits(prompt))
    want_tokens = plain.generate(prompt, max_tokens=12, temperature=0.0).tokens
    monkeypatch.setattr(placement, "MIN_BYTES", 0)  # the fixture is small
    for setting, budget in (("auto", placement.BUDGET_SECONDS), ("auto", 1e-9), ("1", 1e-9)):
        monkeypatch.setenv(placement.ENV, setting)
        monkeypatch.setattr(placement, "BUDGET_SECONDS", budget)
        runner = turbospark_core.open(q4_install)
        moved = runner.opened.placement
        np.testing.assert_array_equal(np.array(runner.logits(prompt)), want_logits)
        assert runner.generate(prompt, max_tokens=12, temperature=0.0).tokens == want_tokens
        if budget < 1 and setting == "auto":  # over once the first (largest) buffer has moved
            largest = max(a.nbytes for a in placement.held_arrays(runner.opened.model))
            assert largest <= moved.moved < moved.movable and "budget ran out" in moved.describe()
        else:
            assert moved.moved == moved.movable > 0 and "keeps them" in moved.describe()


@needs_native
def test_small_models_and_the_switch_leave_weights_in_place(
    q4_install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = turbospark_core.open(q4_install).opened.placement
    assert (small.moved, small.reason) == (0, "under 32 MiB of weights could move")
    assert small.describe() == "weights on the pages MLX read them to (under 32 MiB of weights could move)"
    monkeypatch.setattr(placement, "MIN_BYTES", 0)
    monkeypatch.setenv(placement.ENV, "0")
    off = turbospark_core.open(q4_install).opened.placement
    assert (off.moved, off.reason) == (0, "TURBOSPARK_HUGE_PAGES=0")


def test_without_the_native_module_nothing_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    held = types.SimpleNamespace(weight=mx.ones((1024, 1024)))
    mx.eval(held.weight)
    before = _address(held.weight)
    monkeypatch.setattr(placement, "MIN_BYTES", 0)
    monkeypatch.setattr(native, "available", lambda: False)
    assert placement.place(held) == placement.Placement(reason="no native module")
    assert _address(held.weight) == before


def test_huge_page_setting_reads_the_bracketed_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(placement, "THP_SETTING", setting)
    assert placement.huge_page_setting() == "madvise"
    setting.write_text("always madvise [never]\n")
    assert placement.huge_page_setting() == "never"
    assert placement.why_not() in {"transparent huge pages never", "no native module", "not on the CPU"}
    monkeypatch.setattr(placement, "THP_SETTING", tmp_path / "absent")
    assert placement.huge_page_setting() == "unavailable"


@needs_native
@pytest.mark.parametrize("residency", ["resident", "streamed"])
def test_experts_decode_alike_placed_or_not(
    residency: str, turbospark_install: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resident experts move; a streamed bank's slots (written through numpy views) stay where they are."""
    install = turbospark_install("qwen3_moe")
    prompt = [3, 11, 7, 2, 19, 5]
    runs = []
    for huge in ("0", "1"):
        monkeypatch.setenv(placement.ENV, huge)
        monkeypatch.setattr(placement, "MIN_BYTES", 0)
        runner = turbospark_core.open(install, residency=residency, expert_slots=2)
        assert (runner.opened.placement.moved > 0) == (huge == "1")
        runs.append((np.array(runner.logits(prompt)), runner.generate(prompt, max_tokens=10, temperature=0.0).tokens))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]  # (a moved slot, written through its stale view, crashed here)
