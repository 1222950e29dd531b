"""Hook implementations: the core calls them only for this family's model types; each delegates."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from turbospark_core.family import CacheSpec, DistributedPlan, FamilyContext, FamilySpec, TensorTarget, hookimpl

from turbospark_spark import DISTRIBUTION, FAMILY, MODEL_TYPES, convert, distributed, family


@hookimpl
def register_families(register: Callable[[FamilySpec], None]) -> None:
    register(FamilySpec(name=FAMILY, model_types=MODEL_TYPES, distribution=DISTRIBUTION))


@hookimpl
def arch_from_hf_config(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    return convert.arch_from_hf(hf_config)


@hookimpl
def hf_tensor_target(arch: dict[str, Any], name: str) -> TensorTarget:
    return convert.hf_target(arch, name)


@hookimpl
def arch_problems(arch: dict[str, Any]) -> list[str]:
    return family.Args.problems(arch)


@hookimpl
def kv_quant_unsupported_reason(arch: dict[str, Any], kv_quant: str) -> str | None:
    return None  # plain softmax attention over full and ring caches: quantized KV applies as is


@hookimpl
def accepts_hadamard(arch: dict[str, Any]) -> bool:
    return False


@hookimpl
def steering_supported(arch: dict[str, Any]) -> str | None:
    return None  # the layer loop passes every decoder layer's output through steer()


@hookimpl
def distributed_plan(arch: dict[str, Any]) -> DistributedPlan:
    return distributed.distributed_plan(family.Args.from_arch(arch))


@hookimpl
def cache_layout(arch: dict[str, Any]) -> list[CacheSpec]:
    return family.Args.from_arch(arch).cache_layout()


@hookimpl
def build_family_state(context: FamilyContext) -> family.Model:
    return family.Model(family.Args.from_arch(context.arch), context.weights)
