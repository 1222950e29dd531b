# Copyright 2026 the turbospark authors. Apache-2.0.
"""How the Gemma 4 text decoder splits across ranks: a declaration the core applies (no sharding code here)."""

from __future__ import annotations

from turbospark_core.family import DistributedPlan, PipelinePlan, Split, TensorPlan

from turbospark_gemma4.family import Args


def distributed_plan(args: Args) -> DistributedPlan:
    """Per layer: q/o by query heads, k/v by the layer's key/value heads (sliding and full layers differ in
    head size and count); MLP columns; vocabulary rows of both embeddings and the head. Pipelining keeps
    each KV-sharing layer on the rank of the layer it reads from; a block returns ``(h, kv)``."""
    splits: dict[str, Split] = {}
    q = args.num_attention_heads
    for i in range(args.num_hidden_layers):
        prefix, d, kv = f"model.layers.{i}.self_attn", args.layer_head_dim(i), args.layer_kv_heads(i)
        splits[f"{prefix}.q_proj"] = Split.out((q, d))
        splits[f"{prefix}.o_proj"] = Split.into((q, d))
        splits[f"{prefix}.k_proj"] = Split.out((kv, d))
        splits[f"{prefix}.v_proj"] = Split.out((kv, d))
    splits |= {"*.mlp.gate_proj": Split.out(), "*.mlp.up_proj": Split.out(), "*.mlp.down_proj": Split.into()}
    tensor = TensorPlan(
        splits=splits,
        per_rank=("num_attention_heads", "num_key_value_heads", "num_global_key_value_heads"),
        vocab=("model.embed_tokens", "model.embed_tokens_per_layer", "lm_head"),
    )
    tied = [(i, args.kv_source(i)) for i in range(args.num_hidden_layers) if args.kv_source(i) != i]
    pipeline = PipelinePlan(layer_prefix="model.layers.{}.", block_outputs=2, tied=tied)
    return DistributedPlan(tensor=tensor, pipeline=pipeline)
