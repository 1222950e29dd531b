"""Threads that ran forwards are gone before the interpreter finalizes (Linux).

MLX keeps each thread's cache of ``mx.compile`` traces in thread-local storage, and
its entries hold Python objects. That storage is destroyed as the OS thread exits,
which is after Python has let go of the thread (``Thread.join`` returns before it).
When the interpreter is already finalizing by then, the destructor's request for the
GIL ends the thread by a forced unwind through a ``noexcept`` frame, and the process
aborts ("terminate called without an active exception", exit status 134): a server
stopped by SIGTERM after its worker thread decoded with a quantized KV cache, or any
program whose thread generated that way and then returned.

So a forward notes a thread other than the main one (:func:`note_thread`), and at
exit, once Python has joined its threads, the interpreter waits for the noted ones
that have finished until their OS threads are gone (they are, within a millisecond
or two), a second at most in all. Elsewhere than Linux (no ``/proc/self/task``)
nothing is waited for.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

_TASKS = "/proc/self/task"
_noted: set[int] = set()
_lock = threading.Lock()


def note_thread() -> None:
    """Note the calling thread (not the main one) as one whose exit the interpreter waits for."""
    if threading.current_thread() is threading.main_thread():
        return
    tid = threading.get_native_id()
    if tid in _noted:
        return
    with _lock:
        if not _noted:
            atexit.register(wait_for_noted)
        _noted.add(tid)


def wait_for_noted(limit_s: float = 1.0) -> list[int]:
    """Wait (at most ``limit_s`` in all) until every noted thread that Python no longer runs is gone;
    returns those still there (none, normally)."""
    if not os.path.isdir(_TASKS):
        return []
    running = {t.native_id for t in threading.enumerate()}
    deadline = time.monotonic() + limit_s
    left = []
    for tid in sorted(_noted - running):
        while os.path.exists(f"{_TASKS}/{tid}") and time.monotonic() < deadline:
            time.sleep(0.0005)
        if os.path.exists(f"{_TASKS}/{tid}"):
            left.append(tid)
    return left
