# Copyright 2026 the turbospark authors. Apache-2.0.
"""The Gemma 4 text decoder: sliding/full layers, per-layer inputs, KV sharing, MoE beside the MLP."""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np

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
    AttentionCache,
    CacheSpec,
    KVCache,
    RingKVCache,
    Rope,
    VisionInputs,
    WeightStore,
    attention,
    bool_problem,
    causal_mask,
    float_problem,
    float_problems,
    gelu_tanh_mul,
    int_problem,
    int_problems,
    keys_problem,
    rms_norm,
    steer,
)

LAYER_TYPES = ("sliding_attention", "full_attention")
ROPE_TYPES = ("default", "proportional")
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
_INTS = {
    "hidden_size": MAX_HIDDEN, "num_hidden_layers": MAX_LAYERS, "intermediate_size": MAX_INTERMEDIATE,
    "vocab_size": MAX_VOCAB, "max_position_embeddings": MAX_POSITIONS, "num_attention_heads": MAX_HEADS,
    "num_key_value_heads": MAX_HEADS, "head_dim": MAX_HEAD_DIM, "global_head_dim": MAX_HEAD_DIM,
    "sliding_window": MAX_POSITIONS,
}
_COUNTS = {"hidden_size_per_layer_input": MAX_HIDDEN, "vocab_size_per_layer_input": MAX_VOCAB,
           "num_kv_shared_layers": MAX_LAYERS}  # may be 0
_BOOLS = ("attention_k_eq_v", "use_double_wide_mlp", "tie_word_embeddings")
_OPTIONAL = ("pad_token_id",)  # keys an install may lack (the field's default applies)
_MOE_INTS = {"num_experts": MAX_EXPERTS, "top_k": MAX_EXPERTS, "moe_intermediate_size": MAX_INTERMEDIATE}
_ROPE_FLOATS = {"rope_theta": MAX_FLOAT, "partial_rotary_factor": 1.0, "factor": MAX_FLOAT}


@attrs.frozen(kw_only=True)
class RopeArgs:
    rope_type: str
    rope_theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@attrs.frozen(kw_only=True)
class MoEArgs:
    num_experts: int
    top_k: int
    moe_intermediate_size: int


@attrs.frozen(kw_only=True)
class Args:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    global_head_dim: int
    num_global_key_value_heads: int | None
    layer_types: tuple[str, ...] = attrs.field(converter=tuple)
    sliding_window: int
    rope: dict[str, RopeArgs] = attrs.field(eq=False)
    rms_norm_eps: float
    final_logit_softcapping: float | None
    hidden_size_per_layer_input: int
    vocab_size_per_layer_input: int
    num_kv_shared_layers: int
    attention_k_eq_v: bool
    use_double_wide_mlp: bool
    moe: MoEArgs | None
    tie_word_embeddings: bool
    pad_token_id: int = 0  # what image soft tokens read in the per-layer inputs (older installs: absent, 0)

    @classmethod
    def from_arch(cls, arch: dict[str, Any]) -> Args:
        """Build from an install's arch config, refusing (by key) what the flow cannot serve.

        Raises:
            ArchConfigError: Every problem :meth:`problems` finds, joined.
        """
        problems = cls.problems(arch)
        if problems:
            raise ArchConfigError("; ".join(problems))
        fields = {a.name for a in attrs.fields(cls)} - {"rope", "moe"}
        moe = arch.get("moe")
        return cls(
            **{k: arch[k] for k in fields if k in arch},
            rope={kind: RopeArgs(**arch["rope_parameters"][kind]) for kind in LAYER_TYPES},
            moe=MoEArgs(**moe) if moe else None,
        )

    @staticmethod
    def problems(arch: dict[str, Any]) -> list[str]:
        """What in ``arch`` the flow cannot serve, each naming its key (empty when valid).

        Every key :meth:`from_arch` reads is checked for its type and range first,
        so ``from_arch`` raises nothing but :class:`ArchConfigError`.
        """
        out = _typed_problems(arch)
        types = arch.get("layer_types")
        n = arch.get("num_hidden_layers")
        if (
            not isinstance(types, list)
            or len(types) != n
            or any(not isinstance(t, str) or t not in LAYER_TYPES for t in types)
        ):
            out.append(f"'layer_types' must list {n!r} entries from {LAYER_TYPES} (got {_brief(types)})")
            return out
        if arch.get("hidden_activation") not in ACTIVATIONS:
            out.append(f"hidden_activation={_brief(arch.get('hidden_activation'))} is not one of {ACTIVATIONS}")
        out += _rope_problems(arch.get("rope_parameters"))
        if out:
            return out
        out += _sharing_problems(arch, types)
        moe = arch.get("moe")
        if moe and not moe["top_k"] <= moe["num_experts"]:
            out.append(f"moe top_k={moe['top_k']!r} must be in [1, num_experts={moe['num_experts']!r}]")
        if arch["num_attention_heads"] % arch["num_key_value_heads"]:
            out.append("num_attention_heads is not a multiple of num_key_value_heads")
        return out

    # ------------------------------------------------------------ per-layer shape
    @property
    def first_kv_shared(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == "sliding_attention"

    def layer_head_dim(self, i: int) -> int:
        return self.head_dim if self.is_sliding(i) else self.global_head_dim

    def k_eq_v(self, i: int) -> bool:
        return self.attention_k_eq_v and not self.is_sliding(i)

    def layer_kv_heads(self, i: int) -> int:
        if self.k_eq_v(i) and self.num_global_key_value_heads:
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    def kv_source(self, i: int) -> int:
        """The layer whose keys/values layer ``i`` attends to (itself unless KV-shared)."""
        if i < self.first_kv_shared:
            return i
        return max(j for j in range(self.first_kv_shared) if self.layer_types[j] == self.layer_types[i])

    def cache_layout(self) -> list[CacheSpec]:
        """One cache per layer that computes its own K/V; KV-shared layers have none."""
        return [
            CacheSpec.sliding(self.layer_kv_heads(i), self.head_dim, self.sliding_window)
            if self.is_sliding(i)
            else CacheSpec.full(self.layer_kv_heads(i), self.global_head_dim)
            for i in range(self.first_kv_shared)
        ]


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _typed_problems(arch: dict[str, Any]) -> list[str]:
    """The type and range of every scalar key and of the ``moe`` section :meth:`Args.from_arch` reads."""
    missing = sorted({a.name for a in attrs.fields(Args)} - {"rope", "moe", *_OPTIONAL} - set(arch))
    out = [f"{key!r} is missing (null where the model has none)" for key in missing]
    out += int_problems(arch, _INTS) + int_problems(arch, _COUNTS, low=0)
    out += [p for p in (int_problem(arch, "num_global_key_value_heads", MAX_HEADS, optional=True),
                        int_problem(arch, "pad_token_id", MAX_VOCAB, low=0, optional=True),
                        float_problem(arch, "rms_norm_eps", 1.0),
                        float_problem(arch, "final_logit_softcapping", optional=True)) if p]  # fmt: skip
    out += [p for key in _BOOLS if (p := bool_problem(arch, key))]
    moe = arch.get("moe")
    if moe is None or moe is False:
        return out
    if not isinstance(moe, dict):
        return [*out, f"'moe' must be an object or null (got {type(moe).__name__})"]
    problems = [
        keys_problem(moe, {a.name for a in attrs.fields(MoEArgs)}, "'moe'"),
        *int_problems(moe, _MOE_INTS, where="moe."),
    ]
    return out + [p for p in problems if p]


def _rope_problems(rope: object) -> list[str]:
    """``rope_parameters``: one object per layer type, with :class:`RopeArgs`'s keys and finite values."""
    if not isinstance(rope, dict):
        return [f"'rope_parameters' must be an object with one entry per layer type (got {_brief(rope)})"]
    out: list[str | None] = []
    for kind in LAYER_TYPES:
        entry = rope.get(kind)
        where = f"rope_parameters[{kind!r}]"
        if not isinstance(entry, dict):
            out.append(f"{where} must be an object (got {_brief(entry)})")
            continue
        if entry.get("rope_type") not in ROPE_TYPES:
            out.append(f"{where} rope_type {_brief(entry.get('rope_type'))} is not one of {ROPE_TYPES}")
        out.append(keys_problem(entry, {a.name for a in attrs.fields(RopeArgs)}, where))
        out.append(float_problem(entry, "rope_theta", where=f"{where}."))
        others = {k: v for k, v in _ROPE_FLOATS.items() if k != "rope_theta"}
        out += float_problems(entry, others, optional=True, where=f"{where}.")
    return [p for p in out if p]


def _sharing_problems(arch: dict[str, Any], types: list[str]) -> list[str]:
    shared = arch.get("num_kv_shared_layers")
    n = len(types)
    if not isinstance(shared, int) or not 0 <= shared < n:
        return [f"num_kv_shared_layers={shared!r} must be in [0, num_hidden_layers={n})"]
    producers = set(types[: n - shared])
    missing = sorted(set(types[n - shared :]) - producers)
    if missing:
        return [f"num_kv_shared_layers={shared}: no earlier layer of type {missing[0]!r} to share K/V from"]
    return []


def make_rope(head_dim: int, p: RopeArgs) -> Rope:
    """RoPE over the whole head; ``proportional`` rotates ``partial_rotary_factor`` of it.

    Proportional RoPE keeps the exponents of the full head (``2i / head_dim``)
    for the rotated pairs and leaves the other pairs unrotated (infinite period).
    """
    if p.rope_type == "default":
        return Rope.from_config(dims=head_dim, theta=p.rope_theta, scaling=None, max_positions=0)
    angles = int(p.partial_rotary_factor * head_dim // 2)
    periods = np.full(head_dim // 2, np.inf, dtype=np.float64)
    periods[:angles] = p.factor * p.rope_theta ** (np.arange(0, 2 * angles, 2, dtype=np.float64) / head_dim)
    return Rope(head_dim, mx.array(periods.astype(np.float32)))


def gelu_tanh(x: mx.array) -> mx.array:
    out: mx.array = nn.gelu_approx(x)  # mlx.nn's activations are unannotated
    return out


# A layer's keys, values and mask, as KV-shared layers read them
SharedKV = tuple[mx.array, mx.array, mx.array | str | None]


class Attention:
    def __init__(self, args: Args, w: WeightStore, i: int) -> None:
        prefix = f"model.layers.{i}.self_attn"
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.layer_kv_heads(i)
        self.head_dim = args.layer_head_dim(i)
        self.eps = args.rms_norm_eps
        self.window = args.sliding_window if args.is_sliding(i) else None
        self.owns_kv = args.kv_source(i) == i
        self.q_proj = w.linear(f"{prefix}.q_proj")
        self.q_norm = w.tensor(f"{prefix}.q_norm.weight")
        self.o_proj = w.linear(f"{prefix}.o_proj")
        if self.owns_kv:
            self.k_proj = w.linear(f"{prefix}.k_proj")
            self.k_norm = w.tensor(f"{prefix}.k_norm.weight")
            # K = V: the value is the key projection, v-normed instead of k-normed
            self.v_proj = self.k_proj if args.k_eq_v(i) else w.linear(f"{prefix}.v_proj")
        self.rope = make_rope(self.head_dim, args.rope[args.layer_types[i]])

    def query(self, x: mx.array, offset: int | mx.array) -> mx.array:
        """Normed, rotated queries ``[B, heads, L, D]``."""
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
        return self.rope(rms_norm(q, self.q_norm, self.eps).transpose(0, 2, 1, 3), offset)

    def key_value(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array]:
        """This layer's own normed, rotated keys and normed values ``[B, kv_heads, L, D]``."""
        B, L, _ = x.shape
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        v = k if self.v_proj is self.k_proj else self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        k = self.rope(rms_norm(k, self.k_norm, self.eps).transpose(0, 2, 1, 3), offset)
        return k, rms_norm(v, None, self.eps).transpose(0, 2, 1, 3)

    def cached(self, k: mx.array, v: mx.array, cache: AttentionCache | None) -> SharedKV:
        """Every key and value the queries see (``k``, ``v`` written to the cache first), with the mask."""
        L = k.shape[2]
        if cache is None:
            return k, v, causal_mask(L, self.window)
        k, v = cache.update_and_fetch(k, v)
        return k, v, cache.mask(L)

    def attend(self, q: mx.array, kv: SharedKV) -> mx.array:
        """Attention of ``q`` over ``kv``; ``[B, L, heads * D]``."""
        k, v, mask = kv
        if k.dtype != q.dtype:  # caches may be held in another dtype than the activations
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        return attention(q, k, v, scale=1.0, mask=mask, merge_heads=True)


class MLP:
    def __init__(self, w: WeightStore, prefix: str) -> None:
        self.gate_proj = w.linear(f"{prefix}.gate_proj")
        self.up_proj = w.linear(f"{prefix}.up_proj")
        self.down_proj = w.linear(f"{prefix}.down_proj")

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))


def geglu(gate: mx.array, up: mx.array) -> mx.array:
    return gelu_tanh_mul(gate, up)


class Router:
    def __init__(self, args: Args, moe: MoEArgs, w: WeightStore, prefix: str) -> None:
        self.top_k = moe.top_k
        self.eps = args.rms_norm_eps
        self.proj = w.linear(f"{prefix}.proj")
        # The unit-scale norm, the learned scale and 1/sqrt(hidden) fold into one weight
        self.scale = w.tensor(f"{prefix}.scale") * args.hidden_size**-0.5
        self.per_expert_scale = w.tensor(f"{prefix}.per_expert_scale")

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        logits = self.proj(rms_norm(x, self.scale, self.eps)).astype(mx.float32)
        probs = mx.softmax(logits, axis=-1, precise=True)
        inds = mx.stop_gradient(mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[..., : self.top_k])
        weights = mx.take_along_axis(probs, inds, axis=-1)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return inds, weights * self.per_expert_scale[inds]


class Block:
    def __init__(self, args: Args, w: WeightStore, i: int) -> None:
        prefix = f"model.layers.{i}"
        self.eps = args.rms_norm_eps
        self.self_attn = Attention(args, w, i)
        self.mlp = MLP(w, f"{prefix}.mlp")

        def norm(name: str) -> mx.array:
            return w.tensor(f"{prefix}.{name}.weight")

        self.input_layernorm = norm("input_layernorm")
        self.post_attention_layernorm = norm("post_attention_layernorm")
        self.pre_feedforward_layernorm = norm("pre_feedforward_layernorm")
        self.post_feedforward_layernorm = norm("post_feedforward_layernorm")
        self.layer_scalar = w.tensor(f"{prefix}.layer_scalar")
        self.moe = args.moe is not None
        if args.moe is not None:
            self.router = Router(args, args.moe, w, f"{prefix}.router")
            self.experts = w.experts(f"{prefix}.experts", "gate_proj", "up_proj", "down_proj")
            self.pre_feedforward_layernorm_2 = norm("pre_feedforward_layernorm_2")
            self.post_feedforward_layernorm_1 = norm("post_feedforward_layernorm_1")
            self.post_feedforward_layernorm_2 = norm("post_feedforward_layernorm_2")
        self.ple = args.hidden_size_per_layer_input > 0
        if self.ple:
            self.per_layer_input_gate = w.linear(f"{prefix}.per_layer_input_gate")
            self.per_layer_projection = w.linear(f"{prefix}.per_layer_projection")
            self.post_per_layer_input_norm = norm("post_per_layer_input_norm")

        # One-token decode has fixed shapes: its pure parts run compiled; the cache update, the attention
        # over it and the routed experts (a streamed or observed bank holds Python-side state) do not
        self._decode_qkv = mx.compile(self._qkv)
        self._decode_rest = mx.compile(self._rest)
        self._decode_route = mx.compile(self._route)
        self._decode_combine = mx.compile(self._combine)

    def _norm(self, x: mx.array, weight: mx.array) -> mx.array:
        return rms_norm(x, weight, self.eps)

    def _qkv(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, ...]:
        """The queries, and this layer's own keys and values unless it reads another layer's."""
        normed = self._norm(x, self.input_layernorm)
        q = self.self_attn.query(normed, offset)
        return (q, *self.self_attn.key_value(normed, offset)) if self.self_attn.owns_kv else (q,)

    def _attended(self, x: mx.array, attended: mx.array) -> mx.array:
        return x + self._norm(self.self_attn.o_proj(attended), self.post_attention_layernorm)

    def _dense(self, h: mx.array) -> mx.array:
        return self.mlp(self._norm(h, self.pre_feedforward_layernorm))

    def _finish(self, h: mx.array, ff: mx.array, per_layer: mx.array | None) -> mx.array:
        """The feed-forward residual, the per-layer input and the layer scalar."""
        h = h + self._norm(ff, self.post_feedforward_layernorm)
        if self.ple:
            assert per_layer is not None, "a per-layer-input block is given its per-layer input"
            g = gelu_tanh(self.per_layer_input_gate(h)) * per_layer
            h = h + self._norm(self.per_layer_projection(g), self.post_per_layer_input_norm)
        return h * self.layer_scalar

    def _rest(self, x: mx.array, attended: mx.array, per_layer: mx.array | None) -> mx.array:
        h = self._attended(x, attended)
        return self._finish(h, self._dense(h), per_layer)

    def _route(self, x: mx.array, attended: mx.array) -> tuple[mx.array, ...]:
        h = self._attended(x, attended)
        # The routed experts run beside the dense MLP, on the same residual
        return (h, self._dense(h), self._norm(h, self.pre_feedforward_layernorm_2), *self.router(h))

    def _combine(
        self, h: mx.array, dense: mx.array, y: mx.array, weights: mx.array, per_layer: mx.array | None
    ) -> mx.array:
        y = (y * weights[..., None].astype(y.dtype)).sum(axis=-2)
        ff = self._norm(dense, self.post_feedforward_layernorm_1) + self._norm(y, self.post_feedforward_layernorm_2)
        return self._finish(h, ff, per_layer)

    def __call__(
        self,
        x: mx.array,
        cache: AttentionCache | None,
        offset: int | mx.array,
        shared: SharedKV | None,
        per_layer: mx.array | None,
    ) -> tuple[mx.array, SharedKV]:
        decode = x.shape[1] == 1
        qkv = self._decode_qkv(x, mx.array(offset)) if decode else self._qkv(x, offset)
        kv = shared if shared is not None else self.self_attn.cached(qkv[1], qkv[2], cache)
        attended = self.self_attn.attend(qkv[0], kv)
        if not self.moe:
            return (self._decode_rest if decode else self._rest)(x, attended, per_layer), kv
        h, dense, normed, inds, weights = (self._decode_route if decode else self._route)(x, attended)
        y = self.experts.glu(normed, inds, geglu, weights=weights)
        return (self._decode_combine if decode else self._combine)(h, dense, y, weights, per_layer), kv


class Model:
    def __init__(self, args: Args, w: WeightStore) -> None:
        self.args = args
        self.embed_tokens = w.embedding("model.embed_tokens")
        self.embed_scale = args.hidden_size**0.5
        self.blocks = [Block(args, w, i) for i in range(args.num_hidden_layers)]
        self.kv_sources = [args.kv_source(i) for i in range(args.num_hidden_layers)]
        self.kv_shared_from = {s for i, s in enumerate(self.kv_sources) if s != i}
        self.norm = w.tensor("model.norm.weight")
        self.ple_dim = args.hidden_size_per_layer_input
        if self.ple_dim:
            self.embed_tokens_per_layer = w.embedding("model.embed_tokens_per_layer")
            self.per_layer_model_projection = w.linear("model.per_layer_model_projection")
            self.per_layer_projection_norm = w.tensor("model.per_layer_projection_norm.weight")
        # Tied head unless the install carries its own lm_head
        self.lm_head = w.linear("lm_head") if w.has("lm_head.weight") or w.has("lm_head") else None

    def _per_layer_inputs(self, inputs: mx.array, h: mx.array) -> mx.array:
        B, L = inputs.shape
        shape = (B, L, self.args.num_hidden_layers, self.ple_dim)
        token_scale: float = self.ple_dim**0.5
        context_scale: float = self.args.hidden_size**-0.5
        token = (self.embed_tokens_per_layer(inputs) * token_scale).reshape(shape)
        context = self.per_layer_model_projection(h) * context_scale
        context = rms_norm(context.reshape(shape), self.per_layer_projection_norm, self.args.rms_norm_eps)
        return (context + token.astype(context.dtype)) * 2**-0.5

    def embed(self, inputs: mx.array, vision: VisionInputs | None = None) -> tuple[mx.array, mx.array | None]:
        """The sequence entering layer 0, and the per-layer inputs (None without PLE).

        Token rows are scaled by ``sqrt(hidden)``. Image soft-token rows
        (``vision.mask``) take ``vision.embeds`` unscaled; there the per-layer
        token part reads the pad id instead of the placeholder, while the
        per-layer context part reads the merged rows.
        """
        if vision is None or vision.mask is None or vision.embeds is None:
            h = self.embed_tokens(inputs) * self.embed_scale
            return h, self._per_layer_inputs(inputs, h) if self.ple_dim else None
        mask = vision.mask
        ids = mx.where(mask, self.args.pad_token_id, inputs)
        h = self.embed_tokens(ids) * self.embed_scale
        # row k of the embeds goes to the k-th masked position (row-major)
        index = mx.maximum(mx.cumsum(mask.reshape(-1).astype(mx.int32)) - 1, 0).reshape(mask.shape)
        h = mx.where(mask[..., None], vision.embeds.astype(h.dtype)[index], h)
        return h, self._per_layer_inputs(ids, h) if self.ple_dim else None

    def __call__(
        self,
        inputs: mx.array,
        cache: list[KVCache | RingKVCache] | None = None,
        vision: VisionInputs | None = None,
    ) -> mx.array:
        """Logits for ``inputs``; ``vision`` carries the image soft tokens of this chunk (see :meth:`embed`)."""
        h, per_layer = self.embed(inputs, vision)
        offset = cache[0].offset if cache else 0
        # K/V (and mask) of the layers that KV-shared layers read, from this same pass:
        # a ring may already have dropped rows an earlier query of a long chunk needs
        stored: dict[int, SharedKV] = {}
        for i, (block, src) in enumerate(zip(self.blocks, self.kv_sources, strict=True)):
            c = cache[i] if cache and src == i else None
            pl = None if per_layer is None else per_layer[:, :, i, :]
            h, kv = block(h, c, offset, stored.get(src) if src != i else None, pl)
            h = steer(h, i)
            if i in self.kv_shared_from:
                stored[i] = kv
        h = rms_norm(h, self.norm, self.args.rms_norm_eps)
        out = (self.embed_tokens.as_linear(h) if self.lm_head is None else self.lm_head(h)).astype(mx.float32)
        cap = self.args.final_logit_softcapping
        return out if cap is None else mx.tanh(out / cap) * cap

    @property
    def layers(self) -> list[Block]:
        return self.blocks
