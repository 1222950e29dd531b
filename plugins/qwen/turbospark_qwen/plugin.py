"""Hook implementations: the core calls them only for this family's model types; each delegates."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from turbospark_core.family import (
    CacheSpec,
    DistributedPlan,
    DraftHead,
    FamilyContext,
    FamilySpec,
    HeadContext,
    ResidualMap,
    StateSpec,
    TensorTarget,
    hookimpl,
)

from turbospark_qwen import DISTRIBUTION, FAMILY, MODEL_TYPES, convert, distributed, mtp, rotation
from turbospark_qwen.family import Args, Model


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
def hf_tensor_transform(arch: dict[str, Any], name: str, data: Any) -> dict[str, Any] | None:
    return convert.hf_transform(arch, name, data)


@hookimpl
def arch_problems(arch: dict[str, Any]) -> list[str]:
    return Args.problems(arch)


@hookimpl
def kv_quant_unsupported_reason(arch: dict[str, Any], kv_quant: str) -> str | None:
    return None  # only the full-attention layers hold KV; recurrent state is never quantized


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
def cache_layout(arch: dict[str, Any]) -> list[CacheSpec | StateSpec]:
    return Args.from_arch(arch).cache_layout()


@hookimpl
def build_family_state(context: FamilyContext) -> Model:
    return Model(Args.from_arch(context.arch), context.weights)


@hookimpl
def build_mtp_head(context: HeadContext) -> DraftHead:
    return mtp.build_head(context.arch, context.trunk, context.weights)
