"""Hook implementations: the core calls them only for this family's model types; each delegates."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from turbospark_core.family import CacheSpec, DistributedPlan, FamilyContext, FamilySpec, TensorTarget, hookimpl

from turbospark_gemma3 import (
    DISTRIBUTION,
    FAMILY,
    GGUF_ARCHITECTURES,
    MODEL_TYPES,
    convert,
    distributed,
)
from turbospark_gemma3.family import Args, Model

# Gemma 3's turn markers (<start_of_turn>user ... <end_of_turn>); a system message opens the first user turn
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set system = messages[0]['content'] + '\n\n' if messages[0]['role'] == 'system' else '' -%}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (system if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


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
    return convert.arch_from_gguf(architecture, metadata)


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
    return None  # plain softmax attention over the core's caches: quantized KV applies as is


@hookimpl
def accepts_hadamard(arch: dict[str, Any]) -> bool:
    return False


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
def default_chat_template(arch: dict[str, Any]) -> str:
    return CHAT_TEMPLATE


@hookimpl
def build_family_state(context: FamilyContext) -> Model:
    return Model(Args.from_arch(context.arch), context.weights)
