"""An interrupted convert never leaves an install that opens; re-runs convert cleanly; concurrent converts refuse.

A convert runs in a subprocess that stalls at a chosen point of the write and is
killed there with SIGKILL (no cleanup handler runs).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import turbospark_core
from turbospark_core.convert import convert
from turbospark_core.convert.writer import LOCK_SUFFIX, STAGING_INFIX, destination_lock
from turbospark_core.errors import ConversionError, TurbosparkError
from turbospark_core.manifest import MANIFEST

# The child stalls at POINT (after signalling READY) until it is killed.
_CHILD = r"""
import pathlib, sys, time
import turbospark_core.convert.writer as w
from turbospark_core.convert import convert

src, dst, ready, point, force = sys.argv[1:6]

def stall():
    pathlib.Path(ready).write_text("x")
    time.sleep(600)

if point == "weights_written":  # the weights file is written, the manifest is not
    w.sha256_file = lambda *a, **k: stall()
elif point == "before_rename":  # every file written and synced, nothing renamed yet
    orig = w._sync_tree
    w._sync_tree = lambda root: (orig(root), stall())
elif point == "between_renames":  # (force) the old install moved aside, the new one not yet in place
    orig_rename = pathlib.Path.rename
    def rename(self, target):
        out = orig_rename(self, target)
        if ".partial-old-" in str(target):
            stall()
        return out
    pathlib.Path.rename = rename
convert(src, dst, force=force == "1")
"""


def _killed_convert(src: Path, dst: Path, point: str, tmp_path: Path, *, force: bool = False) -> None:
    ready = tmp_path / f"ready-{point}"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(src), str(dst), str(ready), point, "1" if force else "0"],
    )
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert child.poll() is None, f"the convert exited ({child.returncode}) before reaching {point}"
            assert time.monotonic() < deadline, f"the convert did not reach {point}"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL


def _opens(path: Path) -> bool:
    try:
        turbospark_core.open(path)
    except TurbosparkError:
        return False
    return True


@pytest.mark.parametrize("point", ["weights_written", "before_rename"])
def test_a_killed_convert_leaves_nothing_that_opens(llama_src: Path, tmp_path: Path, point: str) -> None:
    dst = tmp_path / "inst"
    _killed_convert(llama_src, dst, point, tmp_path)
    assert not dst.exists() and not _opens(dst)
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(f".inst{STAGING_INFIX}")]
    assert leftovers  # the staging directory the kill left behind
    assert not any(_opens(p) for p in leftovers if not (p / MANIFEST).exists())
    convert(llama_src, dst)  # a re-run is not refused by a stale lock, and cleans up
    assert _opens(dst)
    assert not any(p.name.startswith(f".inst{STAGING_INFIX}") for p in tmp_path.iterdir())
    assert not (tmp_path / f".inst{LOCK_SUFFIX}").exists()


def test_a_killed_forced_convert_never_leaves_a_partial_install(llama_src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "inst"
    convert(llama_src, dst)
    _killed_convert(llama_src, dst, "between_renames", tmp_path, force=True)
    assert not dst.exists()  # the old install is aside, the new one not in place: nothing at dst opens
    convert(llama_src, dst, force=True)
    assert _opens(dst)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".inst")) == []


def test_a_second_convert_to_the_same_destination_is_refused(llama_src: Path, tmp_path: Path, names) -> None:
    dst = tmp_path / "inst"
    with destination_lock(dst) as lock:
        with pytest.raises(ConversionError) as err:
            convert(llama_src, dst)
        names(err, str(dst), "another `turbospark convert`", str(os.getpid()), str(lock))
    assert not dst.exists()
    convert(llama_src, dst)  # released: the next one proceeds
    assert _opens(dst)


def test_a_concurrent_convert_in_another_process_is_refused(llama_src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "inst"
    ready = tmp_path / "ready-before_rename"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(llama_src), str(dst), str(ready), "before_rename", "0"],
    )
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(ConversionError, match=f"pid {child.pid}"):
            convert(llama_src, dst)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    convert(llama_src, dst)
    assert _opens(dst)
