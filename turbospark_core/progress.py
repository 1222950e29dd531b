"""A dependency-free progress bar on stderr for long work (convert, load, bench)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], total: int, label: str, *, enabled: bool = True) -> Iterator[T]:
    """Yield ``items``, drawing ``label [#####     ] n/total`` on stderr when a terminal or asked."""
    if not enabled or total <= 0:
        yield from items
        return
    start, width, last = time.perf_counter(), 30, -1.0
    for n, item in enumerate(items, 1):
        now = time.perf_counter()
        if n == total or now - last > 0.1:
            last = now
            filled = int(width * n / total)
            sys.stderr.write(
                f"\r{label} [{'#' * filled}{' ' * (width - filled)}] {n}/{total} {now - start:5.1f}s"
            )
            sys.stderr.flush()
        yield item
    sys.stderr.write("\n")
    sys.stderr.flush()
