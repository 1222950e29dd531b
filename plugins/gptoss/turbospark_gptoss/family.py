# Copyright 2026 the turbospark authors. Apache-2.0.
"""The gpt-oss decoder: sliding/full attention with learned sinks, YaRN rope, clamped-SwiGLU MoE."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import mlx.core as mx

from turbospark_core.family import (
    MAX_EXPERTS,
    MAX_FLOAT,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_INTERMEDIATE,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB,
    ROPE_TYPES,
    ArchConfigError,
    CacheSpec,
    KVCache,
    RingKVCache,
    Rope,
    WeightStore,
    causal_mask,
    choice_list_problem,
    float_problems,
    int_problems,
    rms_norm,
    rope_heads,
    rope_scaling_problems,
    steer,
)

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)
_INTS = {
    "hidden_size": MAX_HIDDEN, "num_hidden_layers": MAX_LAYERS, "num_attention_heads": MAX_HEADS,
    "num_key_value_heads": MAX_HEADS, "head_dim": MAX_HEAD_DIM, "intermediate_size": MAX_INTERMEDIATE,
    "vocab_size": MAX_VOCAB, "num_local_experts": MAX_EXPERTS, "num_experts_per_tok": MAX_EXPERTS,
}
_OPTIONAL_INTS = {"max_position_embeddings": MAX_POSITIONS, "sliding_window": MAX_POSITIONS}
_FLOATS = {"rms_norm_eps": 1.0, "swiglu_alpha": MAX_FLOAT, "swiglu_limit": MAX_FLOAT}


@attrs.frozen(kw_only=True)
class Args:
    """The flow's configuration, read from the install's arch config by :meth:`from_arch`."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = attrs.field(eq=False)
    sliding_window: int | None
    layer_types: tuple[str, ...] = attrs.field(converter=tuple)
    num_local_experts: int
    num_experts_per_tok: int
    swiglu_alpha: float
    swiglu_limit: float

    @classmethod
    def from_arch(cls, arch: dict[str, Any]) -> Args:
        """Build from an arch config.

        Raises:
            ArchConfigError: Every problem :meth:`problems` finds, each naming its key.
        """
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
            intermediate_size=arch["intermediate_size"],
            vocab_size=arch["vocab_size"],
            max_position_embeddings=arch.get("max_position_embeddings") or 131072,
            rms_norm_eps=float(arch["rms_norm_eps"]),
            rope_theta=float(arch["rope_theta"]),
            rope_scaling=arch.get("rope_scaling"),
            sliding_window=arch.get("sliding_window"),
            layer_types=arch["layer_types"],
            num_local_experts=arch["num_local_experts"],
            num_experts_per_tok=arch["num_experts_per_tok"],
            swiglu_alpha=float(arch["swiglu_alpha"]),
            swiglu_limit=float(arch["swiglu_limit"]),
        )

    @staticmethod
    def problems(arch: dict[str, Any]) -> list[str]:
        """What the flow cannot serve in ``arch`` (empty when valid), each naming the key.

        Every key :meth:`from_arch` reads is checked for its type and range first,
        so ``from_arch`` raises nothing but :class:`ArchConfigError`.
        """
        out = int_problems(arch, _INTS) + int_problems(arch, _OPTIONAL_INTS, optional=True)
        out += float_problems(arch, _FLOATS) + float_problems(arch, {"rope_theta": MAX_FLOAT}, low=1.0)
        if not out and arch["num_attention_heads"] % arch["num_key_value_heads"]:
            out.append(
                f"num_attention_heads={arch['num_attention_heads']} is not a multiple of "
                f"num_key_value_heads={arch['num_key_value_heads']}"
            )
        if not out and arch["num_experts_per_tok"] > arch["num_local_experts"]:
            out.append(
                f"num_experts_per_tok={arch['num_experts_per_tok']} exceeds "
                f"num_local_experts={arch['num_local_experts']}"
            )
        out += _layer_problems(arch)
        scaling = rope_scaling_problems(arch.get("rope_scaling"))
        if scaling:
            return out + scaling
        rope_type = (arch.get("rope_scaling") or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            out.append(f"rope_scaling type {rope_type!r} is not implemented; supported: {', '.join(ROPE_TYPES)}")
        return out

    def cache_layout(self) -> list[CacheSpec]:
        """One KV cache per layer: a ring of ``sliding_window`` tokens on sliding layers."""
        return [
            CacheSpec.sliding(self.num_key_value_heads, self.head_dim, self.sliding_window)
            if kind == SLIDING and self.sliding_window
            else CacheSpec.full(self.num_key_value_heads, self.head_dim)
            for kind in self.layer_types
        ]


def _layer_problems(arch: dict[str, Any]) -> list[str]:
    kinds = arch.get("layer_types")
    if not isinstance(kinds, (list, tuple)) or len(kinds) != arch.get("num_hidden_layers"):
        return [f"layer_types must list one kind per layer (num_hidden_layers={arch.get('num_hidden_layers')!r})"]
    problem = choice_list_problem(arch, "layer_types", len(kinds), LAYER_TYPES)
    if problem:
        return [problem]
    window = arch.get("sliding_window")
    if SLIDING in kinds and (not isinstance(window, int) or window <= 0):
        return [f"sliding_window must be a positive int for sliding_attention layers (got {window!r})"]
    return []




def clamped_swiglu(alpha: float, limit: float) -> Callable[[mx.array, mx.array], mx.array]:
    """gpt-oss's expert activation: ``(clip(up) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``."""

    def activation(gate: mx.array, up: mx.array) -> mx.array:
        gate = mx.minimum(gate, limit)
        up = mx.clip(up, -limit, limit)
        return (up + 1) * (gate * mx.sigmoid(gate * alpha))

    return activation


class Attention:
    def __init__(self, args: Args, w: WeightStore, prefix: str, window: int | None) -> None:
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.scale = args.head_dim**-0.5
        self.window = window
        self.q_proj = w.linear(f"{prefix}.q_proj")
        self.k_proj = w.linear(f"{prefix}.k_proj")
        self.v_proj = w.linear(f"{prefix}.v_proj")
        self.o_proj = w.linear(f"{prefix}.o_proj")
        self.sinks = w.tensor(f"{prefix}.sinks")
        self.rope = Rope.from_config(
            dims=args.head_dim,
            theta=args.rope_theta,
            scaling=args.rope_scaling,
            max_positions=args.max_position_embeddings,
        )

    def project(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Rotated queries and keys and the values, ``[B, heads, L, D]``."""
        proj = (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        return rope_heads(proj, self.rope, heads=self.n_heads, kv_heads=self.n_kv_heads, offset=offset)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, cache: KVCache | RingKVCache | None) -> mx.array:
        """Attention with the sinks over the cache (written first); ``[B, L, heads * D]``."""
        B, _, L, _ = q.shape
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
            mask = cache.mask(L)
        else:
            mask = causal_mask(L, self.window)
        out = mx.fast.scaled_dot_product_attention(
            q, k, v, scale=self.scale, mask=mask, sinks=self.sinks.astype(q.dtype)
        )
        return out.transpose(0, 2, 1, 3).reshape(B, L, -1)


class MoE:
    def __init__(self, args: Args, w: WeightStore, prefix: str) -> None:
        self.top_k = args.num_experts_per_tok
        self.activation = clamped_swiglu(args.swiglu_alpha, args.swiglu_limit)
        self.router = w.linear(f"{prefix}.router")
        self.experts = w.experts(f"{prefix}.experts", "gate_proj", "up_proj", "down_proj")

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """The chosen experts and their weights: a softmax over the chosen experts' logits only."""
        k = self.top_k
        logits = self.router(x).astype(mx.float32)
        inds = mx.stop_gradient(mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k])
        return inds, mx.softmax(mx.take_along_axis(logits, inds, axis=-1), axis=-1, precise=True)


class Block:
    def __init__(self, args: Args, w: WeightStore, i: int) -> None:
        prefix = f"model.layers.{i}"
        self.eps = args.rms_norm_eps
        window = args.sliding_window if args.layer_types[i] == SLIDING else None
        self.self_attn = Attention(args, w, f"{prefix}.self_attn", window)
        self.mlp = MoE(args, w, f"{prefix}.mlp")
        self.input_layernorm = w.tensor(f"{prefix}.input_layernorm.weight")
        self.post_attention_layernorm = w.tensor(f"{prefix}.post_attention_layernorm.weight")
        # One-token decode has fixed shapes: its pure parts run compiled; the cache update, the attention
        # over the cache and the routed experts (a streamed or observed bank holds Python-side state) do not
        self._decode_qkv = mx.compile(self._qkv)
        self._decode_route = mx.compile(self._route)
        self._decode_combine = mx.compile(self._combine)

    def _qkv(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return self.self_attn.project(rms_norm(x, self.input_layernorm, self.eps), offset)

    def _route(self, x: mx.array, attended: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        h = x + self.self_attn.o_proj(attended)
        normed = rms_norm(h, self.post_attention_layernorm, self.eps)
        return (h, normed, *self.mlp.route(normed))

    def _combine(self, h: mx.array, y: mx.array, weights: mx.array) -> mx.array:
        # The chosen experts' outputs [..., k, D] summed with their weights
        return h + (y * weights[..., None].astype(y.dtype)).sum(axis=-2)

    def __call__(self, x: mx.array, cache: KVCache | RingKVCache | None) -> mx.array:
        decode = x.shape[1] == 1 and cache is not None
        offset = 0 if cache is None else cache.offset
        q, k, v = self._decode_qkv(x, mx.array(offset)) if decode else self._qkv(x, offset)
        attended = self.self_attn.attend(q, k, v, cache)
        h, normed, inds, weights = (self._decode_route if decode else self._route)(x, attended)
        y = self.mlp.experts.glu(normed, inds, self.mlp.activation, weights=weights)
        return (self._decode_combine if decode else self._combine)(h, y, weights)


class Model:
    def __init__(self, args: Args, w: WeightStore) -> None:
        self.args = args
        self.embed_tokens = w.embedding("model.embed_tokens")
        self.blocks = [Block(args, w, i) for i in range(args.num_hidden_layers)]
        self.norm = w.tensor("model.norm.weight")
        # Tied head unless the install carries its own lm_head
        self.lm_head = w.linear("lm_head") if w.has("lm_head.weight") or w.has("lm_head") else None

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        h = self.embed_tokens(inputs)
        for i, block in enumerate(self.blocks):
            h = steer(block(h, None if cache is None else cache[i]), i)
        h = rms_norm(h, self.norm, self.args.rms_norm_eps)
        out = self.embed_tokens.as_linear(h) if self.lm_head is None else self.lm_head(h)
        return out.astype(mx.float32)

    @property
    def layers(self) -> list[Block]:
        return self.blocks
