# Copyright 2026 the turbospark authors. Apache-2.0.
"""The DeepSeek-V2 / V3 decoder: latent attention over a compressed cache, dense or DeepSeekMoE FFN."""

from __future__ import annotations

import mlx.core as mx

from turbospark_core.family import AttentionCache, WeightStore, rms_norm, steer

from turbospark_deepseek.args import Args
from turbospark_deepseek.mla import LatentAttention
from turbospark_deepseek.moe import MLP, MoE


class Block:
    def __init__(self, args: Args, w: WeightStore, i: int) -> None:
        prefix = f"model.layers.{i}"
        self.eps = args.rms_norm_eps
        self.self_attn = LatentAttention(args, w, f"{prefix}.self_attn")
        moe = args.moe if args.moe is not None and i in args.moe.sparse_layers else None
        self.mlp: MLP | MoE = MLP(w, f"{prefix}.mlp") if moe is None else MoE(moe, w, f"{prefix}.mlp")
        self.input_layernorm = w.tensor(f"{prefix}.input_layernorm.weight")
        self.post_attention_layernorm = w.tensor(f"{prefix}.post_attention_layernorm.weight")
        # One-token decode has fixed shapes: compile the pure parts around the cache update
        self._decode_in = mx.compile(self._query_and_row)
        self._decode_out = mx.compile(self._rest) if isinstance(self.mlp, MLP) else self._rest

    def _query_and_row(self, x: mx.array, offset: mx.array) -> tuple[mx.array, mx.array]:
        attn = self.self_attn
        h = rms_norm(x, self.input_layernorm, self.eps)
        q_nope, q_r = attn.query(h, offset)
        return attn.absorbed_query(q_nope, q_r), attn.cache_row(h, offset)

    def _rest(self, x: mx.array, attended: mx.array) -> mx.array:
        h = x + self.self_attn.output(attended)
        return h + self.mlp(rms_norm(h, self.post_attention_layernorm, self.eps))

    def __call__(self, x: mx.array, cache: AttentionCache | None) -> mx.array:
        if x.shape[1] == 1 and cache is not None:
            q, row = self._decode_in(x, mx.array(cache.offset))
            keys, _ = cache.update_and_fetch(row, row[..., :0])
            return self._decode_out(x, self.self_attn.absorbed(q, keys, cache.mask(1)))
        h = x + self.self_attn(rms_norm(x, self.input_layernorm, self.eps), cache)
        return h + self.mlp(rms_norm(h, self.post_attention_layernorm, self.eps))


class Model:
    def __init__(self, args: Args, w: WeightStore) -> None:
        self.args = args
        self.embed_tokens = w.embedding("model.embed_tokens")
        self.blocks = [Block(args, w, i) for i in range(args.num_hidden_layers)]
        self.norm = w.tensor("model.norm.weight")
        self.lm_head = None if args.tie_word_embeddings else w.linear("lm_head")
        self._derived = False

    def __call__(self, inputs: mx.array, cache: list[AttentionCache] | None = None) -> mx.array:
        if not self._derived:
            # The per-head maps cut from kv_b_proj, computed once, for the blocks this model runs: a pipeline
            # rank's list holds relays in place of other ranks' layers, whose maps are never computed
            mx.eval([a for b in self.blocks if isinstance(b, Block) for a in b.self_attn.derived])
            self._derived = True
        h = self.embed_tokens(inputs)
        for i, block in enumerate(self.blocks):
            h = steer(block(h, None if cache is None else cache[i]), i)
        h = rms_norm(h, self.norm, self.args.rms_norm_eps)
        out = self.embed_tokens.as_linear(h) if self.lm_head is None else self.lm_head(h)
        return out.astype(mx.float32)

    @property
    def layers(self) -> list[Block]:
        return self.blocks
