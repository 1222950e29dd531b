# Copyright 2026 the turbospark authors. Apache-2.0.
"""Which Llama-style tensors read and write the residual stream (for ``convert --rotate``)."""

from __future__ import annotations

from typing import Any

from turbospark_core.family import NormReaders, ResidualMap, names_under

# linears reading a norm's output: attention projections; dense MLP, router and routed or shared experts
_ATTN_READERS = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
_MLP_READERS = ("gate_proj.weight", "up_proj.weight", ".gate.weight", "shared_expert_gate.weight")
_WRITERS = ("o_proj.weight", "down_proj.weight")


def residual_map(arch: dict[str, Any], names: list[str]) -> ResidualMap:
    """The residual readers and writers of every layer, found by name in the install."""
    norms: list[NormReaders] = []
    writers: list[str] = []
    for i in range(arch["num_hidden_layers"]):
        p = f"model.layers.{i}."
        attn, mlp = names_under(names, p + "self_attn.", _ATTN_READERS), names_under(names, p + "mlp.", _MLP_READERS)
        norms.append(NormReaders(norm=f"{p}input_layernorm.weight", readers=attn))
        norms.append(NormReaders(norm=f"{p}post_attention_layernorm.weight", readers=mlp))
        writers.extend(names_under(names, p, _WRITERS))
    return ResidualMap(
        hidden_size=arch["hidden_size"],
        embedding="model.embed_tokens.weight",
        head="lm_head.weight",
        final_norm="model.norm.weight",
        norms=norms,
        writers=writers,
    )
