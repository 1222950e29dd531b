"""Memory: the default budget, the open-time estimate, and the over-budget refusal."""

from __future__ import annotations

import ctypes
import functools
import math
import os
import re
from collections.abc import Callable

import attrs

from turbospark_core.errors import MemoryBudgetError, OptionError

DEFAULT_FRACTION = 0.8
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def available_bytes() -> int:
    """Memory available to this process now (MemAvailable, else total RAM)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim  # the process's own symbols: glibc's
    except (OSError, AttributeError):  # a C library without it (musl, macOS)
        return None
    return trim


def release_freed_heap() -> bool:
    """Hand the C heap's freed pages back to the system (glibc's ``malloc_trim``); ``False`` where there is none.

    A parse that frees most of what it allocated (a large ``tokenizer.json``)
    leaves those pages resident in the heap otherwise.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def parse_budget(value: int | float | str | None) -> int:
    """Bytes from ``8e9``, ``"8GB"``, ``"512MiB"``; ``None`` = a safe fraction of free RAM.

    Raises:
        OptionError: Unparseable or non-positive.
    """
    if value is None:
        return int(available_bytes() * DEFAULT_FRACTION)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            msg = f"memory_budget={value!r} is not a size; use bytes or e.g. '8GB', '512MiB'"
            raise OptionError(msg)
        try:
            value = float(m.group(1)) * _UNITS[m.group(2).lower()]
        except ValueError:
            msg = f"memory_budget={value!r} is not a size; use bytes or e.g. '8GB', '512MiB'"
            raise OptionError(msg) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        msg = f"memory_budget={value!r} must be positive: a finite number of bytes or a size like '8GB'"
        raise OptionError(msg)
    return int(value)


@attrs.frozen(kw_only=True)
class MemoryEstimate:
    """What an open will allocate, in bytes (``drafter``: what a speculative drafter adds, open step 12)."""

    weights: int
    kv: int
    experts: int = 0
    drafter: int = 0

    @property
    def total(self) -> int:
        """All of it."""
        return self.weights + self.kv + self.experts + self.drafter

    def check(self, budget: int, *, max_context: int, slots: int) -> None:
        """Refuse an open that would exceed ``budget``, naming the knob to turn.

        Raises:
            MemoryBudgetError: With the breakdown and what to lower.
        """
        if self.total <= budget:
            return
        gb = 1e9
        msg = (
            f"opening needs ~{self.total / gb:.2f} GB (weights {self.weights / gb:.2f} GB, "
            f"KV at max_context={max_context} x {slots} slot(s) {self.kv / gb:.2f} GB, "
            f"experts {self.experts / gb:.2f} GB) but memory_budget is {budget / gb:.2f} GB; "
            f"lower max_context or session_slots, or raise memory_budget"
        )
        raise MemoryBudgetError(msg)
