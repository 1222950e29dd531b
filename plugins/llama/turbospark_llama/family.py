# Copyright 2026 the turbospark authors. Apache-2.0.
"""The Llama-style decoder: GQA + RoPE attention, dense SwiGLU or routed-expert MoE."""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core.family import (
    MAX_EXPERTS,
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
    Rope,
    VisionInputs,
    WeightStore,
    attention,
    bool_problem,
    cached_attention,
    float_problems,
    fuse_linears,
    fused_layer,
    fused_parts,
    index_list_problem,
    int_problems,
    is_int,
    keys_problem,
    linear_gated,
    linear_normed,
    linear_plus,
    rms_norm,
    rope_heads,
    rope_scaling_problems,
    silu_mul,
    steer,
)

QK_NORMS = (None, "head", "full")
SCORINGS = ("softmax", "sigmoid")


@attrs.frozen(kw_only=True)
class MoEArgs:
    num_experts: int
    top_k: int
    scoring: str = "softmax"
    norm_topk_prob: bool = True
    sparse_layers: tuple[int, ...] = attrs.field(converter=tuple)


@attrs.frozen(kw_only=True)
class MRopeArgs:
    """Multimodal rope (Qwen-VL): frequency j rotates by the t, h or w position (image positions only)."""

    section: tuple[int, ...] = attrs.field(converter=tuple)
    interleaved: bool = False

    def axes(self) -> np.ndarray:
        """The position axis (0 = t, 1 = h, 2 = w) each rotary frequency reads."""
        n = sum(self.section)
        if self.interleaved:
            j = np.arange(n)
            axes = np.zeros(n, dtype=np.int64)
            axes[(j % 3 == 1) & (j < 3 * self.section[1])] = 1
            axes[(j % 3 == 2) & (j < 3 * self.section[2])] = 2
            return axes
        return np.concatenate([np.full(k, a, dtype=np.int64) for a, k in enumerate(self.section)])


@attrs.frozen(kw_only=True)
class Args:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = attrs.field(eq=False)
    max_position_embeddings: int
    qk_norm: str | None
    moe: MoEArgs | None
    mrope: MRopeArgs | None = None

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
            num_attention_heads=arch["num_attention_heads"],
            num_key_value_heads=arch["num_key_value_heads"],
            head_dim=arch["head_dim"],
            rotary_dim=arch.get("rotary_dim") or arch["head_dim"],
            vocab_size=arch["vocab_size"],
            rms_norm_eps=float(arch["rms_norm_eps"]),
            rope_theta=float(arch["rope_theta"]),
            rope_scaling=arch.get("rope_scaling"),
            max_position_embeddings=arch.get("max_position_embeddings") or 4096,
            qk_norm=arch.get("qk_norm"),
            moe=MoEArgs(**moe) if moe else None,
            mrope=MRopeArgs(**arch["mrope"]) if arch.get("mrope") else None,
        )

    @staticmethod
    def problems(arch: dict[str, Any]) -> list[str]:
        """What in ``arch`` the flow cannot serve, each naming its key (empty when valid).

        Every key :meth:`from_arch` reads is checked for its type and range first,
        so ``from_arch`` raises nothing but :class:`ArchConfigError`.
        """
        out = _typed_problems(arch)
        if out:
            return out
        if arch["num_attention_heads"] % arch["num_key_value_heads"]:
            out.append(
                f"num_attention_heads={arch['num_attention_heads']} is not a multiple of "
                f"num_key_value_heads={arch['num_key_value_heads']}"
            )
        rotary = arch.get("rotary_dim") or arch["head_dim"]
        if rotary > arch["head_dim"] or rotary % 2:
            out.append(f"rotary_dim={rotary} must be even and at most head_dim={arch['head_dim']}")
        moe = arch.get("moe")
        if moe and moe.get("scoring", "softmax") not in SCORINGS:
            out.append(f"moe scoring {moe.get('scoring')!r} is not one of {SCORINGS}")
        out += _mrope_problems(arch.get("mrope"), rotary)
        if moe and not moe["top_k"] <= moe["num_experts"]:
            out.append(f"moe top_k={moe['top_k']!r} must be in [1, num_experts={moe['num_experts']!r}]")
        return out

    def cache_layout(self) -> list[CacheSpec]:
        """One full-attention KV cache per layer."""
        return [CacheSpec.full(self.num_key_value_heads, self.head_dim)] * self.num_hidden_layers


_INTS = {
    "hidden_size": MAX_HIDDEN, "num_hidden_layers": MAX_LAYERS, "num_attention_heads": MAX_HEADS,
    "num_key_value_heads": MAX_HEADS, "head_dim": MAX_HEAD_DIM, "vocab_size": MAX_VOCAB,
}  # fmt: skip
_OPTIONAL_INTS = {"rotary_dim": MAX_HEAD_DIM, "max_position_embeddings": MAX_POSITIONS}
_FLOATS = {"rms_norm_eps": 1.0}
_MOE_INTS = {"num_experts": MAX_EXPERTS, "top_k": MAX_EXPERTS}


def _mrope_problems(mrope: Any, rotary: int) -> list[str]:
    if mrope is None:
        return []
    if not isinstance(mrope, dict) or set(mrope) - {"section", "interleaved"}:
        return [f"'mrope' must be an object with 'section' and 'interleaved' (got {mrope!r:.80})"]
    section = mrope.get("section")
    if (
        not isinstance(section, list)
        or len(section) != 3
        or not all(is_int(k) and k >= 0 for k in section)
        or sum(section) != rotary // 2
    ):
        return [f"mrope.section={section!r:.80} must be 3 counts summing to rotary_dim/2={rotary // 2}"]
    if not isinstance(mrope.get("interleaved", False), bool):
        return ["mrope.interleaved must be true or false"]
    return []


def _typed_problems(arch: dict[str, Any]) -> list[str]:
    """The type and range of every key :meth:`Args.from_arch` reads."""
    out = int_problems(arch, _INTS) + int_problems(arch, _OPTIONAL_INTS, optional=True)
    out += float_problems(arch, _FLOATS) + float_problems(arch, {"rope_theta": MAX_FLOAT}, low=1.0)
    out += rope_scaling_problems(arch.get("rope_scaling"))
    if arch.get("qk_norm") not in QK_NORMS:
        out.append(f"qk_norm={arch.get('qk_norm')!r} is not one of {QK_NORMS}")
    moe = arch.get("moe")
    if moe is None or moe is False:
        return out
    if not isinstance(moe, dict):
        return [*out, f"'moe' must be an object or null (got {type(moe).__name__})"]
    problems = [keys_problem(moe, {a.name for a in attrs.fields(MoEArgs)}, "'moe'")]
    problems += int_problems(moe, _MOE_INTS, where="moe.")
    problems.append(bool_problem(moe, "norm_topk_prob", optional=True, where="moe."))
    layers = arch.get("num_hidden_layers")
    problems.append(index_list_problem(moe, "sparse_layers", layers if is_int(layers) else 0, where="moe."))
    if not isinstance(moe.get("scoring", "softmax"), str):
        problems.append(f"moe scoring must be a string (got {type(moe['scoring']).__name__})")
    return out + [p for p in problems if p]


class Attention:
    def __init__(self, args: Args, w: WeightStore, prefix: str) -> None:
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        self.eps = args.rms_norm_eps
        self.qk_norm = args.qk_norm
        self.q_proj = w.linear(f"{prefix}.q_proj")
        self.k_proj = w.linear(f"{prefix}.k_proj")
        self.v_proj = w.linear(f"{prefix}.v_proj")
        self.o_proj = w.linear(f"{prefix}.o_proj")
        # one multiply for q, k and v where they are held alike
        self.qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        self.splits = [self.q_proj.out_features, self.q_proj.out_features + self.k_proj.out_features]
        if self.qkv is not None:  # the separate projections become views of the fused one (held once)
            sizes = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
            self.q_proj, self.k_proj, self.v_proj = fused_parts(self.qkv, sizes)
        self.q_norm = w.tensor(f"{prefix}.q_norm.weight") if args.qk_norm else None
        self.k_norm = w.tensor(f"{prefix}.k_norm.weight") if args.qk_norm else None
        self.rope = Rope.from_config(
            dims=args.rotary_dim,
            theta=args.rope_theta,
            scaling=args.rope_scaling,
            max_positions=args.max_position_embeddings,
        )
        self.rotary_dim = args.rotary_dim
        self.mrope_axes = None if args.mrope is None else mx.array(args.mrope.axes())
        inv = 1.0 / (args.rope_theta ** (np.arange(0, args.rotary_dim, 2, dtype=np.float64) / args.rotary_dim))
        self.inv_freq = mx.array(inv.astype(np.float32))

    def rope_at(self, x: mx.array, positions: mx.array) -> mx.array:
        """Rotate ``x`` ``[B, heads, L, D]`` by explicit M-RoPE ``positions`` ``[3, B, L]`` (image prompts)."""
        if self.mrope_axes is None:
            msg = "explicit image positions need the install's 'mrope' section; re-convert the trunk"
            raise ArchConfigError(msg)
        pos = mx.take(positions.astype(mx.float32), self.mrope_axes, axis=0)  # [F, B, L]
        angles = pos.transpose(1, 2, 0) * self.inv_freq  # [B, L, F]
        emb = mx.concatenate([angles, angles], axis=-1)[:, None]  # [B, 1, L, rotary]
        cos, sin = mx.cos(emb).astype(x.dtype), mx.sin(emb).astype(x.dtype)
        r = self.rotary_dim
        head, tail = x[..., :r], x[..., r:]
        half = r // 2
        rotated = mx.concatenate([-head[..., half:], head[..., :half]], axis=-1)
        out = head * cos + rotated * sin
        return out if tail.shape[-1] == 0 else mx.concatenate([out, tail], axis=-1)

    def project(
        self,
        x: mx.array,
        offset: int | mx.array,
        positions: mx.array | None = None,
        norm: mx.array | None = None,
    ) -> tuple[mx.array, mx.array, mx.array]:
        """q, k, v heads ``[B, H, L, D]``, q and k rotated (one native op on the CPU with the rope).

        ``norm``: the layer's input RMSNorm weight, applied to ``x`` first
        (inside the fused q/k/v product where it can be).
        """
        if norm is not None and self.qkv is None:
            x, norm = rms_norm(x, norm, self.eps), None
        proj: mx.array | tuple[mx.array, mx.array, mx.array]
        if self.qkv is None:
            proj = (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        else:
            proj = self.qkv(x) if norm is None else linear_normed(self.qkv, x, norm, self.eps)
        if self.qk_norm == "full":
            q, k, v = mx.split(proj, self.splits, axis=-1) if isinstance(proj, mx.array) else proj
            proj = (rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps), v)
        norms = None
        if self.qk_norm == "head":
            assert self.q_norm is not None and self.k_norm is not None
            norms = (self.q_norm, self.k_norm)
        if positions is None:
            return rope_heads(
                proj, self.rope, heads=self.n_heads, kv_heads=self.n_kv_heads, offset=offset, norms=norms,
                eps=self.eps,
            )  # fmt: skip
        # explicit M-RoPE positions (image prompts): the heads unrotated, then rotated by position
        B, L, _ = x.shape
        q, k, v = mx.split(proj, self.splits, axis=-1) if isinstance(proj, mx.array) else proj
        q = q.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = k.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if norms is not None:
            q, k = rms_norm(q, norms[0], self.eps), rms_norm(k, norms[1], self.eps)
        return self.rope_at(q, positions), self.rope_at(k, positions), v

    def attend(self, q: mx.array, k: mx.array, v: mx.array, cache: KVCache | None) -> mx.array:
        """Attention over the cache (written first), the heads merged: ``[B, L, H * D]``."""
        if cache is None:
            return attention(q, k, v, scale=self.scale, mask="causal" if q.shape[2] > 1 else None, merge_heads=True)
        return cached_attention(q, k, v, cache, scale=self.scale, merge_heads=True)

    def __call__(
        self,
        x: mx.array,
        cache: KVCache | None,
        shift: int | mx.array = 0,
        positions: mx.array | None = None,
        *,
        norm: mx.array,
    ) -> mx.array:
        """``x`` plus the attention of ``rms_norm(x, norm)``."""
        q, k, v = self.project(x, (0 if cache is None else cache.offset) + shift, positions, norm)
        return linear_plus(self.o_proj, self.attend(q, k, v, cache), x)


class MLP:
    def __init__(self, w: WeightStore, prefix: str) -> None:
        self.gate_proj = w.linear(f"{prefix}.gate_proj")
        self.up_proj = w.linear(f"{prefix}.up_proj")
        self.down_proj = w.linear(f"{prefix}.down_proj")
        self.gate_up = fuse_linears([self.gate_proj, self.up_proj])
        if self.gate_up is not None:
            sizes = [self.gate_proj.out_features, self.up_proj.out_features]
            self.gate_proj, self.up_proj = fused_parts(self.gate_up, sizes)

    def __call__(self, h: mx.array, norm: mx.array, eps: float) -> mx.array:
        """``h`` plus the MLP of ``rms_norm(h, norm, eps)`` (the norm and the activation inside the products)."""
        if self.gate_up is not None:
            return linear_gated(self.down_proj, linear_normed(self.gate_up, h, norm, eps), "silu_mul", h)
        x = rms_norm(h, norm, eps)
        return linear_plus(self.down_proj, swiglu(self.gate_proj(x), self.up_proj(x)), h)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return silu_mul(gate, up)


class MoE:
    def __init__(self, args: MoEArgs, w: WeightStore, prefix: str) -> None:
        self.args = args
        self.gate = w.linear(f"{prefix}.gate")
        self.e_score_correction_bias = w.optional(f"{prefix}.e_score_correction_bias")
        self.experts = w.experts(f"{prefix}.experts", "gate_proj", "up_proj", "down_proj")

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """The chosen experts and their weights."""
        k = self.args.top_k
        logits = self.gate(x).astype(mx.float32)
        if self.args.scoring == "softmax":
            scores = mx.softmax(logits, axis=-1, precise=True)
            choice = scores
        else:
            scores = mx.sigmoid(logits)
            bias = self.e_score_correction_bias
            choice = scores if bias is None else scores + bias
        inds = mx.stop_gradient(mx.argpartition(-choice, kth=k - 1, axis=-1)[..., :k])
        weights = mx.take_along_axis(scores, inds, axis=-1)
        if self.args.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return inds, weights

    def __call__(self, h: mx.array, norm: mx.array, eps: float) -> mx.array:
        """``h`` plus the experts' weighted output for ``rms_norm(h, norm, eps)``."""
        x = rms_norm(h, norm, eps)
        inds, weights = self.route(x)
        return h + combine(self.experts.glu(x, inds, swiglu, weights=weights), weights)


def combine(y: mx.array, weights: mx.array) -> mx.array:
    """The chosen experts' outputs ``[..., k, D]`` summed with their weights."""
    return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


class Block:
    def __init__(self, args: Args, w: WeightStore, i: int) -> None:
        prefix = f"model.layers.{i}"
        self.eps = args.rms_norm_eps
        self.self_attn = Attention(args, w, f"{prefix}.self_attn")
        moe = args.moe if args.moe is not None and i in args.moe.sparse_layers else None
        self.mlp = MLP(w, f"{prefix}.mlp") if moe is None else MoE(moe, w, f"{prefix}.mlp")
        self.input_layernorm = w.tensor(f"{prefix}.input_layernorm.weight")
        self.post_attention_layernorm = w.tensor(f"{prefix}.post_attention_layernorm.weight")

        # One-token decode has fixed shapes: compile the pure parts around the cache update and the
        # routed experts (a streamed or observed bank holds Python-side state)
        self._decode_qkv = mx.compile(self._qkv)
        self._decode_rest = mx.compile(self._rest)
        self._decode_route = mx.compile(self._route)
        self._decode_combine = mx.compile(self._combine)
        # A dense layer with quantized matrices on the CPU: the whole step as one native op
        self._fused = None
        attn = self.self_attn
        if isinstance(self.mlp, MLP) and attn.qk_norm != "full":
            norms = None if attn.q_norm is None or attn.k_norm is None else (attn.q_norm, attn.k_norm)
            self._fused = fused_layer(
                input_norm=self.input_layernorm, qkv=attn.qkv, o_proj=attn.o_proj,
                mlp_norm=self.post_attention_layernorm, gate_up=self.mlp.gate_up, down=self.mlp.down_proj,
                heads=attn.n_heads, kv_heads=attn.n_kv_heads, rope=attn.rope, scale=attn.scale, eps=self.eps,
                head_norms=norms,
            )  # fmt: skip

    def _qkv(self, x: mx.array, offset: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return self.self_attn.project(x, offset, norm=self.input_layernorm)

    def _rest(self, x: mx.array, attended: mx.array) -> mx.array:
        h = linear_plus(self.self_attn.o_proj, attended, x)
        return self.mlp(h, self.post_attention_layernorm, self.eps)

    def _route(self, x: mx.array, attended: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        assert isinstance(self.mlp, MoE)
        h = linear_plus(self.self_attn.o_proj, attended, x)
        normed = rms_norm(h, self.post_attention_layernorm, self.eps)
        return (h, normed, *self.mlp.route(normed))

    def _combine(self, h: mx.array, y: mx.array, weights: mx.array) -> mx.array:
        return h + combine(y, weights)

    def __call__(
        self, x: mx.array, cache: KVCache | None, shift: int | mx.array = 0, positions: mx.array | None = None
    ) -> mx.array:
        if self._fused is not None and cache is not None and positions is None and isinstance(shift, int) and not shift:
            y = self._fused(x, cache)
            if y is not None:
                return y
        if x.shape[1] == 1 and cache is not None and positions is None:
            offset = mx.array(cache.offset)
            q, k, v = self._decode_qkv(x, offset if isinstance(shift, int) and not shift else offset + shift)
            attended = self.self_attn.attend(q, k, v, cache)
            if isinstance(self.mlp, MLP):
                return self._decode_rest(x, attended)
            h, normed, inds, weights = self._decode_route(x, attended)
            return self._decode_combine(h, self.mlp.experts.glu(normed, inds, swiglu, weights=weights), weights)
        h = self.self_attn(x, cache, shift, positions, norm=self.input_layernorm)
        return self.mlp(h, self.post_attention_layernorm, self.eps)


class Model:
    def __init__(self, args: Args, w: WeightStore) -> None:
        self.args = args
        self.embed_tokens = w.embedding("model.embed_tokens")
        self.blocks = [Block(args, w, i) for i in range(args.num_hidden_layers)]
        for block, following in zip(self.blocks, self.blocks[1:], strict=False):
            if block._fused is not None:
                block._fused.read_ahead(following._fused)
        self.norm = w.tensor("model.norm.weight")
        # Tied head unless the install carries its own lm_head
        self.lm_head = w.linear("lm_head") if w.has("lm_head.weight") or w.has("lm_head") else None

    def __call__(
        self, inputs: mx.array, cache: list[KVCache] | None = None, vision: VisionInputs | None = None
    ) -> mx.array:
        h = self.embed_tokens(inputs)
        if vision is None:
            for i, block in enumerate(self.blocks):
                h = steer(block(h, None if cache is None else cache[i]), i)
            return self._head(h)
        # Images (Qwen3-VL): tower rows replace the soft-token embeddings; DeepStack features are added
        # after the early layers; explicit M-RoPE positions in the prompt, shifted positions after it
        extra: list[mx.array] = []
        mask = vision.mask
        if mask is not None and vision.embeds is not None:
            take = mx.maximum(mx.cumsum(mask.reshape(-1).astype(mx.int32)) - 1, 0).reshape(mask.shape)
            where = mask[..., None]
            h = mx.where(where, vision.embeds[take].astype(h.dtype), h)
            extra = [mx.where(where, f[take].astype(h.dtype), 0) for f in vision.layer_features]
        for i, block in enumerate(self.blocks):
            h = block(h, None if cache is None else cache[i], vision.shift, vision.positions)
            if i < len(extra):
                h = h + extra[i]
            h = steer(h, i)
        return self._head(h)

    def _head(self, h: mx.array) -> mx.array:
        h = rms_norm(h, self.norm, self.args.rms_norm_eps)
        out = self.embed_tokens.as_linear(h) if self.lm_head is None else self.lm_head(h)
        return out.astype(mx.float32)

    @property
    def layers(self) -> list[Block]:
        return self.blocks
