"""Hook implementations: each one checks the model type and delegates."""

from __future__ import annotations

from typing import Any, Callable

from turbospark_core import hookimpl
from turbospark_core.cache_spec import CacheSpec
from turbospark_core.context import FamilyContext
from turbospark_core.convert.records import TensorTarget
from turbospark_core.registry import FamilySpec

from turbospark_gemma4 import DISTRIBUTION, FAMILY, MODEL_TYPES, convert
from turbospark_gemma4.family import Args, Model


def _mine(arch: dict[str, Any]) -> bool:
    return arch.get("model_type") in MODEL_TYPES


@hookimpl
def register_families(register: Callable[[FamilySpec], None]) -> None:
    register(FamilySpec(name=FAMILY, model_types=MODEL_TYPES, distribution=DISTRIBUTION))


@hookimpl
def arch_from_hf_config(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    return convert.arch_from_hf(hf_config) if _mine(hf_config) else None


@hookimpl
def hf_tensor_target(arch: dict[str, Any], name: str) -> TensorTarget | None:
    return convert.hf_target(arch, name) if _mine(arch) else None


@hookimpl
def hf_tensor_transform(arch: dict[str, Any], name: str, data: Any) -> dict[str, Any] | None:
    return convert.hf_transform(arch, name, data) if _mine(arch) else None


@hookimpl
def arch_problems(arch: dict[str, Any]) -> list[str] | None:
    return Args.problems(arch) if _mine(arch) else None


@hookimpl
def kv_quant_unsupported_reason(arch: dict[str, Any], kv_quant: str) -> str | None:
    return None  # plain softmax attention over the core's caches: quantized KV applies as is


@hookimpl
def accepts_hadamard(arch: dict[str, Any]) -> bool | None:
    return False if _mine(arch) else None


@hookimpl
def steering_supported(arch: dict[str, Any]) -> bool | None:
    return False if _mine(arch) else None  # the flow has no steering points yet


@hookimpl
def cache_layout(arch: dict[str, Any]) -> list[CacheSpec] | None:
    return Args.from_arch(arch).cache_specs() if _mine(arch) else None


@hookimpl
def build_family_state(context: FamilyContext) -> Model | None:
    if not _mine(context.arch):
        return None
    return Model(Args.from_arch(context.arch), context.weights)
