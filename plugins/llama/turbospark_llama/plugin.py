"""Hook implementations: the core calls them only for this family's model types; each delegates."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from turbospark_core.family import (
    CacheSpec,
    DistributedPlan,
    FamilyContext,
    FamilySpec,
    ResidualMap,
    TensorTarget,
    VisionContext,
    VisionSpec,
    hookimpl,
)

from turbospark_llama import (
    DISTRIBUTION,
    FAMILY,
    GGUF_ARCHITECTURES,
    MODEL_TYPES,
    convert,
    distributed,
    rotation,
    vision,
)
from turbospark_llama.family import Args, Model


@hookimpl
def register_families(register: Callable[[FamilySpec], None]) -> None:
    register(
        FamilySpec(
            name=FAMILY,
            model_types=MODEL_TYPES,
            distribution=DISTRIBUTION,
            gguf_architectures=GGUF_ARCHITECTURES,
        )
    )


@hookimpl
def arch_from_hf_config(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    return convert.arch_from_hf(hf_config)


@hookimpl
def arch_from_gguf(architecture: str, metadata: dict[str, Any], tensor_names: list[str]) -> dict[str, Any] | None:
    return convert.arch_from_gguf(architecture, metadata, tensor_names)


@hookimpl
def hf_tensor_target(arch: dict[str, Any], name: str) -> TensorTarget:
    return convert.hf_target(arch, name)


@hookimpl
def gguf_tensor_target(arch: dict[str, Any], name: str) -> TensorTarget:
    return convert.gguf_target(arch, name)


@hookimpl
def arch_problems(arch: dict[str, Any]) -> list[str]:
    return Args.problems(arch)


@hookimpl
def kv_quant_unsupported_reason(arch: dict[str, Any], kv_quant: str) -> str | None:
    return None  # plain softmax attention: quantized KV applies as is


@hookimpl
def accepts_hadamard(arch: dict[str, Any]) -> bool:
    return True  # rotation is folded into the weights: the flow computes the same thing


@hookimpl
def hadamard_residual_map(arch: dict[str, Any], names: list[str]) -> ResidualMap:
    return rotation.residual_map(arch, names)


@hookimpl
def steering_supported(arch: dict[str, Any]) -> str | None:
    return None  # the layer loop passes every decoder layer's output through steer()


@hookimpl
def distributed_plan(arch: dict[str, Any]) -> DistributedPlan:
    return distributed.distributed_plan(Args.from_arch(arch))


@hookimpl
def cache_layout(arch: dict[str, Any]) -> list[CacheSpec]:
    return Args.from_arch(arch).cache_layout()


@hookimpl
def build_family_state(context: FamilyContext) -> Model:
    return Model(Args.from_arch(context.arch), context.weights)


@hookimpl
def vision_arch_from_hf_config(hf_config: dict[str, Any]) -> VisionSpec | None:
    return vision.vision_spec(hf_config)  # Qwen3-VL only; None for the text-only model types


@hookimpl
def vision_tensor_target(vision: dict[str, Any], name: str) -> TensorTarget:
    from turbospark_llama.vision import vision_target

    return vision_target(name)


@hookimpl
def build_vision(context: VisionContext) -> vision.Qwen3VLTower | None:
    if context.arch.get("model_type") != "qwen3_vl" or context.vision.get("model_type") != "qwen3_vl":
        return None
    return vision.Qwen3VLTower(context)
