"""Speculative decoding: drafters propose tokens, the target verifies them in one forward.

One concept per module: :mod:`.drafter` (the protocol every drafter follows and
the :class:`~.drafter.Draft` record), the drafters themselves, the verify /
acceptance rule, and the open-time construction (which drafter an open asks for).
"""

from __future__ import annotations

from turbospark_core.speculative.drafter import Draft, Drafter, DrafterFactory

__all__ = ["Draft", "Drafter", "DrafterFactory"]
