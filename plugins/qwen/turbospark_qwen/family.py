# Copyright 2026 the turbospark authors. Apache-2.0.
"""Qwen 3.5: gated-DeltaNet linear attention, every n-th layer gated full attention, dense or MoE."""

from __future__ import annotations

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
    ArchConfigError,
    CacheSpec,
    KVCache,
    RecurrentState,
    Rope,
    StateSpec,
    WeightStore,
    attention,
    bool_problem,
    cached_attention,
    float_problems,
    int_problems,
    keys_problem,
    rope_scaling_problems,
    silu_mul,
    steer,
)
from turbospark_core.family import (
    rms_norm as core_rms_norm,
)

from turbospark_qwen.gated_delta import gated_delta, l2_normalize

LAYER_KINDS = ("linear_attention", "full_attention")
ACTIVATIONS = ("silu",)
_INTS = {
    "hidden_size": MAX_HIDDEN, "num_hidden_layers": MAX_LAYERS, "vocab_size": MAX_VOCAB,
    "num_attention_heads": MAX_HEADS, "num_key_value_heads": MAX_HEADS, "head_dim": MAX_HEAD_DIM,
    "rotary_dim": MAX_HEAD_DIM, "linear_num_key_heads": MAX_HEADS, "linear_num_value_heads": MAX_HEADS,
    "linear_key_head_dim": MAX_HEAD_DIM, "linear_value_head_dim": MAX_HEAD_DIM, "linear_conv_kernel_dim": 64,
}
_OPTIONAL_INTS = {"max_position_embeddings": MAX_POSITIONS, "mtp_num_hidden_layers": MAX_LAYERS}
_FLOATS = {"rms_norm_eps": 1.0}
_MOE_INTS = {
    "num_experts": MAX_EXPERTS, "top_k": MAX_EXPERTS, "moe_intermediate_size": MAX_INTERMEDIATE,
    "shared_expert_intermediate_size": MAX_INTERMEDIATE,
}


@attrs.frozen(kw_only=True)
class MoEArgs:
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool = True


@attrs.frozen(kw_only=True)
class Args:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None = attrs.field(eq=False)
    layer_types: tuple[str, ...] = attrs.field(converter=tuple)
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    moe: MoEArgs | None
    mtp_num_hidden_layers: int = 0

    @classmethod
    def from_arch(cls, arch: dict[str, Any]) -> Args:
        problems = cls.problems(arch)
        if problems:
            raise ArchConfigError("; ".join(problems))
        moe = arch.get("moe")
        return cls(
            model_type=arch["model_type"],
            hidden_size=arch["hidden_size"],
            num_hidden_layers=arch["num_hidden_layers"],
            vocab_size=arch["vocab_size"],
            max_position_embeddings=arch.get("max_position_embeddings") or 32768,
            rms_norm_eps=float(arch["rms_norm_eps"]),
            num_attention_heads=arch["num_attention_heads"],
            num_key_value_heads=arch["num_key_value_heads"],
            head_dim=arch["head_dim"],
            rotary_dim=arch["rotary_dim"],
            rope_theta=float(arch["rope_theta"]),
            rope_scaling=arch.get("rope_scaling"),
            layer_types=arch["layer_types"],
            linear_num_key_heads=arch["linear_num_key_heads"],
            linear_num_value_heads=arch["linear_num_value_heads"],
            linear_key_head_dim=arch["linear_key_head_dim"],
            linear_value_head_dim=arch["linear_value_head_dim"],
            linear_conv_kernel_dim=arch["linear_conv_kernel_dim"],
            moe=MoEArgs(**moe) if moe else None,
            mtp_num_hidden_layers=arch.get("mtp_num_hidden_layers") or 0,
        )

    @staticmethod
    def problems(arch: dict[str, Any]) -> list[str]:
        """What in ``arch`` the flow cannot serve, each naming its key (empty when valid).

        Every key :meth:`from_arch` reads is checked for its type and range first,
        so ``from_arch`` raises nothing but :class:`ArchConfigError`.
        """
        out = int_problems(arch, _INTS) + int_problems(arch, _OPTIONAL_INTS, optional=True)
        out += float_problems(arch, _FLOATS) + float_problems(arch, {"rope_theta": MAX_FLOAT}, low=1.0)
        out += rope_scaling_problems(arch.get("rope_scaling"))
        out += [p for p in [bool_problem(arch, "mtp_use_dedicated_embeddings", optional=True)] if p]
        if not out:
            out += _head_problems(arch)
        layer_types = arch.get("layer_types")
        if not isinstance(layer_types, (list, tuple)) or len(layer_types) != arch.get("num_hidden_layers"):
            out.append(f"layer_types must list one kind per layer (got {_brief(layer_types)})")
        else:
            out += [
                f"layer_types[{i}]={_brief(kind)} is a layer kind this flow does not implement "
                f"(implemented: {', '.join(LAYER_KINDS)})"
                for i, kind in enumerate(layer_types)
                if not isinstance(kind, str) or kind not in LAYER_KINDS
            ]
        if arch.get("hidden_act") not in ACTIVATIONS:
            act = _brief(arch.get("hidden_act"))
            out.append(f"hidden_act={act} is not supported (supported: {', '.join(ACTIVATIONS)})")
        return out + _moe_problems(arch.get("moe"))

    def cache_layout(self) -> list[CacheSpec | StateSpec]:
        """Per layer: a KV cache for full attention, conv + recurrent state for DeltaNet."""
        conv_dim = 2 * self.linear_num_key_heads * self.linear_key_head_dim
        conv_dim += self.linear_num_value_heads * self.linear_value_head_dim
        state = StateSpec(
            shapes={
                "conv": (self.linear_conv_kernel_dim - 1, conv_dim),
                "recurrent": (self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim),
            }
        )
        full = CacheSpec.full(self.num_key_value_heads, self.head_dim)
        return [full if kind == "full_attention" else state for kind in self.layer_types]


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _moe_problems(moe: object) -> list[str]:
    """The ``moe`` section: null, or exactly :class:`MoEArgs`'s keys with bounded values."""
    if moe is None or moe is False:
        return []
    if not isinstance(moe, dict):
        return [f"'moe' must be an object or null (got {type(moe).__name__})"]
    out = [keys_problem(moe, {a.name for a in attrs.fields(MoEArgs)}, "'moe'")]
    out += int_problems(moe, _MOE_INTS, where="moe.")
    out.append(bool_problem(moe, "norm_topk_prob", optional=True, where="moe."))
    problems = [p for p in out if p]
    if not problems and moe["top_k"] > moe["num_experts"]:
        problems.append(f"moe top_k={moe['top_k']} must be in [1, num_experts={moe['num_experts']}]")
    return problems


def _head_problems(arch: dict[str, Any]) -> list[str]:
    out = []
    if arch["num_attention_heads"] % arch["num_key_value_heads"]:
        out.append(
            f"num_attention_heads={arch['num_attention_heads']} is not a multiple of "
            f"num_key_value_heads={arch['num_key_value_heads']}"
        )
    if arch["linear_num_value_heads"] % arch["linear_num_key_heads"]:
        out.append(
            f"linear_num_value_heads={arch['linear_num_value_heads']} is not a multiple of "
            f"linear_num_key_heads={arch['linear_num_key_heads']}"
        )
    if arch["rotary_dim"] > arch["head_dim"] or arch["rotary_dim"] % 2:
        out.append(f"rotary_dim={arch['rotary_dim']} must be even and at most head_dim={arch['head_dim']}")
    return out


def constant(x: mx.array) -> mx.array:
    # Derived weights are computed once at build, not on every forward pass
    mx.eval(x)
    return x


def norm_weight(w: mx.array) -> mx.array:
    # (1 + w) in float32, before any narrowing
    return constant(1.0 + w.astype(mx.float32))


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return core_rms_norm(x.astype(mx.float32), weight, eps).astype(x.dtype)


def silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return silu_mul(gate, up)


class GatedDeltaNet:
    def __init__(self, args: Args, w: WeightStore, prefix: str) -> None:
        self.n_k, self.n_v = args.linear_num_key_heads, args.linear_num_value_heads
        self.d_k, self.d_v = args.linear_key_head_dim, args.linear_value_head_dim
        self.kernel = args.linear_conv_kernel_dim
        self.eps = args.rms_norm_eps
        self.in_proj_qkv = w.linear(f"{prefix}.in_proj_qkv")
        self.in_proj_z = w.linear(f"{prefix}.in_proj_z")
        self.in_proj_b = w.linear(f"{prefix}.in_proj_b")
        self.in_proj_a = w.linear(f"{prefix}.in_proj_a")
        self.out_proj = w.linear(f"{prefix}.out_proj")
        conv = w.tensor(f"{prefix}.conv1d.weight")  # [C, 1, K] (or mlx-lm's [C, K, 1])
        taps = mx.contiguous(conv.reshape(conv.shape[0], self.kernel).T)  # [K, C]
        self.conv1d = [constant(taps[j]) for j in range(self.kernel)]  # one row per tap (no indexing per step)
        self.neg_A = constant(-mx.exp(w.tensor(f"{prefix}.A_log").astype(mx.float32)))
        self.dt_bias = constant(w.tensor(f"{prefix}.dt_bias").astype(mx.float32))
        self.norm = constant(w.tensor(f"{prefix}.norm.weight").astype(mx.float32))  # gated norm: plain w

    def _conv(self, qkv: mx.array, past: mx.array) -> tuple[mx.array, mx.array]:
        """The causal depthwise conv over ``past`` (the last K-1 inputs) then ``qkv``; and the new window."""
        L = qkv.shape[1]
        window = mx.concatenate([past.astype(qkv.dtype), qkv], axis=1)
        out = window[:, :L] * self.conv1d[0]
        for j in range(1, self.kernel):
            out = out + window[:, j : j + L] * self.conv1d[j]
        return silu(out), mx.contiguous(window[:, L:])

    def mix(self, x: mx.array, conv: mx.array, state: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Outputs for ``x`` from the conv window and recurrent state; the new window and state (pure)."""
        B, L, _ = x.shape
        mixed, conv = self._conv(self.in_proj_qkv(x), conv)
        key_dim = self.n_k * self.d_k
        q = mixed[..., :key_dim].reshape(B, L, self.n_k, self.d_k)
        k = mixed[..., key_dim : 2 * key_dim].reshape(B, L, self.n_k, self.d_k)
        v = mixed[..., 2 * key_dim :].reshape(B, L, self.n_v, self.d_v)
        q = l2_normalize(q.astype(mx.float32)) * self.d_k**-0.5
        k = l2_normalize(k.astype(mx.float32))
        beta = mx.sigmoid(self.in_proj_b(x).astype(mx.float32))
        g = self.neg_A * _softplus(self.in_proj_a(x).astype(mx.float32) + self.dt_bias)
        out, state = gated_delta(q, k, v, g, beta, state)
        z = self.in_proj_z(x).reshape(B, L, self.n_v, self.d_v)
        out = core_rms_norm(out, self.norm, self.eps) * silu(z.astype(mx.float32))
        return self.out_proj(out.reshape(B, L, -1).astype(x.dtype)), conv, state

    def state(self, cache: RecurrentState | None, batch: int) -> tuple[mx.array, mx.array]:
        """The conv window and recurrent state ``cache`` holds (zeros without one)."""
        if cache is not None:
            return cache.get("conv", batch), cache.get("recurrent", batch)
        conv_dim = 2 * self.n_k * self.d_k + self.n_v * self.d_v
        return mx.zeros((batch, self.kernel - 1, conv_dim)), mx.zeros((batch, self.n_v, self.d_k, self.d_v))

    @staticmethod
    def keep(cache: RecurrentState, conv: mx.array, state: mx.array, tokens: int) -> None:
        """Store the new conv window and recurrent state, ``tokens`` tokens on."""
        cache.set("conv", conv)
        cache.set("recurrent", state)
        cache.advance(tokens)


def _softplus(x: mx.array) -> mx.array:
    # torch's softplus (threshold 20) in one stable expression
    return mx.logaddexp(x, 0.0)


class Attention:
    def __init__(self, args: Args, w: WeightStore, prefix: str) -> None:
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.eps = args.rms_norm_eps
        self.q_proj = w.linear(f"{prefix}.q_proj")  # per head: [query | output gate]
        self.k_proj = w.linear(f"{prefix}.k_proj")
        self.v_proj = w.linear(f"{prefix}.v_proj")
        self.o_proj = w.linear(f"{prefix}.o_proj")
        self.q_norm = norm_weight(w.tensor(f"{prefix}.q_norm.weight"))
        self.k_norm = norm_weight(w.tensor(f"{prefix}.k_norm.weight"))
        # Multimodal rope on text-only positions: every section sees one position, so plain partial rope
        self.rope = Rope.from_config(
            dims=args.rotary_dim,
            theta=args.rope_theta,
            scaling=args.rope_scaling,
            max_positions=args.max_position_embeddings,
        )

    def project(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Rotated queries and keys, values (``[B, heads, L, D]``) and the output gate's logits ``[B, L, -1]``."""
        B, L, _ = x.shape
        q_gate = self.q_proj(x).reshape(B, L, self.n_heads, 2 * self.head_dim)
        q, gate = q_gate[..., : self.head_dim], q_gate[..., self.head_dim :]
        q = rms_norm(q, self.q_norm, self.eps).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        k = rms_norm(k, self.k_norm, self.eps).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        return self.rope(q, offset), self.rope(k, offset), v, gate.reshape(B, L, -1)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, cache: KVCache | None) -> mx.array:
        """Attention over the cache (written first); ``[B, L, heads * D]``."""
        scale = self.head_dim**-0.5
        if cache is None:
            return attention(q, k, v, scale=scale, mask="causal" if q.shape[2] > 1 else None, merge_heads=True)
        return cached_attention(q, k, v, cache, scale=scale, merge_heads=True)

    def output(self, attended: mx.array, gate: mx.array) -> mx.array:
        return self.o_proj(attended * mx.sigmoid(gate))

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        q, k, v, gate = self.project(x, 0 if cache is None else cache.offset)
        return self.output(self.attend(q, k, v, cache), gate)


class MLP:
    def __init__(self, w: WeightStore, prefix: str) -> None:
        self.gate_proj = w.linear(f"{prefix}.gate_proj")
        self.up_proj = w.linear(f"{prefix}.up_proj")
        self.down_proj = w.linear(f"{prefix}.down_proj")

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class SparseMoE:
    def __init__(self, args: MoEArgs, w: WeightStore, prefix: str) -> None:
        self.args = args
        self.gate = w.linear(f"{prefix}.gate")
        self.experts = w.experts(f"{prefix}.experts", "gate_proj", "up_proj", "down_proj")
        self.shared_expert = MLP(w, f"{prefix}.shared_expert")
        self.shared_expert_gate = w.linear(f"{prefix}.shared_expert_gate")

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """The chosen experts and their weights."""
        k = self.args.top_k
        scores = mx.softmax(self.gate(x).astype(mx.float32), axis=-1, precise=True)
        inds = mx.stop_gradient(mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k])
        weights = mx.take_along_axis(scores, inds, axis=-1)
        if self.args.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return inds, weights

    def shared(self, x: mx.array) -> mx.array:
        """The gated shared expert."""
        return mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def __call__(self, x: mx.array) -> mx.array:
        inds, weights = self.route(x)
        return combine(self.experts.glu(x, inds, swiglu, weights=weights), weights) + self.shared(x)


def combine(y: mx.array, weights: mx.array) -> mx.array:
    """The chosen experts' outputs ``[..., k, D]`` summed with their weights."""
    return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


class Block:
    def __init__(self, args: Args, w: WeightStore, i: int) -> None:
        prefix = f"model.layers.{i}"
        self.eps = args.rms_norm_eps
        self.is_linear = args.layer_types[i] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(args, w, f"{prefix}.linear_attn")
        else:
            self.self_attn = Attention(args, w, f"{prefix}.self_attn")
        self.mlp = SparseMoE(args.moe, w, f"{prefix}.mlp") if args.moe else MLP(w, f"{prefix}.mlp")
        self.input_layernorm = norm_weight(w.tensor(f"{prefix}.input_layernorm.weight"))
        self.post_attention_layernorm = norm_weight(w.tensor(f"{prefix}.post_attention_layernorm.weight"))
        # One-token decode has fixed shapes: its pure parts run compiled; the cache and state updates, the
        # attention over the cache and the routed experts (a streamed bank holds Python-side state) do not
        self._decode_delta = mx.compile(self._delta)
        self._decode_qkv = mx.compile(self._qkv)
        self._decode_attended = mx.compile(self._attended)
        self._decode_ffn = mx.compile(self._ffn)
        self._decode_route = mx.compile(self._route)
        self._decode_combine = mx.compile(self._combine)

    def _delta(self, x: mx.array, conv: mx.array, state: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        out, conv, state = self.linear_attn.mix(rms_norm(x, self.input_layernorm, self.eps), conv, state)
        return x + out, conv, state

    def _qkv(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        return self.self_attn.project(rms_norm(x, self.input_layernorm, self.eps), offset)

    def _attended(self, x: mx.array, attended: mx.array, gate: mx.array) -> mx.array:
        return x + self.self_attn.output(attended, gate)

    def _ffn(self, h: mx.array) -> mx.array:
        return h + self.mlp(rms_norm(h, self.post_attention_layernorm, self.eps))

    def _route(self, h: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        assert isinstance(self.mlp, SparseMoE)
        normed = rms_norm(h, self.post_attention_layernorm, self.eps)
        return (normed, *self.mlp.route(normed), self.mlp.shared(normed))

    def _combine(self, h: mx.array, y: mx.array, weights: mx.array, shared: mx.array) -> mx.array:
        return h + (combine(y, weights) + shared)

    def __call__(self, x: mx.array, cache: KVCache | RecurrentState | None) -> mx.array:
        decode = x.shape[1] == 1 and cache is not None
        if self.is_linear:
            assert not isinstance(cache, KVCache), "a linear-attention layer's cache is its RecurrentState"
            conv, state = self.linear_attn.state(cache, x.shape[0])
            h, conv, state = (self._decode_delta if decode else self._delta)(x, conv, state)
            if cache is not None:
                self.linear_attn.keep(cache, conv, state, x.shape[1])
        else:
            assert not isinstance(cache, RecurrentState), "an attention layer's cache is a KVCache"
            offset = 0 if cache is None else cache.offset
            q, k, v, gate = self._decode_qkv(x, mx.array(offset)) if decode else self._qkv(x, offset)
            h = (self._decode_attended if decode else self._attended)(x, self.self_attn.attend(q, k, v, cache), gate)
        if not isinstance(self.mlp, SparseMoE):
            return (self._decode_ffn if decode else self._ffn)(h)
        normed, inds, weights, shared = (self._decode_route if decode else self._route)(h)
        y = self.mlp.experts.glu(normed, inds, swiglu, weights=weights)
        return (self._decode_combine if decode else self._combine)(h, y, weights, shared)


class Model:
    def __init__(self, args: Args, w: WeightStore) -> None:
        self.args = args
        self.embed_tokens = w.embedding("model.embed_tokens")
        self.blocks = [Block(args, w, i) for i in range(args.num_hidden_layers)]
        self.norm = norm_weight(w.tensor("model.norm.weight"))
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
