# Copyright 2026 the turbospark authors. Apache-2.0.
"""Qwen 3.5's multi-token-prediction (MTP) head, the flow behind the ``mtp`` drafter.

Slot ``t`` (predicts ``x_{t+2}``), as in vLLM's and SGLang's ``qwen3_5_mtp``::

    h_t = trunk final norm (residual after the last trunk layer)    what lm_head reads
    u_t = mtp.fc( concat[ norm1p(embed(x_{t+1}); pre_fc_norm_embedding),
                          norm1p(h_t; pre_fc_norm_hidden) ] )       embedding first
    o_t = one full-attention decoder layer (the trunk's, with its own KV cache; RoPE position t)
    logits_t = lm_head(norm1p(o_t; mtp.norm))                       trunk's head (tied or not)

A chained draft feeds ``norm1p(o_t; mtp.norm)`` back as the next slot's hidden.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from turbospark_core.family import ArchConfigError, CacheSpec, KVCache, WeightStore

from turbospark_qwen.family import MLP, Args, Attention, Model, SparseMoE, norm_weight, rms_norm

PREFIX = "mtp"


class MtpLayer:
    """``mtp.layers.<i>``: a Qwen 3.5 full-attention decoder layer (gated attention, dense or MoE FFN)."""

    def __init__(self, args: Args, w: WeightStore, i: int) -> None:
        prefix = f"{PREFIX}.layers.{i}"
        self.eps = args.rms_norm_eps
        self.self_attn = Attention(args, w, f"{prefix}.self_attn")
        self.mlp = SparseMoE(args.moe, w, f"{prefix}.mlp") if args.moe else MLP(w, f"{prefix}.mlp")
        self.input_layernorm = norm_weight(w.tensor(f"{prefix}.input_layernorm.weight"))
        self.post_attention_layernorm = norm_weight(w.tensor(f"{prefix}.post_attention_layernorm.weight"))

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = x + self.self_attn(rms_norm(x, self.input_layernorm, self.eps), cache)
        return h + self.mlp(rms_norm(h, self.post_attention_layernorm, self.eps))


class MtpHead:
    """The head over the trunk's embedding, final norm and output head (the :class:`DraftHead` protocol)."""

    def __init__(self, args: Args, trunk: Model, w: WeightStore) -> None:
        if args.mtp_num_hidden_layers != 1:
            msg = (
                f"mtp_num_hidden_layers={args.mtp_num_hidden_layers}: the qwen MTP flow serves heads of one "
                f"layer (as every Qwen 3.5 / 3.6 release); open without mtp"
            )
            raise ArchConfigError(msg)
        self.args = args
        self.trunk = trunk
        # mtp_use_dedicated_embeddings: the head's own table; else the trunk's
        dedicated = w.has(f"{PREFIX}.embed_tokens.weight") or w.has(f"{PREFIX}.embed_tokens")
        self.embed_tokens = w.embedding(f"{PREFIX}.embed_tokens") if dedicated else trunk.embed_tokens
        self.fc = w.linear(f"{PREFIX}.fc")
        self.pre_fc_norm_embedding = norm_weight(w.tensor(f"{PREFIX}.pre_fc_norm_embedding.weight"))
        self.pre_fc_norm_hidden = norm_weight(w.tensor(f"{PREFIX}.pre_fc_norm_hidden.weight"))
        self.layers = [MtpLayer(args, w, i) for i in range(args.mtp_num_hidden_layers)]
        self.norm = norm_weight(w.tensor(f"{PREFIX}.norm.weight"))

    def cache_layout(self) -> list[CacheSpec]:
        return [CacheSpec.full(self.args.num_key_value_heads, self.args.head_dim) for _ in self.layers]

    def trunk_hidden(self, residual: mx.array) -> mx.array:
        return rms_norm(residual, self.trunk.norm, self.args.rms_norm_eps)

    def __call__(self, hidden: mx.array, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        eps = self.args.rms_norm_eps
        e = rms_norm(self.embed_tokens(tokens), self.pre_fc_norm_embedding, eps)
        h = rms_norm(hidden.astype(e.dtype), self.pre_fc_norm_hidden, eps)
        x = self.fc(mx.concatenate([e, h], axis=-1))
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            x = layer(x, layer_cache)
        out = rms_norm(x, self.norm, eps)
        head = self.trunk
        logits = head.embed_tokens.as_linear(out) if head.lm_head is None else head.lm_head(out)
        return logits.astype(mx.float32), out


def build_head(arch: dict[str, Any], trunk: object, weights: WeightStore) -> MtpHead:
    """The head for ``build_mtp_head`` (``trunk`` is this plugin's :class:`Model`)."""
    if not isinstance(trunk, Model):
        msg = f"the qwen MTP head needs the qwen trunk model, got {type(trunk).__name__}"
        raise ArchConfigError(msg)
    return MtpHead(Args.from_arch(arch), trunk, weights)
