# Copyright 2026 the turbospark-gemma3 authors. Apache-2.0.
"""The Gemma 3 text decoder: sliding/global attention with q/k norms, sandwich norms, GELU-tanh MLP."""

from __future__ import annotations

import math
from typing import Any

import attrs
import mlx.core as mx

from turbospark_core.family import (
    MAX_FLOAT,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB,
    ArchConfigError,
    CacheSpec,
    KVCache,
    Linear,
    RingKVCache,
    Rope,
    WeightStore,
    attention,
    cached_attention,
    causal_mask,
    choice_list_problem,
    float_problems,
    fuse_linears,
    fused_layer,
    fused_parts,
    gelu_tanh_mul,
    int_problems,
    linear_gated,
    linear_normed,
    linear_plus,
    rms_norm,
    rope_heads,
    rope_scaling_problems,
    steer,
)

SLIDING, FULL = "sliding_attention", "full_attention"
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
_INTS = {
    "hidden_size": MAX_HIDDEN, "num_hidden_layers": MAX_LAYERS, "num_attention_heads": MAX_HEADS,
    "num_key_value_heads": MAX_HEADS, "head_dim": MAX_HEAD_DIM, "vocab_size": MAX_VOCAB,
    "sliding_window": MAX_POSITIONS,
}  # fmt: skip
_FLOATS = {"rms_norm_eps": 1.0, "query_pre_attn_scalar": MAX_FLOAT}
_ROPE_BASES = {"rope_theta": MAX_FLOAT, "rope_local_base_freq": MAX_FLOAT}  # above 1


@attrs.frozen(kw_only=True)
class Args:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    query_pre_attn_scalar: float
    sliding_window: int
    layer_types: tuple[str, ...] = attrs.field(converter=tuple)
    rope_theta: float
    rope_local_base_freq: float
    rope_scaling: dict[str, Any] | None = attrs.field(eq=False)
    max_position_embeddings: int
    final_logit_softcapping: float | None
    norm_adds_one: bool

    @classmethod
    def from_arch(cls, arch: dict[str, Any]) -> Args:
        problems = cls.problems(arch)
        if problems:
            raise ArchConfigError("; ".join(problems))
        return cls(
            model_type=arch["model_type"],
            hidden_size=arch["hidden_size"],
            num_hidden_layers=arch["num_hidden_layers"],
            num_attention_heads=arch["num_attention_heads"],
            num_key_value_heads=arch["num_key_value_heads"],
            head_dim=arch["head_dim"],
            vocab_size=arch["vocab_size"],
            rms_norm_eps=float(arch["rms_norm_eps"]),
            query_pre_attn_scalar=float(arch["query_pre_attn_scalar"]),
            sliding_window=arch["sliding_window"],
            layer_types=arch["layer_types"],
            rope_theta=float(arch["rope_theta"]),
            rope_local_base_freq=float(arch["rope_local_base_freq"]),
            rope_scaling=arch.get("rope_scaling"),
            max_position_embeddings=arch.get("max_position_embeddings") or 131072,
            final_logit_softcapping=arch.get("final_logit_softcapping"),
            norm_adds_one=bool(arch["norm_adds_one"]),
        )

    @staticmethod
    def problems(arch: dict[str, Any]) -> list[str]:
        out = int_problems(arch, _INTS) + int_problems(arch, {"max_position_embeddings": MAX_POSITIONS}, optional=True)
        out += float_problems(arch, _FLOATS) + float_problems(arch, _ROPE_BASES, low=1.0)
        out += float_problems(arch, {"final_logit_softcapping": MAX_FLOAT}, optional=True)
        out += rope_scaling_problems(arch.get("rope_scaling"))
        if not out and arch["num_attention_heads"] % arch["num_key_value_heads"]:
            out.append(
                f"num_attention_heads={arch['num_attention_heads']} is not a multiple of "
                f"num_key_value_heads={arch['num_key_value_heads']}"
            )
        types = arch.get("layer_types")
        if choice_list_problem(arch, "layer_types", arch.get("num_hidden_layers"), (SLIDING, FULL)):
            out.append(f"layer_types must list {SLIDING!r}/{FULL!r} once per layer (got {types!r:.80})")
        if arch.get("hidden_activation") not in ACTIVATIONS:
            out.append(f"hidden_activation {arch.get('hidden_activation')!r} is not one of {ACTIVATIONS}")
        if arch.get("attn_logit_softcapping") is not None:
            out.append(f"attn_logit_softcapping={arch['attn_logit_softcapping']!r} is not supported (Gemma 2 style)")
        if arch.get("use_bidirectional_attention"):
            out.append("use_bidirectional_attention=True (an encoder variant) is not supported")
        if arch.get("rope_local_scaling") is not None:
            out.append(f"rope scaling on sliding layers {arch['rope_local_scaling']!r} is not supported")
        if not isinstance(arch.get("norm_adds_one"), bool):
            out.append(f"norm_adds_one must be true or false (got {arch.get('norm_adds_one')!r})")
        return out

    def cache_layout(self) -> list[CacheSpec]:
        """One KV cache per layer: a ring of ``sliding_window`` tokens on sliding layers."""
        n_kv, head_dim = self.num_key_value_heads, self.head_dim
        return [
            CacheSpec.sliding(n_kv, head_dim, self.sliding_window)
            if kind == SLIDING
            else CacheSpec.full(n_kv, head_dim)
            for kind in self.layer_types
        ]


class RMSNorm:
    """Gemma's RMSNorm: normalize in float32, scale by (1 + w) computed in float32."""

    def __init__(self, w: WeightStore, name: str, eps: float, adds_one: bool) -> None:
        weight = w.tensor(name).astype(mx.float32)
        self.weight = 1.0 + weight if adds_one else weight
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x.astype(mx.float32), self.weight, self.eps).astype(x.dtype)

    def into(self, linear: Linear, x: mx.array) -> mx.array:
        """``linear(self(x))``: float32 activations are normalized inside a quantized product (one op)."""
        return linear_normed(linear, x, self.weight, self.eps) if x.dtype == mx.float32 else linear(self(x))

    def after(self, y: mx.array, residual: mx.array) -> mx.array:
        """``residual`` plus ``self(y)`` (a sandwich norm's residual add)."""
        return _residual(residual, self(y))

    def fold(self, residual: mx.array) -> tuple[mx.array, float] | None:
        """This norm as a product's ``post_norm`` where it may run inside it: float32 activations."""
        return (self.weight, self.eps) if residual.dtype == mx.float32 else None


class Attention:
    def __init__(self, args: Args, w: WeightStore, prefix: str, sliding: bool) -> None:
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.query_pre_attn_scalar**-0.5
        self.window = args.sliding_window if sliding else None
        self.q_proj = w.linear(f"{prefix}.q_proj")
        self.k_proj = w.linear(f"{prefix}.k_proj")
        self.v_proj = w.linear(f"{prefix}.v_proj")
        self.o_proj = w.linear(f"{prefix}.o_proj")
        # one multiply for q, k and v where they are held alike (the separate ones become views)
        self.qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        self.sizes = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
        if self.qkv is not None:
            self.q_proj, self.k_proj, self.v_proj = fused_parts(self.qkv, self.sizes)
        self.q_norm = RMSNorm(w, f"{prefix}.q_norm.weight", args.rms_norm_eps, args.norm_adds_one)
        self.k_norm = RMSNorm(w, f"{prefix}.k_norm.weight", args.rms_norm_eps, args.norm_adds_one)
        # Local layers rotate with their own base and no scaling
        self.rope = Rope.from_config(
            dims=args.head_dim,
            theta=args.rope_local_base_freq if sliding else args.rope_theta,
            scaling=None if sliding else args.rope_scaling,
            max_positions=args.max_position_embeddings,
        )

    def __call__(self, x: mx.array, cache: KVCache | RingKVCache | None, norm: RMSNorm, post: RMSNorm) -> mx.array:
        """``x`` plus ``post`` of the attention of ``norm(x)``."""
        L = x.shape[1]
        offset = 0 if cache is None else cache.offset
        q, k, v = self.heads(x, offset, norm)
        if cache is None:
            attended = attention(q, k, v, scale=self.scale, mask=causal_mask(L, self.window), merge_heads=True)
        else:
            attended = cached_attention(q, k, v, cache, scale=self.scale, merge_heads=True)
        folded = post.fold(x)
        if folded is not None:
            return linear_plus(self.o_proj, attended, x, post_norm=folded)
        return post.after(self.o_proj(attended), x)

    def heads(self, x: mx.array, offset: int, norm: RMSNorm) -> tuple[mx.array, mx.array, mx.array]:
        """q, k, v ``[B, H, L, D]`` of ``norm(x)``: q and k normalized per head, then rotated."""
        if self.qkv is not None:
            proj: mx.array | tuple[mx.array, mx.array, mx.array] = norm.into(self.qkv, x)
        else:
            normed = norm(x)
            proj = (self.q_proj(normed), self.k_proj(normed), self.v_proj(normed))
        if x.dtype == mx.float32:  # the norms' own dtype: one op (native on the CPU) does it all
            norms = (self.q_norm.weight, self.k_norm.weight)
            return rope_heads(
                proj, self.rope, heads=self.n_heads, kv_heads=self.n_kv_heads, offset=offset, norms=norms,
                eps=self.q_norm.eps,
            )  # fmt: skip
        # narrower activations: Gemma normalizes in float32 and narrows after
        B, L, _ = x.shape
        splits = [self.sizes[0], self.sizes[0] + self.sizes[1]]
        q, k, v = mx.split(proj, splits, axis=-1) if isinstance(proj, mx.array) else proj
        q = self.q_norm(q.reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        k = self.k_norm(k.reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(q, offset), self.rope(k, offset), v




class MLP:
    def __init__(self, w: WeightStore, prefix: str) -> None:
        self.gate_proj = w.linear(f"{prefix}.gate_proj")
        self.up_proj = w.linear(f"{prefix}.up_proj")
        self.down_proj = w.linear(f"{prefix}.down_proj")
        self.gate_up = fuse_linears([self.gate_proj, self.up_proj])
        if self.gate_up is not None:
            sizes = [self.gate_proj.out_features, self.up_proj.out_features]
            self.gate_proj, self.up_proj = fused_parts(self.gate_up, sizes)

    def __call__(self, x: mx.array, norm: RMSNorm, post: RMSNorm) -> mx.array:
        """``x`` plus ``post`` of the MLP of ``norm(x)`` (float32 activations: norms, GeGLU and add in the products)."""
        folded = post.fold(x)
        if self.gate_up is not None and folded is not None:
            return linear_gated(self.down_proj, norm.into(self.gate_up, x), "gelu_tanh_mul", x, post_norm=folded)
        if self.gate_up is not None:
            return post.after(self.down_proj(gelu_tanh_mul(norm.into(self.gate_up, x))), x)
        normed = norm(x)
        return post.after(self.down_proj(gelu_tanh_mul(self.gate_proj(normed), self.up_proj(normed))), x)


def _residual(x: mx.array, y: mx.array) -> mx.array:
    if x.dtype != mx.float16:
        return x + y
    # Gemma's activations overflow float16: add in float32 and clip
    bound = mx.finfo(mx.float16).max
    return mx.clip(x.astype(mx.float32) + y.astype(mx.float32), -bound, bound).astype(mx.float16)


class Block:
    def __init__(self, args: Args, w: WeightStore, i: int) -> None:
        prefix = f"model.layers.{i}"
        self.sliding = args.layer_types[i] == SLIDING
        self.self_attn = Attention(args, w, f"{prefix}.self_attn", self.sliding)
        self.mlp = MLP(w, f"{prefix}.mlp")

        def norm(name: str) -> RMSNorm:
            return RMSNorm(w, f"{prefix}.{name}.weight", args.rms_norm_eps, args.norm_adds_one)

        self.input_layernorm = norm("input_layernorm")
        self.post_attention_layernorm = norm("post_attention_layernorm")
        self.pre_feedforward_layernorm = norm("pre_feedforward_layernorm")
        self.post_feedforward_layernorm = norm("post_feedforward_layernorm")
        self._decode_ffn = mx.compile(self._ffn)  # one-token steps have fixed shapes
        # quantized matrices on the CPU: the whole step (sandwich norms and all) as one native op
        attn = self.self_attn
        self._fused = fused_layer(
            input_norm=self.input_layernorm.weight,
            qkv=attn.qkv if attn.qkv is not None else (attn.q_proj, attn.k_proj, attn.v_proj),
            o_proj=attn.o_proj, mlp_norm=self.pre_feedforward_layernorm.weight, gate_up=self.mlp.gate_up,
            down=self.mlp.down_proj, heads=attn.n_heads, kv_heads=attn.n_kv_heads, rope=attn.rope, scale=attn.scale,
            eps=args.rms_norm_eps, activation="gelu_tanh_mul", head_norms=(attn.q_norm.weight, attn.k_norm.weight),
            post_attention_norm=self.post_attention_layernorm.weight,
            post_mlp_norm=self.post_feedforward_layernorm.weight,
        )  # fmt: skip

    def _ffn(self, h: mx.array) -> mx.array:
        return self.mlp(h, self.pre_feedforward_layernorm, self.post_feedforward_layernorm)

    def __call__(self, x: mx.array, cache: KVCache | RingKVCache | None) -> mx.array:
        if self._fused is not None and cache is not None:
            y = self._fused(x, cache)
            if y is not None:
                return y
        h = self.self_attn(x, cache, self.input_layernorm, self.post_attention_layernorm)
        return self._decode_ffn(h) if x.shape[1] == 1 else self._ffn(h)


class Model:
    def __init__(self, args: Args, w: WeightStore) -> None:
        self.args = args
        self.embed_tokens = w.embedding("model.embed_tokens")
        # sqrt(hidden) as a float32 scalar, narrowed to the activations' dtype (as transformers does)
        self.embed_scale = mx.array(math.sqrt(args.hidden_size), mx.float32)
        self.blocks = [Block(args, w, i) for i in range(args.num_hidden_layers)]
        for block, following in zip(self.blocks, self.blocks[1:], strict=False):
            if block._fused is not None:
                block._fused.read_ahead(following._fused)
        self.norm = RMSNorm(w, "model.norm.weight", args.rms_norm_eps, args.norm_adds_one)
        # Tied head unless the install carries its own lm_head
        self.lm_head = w.linear("lm_head") if w.has("lm_head.weight") or w.has("lm_head") else None
        mx.eval(self._norm_weights())

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        h = self.embed_tokens(inputs)
        h = h * self.embed_scale.astype(h.dtype)
        for i, block in enumerate(self.blocks):
            h = steer(block(h, None if cache is None else cache[i]), i)
        h = self.norm(h)
        out = self.embed_tokens.as_linear(h) if self.lm_head is None else self.lm_head(h)
        out = out.astype(mx.float32)
        cap = self.args.final_logit_softcapping
        return out if cap is None else mx.tanh(out / cap) * cap

    def _norm_weights(self) -> list[mx.array]:
        # (1 + w) once at build, not on every forward
        out = [self.norm.weight]
        for b in self.blocks:
            norms = (b.input_layernorm, b.post_attention_layernorm, b.pre_feedforward_layernorm,
                     b.post_feedforward_layernorm, b.self_attn.q_norm, b.self_attn.k_norm)
            out += [n.weight for n in norms]
        return out

    @property
    def layers(self) -> list[Block]:
        return self.blocks
