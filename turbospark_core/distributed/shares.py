"""Which share of each tensor, head count and layer range a rank holds: the arithmetic behind every split.

Pure functions of the declared plan, the tensor shapes and the group size,
so every refusal is made (and tested) before anything is read.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

from turbospark_core.distributed.plan import Split
from turbospark_core.errors import DistributedError

Range = tuple[int, int]  # [start, stop) along one axis


def head_share(heads: int, size: int, rank: int, what: str, *, replicate: bool = True) -> tuple[int, int]:
    """``(first, count)``: the heads of ``heads`` rank ``rank`` of ``size`` holds.

    ``heads`` divisible by ``size``: a contiguous ``heads // size``. Fewer
    heads than ranks with ``replicate`` (``size`` divisible by ``heads``): the
    one head its share of the queries reads. Anything else is refused.

    Raises:
        DistributedError: Naming ``what``, the numbers and the fix.
    """
    if heads > 0 and heads % size == 0:
        count = heads // size
        return rank * count, count
    if replicate and 0 < heads < size and size % heads == 0:
        return rank * heads // size, 1
    fix = f"a group size that divides {heads}"
    if replicate:
        fix += f" (or a multiple of {heads})"
    msg = (
        f"distributed='tensor' over {size} ranks cannot split {what}={heads} "
        f"({'neither divides the other' if replicate else f'not divisible by {size}'}); "
        f"launch with {fix}, or use distributed='pipeline'"
    )
    raise DistributedError(msg)


def per_rank_arch(arch: Mapping[str, Any], keys: Iterable[str], size: int) -> dict[str, Any]:
    """``arch`` with each head count in ``keys`` replaced by what one rank holds (dotted keys reach into sections).

    A key the arch lacks, or holds as null, is left alone.

    Raises:
        DistributedError: A count that cannot be split over ``size`` ranks.
    """
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in arch.items()}
    for key in keys:
        *path, leaf = key.split(".")
        node: Any = out
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or not isinstance(node.get(leaf), int) or isinstance(node.get(leaf), bool):
            continue
        node[leaf] = head_share(node[leaf], size, 0, key)[1]
    return out


def split_ranges(split: Split, length: int, size: int, rank: int, name: str) -> list[Range]:
    """The ranges along ``split``'s axis (``length`` long) that rank ``rank`` holds of tensor ``name``.

    Raises:
        DistributedError: The sections do not add up to ``length``, or a part cannot be split.
    """
    if not split.sections:
        if length % size:
            msg = (
                f"distributed='tensor' over {size} ranks cannot split {name!r}: its {length} "
                f"{'input columns' if split.axis == 'in' else 'rows'} are not divisible by {size}; "
                f"launch with a group size dividing {length}, or use distributed='pipeline'"
            )
            raise DistributedError(msg)
        step = length // size
        return [(rank * step, (rank + 1) * step)]
    total = sum(h * w for h, w in split.sections)
    if total != length:
        msg = (
            f"the family's tensor plan splits {name!r} into sections {list(split.sections)} ({total} rows), "
            f"but the tensor has {length} along that axis; the plugin's plan does not fit this install"
        )
        raise DistributedError(msg)
    out, start = [], 0
    for i, (heads, width) in enumerate(split.sections):
        what = f"the heads of {name!r}" + (f" (section {i})" if len(split.sections) > 1 else "")
        first, count = head_share(heads, size, rank, what, replicate=split.axis == "out")
        out.append((start + first * width, start + (first + count) * width))
        start += heads * width
    return _merged(out)


def _merged(ranges: list[Range]) -> list[Range]:
    out: list[Range] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def find_split(splits: Mapping[str, Split], name: str) -> Split | None:
    """The split declared for ``name`` (an exact key first, then the first matching glob)."""
    if name in splits:
        return splits[name]
    return next((s for pattern, s in splits.items() if fnmatch.fnmatchcase(name, pattern)), None)


def matches(patterns: Iterable[str], name: str) -> bool:
    """Whether ``name`` is one of ``patterns`` (exact names or ``fnmatch`` globs)."""
    return any(name == p or fnmatch.fnmatchcase(name, p) for p in patterns)


def layer_ranges(costs: list[int], size: int, tied: Iterable[tuple[int, int]] = ()) -> list[Range]:
    """Contiguous decoder-layer ranges, one per rank, balancing ``costs`` (bytes per layer).

    Minimizes the largest range's cost; every rank gets at least one layer and
    no range boundary falls between a ``tied`` pair.

    Raises:
        DistributedError: Fewer layers than ranks, or the tied pairs leave no such split.
    """
    n = len(costs)
    if n < size:
        msg = (
            f"distributed='pipeline' over {size} ranks needs at least one decoder layer per rank, "
            f"but the model has {n}; launch with at most {n} ranks"
        )
        raise DistributedError(msg)
    pairs = [(min(a, b), max(a, b)) for a, b in tied]
    allowed = [0 < k < n and not any(lo < k <= hi for lo, hi in pairs) for k in range(n + 1)]
    allowed[0] = allowed[n] = True
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][j]: the smallest largest-range cost splitting layers [0, j) into k ranges
    best = [[inf] * (n + 1) for _ in range(size + 1)]
    cut = [[0] * (n + 1) for _ in range(size + 1)]
    best[0][0] = 0
    for k in range(1, size + 1):
        for j in range(k, n + 1):
            if not allowed[j]:
                continue
            for i in range(k - 1, j):
                if best[k - 1][i] == inf or not allowed[i]:
                    continue
                worst = max(best[k - 1][i], prefix[j] - prefix[i])
                if worst < best[k][j]:
                    best[k][j], cut[k][j] = worst, i
    if best[size][n] == inf:
        shown = ", ".join(f"{a}-{b}" for a, b in sorted(set(pairs)))
        msg = (
            f"distributed='pipeline' over {size} ranks: the layers that must run together ({shown}: a layer "
            f"and the layer whose keys and values it reads) leave no split into {size} ranges of the model's "
            f"{n} layers; launch with fewer ranks"
        )
        raise DistributedError(msg)
    out, j = [], n
    for k in range(size, 0, -1):
        i = cut[k][j]
        out.append((i, j))
        j = i
    return out[::-1]
