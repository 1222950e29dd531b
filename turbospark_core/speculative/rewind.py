"""Exact rewind of a sequence's caches after rejected drafts, without re-prefilling anything.

Full KV caches (quantized or not) and sliding-window rings drop their last
tokens in place (rings keep ``slack`` spare slots so the window survives).
Recurrent state (gated DeltaNet's recurrent and conv state) cannot be cut:
it is checkpointed before the tokens that may be rejected, restored, and the
kept tokens are run again (the caller's replay), which costs one forward of
the kept tokens only when something was rejected.
"""

from __future__ import annotations

from typing import Any

from turbospark_core.kv_cache import Cache, RecurrentState, trim_caches, trimmable


class Checkpoint:
    """Where a sequence's caches stood after ``length`` tokens.

    Taken before running tokens that may be rejected; holds copies of the
    recurrent states only (KV and rings are trimmed, not copied).
    """

    def __init__(self, caches: list[Cache], length: int) -> None:
        self.length = length
        self.trimmable = trimmable(caches)
        self._recurrent: dict[int, dict[str, Any]] = {
            i: c.snapshot() for i, c in enumerate(caches) if isinstance(c, RecurrentState)
        }

    def rewind(self, caches: list[Cache], held: int, keep: int) -> int:
        """The caches hold ``held`` tokens; keep the first ``keep`` (``length <= keep <= held``).

        Returns how many tokens the caches hold afterwards: ``keep`` when
        every cache trims in place, else ``length`` (recurrent state restored:
        the caller runs tokens ``length .. keep-1`` again).
        """
        if keep >= held:
            return held
        if self.trimmable:
            trim_caches(caches, held - keep)
            return keep
        trim_caches(caches, held - self.length)
        for i, snap in self._recurrent.items():
            caches[i].restore(snap)
        return self.length
