# Copyright 2026 the turbospark authors. Apache-2.0.
"""How the Llama-style decoder splits across ranks: a declaration the core applies (no sharding code here)."""

from __future__ import annotations

from turbospark_core.family import DistributedPlan, PipelinePlan, Split, TensorPlan

from turbospark_llama.family import Args


def distributed_plan(args: Args) -> DistributedPlan:
    """Heads of q/k/v (column-parallel) and o (row-parallel), MLP columns, vocabulary rows; layers for pipelining.

    ``qk_norm="full"`` normalizes each token's whole query and key rows, over
    every head: a rank holding some heads cannot, so tensor parallelism is refused.
    """
    pipeline = PipelinePlan(layer_prefix="model.layers.{}.")
    if args.qk_norm == "full":
        refusal = (
            "qk_norm='full' normalizes each token's query and key rows over all heads, "
            "which tensor parallelism splits across ranks"
        )
        return DistributedPlan(tensor_refusal=refusal, pipeline=pipeline)
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
    return DistributedPlan(tensor=tensor, pipeline=pipeline)
