"""The process group ``mlx.launch`` started (``mx.distributed.init()``), and the few collectives the open needs."""

from __future__ import annotations

import json
import os
from typing import Any

import mlx.core as mx
import numpy as np

MODES = ("tensor", "pipeline")


class Group:
    """This process's place in the group: ``rank`` of ``size`` (size 1 without ``mlx.launch``)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.rank: int = handle.rank()
        self.size: int = handle.size()

    def all_sum(self, x: mx.array) -> mx.array:
        """``x`` summed over the group (lazy)."""
        return mx.distributed.all_sum(x, group=self.handle)

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (one collective: every rank must ask)."""
        total = self.all_sum(mx.array([1 if flag else 0], dtype=mx.int32))
        return int(np.asarray(total)[0]) == self.size

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's ``payload`` on every rank (the others pass ``None``); two collectives."""
        length = self.all_sum(mx.array([len(payload or b"") if self.rank == 0 else 0], dtype=mx.int32))
        n = int(np.asarray(length)[0])
        if self.rank == 0:
            data = np.frombuffer(payload or b"", dtype=np.uint8)
        else:
            data = np.zeros(n, dtype=np.uint8)
        out = self.all_sum(mx.array(data))
        return bytes(np.array(out, dtype=np.uint8))

    def broadcast_json(self, value: Any = None) -> Any:
        """Rank 0's JSON-able ``value`` on every rank."""
        payload = json.dumps(value, separators=(",", ":")).encode() if self.rank == 0 else None
        return json.loads(self.broadcast_bytes(payload))

    def shared_seed(self) -> int:
        """A random seed drawn by rank 0, the same on every rank."""
        seed = int.from_bytes(os.urandom(4), "little") >> 1 if self.rank == 0 else 0
        return int(np.asarray(self.all_sum(mx.array([seed], dtype=mx.int64)))[0])


_WORLD: Group | None = None


def world() -> Group:
    """The group of this process (``mx.distributed.init()``; size 1 when not started by ``mlx.launch``)."""
    global _WORLD
    if _WORLD is None:
        _WORLD = Group(mx.distributed.init())
    return _WORLD
