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


@attrs.frozen(kw_only=True)
class HeadContext:
    """Everything ``build_mtp_head`` may use: the install's multi-token-prediction head.

    Attributes:
        arch: The install's arch config.
        trunk: The model ``build_family_state`` built (the head reuses its
            embedding, final norm and output head).
        weights: A weight store over the head's own tensors (``mtp.safetensors``,
            install names ``mtp.*``), held under the trunk's compute policy.
        compute_dtype: Activation dtype chosen by the compute policy.
    """

    arch: dict[str, Any]
    trunk: FamilyModel = attrs.field(eq=False)
    weights: WeightStore = attrs.field(eq=False)
    compute_dtype: mx.Dtype = attrs.field(eq=False)


class DraftHead(Protocol):
    """A multi-token-prediction head's flow: one draft slot per (trunk hidden, next token) pair.

    Slot ``t`` reads ``h_t`` (the trunk's hidden at position ``t`` after its final
    norm: what the output head reads) and token ``x_{t+1}``, and predicts
    ``x_{t+2}``. The head keeps its own KV caches (one per entry of
    :meth:`cache_layout`, made and trimmed by the core); a slot's position is the
    number of slots its cache holds before it.
    """

    def cache_layout(self) -> list[CacheSpec]:
        """The head's own KV caches (one per MTP layer)."""
        ...

    def trunk_hidden(self, residual: mx.array) -> mx.array:
        """``h_t`` from the residual after the trunk's last decoder layer (applies the trunk's final norm)."""
        ...

    def __call__(self, hidden: mx.array, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """Logits ``[B, L, vocab]`` (float32) and the head's output hidden ``[B, L, H]`` for ``L`` slots.

        ``hidden`` ``[B, L, H]`` are the slots' ``h_t`` (for a chained draft: the
        previous slot's output hidden), ``tokens`` ``[B, L]`` their ``x_{t+1}``;
        the slots are appended to ``cache``.
        """
        ...
