"""Multi-head latent attention (MLA) over a compressed cache.

Per token and layer the cache holds one row ``[c | k_r]``: the latent ``c``
(``kv_lora_rank``, after ``kv_a_layernorm``) and the rotated rope key ``k_r``
(``qk_rope_head_dim``), shared by every head; no values (``c`` is the value).

Absorbed form (decode, and whenever cheaper): the key up-projection ``W_UK`` is
folded into the query and the value up-projection ``W_UV`` applied after
attention, which makes it multi-query attention with key ``[c | k_r]`` and value
``c``. Expanded form (long prefill chunks): per-head keys and values are
rebuilt from the cached latents, as the checkpoint's reference does.
"""

from __future__ import annotations

import mlx.core as mx

from turbospark_core.family import AttentionCache, WeightStore, rms_norm

from turbospark_deepseek.args import LATENT_EPS, Args
from turbospark_deepseek.moe import float_matrix
from turbospark_deepseek.rope import LatentRope


class LatentAttention:
    def __init__(self, args: Args, w: WeightStore, prefix: str) -> None:
        self.n_heads = H = args.num_attention_heads
        self.dn, self.dr = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.dv, self.r = args.v_head_dim, args.kv_lora_rank
        if args.q_lora_rank is None:
            self.q_proj = w.linear(f"{prefix}.q_proj")
            self.q_a_proj = self.q_b_proj = None
            self.q_a_norm = None
        else:
            self.q_a_proj = w.linear(f"{prefix}.q_a_proj")
            self.q_a_norm = w.tensor(f"{prefix}.q_a_layernorm.weight")
            self.q_b_proj = w.linear(f"{prefix}.q_b_proj")
        self.kv_a_proj = w.linear(f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_norm = w.tensor(f"{prefix}.kv_a_layernorm.weight")
        # kv_b_proj rows per head: [k_nope (dn) | v (dv)], each a map from the latent (r)
        per_head = float_matrix(w, f"{prefix}.kv_b_proj").reshape(H, self.dn + self.dv, self.r)
        self.w_uk = mx.contiguous(per_head[:, : self.dn, :])  # [H, dn, r]: q_nope -> latent query
        self.w_uk_t = mx.contiguous(self.w_uk.swapaxes(-1, -2))  # [H, r, dn]: latent -> k_nope
        self.w_uv_t = mx.contiguous(per_head[:, self.dn :, :].swapaxes(-1, -2))  # [H, r, dv]: latent -> v
        self.o_proj = w.linear(f"{prefix}.o_proj")
        self.rope = LatentRope(self.dr, args.rope_theta, args.rope_scaling)
        self.scale = (self.dn + self.dr) ** -0.5 * self.rope.softmax_factor

    @property
    def derived(self) -> list[mx.array]:
        """The per-head up-projections cut from ``kv_b_proj`` (evaluated once at build)."""
        return [self.w_uk, self.w_uk_t, self.w_uv_t]

    # ------------------------------------------------------------ pieces
    def query(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array]:
        """``q_nope`` ``[B, H, L, dn]`` and rotated ``q_r`` ``[B, H, L, dr]``."""
        B, L, _ = x.shape
        if self.q_a_proj is None or self.q_b_proj is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(rms_norm(self.q_a_proj(x), self.q_a_norm, LATENT_EPS))
        q = q.reshape(B, L, self.n_heads, self.dn + self.dr).transpose(0, 2, 1, 3)
        return q[..., : self.dn], self.rope(q[..., self.dn :], offset)

    def cache_row(self, x: mx.array, offset: int | mx.array) -> mx.array:
        """What the cache holds for ``x``: ``[B, 1, L, r + dr]`` = ``[c | k_r]``."""
        a = self.kv_a_proj(x)
        c = rms_norm(a[..., : self.r], self.kv_a_norm, LATENT_EPS)
        k_r = self.rope(mx.expand_dims(a[..., self.r :], 1), offset)
        return mx.concatenate([mx.expand_dims(c, 1), k_r.astype(c.dtype)], axis=-1)

    def absorbed_query(self, q_nope: mx.array, q_r: mx.array) -> mx.array:
        """``[W_UK_h^T q_nope_h | q_r_h]`` ``[B, H, L, r + dr]``: a query against ``[c | k_r]``."""
        return mx.concatenate([q_nope @ self.w_uk, q_r], axis=-1)

    def absorbed(self, q: mx.array, keys: mx.array, mask: mx.array | str | None) -> mx.array:
        """Attention over the latent rows; ``[B, H, L, dv]``."""
        out = mx.fast.scaled_dot_product_attention(q, keys, keys[..., : self.r], scale=self.scale, mask=mask)
        return out @ self.w_uv_t

    def expanded(self, q_nope: mx.array, q_r: mx.array, keys: mx.array, mask: mx.array | str | None) -> mx.array:
        """Attention with per-head keys and values rebuilt from the latents; ``[B, H, L, dv]``."""
        B, _, S, _ = keys.shape
        latent = keys[..., : self.r]
        k_r = mx.broadcast_to(keys[..., self.r :], (B, self.n_heads, S, self.dr))
        k = mx.concatenate([latent @ self.w_uk_t, k_r], axis=-1)
        q = mx.concatenate([q_nope, q_r], axis=-1)
        return mx.fast.scaled_dot_product_attention(q, k, latent @ self.w_uv_t, scale=self.scale, mask=mask)

    def output(self, attended: mx.array) -> mx.array:
        B, _, L, _ = attended.shape
        return self.o_proj(attended.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def expand_is_cheaper(self, L: int, S: int) -> bool:
        """Multiply-adds of the two forms for ``L`` queries over ``S`` keys (per head)."""
        absorbed = L * (self.dn * self.r + S * (2 * self.r + self.dr) + self.r * self.dv)
        expanded = S * self.r * (self.dn + self.dv) + L * S * (2 * self.dn + self.dr + self.dv)
        return expanded < absorbed

    # ------------------------------------------------------------ the layer
    def __call__(self, x: mx.array, cache: AttentionCache | None) -> mx.array:
        L = x.shape[1]
        offset = 0 if cache is None else cache.offset
        q_nope, q_r = self.query(x, offset)
        row = self.cache_row(x, offset)
        mask: mx.array | str | None = "causal" if L > 1 else None
        keys = row
        if cache is not None:
            keys, _ = cache.update_and_fetch(row, row[..., :0])
            mask = cache.mask(L)
        if self.expand_is_cheaper(L, keys.shape[2]):
            return self.output(self.expanded(q_nope, q_r, keys, mask))
        return self.output(self.absorbed(self.absorbed_query(q_nope, q_r), keys, mask))
