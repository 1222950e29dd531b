# Copyright 2026 the turbospark authors. Apache-2.0.
"""How Qwen 3.5 splits across ranks: a declaration the core applies (no sharding code here)."""

from __future__ import annotations

from turbospark_core.family import DistributedPlan, PipelinePlan, Split, TensorPlan

from turbospark_qwen.family import Args


def distributed_plan(args: Args) -> DistributedPlan:
    """Gated-DeltaNet key/value heads (the fused q|k|v projection and conv by section), attention heads,
    MLP and shared-expert columns, vocabulary rows; layers for pipelining."""
    nk, nv, dk, dv = (
        args.linear_num_key_heads,
        args.linear_num_value_heads,
        args.linear_key_head_dim,
        args.linear_value_head_dim,
    )
    q, kv, d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    qkv = Split.out((nk, dk), (nk, dk), (nv, dv))
    splits = {
        "*.linear_attn.in_proj_qkv": qkv,
        "*.linear_attn.conv1d": qkv,
        "*.linear_attn.in_proj_z": Split.out((nv, dv)),
        "*.linear_attn.in_proj_b": Split.out((nv, 1)),
        "*.linear_attn.in_proj_a": Split.out((nv, 1)),
        "*.linear_attn.A_log": Split.out((nv, 1)),
        "*.linear_attn.dt_bias": Split.out((nv, 1)),
        "*.linear_attn.out_proj": Split.into((nv, dv)),
        "*.self_attn.q_proj": Split.out((q, 2 * d)),  # per head: [query | output gate]
        "*.self_attn.k_proj": Split.out((kv, d)),
        "*.self_attn.v_proj": Split.out((kv, d)),
        "*.self_attn.o_proj": Split.into((q, d)),
    }
    for mlp in ("*.mlp", "*.mlp.shared_expert"):
        splits |= {f"{mlp}.gate_proj": Split.out(), f"{mlp}.up_proj": Split.out(), f"{mlp}.down_proj": Split.into()}
    tensor = TensorPlan(
        splits=splits,
        per_rank=("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads"),
        vocab=("model.embed_tokens", "lm_head"),
    )
    return DistributedPlan(tensor=tensor, pipeline=PipelinePlan(layer_prefix="model.layers.{}."))
