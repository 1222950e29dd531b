# Copyright 2026 the turbospark authors. Apache-2.0.
"""The Spark 2.5 decoder: fused QKV, per-layer-type RoPE, head-wise sigmoid output gate, GELU MLP."""

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
    MAX_INTERMEDIATE,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB,
    ROPE_TYPES,
    ArchConfigError,
    AttentionCache,
    CacheSpec,
    Rope,
    WeightStore,
    attention,
    cached_attention,
    causal_mask,
    float_problems,
    int_problems,
    is_int,
    is_number,
    rms_norm,
    rope_heads,
    rope_scaling_problems,
    steer,
)

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)
ACTIVATIONS = ("gelu",)  # Hugging Face "gelu" is the exact erf form
GATE_MODES = ("sigmoid",)
_INTS = {
    "hidden_size": MAX_HIDDEN, "num_hidden_layers": MAX_LAYERS, "num_attention_heads": MAX_HEADS,
    "num_key_value_heads": MAX_HEADS, "head_dim": MAX_HEAD_DIM, "intermediate_size": MAX_INTERMEDIATE,
    "vocab_size": MAX_VOCAB, "sliding_window": MAX_POSITIONS,
}  # fmt: skip
_OPTIONAL_INTS = {"max_position_embeddings": MAX_POSITIONS}


@attrs.frozen(kw_only=True)
class RopeArgs:
    rope_theta: float
    rotary_dim: int
    rope_scaling: dict[str, Any] | None = attrs.field(default=None, eq=False)

    @classmethod
    def from_arch(cls, rope: dict[str, Any]) -> RopeArgs:
        """One layer type's entry of the arch's ``rope`` section."""
        return cls(
            rope_theta=float(rope["rope_theta"]),
            rotary_dim=rope["rotary_dim"],
            rope_scaling=rope.get("rope_scaling"),
        )


@attrs.frozen(kw_only=True)
class Args:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    sliding_window: int
    layer_types: tuple[str, ...] = attrs.field(converter=tuple)
    rope: dict[str, RopeArgs] = attrs.field(eq=False)
    tie_word_embeddings: bool

    @classmethod
    def from_arch(cls, arch: dict[str, Any]) -> Args:
        """Build from an install's arch config, refusing (by name) what the flow does not implement.

        Raises:
            ArchConfigError: Every problem :meth:`problems` finds, joined.
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
            rms_norm_eps=float(arch["rms_norm_eps"]),
            max_position_embeddings=arch.get("max_position_embeddings") or 8192,
            sliding_window=arch["sliding_window"],
            layer_types=arch["layer_types"],
            rope={kind: RopeArgs.from_arch(arch["rope"][kind]) for kind in set(arch["layer_types"])},
            tie_word_embeddings=bool(arch["tie_word_embeddings"]),
        )

    @staticmethod
    def problems(arch: dict[str, Any]) -> list[str]:
        """What in ``arch`` the flow does not implement, each naming the key and what is supported."""
        out = int_problems(arch, _INTS) + int_problems(arch, _OPTIONAL_INTS, optional=True)
        out += float_problems(arch, {"rms_norm_eps": 1.0})
        if not out and arch["num_attention_heads"] % arch["num_key_value_heads"]:
            out.append(
                f"num_attention_heads={arch['num_attention_heads']} is not a multiple of "
                f"num_key_value_heads={arch['num_key_value_heads']}"
            )
        if arch.get("hidden_act") not in ACTIVATIONS:
            out.append(f"hidden_act={arch.get('hidden_act')!r} is not implemented; supported: 'gelu' (exact erf)")
        if arch.get("gate_attn_act_mode") not in GATE_MODES:
            out.append(
                f"gate_attn_act_mode={arch.get('gate_attn_act_mode')!r} is not implemented; supported: 'sigmoid'"
            )
        if arch.get("headwise_attn_output_gate") is not True:
            out.append(
                f"headwise_attn_output_gate={arch.get('headwise_attn_output_gate')!r}: only the head-wise "
                f"output gate (one scalar per head from g_proj) is implemented"
            )
        if not isinstance(arch.get("tie_word_embeddings"), bool):
            out.append(f"tie_word_embeddings must be true or false (got {arch.get('tie_word_embeddings')!r})")
        return out + _layer_problems(arch)

    def cache_layout(self) -> list[CacheSpec]:
        """One KV cache per layer: a ring of ``sliding_window`` tokens on sliding layers."""
        n, d = self.num_key_value_heads, self.head_dim
        return [
            CacheSpec.sliding(n, d, self.sliding_window) if kind == SLIDING else CacheSpec.full(n, d)
            for kind in self.layer_types
        ]


def _layer_problems(arch: dict[str, Any]) -> list[str]:
    kinds = arch.get("layer_types")
    if not isinstance(kinds, (list, tuple)) or len(kinds) != arch.get("num_hidden_layers"):
        return [f"layer_types must list one type per layer ({arch.get('num_hidden_layers')!r}), got {kinds!r}"]
    unknown = sorted({repr(k) for k in kinds if not isinstance(k, str) or k not in LAYER_TYPES})
    if unknown:
        return [f"layer type(s) {', '.join(unknown)[:200]} not implemented; supported: {', '.join(LAYER_TYPES)}"]
    given = arch.get("rope")
    rope: dict[str, Any] = given if isinstance(given, dict) else {}
    return [p for kind in sorted(set(kinds)) for p in _rope_problems(kind, rope.get(kind), arch.get("head_dim"))]


def _rope_problems(kind: str, rope: Any, head_dim: Any) -> list[str]:
    if not isinstance(rope, dict):
        return [f"no rope parameters for layer type {kind!r} (rope_parameters[{kind!r}] is missing)"]
    out = []
    theta, dims = rope.get("rope_theta"), rope.get("rotary_dim")
    if not is_number(theta) or not 1 < theta <= MAX_FLOAT:
        out.append(f"{kind} rope_theta must be a finite number above 1 (got {theta!r})")
    limit = head_dim if is_int(head_dim) else 0
    if not is_int(dims) or dims <= 0 or dims % 2 or dims > limit:
        out.append(
            f"{kind} rotary dims {dims!r} (head_dim x partial_rotary_factor) must be a positive even "
            f"number <= head_dim={head_dim!r}"
        )
    scaling_problems = rope_scaling_problems(rope.get("rope_scaling"), f"{kind} rope_scaling")
    if scaling_problems:
        return out + scaling_problems
    scaling = rope.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        out.append(f"{kind} rope_type {rope_type!r} is not implemented; supported: {', '.join(ROPE_TYPES)}")
    return out




class Attention:
    def __init__(self, args: Args, w: WeightStore, prefix: str, kind: str) -> None:
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.scale = args.head_dim**-0.5
        self.q_k_v_proj = w.linear(f"{prefix}.q_k_v_proj")
        self.g_proj = w.linear(f"{prefix}.g_proj")
        self.out_proj = w.linear(f"{prefix}.out_proj")
        rope = args.rope[kind]
        self.rope = Rope.from_config(
            dims=rope.rotary_dim,
            theta=rope.rope_theta,
            scaling=rope.rope_scaling,
            max_positions=args.max_position_embeddings,
        )

    def project(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Rotated queries and keys, values (``[B, heads, L, D]``) and the output gate's logits (one per head)."""
        q, k, v = rope_heads(
            self.q_k_v_proj(x), self.rope, heads=self.n_heads, kv_heads=self.n_kv_heads, offset=offset
        )
        return q, k, v, self.g_proj(x)

    def attend(
        self, q: mx.array, k: mx.array, v: mx.array, mask: mx.array | str | None, cache: AttentionCache | None
    ) -> mx.array:
        """Attention over the cache (written first); ``[B, L, heads, D]``."""
        if cache is not None:
            return cached_attention(q, k, v, cache, scale=self.scale).transpose(0, 2, 1, 3)
        return attention(q, k, v, scale=self.scale, mask=mask).transpose(0, 2, 1, 3)

    def output(self, attended: mx.array, gate: mx.array) -> mx.array:
        B, L, _, _ = attended.shape
        # One sigmoid gate per head, computed in float32
        gate = mx.sigmoid(gate.astype(mx.float32)).astype(attended.dtype)
        return self.out_proj((attended * gate[..., None]).reshape(B, L, -1))


def gelu(x: mx.array) -> mx.array:
    return 0.5 * x * (1.0 + mx.erf(x * (1.0 / math.sqrt(2.0))))


class MLP:
    def __init__(self, w: WeightStore, prefix: str) -> None:
        self.gate_proj = w.linear(f"{prefix}.gate_proj")
        self.up_proj = w.linear(f"{prefix}.up_proj")
        self.down_proj = w.linear(f"{prefix}.down_proj")

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(gelu(self.gate_proj(x)) * self.up_proj(x))


class Block:
    def __init__(self, args: Args, w: WeightStore, i: int) -> None:
        prefix = f"model.layers.{i}"
        self.eps = args.rms_norm_eps
        self.self_attn = Attention(args, w, f"{prefix}.self_attn", args.layer_types[i])
        self.mlp = MLP(w, f"{prefix}.mlp")
        self.input_layernorm = w.tensor(f"{prefix}.input_layernorm.weight")
        self.post_attention_layernorm = w.tensor(f"{prefix}.post_attention_layernorm.weight")
        # One-token decode has fixed shapes: its pure parts run compiled; the cache update and the
        # attention over the cache do not
        self._decode_qkv = mx.compile(self._qkv)
        self._decode_rest = mx.compile(self._rest)

    def _qkv(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        return self.self_attn.project(rms_norm(x, self.input_layernorm, self.eps), offset)

    def _rest(self, x: mx.array, attended: mx.array, gate: mx.array) -> mx.array:
        h = x + self.self_attn.output(attended, gate)
        return h + self.mlp(rms_norm(h, self.post_attention_layernorm, self.eps))

    def __call__(self, x: mx.array, mask: mx.array | str | None, cache: AttentionCache | None) -> mx.array:
        decode = x.shape[1] == 1 and cache is not None
        offset = 0 if cache is None else cache.offset
        q, k, v, gate = self._decode_qkv(x, mx.array(offset)) if decode else self._qkv(x, offset)
        attended = self.self_attn.attend(q, k, v, mask, cache)
        return (self._decode_rest if decode else self._rest)(x, attended, gate)


class Model:
    def __init__(self, args: Args, w: WeightStore) -> None:
        self.args = args
        self.embedding = w.embedding("model.embedding")
        self.blocks = [Block(args, w, i) for i in range(args.num_hidden_layers)]
        self.sliding = [kind == SLIDING for kind in args.layer_types]  # per layer (not read from the blocks)
        self.norm = w.tensor("model.norm.weight")
        self.lm_head = None if args.tie_word_embeddings else w.linear("lm_head")

    def __call__(self, inputs: mx.array, cache: list[AttentionCache] | None = None) -> mx.array:
        h = self.embedding(inputs)
        L = h.shape[1]
        # Without a cache every layer sees the whole sequence; caches build their own masks
        full_mask = "causal" if L > 1 else None
        window_mask = causal_mask(L, self.args.sliding_window) if cache is None else None
        for i, block in enumerate(self.blocks):
            mask = window_mask if self.sliding[i] else full_mask
            h = steer(block(h, mask, None if cache is None else cache[i]), i)
        h = rms_norm(h, self.norm, self.args.rms_norm_eps)
        out = self.embedding.as_linear(h) if self.lm_head is None else self.lm_head(h)
        return out.astype(mx.float32)

    @property
    def layers(self) -> list[Block]:
        return self.blocks
