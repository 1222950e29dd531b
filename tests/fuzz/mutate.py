"""Structure-aware mutations of the inputs turbospark reads: JSON documents, length-prefixed headers, GGUF.

Every mutator takes a ``random.Random`` (seeded by the caller: runs are
reproducible) and returns new bytes or a new structure; none modifies its input.
"""

from __future__ import annotations

import copy
import json
import math
import random
import struct
from typing import Any

HOSTILE: list[Any] = [
    None, True, False, 0, 1, -1, 2, 3, 7, 31, 32, 64, 4096, 2**31, 2**31 - 1, 2**32, 2**63, 2**64, -2**63, 10**30,
    0.0, -0.0, 0.5, 1e-300, 1e308, -1e308, math.inf, -math.inf, math.nan, "", "a", "0", "16", "null", "\x00",
    "\ud800", "\u00e9", "x" * 5000, [], [0], [1, 2], [[]], {}, {"a": 1}, {"rope_type": "yarn"},
]  # fmt: skip


def hostile_value(rnd: random.Random, near: Any = None) -> Any:
    """A value chosen to break a reader.

    Wrong types, bounds, non-finite floats, deep nesting, or a tweak of ``near``.
    """
    roll = rnd.random()
    if roll < 0.45:
        return copy.deepcopy(rnd.choice(HOSTILE))
    if roll < 0.75 and isinstance(near, (int, float)) and not isinstance(near, bool):
        return _tweak_number(rnd, near)
    if roll < 0.85 and isinstance(near, str):
        return _tweak_string(rnd, near)
    if roll < 0.9:
        depth = rnd.choice([10, 100, 300])
        value: Any = 0
        for _ in range(depth):
            value = [value]
        return value
    if roll < 0.95:
        return [copy.deepcopy(near)] * rnd.randint(0, 40)
    return rnd.randint(-(2**70), 2**70)


def _tweak_number(rnd: random.Random, n: int | float) -> Any:
    ops = [
        lambda: n + 1, lambda: n - 1, lambda: -n, lambda: n * 2, lambda: n * 1000003,
        lambda: n // 2 if isinstance(n, int) else n / 2,
        lambda: float(n), lambda: str(n), lambda: [n], lambda: n ** 3 if abs(n) < 10**6 else n, lambda: 0,
        lambda: n + 0.5,
    ]  # fmt: skip
    return rnd.choice(ops)()


def _tweak_string(rnd: random.Random, s: str) -> Any:
    if not s:
        return rnd.choice(["x", 0, None])
    i = rnd.randrange(len(s))
    ops = [
        lambda: s[:i] + s[i + 1 :], lambda: s[:i] + chr(rnd.randrange(32, 0x2FFF)) + s[i:], lambda: s + s,
        lambda: s.upper(), lambda: s[::-1], lambda: s[:i], lambda: s + ".", lambda: "../" + s, lambda: [s],
        lambda: {s: s},
    ]  # fmt: skip
    return rnd.choice(ops)()


def _paths(doc: Any, limit: int = 4000) -> list[tuple[Any, ...]]:
    """Paths to every node (breadth first, bounded)."""
    out: list[tuple[Any, ...]] = [()]
    queue: list[tuple[tuple[Any, ...], Any]] = [((), doc)]
    while queue and len(out) < limit:
        path, node = queue.pop(0)
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
        for key, child in children:
            out.append((*path, key))
            queue.append(((*path, key), child))
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def mutate_json(rnd: random.Random, doc: Any, *, rounds: int | None = None) -> Any:
    """``doc`` with one to a few structural edits: a value replaced, a key dropped or added, a node spliced."""
    doc = copy.deepcopy(doc)
    for _ in range(rounds or rnd.choice([1, 1, 1, 2, 3])):
        paths = _paths(doc)
        path = rnd.choice(paths)
        if not path:
            doc = hostile_value(rnd, doc) if rnd.random() < 0.05 else doc
            continue
        parent, key = _get(doc, path[:-1]), path[-1]
        roll = rnd.random()
        if roll < 0.6:
            parent[key] = hostile_value(rnd, parent[key])
        elif roll < 0.75:
            del parent[key]
        elif roll < 0.85:
            parent[key] = copy.deepcopy(_get(doc, rnd.choice(paths))) if rnd.random() < 0.5 else parent[key]
        elif isinstance(parent, dict):
            parent[rnd.choice(["__metadata__", "x", "", str(key) + "_", "model_type", "version"])] = hostile_value(rnd)
        else:
            parent.insert(key, hostile_value(rnd, parent[key]))
    return doc


def mutate_section(rnd: random.Random, value: Any) -> Any:
    """``value`` (one section of a document) mutated, possibly replaced whole or dropped (``None``)."""
    try:
        wrapped = mutate_json(rnd, {"s": value})
    except RecursionError:
        return [[[[[[0]]]]]]
    return wrapped.get("s") if isinstance(wrapped, dict) else wrapped


def dumps(doc: Any) -> bytes:
    """JSON text as a converter would write it (non-finite floats as ``Infinity``/``NaN``)."""
    try:
        return json.dumps(doc, allow_nan=True).encode("utf-8", "surrogatepass")
    except RecursionError:  # nested past the encoder's depth: a nesting bomb is the input then
        return b"[" * 20000 + b"]" * 20000


def mutate_bytes(rnd: random.Random, data: bytes) -> bytes:
    """A byte-level edit: flips, truncation, insertion, duplication, or a nesting bomb spliced in."""
    if not data:
        return bytes([rnd.randrange(256)])
    buf = bytearray(data)
    roll = rnd.random()
    i = rnd.randrange(len(buf))
    if roll < 0.35:
        for _ in range(rnd.randint(1, 4)):
            buf[rnd.randrange(len(buf))] ^= 1 << rnd.randrange(8)
    elif roll < 0.5:
        del buf[rnd.randrange(len(buf)) :]
    elif roll < 0.65:
        buf[i:i] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 16)))
    elif roll < 0.75:
        j = min(len(buf), i + rnd.randint(1, 64))
        buf[i:i] = buf[i:j]
    elif roll < 0.85:
        buf[i:i] = rnd.choice([b"[" * 100000, b'{"a":' * 50000, b"9" * 5000, b"\xff\xfe", b"\\ud800", b"1e999"])
    else:
        j = min(len(buf), i + rnd.randint(1, 8))
        buf[i:j] = struct.pack("<Q", rnd.choice([0, 1, 2**31, 2**63, 2**64 - 1, len(buf), len(buf) + 1]))[: j - i]
    return bytes(buf)


def mutate_document(rnd: random.Random, doc: Any) -> bytes:
    """Mostly structure-aware JSON edits, sometimes a byte-level edit of the serialized text."""
    try:
        text = dumps(mutate_json(rnd, doc)) if rnd.random() < 0.85 else dumps(doc)
    except RecursionError:  # the edit nested too deep to copy: the nesting bomb is the input
        text = b"[" * 20000 + b"]" * 20000
    return mutate_bytes(rnd, text) if rnd.random() < 0.2 else text


def safetensors_blob(header: Any, data: bytes, *, length: int | None = None) -> bytes:
    """A safetensors container: little-endian u64 header length, JSON header, data."""
    body = dumps(header)
    return struct.pack("<Q", len(body) if length is None else length) + body + data


def mutate_safetensors(rnd: random.Random, header: dict[str, Any], data: bytes) -> bytes:
    """A mutated header (structure-aware), sometimes a wrong length prefix or a byte-level edit."""
    try:
        mutated = mutate_json(rnd, header)
    except RecursionError:
        mutated = {"t": [[[[0]]]]}
    roll = rnd.random()
    if roll < 0.1:
        length = rnd.choice([0, 1, 2**63, 2**64 - 1, len(dumps(mutated)) + rnd.randint(-4, 4)])
        return safetensors_blob(mutated, data, length=max(0, min(length, 2**64 - 1)))
    blob = safetensors_blob(mutated, data)
    if roll < 0.25:
        head = mutate_bytes(rnd, blob[: 8 + len(dumps(mutated))])
        return head + data
    return blob
