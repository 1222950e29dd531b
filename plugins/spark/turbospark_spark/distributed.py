# Copyright 2026 the turbospark authors. Apache-2.0.
"""How the Spark 2.5 decoder splits across ranks: a declaration the core applies (no sharding code here)."""

from __future__ import annotations

from turbospark_core.family import DistributedPlan, PipelinePlan, Split, TensorPlan

from turbospark_spark.family import Args


def distributed_plan(args: Args) -> DistributedPlan:
    """The fused ``[q | k | v]`` projection by its three sections' heads, the head-wise output gate
    (one row per query head) and the output projection by query heads, MLP columns, vocabulary rows;
    layers for pipelining.

    Everything per head stays on the head's rank: the partial rotary dims, the
    sliding or full mask and the sigmoid gate act within each head, so a rank's
    heads compute exactly what one process computes for them.
    """
    q, kv, d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    tensor = TensorPlan(
        splits={
            "*.self_attn.q_k_v_proj": Split.out((q, d), (kv, d), (kv, d)),
            "*.self_attn.g_proj": Split.out((q, 1)),
            "*.self_attn.out_proj": Split.into((q, d)),
            "*.mlp.gate_proj": Split.out(),
            "*.mlp.up_proj": Split.out(),
            "*.mlp.down_proj": Split.into(),
        },
        per_rank=("num_attention_heads", "num_key_value_heads"),
        vocab=("model.embedding", "lm_head"),
    )
    return DistributedPlan(tensor=tensor, pipeline=PipelinePlan(layer_prefix="model.layers.{}."))
