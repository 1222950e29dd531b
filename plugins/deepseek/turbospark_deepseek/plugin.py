"""Hook implementations: the core calls them only for this family's model types; each delegates."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from turbospark_core.family import CacheSpec, DistributedPlan, FamilyContext, FamilySpec, TensorTarget, hookimpl

from turbospark_deepseek import DISTRIBUTION, FAMILY, MODEL_TYPES, REFUSED_MODEL_TYPES, convert, distributed
from turbospark_deepseek.args import Args
from turbospark_deepseek.family import Model

# Measured (tests/test_kv_quant.py): the latent is every head's key AND value, so its rounding
# reaches all heads twice. Max relative logit error on a tiny random model: q8 0.036 (a plain
# cache's q8 on a same-size llama: 0.015), kept; q4 0.55 (plain: 0.2-0.3), refused.
KV_QUANT_REFUSALS = {
    "q4": (
        "4-bit rows of the MLA latent move logits about 2x more than a plain KV cache's q4 on the same "
        "size of model (0.55 vs 0.2-0.3 max relative error; 0.84 with MoE routing flips); use kv_quant='q8' "
        "(the latent cache is already ~4-7x smaller than expanded K/V)"
    ),
}


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
    return KV_QUANT_REFUSALS.get(kv_quant)


@hookimpl
def accepts_hadamard(arch: dict[str, Any]) -> bool:
    return False  # the flow applies no online transforms for a rotated residual stream


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
