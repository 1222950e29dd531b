"""The hooks: what the family serves, how its checkpoints map, which caches it needs, its model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from turbospark_core.family import CacheSpec, FamilyContext, FamilySpec, TensorTarget, hookimpl

from turbospark_minimal.family import KEYS, Model


@hookimpl
def register_families(register: Callable[[FamilySpec], None]) -> None:
    register(FamilySpec(name="minimal", model_types=("minimal_llama",), distribution="turbospark-minimal"))


@hookimpl
def arch_from_hf_config(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    return {key: hf_config[key] for key in KEYS}


@hookimpl
def hf_tensor_target(arch: dict[str, Any], name: str) -> TensorTarget:
    return TensorTarget.to(name)  # the install keeps Hugging Face names


@hookimpl
def cache_layout(arch: dict[str, Any]) -> list[CacheSpec]:
    head_dim = arch["hidden_size"] // arch["num_attention_heads"]
    return [CacheSpec.full(arch["num_key_value_heads"], head_dim)] * arch["num_hidden_layers"]


@hookimpl
def build_family_state(context: FamilyContext) -> Model:
    return Model(context)
