"""Hook implementations: each one checks the model type and delegates."""

from __future__ import annotations

from typing import Any, Callable

from turbospark_core import hookimpl
from turbospark_core.cache_spec import CacheSpec
from turbospark_core.context import FamilyContext
from turbospark_core.convert.records import TensorTarget
from turbospark_core.registry import FamilySpec

from turbospark_llama import DISTRIBUTION, FAMILY, GGUF_ARCHITECTURES, MODEL_TYPES, convert
from turbospark_llama.family import Args, Model


def _mine(arch: dict[str, Any]) -> bool:
    return arch.get("model_type") in MODEL_TYPES


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
    if hf_config.get("model_type") not in MODEL_TYPES:
        return None
    return convert.arch_from_hf(hf_config)


@hookimpl
def arch_from_gguf(architecture: str, metadata: dict[str, Any], tensor_names: list[str]) -> dict[str, Any] | None:
    if architecture not in GGUF_ARCHITECTURES:
        return None
    return convert.arch_from_gguf(architecture, metadata, tensor_names)


@hookimpl
def hf_tensor_target(arch: dict[str, Any], name: str) -> TensorTarget | None:
    return convert.hf_target(arch, name) if _mine(arch) else None


@hookimpl
def gguf_tensor_target(arch: dict[str, Any], name: str) -> TensorTarget | None:
    return convert.gguf_target(arch, name) if _mine(arch) else None


@hookimpl
def arch_problems(arch: dict[str, Any]) -> list[str] | None:
    return Args.problems(arch) if _mine(arch) else None


@hookimpl
def kv_quant_unsupported_reason(arch: dict[str, Any], kv_quant: str) -> str | None:
    return None  # plain softmax attention: quantized KV applies as is


@hookimpl
def accepts_hadamard(arch: dict[str, Any]) -> bool | None:
    return False if _mine(arch) else None


@hookimpl
def steering_supported(arch: dict[str, Any]) -> bool | None:
    return False if _mine(arch) else None  # the flow has no steering points yet


@hookimpl
def cache_layout(arch: dict[str, Any]) -> list[CacheSpec] | None:
    if not _mine(arch):
        return None
    args = Args.from_arch(arch)
    return [CacheSpec.full(args.num_key_value_heads, args.head_dim)] * args.num_hidden_layers


@hookimpl
def build_family_state(context: FamilyContext) -> Model | None:
    if not _mine(context.arch):
        return None
    return Model(Args.from_arch(context.arch), context.weights)
