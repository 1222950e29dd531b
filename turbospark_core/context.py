"""What the core hands a family to build its flow, and what the family hands back."""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import mlx.core as mx

from turbospark_core.cache_spec import CacheSpec, StateSpec
from turbospark_core.weights import WeightStore


@attrs.frozen(kw_only=True)
class FamilyContext:
    """Everything ``build_family_state`` may use.

    Attributes:
        arch: The install's arch config (``model_type`` included).
        weights: The core's weight store (linear, embedding, expert objects).
        cache_layout: The per-layer caches the core allocates for each sequence.
        compute_dtype: Activation dtype chosen by the compute policy.
    """

    arch: dict[str, Any]
    weights: WeightStore = attrs.field(eq=False)
    cache_layout: tuple[CacheSpec | StateSpec, ...]
    compute_dtype: mx.Dtype = attrs.field(eq=False)


class FamilyModel(Protocol):
    """A family's flow: token ids in, logits out, with the core's caches."""

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        """Logits ``[B, L, vocab]`` for ``inputs`` ``[B, L]``, appending to ``cache``."""
        ...

    @property
    def layers(self) -> list[Any]:
        """The decoder blocks, in order."""
        ...


@attrs.frozen(kw_only=True)
class Capabilities:
    """A family's answers to the core's probes, asked once at open.

    Attributes:
        family: The serving family's name (shown by ``inspect``).
        distribution: The plugin distribution that provides it (shown by ``inspect``).
        accepts_hadamard: The family's ``accepts_hadamard`` answer: open step 6
            refuses a hadamard-folded install without it; ``inspect`` shows it.
    """

    family: str
    distribution: str
    accepts_hadamard: bool
