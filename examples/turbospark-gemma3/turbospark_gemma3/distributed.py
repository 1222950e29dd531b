# Copyright 2026 the turbospark-gemma3 authors. Apache-2.0.
"""How the Gemma 3 text decoder splits across ranks: a declaration turbospark applies (no sharding code here)."""

from __future__ import annotations

from turbospark_core.family import DistributedPlan, PipelinePlan, Split, TensorPlan

from turbospark_gemma3.family import Args


def distributed_plan(args: Args) -> DistributedPlan:
    """q/k/v by heads and o by query heads (column- then row-parallel), GeGLU columns, vocabulary rows of
    the (tied) embedding and of an install's own head; layers for pipelining.

    The q/k norms, the rope and the sliding or global mask act within each
    head, so a rank's heads compute exactly what one process computes for
    them; fewer key/value heads than ranks are replicated by turbospark.
    """
    q, kv, d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    tensor = TensorPlan(
        splits={
            "*.self_attn.q_proj": Split.out((q, d)),
            "*.self_attn.k_proj": Split.out((kv, d)),
            "*.self_attn.v_proj": Split.out((kv, d)),
            "*.self_attn.o_proj": Split.into((q, d)),
            "*.mlp.gate_proj": Split.out(),
            "*.mlp.up_proj": Split.out(),
            "*.mlp.down_proj": Split.into(),
        },
        per_rank=("num_attention_heads", "num_key_value_heads"),
        vocab=("model.embed_tokens", "lm_head"),
    )
    return DistributedPlan(tensor=tensor, pipeline=PipelinePlan(layer_prefix="model.layers.{}."))
