"""Hook implementations: the core calls them only for this family's model types; each delegates."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from turbospark_core.family import CacheSpec, FamilyContext, FamilySpec, TensorTarget, hookimpl

from turbospark_deepseek import DISTRIBUTION, FAMILY, MODEL_TYPES, REFUSED_MODEL_TYPES, convert
from turbospark_deepseek.args import Args
from turbospark_deepseek.family import Model


@hookimpl
def register_families(register: Callable[[FamilySpec], None]) -> None:
    register(FamilySpec(name=FAMILY, model_types=MODEL_TYPES + tuple(REFUSED_MODEL_TYPES), distribution=DISTRIBUTION))


@hookimpl
def arch_from_hf_config(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    return convert.arch_from_hf(hf_config)


@hookimpl
def hf_tensor_target(arch: dict[str, Any], name: str) -> TensorTarget:
    return convert.hf_target(arch, name)


@hookimpl
def arch_problems(arch: dict[str, Any]) -> list[str]:
    return Args.problems(arch)


@hookimpl
def kv_quant_unsupported_reason(arch: dict[str, Any], kv_quant: str) -> str | None:
    return None  # the latent rows quantize like any key row (measured: tests/test_kv_quant.py)


@hookimpl
def accepts_hadamard(arch: dict[str, Any]) -> bool:
    return False  # the flow applies no online transforms for a rotated residual stream


@hookimpl
def steering_supported(arch: dict[str, Any]) -> str | None:
    return None  # the layer loop passes every decoder layer's output through steer()


@hookimpl
def cache_layout(arch: dict[str, Any]) -> list[CacheSpec]:
    return Args.from_arch(arch).cache_layout()


@hookimpl
def build_family_state(context: FamilyContext) -> Model:
    return Model(Args.from_arch(context.arch), context.weights)
