# Copyright 2026 the turbospark authors. Apache-2.0.
"""How the DeepSeek decoder splits across ranks: a declaration the core applies (no sharding code here)."""

from __future__ import annotations

from turbospark_core.family import DistributedPlan, PipelinePlan, Split, TensorPlan

from turbospark_deepseek.args import Args


def distributed_plan(args: Args) -> DistributedPlan:
    """Latent attention by query heads, MLP and shared-expert columns, vocabulary rows; layers for pipelining.

    Tensor parallelism: the per-head maps split by heads: the query projection
    (``q_proj``, or ``q_b_proj`` after the replicated low-rank ``q_a_proj``;
    rows per head ``[q_nope | q_rope]``), the latent up-projection
    ``kv_b_proj`` (rows per head ``[k_nope | v]``) and the output projection
    (``o_proj``, row-parallel, summed over the ranks). The latent
    down-projection ``kv_a_proj_with_mqa``, its norm and so the cache row
    ``[c | k_r]`` are shared by every head, so every rank computes and holds
    them whole (the cache is one key row per token, not split). Both forms of
    the attention act per head on that shared row: absorbed (each head's
    ``W_UK`` folded into its query, ``W_UV`` after attention) and expanded
    (each head's keys and values rebuilt from the latents), and the choice
    between them counts per-head work, so a rank's heads compute exactly what
    one process computes for them; only ``o_proj``'s sum over heads (and the
    MLPs' sums) is reordered. Routers are replicated; routed experts are split
    by expert by the core, the shared experts (one MLP of their summed width)
    by columns like the dense MLPs.
    """
    q, dq, kv = args.num_attention_heads, args.q_head_dim, args.qk_nope_head_dim + args.v_head_dim
    query = "*.self_attn.q_proj" if args.q_lora_rank is None else "*.self_attn.q_b_proj"
    splits = {
        query: Split.out((q, dq)),
        "*.self_attn.kv_b_proj": Split.out((q, kv)),
        "*.self_attn.o_proj": Split.into((q, args.v_head_dim)),
    }
    for mlp in ("*.mlp", "*.mlp.shared_experts"):
        splits |= {f"{mlp}.gate_proj": Split.out(), f"{mlp}.up_proj": Split.out(), f"{mlp}.down_proj": Split.into()}
    tensor = TensorPlan(splits=splits, per_rank=("num_attention_heads",), vocab=("model.embed_tokens", "lm_head"))
    return DistributedPlan(tensor=tensor, pipeline=PipelinePlan(layer_prefix="model.layers.{}."))
