"""Threads that ran forwards are waited for at exit (``turbospark_core.thread_exit``)."""

from __future__ import annotations

import sys
import threading

import pytest

from turbospark_core import thread_exit


@pytest.fixture(autouse=True)
def _fresh_notes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(thread_exit, "_noted", set())


def test_the_main_thread_is_not_noted() -> None:
    thread_exit.note_thread()
    assert not thread_exit._noted


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="waits only where /proc/self/task lists threads")
def test_a_finished_thread_is_waited_for_until_gone() -> None:
    ids: list[int] = []

    def work() -> None:
        thread_exit.note_thread()
        thread_exit.note_thread()  # once is enough
        ids.append(threading.get_native_id())

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert thread_exit._noted == set(ids)
    assert thread_exit.wait_for_noted() == []


def test_a_running_thread_is_not_waited_for() -> None:
    """A thread still running (a daemon serving on) would never be gone: the wait skips it."""
    go, noted = threading.Event(), threading.Event()

    def work() -> None:
        thread_exit.note_thread()
        noted.set()
        go.wait(10)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    noted.wait(10)
    assert thread_exit.wait_for_noted(limit_s=5) == []  # returns at once, nothing left to wait for
    go.set()
    t.join()
