# Copyright 2026 the turbospark authors. Apache-2.0.
"""How gpt-oss splits across ranks: a declaration the core applies (no sharding code here)."""

from __future__ import annotations

from turbospark_core.family import DistributedPlan, PipelinePlan, Split, TensorPlan

from turbospark_gptoss.family import Args


def distributed_plan(args: Args) -> DistributedPlan:
    """q/k/v (with their biases) and the attention sinks by head, o by query heads (its bias added once);
    vocabulary rows; the experts are split by expert by the core. Layers for pipelining."""
    q, kv, d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    tensor = TensorPlan(
        splits={
            "*.self_attn.q_proj": Split.out((q, d)),
            "*.self_attn.k_proj": Split.out((kv, d)),
            "*.self_attn.v_proj": Split.out((kv, d)),
            "*.self_attn.o_proj": Split.into((q, d)),
            "*.self_attn.sinks": Split.out((q, 1)),
        },
        per_rank=("num_attention_heads", "num_key_value_heads"),
        vocab=("model.embed_tokens", "lm_head"),
    )
    return DistributedPlan(tensor=tensor, pipeline=PipelinePlan(layer_prefix="model.layers.{}."))
