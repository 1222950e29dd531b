"""Weights on huge pages: the end of open step 8, once the family state is built and evaluated.

A decode step streams every weight once. On 4 KiB pages it pays a TLB miss (and a page walk) every
4 KiB of them, and the hardware prefetchers stop at each page's end; MLX reads the install's tensors
into buffers of their own, on small pages scattered over memory. So on the CPU the arrays the model
holds (weights, fused copies and their views, norms) move into buffers that Linux backs with
2 MiB transparent huge pages where it can (``madvise``): measured on Zen 4 with two cores, Gemma 3
270M and SmolLM2-135M decode 10-13% faster. The arrays keep their identity, so every holder reads
the moved data; the old buffers are freed a batch at a time, so peak memory does not grow.

The move costs what faulting the new pages in costs: a fraction of a millisecond a huge page on
most machines, but about 10 ms in a virtual machine whose host backs the guest's free memory
lazily (1.4 GB of weights took 6 s there). So the largest arrays go first and the move stops
starting new ones after ``BUDGET_SECONDS``: what is left stays where it is (``turbospark inspect``
says how much moved). ``TURBOSPARK_HUGE_PAGES=1`` moves everything whatever it takes, ``0``
nothing; without the native module, on a GPU, or where the kernel has no huge pages to give,
nothing moves.
"""

from __future__ import annotations

import os
import types
from pathlib import Path

import attrs
import mlx.core as mx

from turbospark_core import native

ENV = "TURBOSPARK_HUGE_PAGES"
BATCH_BYTES = 16 << 20
MIN_BYTES = 32 << 20
"""Models holding less stay put: their weights are within reach of the TLB's small pages (Zen 4: 12 MiB)."""
BUDGET_SECONDS = 2.0
"""After this long no further array starts moving (unless ``TURBOSPARK_HUGE_PAGES=1``)."""
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@attrs.frozen
class Placement:
    """What the open did with the weights' pages.

    Attributes:
        moved: Bytes moved onto huge pages.
        movable: Bytes that could have moved (``moved`` is less where the budget ran out).
        seconds: The move's time.
        reason: Why nothing moved (``None`` when something did).
    """

    moved: int = 0
    movable: int = 0
    seconds: float = 0.0
    reason: str | None = None

    def describe(self) -> str:
        """One line for ``turbospark inspect``."""
        if not self.moved:
            return f"weights on the pages MLX read them to ({self.reason})"
        moved = f"{self.moved / 1e6:.1f} MB of weights moved onto huge pages in {self.seconds:.2f} s"
        if self.moved == self.movable:
            return f"{moved} ({ENV}=0 keeps them where MLX read them)"
        return f"{moved}, of {self.movable / 1e6:.1f} MB: the {BUDGET_SECONDS:g} s budget ran out ({ENV}=1 moves all)"


def held_arrays(root: object) -> list[mx.array]:
    """Every ``mx.array`` reachable from ``root`` through attributes, slots, lists, tuples and dicts.

    An object whose class sets ``pins_memory = True`` is not entered: it hands out views of its
    arrays' memory (a streamed expert bank writes its slots through numpy views), which a move
    would leave pointing at freed memory.
    """
    found: list[mx.array] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, type(None), type, types.ModuleType)):
            continue
        if getattr(type(obj), "pins_memory", False):
            continue
        seen.add(id(obj))
        if isinstance(obj, mx.array):
            found.append(obj)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        else:
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            for cls in type(obj).__mro__:
                slots = cls.__dict__.get("__slots__", ())
                for name in (slots,) if isinstance(slots, str) else slots:
                    stack.append(getattr(obj, name, None))
    return found


def huge_page_setting() -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), or ``unavailable``."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unavailable"


def _setting() -> str:
    """``TURBOSPARK_HUGE_PAGES``: ``0`` never, ``1`` whatever it takes, otherwise within the budget."""
    value = os.environ.get(ENV, "auto").lower()
    if value in native.OFF_WORDS:
        return "never"
    return "always" if value in {"1", "on", "true", "yes"} else "auto"


def why_not() -> str | None:
    """Why the weights stay where MLX read them here, whatever their size; ``None`` when they may move."""
    if _setting() == "never":
        return f"{ENV}=0"
    if not native.available():
        return "no native module"
    if mx.default_device() != mx.cpu:
        return "not on the CPU"
    setting = huge_page_setting()
    return None if setting in {"always", "madvise"} else f"transparent huge pages {setting}"


def place(model: object) -> Placement:
    """Move the arrays ``model`` holds onto huge pages, as far as the budget allows (see the module's doc)."""
    if (reason := why_not()) is not None:
        return Placement(reason=reason)
    budget = 0.0 if _setting() == "always" else BUDGET_SECONDS
    moved, movable, seconds = native.place_on_huge_pages(held_arrays(model), BATCH_BYTES, budget, MIN_BYTES)
    if not moved:
        return Placement(movable=movable, reason=f"under {MIN_BYTES >> 20} MiB of weights could move")
    return Placement(moved=moved, movable=movable, seconds=seconds)
