"""The flow: RMSNorm, rotary attention over the core's KV caches, SwiGLU MLP, tied head."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from turbospark_core.family import FamilyContext, Rope

KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta")
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")


class Model:
    def __init__(self, context: FamilyContext) -> None:
        arch, w = context.arch, context.weights
        self.heads, self.kv_heads = arch["num_attention_heads"], arch["num_key_value_heads"]
        self.eps = arch["rms_norm_eps"]
        head_dim = arch["hidden_size"] // self.heads
        self.rope = Rope.from_config(dims=head_dim, theta=arch["rope_theta"], scaling=None,
                                     max_positions=arch["max_position_embeddings"])
        self.embed = w.embedding("model.embed_tokens")
        self.norm = w.tensor("model.norm.weight")
        self.layers = [{**{n: w.linear(f"model.layers.{i}.{n}") for n in LINEARS},
                        **{n: w.tensor(f"model.layers.{i}.{n}.weight") for n in NORMS}}
                       for i in range(arch["num_hidden_layers"])]

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        h = self.embed(inputs)
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else cache[i]
            h = h + self.attention(layer, mx.fast.rms_norm(h, layer["input_layernorm"], self.eps), layer_cache)
            x = mx.fast.rms_norm(h, layer["post_attention_layernorm"], self.eps)
            gate = layer["mlp.gate_proj"](x)
            h = h + layer["mlp.down_proj"](gate * mx.sigmoid(gate) * layer["mlp.up_proj"](x))
        return self.embed.as_linear(mx.fast.rms_norm(h, self.norm, self.eps)).astype(mx.float32)

    def attention(self, layer: dict[str, Any], x: mx.array, cache: Any) -> mx.array:
        B, L, _ = x.shape
        q, k, v = (layer[f"self_attn.{p}_proj"](x).reshape(B, L, n, -1).transpose(0, 2, 1, 3)
                   for p, n in (("q", self.heads), ("k", self.kv_heads), ("v", self.kv_heads)))
        offset = 0 if cache is None else cache.offset
        q, k, mask = self.rope(q, offset), self.rope(k, offset), "causal" if L > 1 else None
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
            mask = cache.mask(L)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask)
        return layer["self_attn.o_proj"](out.transpose(0, 2, 1, 3).reshape(B, L, -1))
