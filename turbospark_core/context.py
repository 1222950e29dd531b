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
        steering_refusal: The family's ``steering_supported`` answer: ``None``
            when its flow applies steering edits, else why not (open step 14,
            steered requests and residual capture are refused with it);
            ``inspect`` and the server's ``/v1/models`` show it.
    """

    family: str
    distribution: str
    accepts_hadamard: bool
    steering_refusal: str | None = None

    @property
    def steering(self) -> bool:
        """Whether the family's flow applies steering edits."""
        return self.steering_refusal is None
