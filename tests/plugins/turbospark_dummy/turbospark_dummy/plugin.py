"""Hook implementations of the dummy family; the core calls them only for ``dummy_lm``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from turbospark_core.family import CacheSpec, FamilyContext, FamilySpec, TensorTarget, hookimpl

from turbospark_dummy import DISTRIBUTION, FAMILY, MODEL_TYPES


class BigramModel:
    """Logits of the next token from the current one only: ``lm_head(embed(ids))``."""

    def __init__(self, context: FamilyContext) -> None:
        self.embed_tokens = context.weights.embedding("model.embed_tokens")
        self.lm_head = context.weights.linear("lm_head")

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        return self.lm_head(self.embed_tokens(inputs))

    @property
    def layers(self) -> list[Any]:
        return []


@hookimpl
def register_families(register: Callable[[FamilySpec], None]) -> None:
    register(FamilySpec(name=FAMILY, model_types=MODEL_TYPES, distribution=DISTRIBUTION))


@hookimpl
def arch_from_hf_config(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    return {
        "model_type": hf_config["model_type"],
        "hidden_size": hf_config["hidden_size"],
        "num_hidden_layers": 1,
        "vocab_size": hf_config["vocab_size"],
    }


@hookimpl
def hf_tensor_target(arch: dict[str, Any], name: str) -> TensorTarget:
    return TensorTarget.to(name)


@hookimpl
def arch_problems(arch: dict[str, Any]) -> list[str]:
    return []


@hookimpl
def accepts_hadamard(arch: dict[str, Any]) -> bool:
    return False


@hookimpl
def steering_supported(arch: dict[str, Any]) -> str:
    return "the bigram flow has no decoder layers to steer"


@hookimpl
def cache_layout(arch: dict[str, Any]) -> list[CacheSpec]:
    return []


@hookimpl
def build_family_state(context: FamilyContext) -> BigramModel:
    return BigramModel(context)
