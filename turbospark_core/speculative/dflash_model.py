"""The DFlash drafter network: pre-norm decoder layers that draft a block from the target's hidden states.

The math (``shared/fixtures/README.md``, "DFlash drafter fixtures"), float32:

* context token ``t``: ``c_t = RMSNorm(fc(concat_l F_l(t)); hidden_norm)``, ``F_l`` the output
  residual of TARGET layer ``l`` (``target_layer_ids``, in order);
* each drafter layer keeps the context's keys and values, ``k_norm``-ed and RoPE'd at the
  context positions (``c`` does not go through ``input_layernorm``), across rounds;
* a round embeds the block ``[anchor, mask x (B-1)]`` with the TARGET's embedding (no scale)
  at positions ``p .. p+B-1``; every block slot attends, with no mask, to the whole
  cached context and all ``B`` slots; the block's own keys and values are not kept;
* logits of slots ``1 .. B-1`` are the target's LM head on ``RMSNorm(x; norm)``.

RoPE is rotate-half over the whole head with the DRAFTER's ``rope_theta`` /
``rope_scaling`` (llama3 included), through the core's :class:`~turbospark_core.rope.Rope`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from turbospark_core.cache_spec import CacheSpec
from turbospark_core.kv_cache import KVCache
from turbospark_core.rope import Rope
from turbospark_core.speculative.dflash_config import DFlashConfig
from turbospark_core.weights import WeightStore

Project = Callable[[mx.array], mx.array]
"""The target's embedding (ids -> rows) or LM head (hidden -> logits)."""


class ContextCache:
    """One drafter layer's context keys and values (RoPE'd), kept across rounds."""

    def __init__(self, cache: KVCache) -> None:
        self._cache = cache

    @property
    def length(self) -> int:
        """Context entries held."""
        return self._cache.offset

    def extend(self, keys: mx.array | None, values: mx.array | None) -> tuple[mx.array | None, mx.array | None]:
        """Append ``[1, kv_heads, n, head_dim]`` rows (or none) and return every held row."""
        if keys is not None and values is not None:
            return self._cache.update_and_fetch(keys, values)
        n, k, v = self._cache.offset, self._cache.keys, self._cache.values
        if n == 0 or k is None or v is None:
            return None, None
        return k[..., :n, :], v[..., :n, :]

    def keep(self, n: int) -> None:
        """Hold only the first ``n`` entries."""
        self._cache.trim(self._cache.offset - min(n, self._cache.offset))

    @property
    def state(self) -> list[mx.array]:
        """Arrays to evaluate with a round."""
        return self._cache.state


class DFlashLayer:
    """One drafter decoder layer (names under ``layers.<i>.``)."""

    def __init__(self, cfg: DFlashConfig, w: WeightStore, i: int, rope: Rope) -> None:
        p = f"layers.{i}"
        self.cfg = cfg
        self.rope = rope
        self.q_proj = w.linear(f"{p}.self_attn.q_proj")
        self.k_proj = w.linear(f"{p}.self_attn.k_proj")
        self.v_proj = w.linear(f"{p}.self_attn.v_proj")
        self.o_proj = w.linear(f"{p}.self_attn.o_proj")
        self.q_norm = w.tensor(f"{p}.self_attn.q_norm.weight")
        self.k_norm = w.tensor(f"{p}.self_attn.k_norm.weight")
        self.input_layernorm = w.tensor(f"{p}.input_layernorm.weight")
        self.post_attention_layernorm = w.tensor(f"{p}.post_attention_layernorm.weight")
        self.gate_proj = w.linear(f"{p}.mlp.gate_proj")
        self.up_proj = w.linear(f"{p}.mlp.up_proj")
        self.down_proj = w.linear(f"{p}.mlp.down_proj")

    def _heads(self, x: mx.array, n_heads: int) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, n_heads, self.cfg.head_dim).transpose(0, 2, 1, 3)

    def keys_values(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """``k_norm``-ed, RoPE'd keys and the values of ``x`` ``[1, n, H]`` at positions ``offset ..``."""
        eps = self.cfg.rms_norm_eps
        k = mx.fast.rms_norm(self._heads(self.k_proj(x), self.cfg.num_kv_heads), self.k_norm, eps)
        return self.rope(k, offset), self._heads(self.v_proj(x), self.cfg.num_kv_heads)

    def __call__(self, x: mx.array, offset: int, ctx_keys: mx.array | None, ctx_values: mx.array | None) -> mx.array:
        """The block ``x`` ``[1, B, H]`` at positions ``offset ..`` through this layer, seeing the context."""
        eps = self.cfg.rms_norm_eps
        h = mx.fast.rms_norm(x, self.input_layernorm, eps)
        q = self.rope(mx.fast.rms_norm(self._heads(self.q_proj(h), self.cfg.num_heads), self.q_norm, eps), offset)
        k, v = self.keys_values(h, offset)
        if ctx_keys is not None and ctx_values is not None:
            k = mx.concatenate([ctx_keys.astype(k.dtype), k], axis=2)
            v = mx.concatenate([ctx_values.astype(v.dtype), v], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.cfg.head_dim**-0.5, mask=None)
        B, _, L, _ = q.shape
        x = x + self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
        y = mx.fast.rms_norm(x, self.post_attention_layernorm, eps)
        gate = self.gate_proj(y)
        return x + self.down_proj(gate * mx.sigmoid(gate) * self.up_proj(y))


class DFlashNetwork:
    """The drafter's weights and flow, bound to the target's embedding and LM head.

    Args:
        cfg: The drafter's checked config.
        weights: The drafter install's weight store.
        embed: The target's token embedding (no scaling applied).
        head: The target's LM head (hidden -> logits).
        dtype: The compute dtype (the target's).
    """

    def __init__(self, cfg: DFlashConfig, weights: WeightStore, embed: Project, head: Project, dtype: mx.Dtype) -> None:
        self.cfg = cfg
        self.embed = embed
        self.head = head
        self.dtype = dtype
        rope = Rope.from_config(
            dims=cfg.head_dim, theta=cfg.rope_theta, scaling=cfg.rope_scaling, max_positions=cfg.max_position_embeddings
        )
        self.fc = weights.linear("fc")
        self.hidden_norm = weights.tensor("hidden_norm.weight")
        self.norm = weights.tensor("norm.weight")
        self.layers = [DFlashLayer(cfg, weights, i, rope) for i in range(cfg.num_layers)]

    def new_context(self, max_context: int) -> list[ContextCache]:
        """Empty per-layer context caches for one sequence (at most ``max_context`` entries)."""
        spec = CacheSpec.full(self.cfg.num_kv_heads, self.cfg.head_dim)
        return [ContextCache(KVCache(spec, max_context, self.dtype)) for _ in self.layers]

    def context(self, features: Sequence[mx.array]) -> mx.array:
        """``c = hidden_norm(fc(concat(features)))``: ``[n, H]`` per target layer -> ``[1, n, H]``."""
        joined = mx.concatenate([f.astype(self.dtype) for f in features], axis=-1)
        return mx.fast.rms_norm(
            self.fc(joined.reshape(1, -1, joined.shape[-1])), self.hidden_norm, self.cfg.rms_norm_eps
        )

    def append_context(self, caches: list[ContextCache], features: Sequence[mx.array], offset: int) -> None:
        """Add context rows: per target layer ``[n, H]`` features of positions ``offset .. offset+n-1``."""
        c = self.context(features)
        for layer, cache in zip(self.layers, caches, strict=True):
            cache.extend(*layer.keys_values(c, offset))

    def block_logits(self, anchor: int, position: int, caches: list[ContextCache]) -> mx.array:
        """One drafting round: logits ``[B-1, vocab]`` (float32) of block slots ``1 .. B-1``.

        Args:
            anchor: The last committed token, at ``position`` (the block's first position).
            caches: The sequence's context caches (read, never given the block's keys and values).
        """
        ids = mx.array([anchor] + [self.cfg.mask_token_id] * (self.cfg.block_size - 1))
        x = self.embed(ids)[None].astype(self.dtype)
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, position, *cache.extend(None, None))
        h = mx.fast.rms_norm(x[0, 1:], self.norm, self.cfg.rms_norm_eps)
        return self.head(h).astype(mx.float32)
