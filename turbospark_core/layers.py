"""The objects families call: ``Linear``, ``Embedding``, and routed experts (the ``Experts`` protocol).

The weight store hands them out; families never see how a matrix is held.
:class:`Linear` is the one place a weight matrix is held and multiplied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import mlx.core as mx
import mlx.nn as nn

from turbospark_core import dequant, native
from turbospark_core.batch_cache import BatchKVCache
from turbospark_core.kv_cache import AttentionCache, KVCache, RingKVCache
from turbospark_core.rope import Rope
from turbospark_core.tensor_index import QuantSpec

Activation = Callable[[mx.array, mx.array], mx.array]
"""``(gate, up) -> hidden``, e.g. ``silu(gate) * up``."""

SORT_THRESHOLD = 64  # (token, expert) pairs from which ExpertBank.glu groups rows by expert


class Linear:
    """``y = x @ W.T (+ b)``, dense or through MLX's quantized matmul.

    An affine quantized matrix held with ``biases=None`` is symmetric: each
    group's bias is ``-2^(bits-1)`` times its scale (GGUF's Q8_0/Q4_0/Q6_K...),
    derived where needed instead of stored and read.
    """

    def __init__(
        self,
        weight: mx.array,
        bias: mx.array | None = None,
        *,
        quant: QuantSpec | None = None,
        scales: mx.array | None = None,
        biases: mx.array | None = None,
    ) -> None:
        if quant is not None and scales is None:
            msg = f"a quantized Linear ({quant.mode}, {quant.bits}-bit) needs its scales; pass scales= with quant="
            raise ValueError(msg)
        self.weight = weight
        self.bias = bias
        self.quant = quant
        self.scales = scales
        self.biases = biases
        # a dense matrix's transposed view, made once: a new ``weight.T`` per call would be one more graph
        # node per product and step
        self._weight_t = weight.T if quant is None else None

    @property
    def out_features(self) -> int:
        """Rows of the weight matrix."""
        return self.weight.shape[-2]

    def __call__(self, x: mx.array) -> mx.array:
        if self._weight_t is not None:
            return x @ self._weight_t if self.bias is None else mx.addmm(self.bias, x, self._weight_t)
        assert self.quant is not None and self.scales is not None  # __init__ gives every quantized Linear its scales
        y = native.quantized_matmul(x, self.weight, self.scales, self.biases, self.quant)
        return y if self.bias is None else y + self.bias


FUSE_MAX_BYTES = 64 << 20  # fused copies above this would add too much memory beside the stored weights


def fuse_linears(parts: list[Linear]) -> Linear | None:
    """One :class:`Linear` computing ``parts`` side by side (their outputs concatenated), or ``None``.

    Fusing matrices that read the same input (q/k/v, gate/up) makes one
    multiply, one dispatch and one pass over the input instead of several:
    thin models' decode steps are bound by per-op overhead. ``None`` when the
    parts are held differently (dense vs quantized, other bits or groups, some
    with a bias), on another input size, larger than :data:`FUSE_MAX_BYTES`
    together (the fused copy is held beside the stored weights), or not plain
    :class:`Linear` objects (a distributed rank's row-parallel or placeholder ones).
    """
    first = parts[0]
    same = all(
        type(p) is Linear
        and p.quant == first.quant
        and p.weight.dtype == first.weight.dtype
        and p.weight.shape[1:] == first.weight.shape[1:]
        and p.weight.ndim == 2
        and (p.bias is None) == (first.bias is None)
        and (p.biases is None) == (first.biases is None)
        and (p.scales is None) == (first.scales is None)
        and (p.scales is None or first.scales is None or p.scales.dtype == first.scales.dtype)
        for p in parts
    )
    size = sum(p.weight.nbytes + (0 if p.scales is None else 2 * p.scales.nbytes) for p in parts)
    if len(parts) < 2 or not same or size > FUSE_MAX_BYTES:
        return None

    def cat(arrays: list[mx.array | None]) -> mx.array | None:
        held = [a for a in arrays if a is not None]
        return mx.concatenate(held, axis=0) if len(held) == len(arrays) else None

    weight = cat([p.weight for p in parts])
    assert weight is not None
    fused = Linear(
        weight,
        cat([p.bias for p in parts]),
        quant=first.quant,
        scales=cat([p.scales for p in parts]),
        biases=cat([p.biases for p in parts]),
    )
    mx.eval([a for a in (fused.weight, fused.bias, fused.scales, fused.biases) if a is not None])
    return fused


def fused_parts(fused: Linear, sizes: list[int]) -> list[Linear]:
    """The parts of a :func:`fuse_linears` result as views into its arrays (rows ``sizes`` each).

    Families hold these in place of the originals, so the weights are held once.
    """
    out, start = [], 0
    for n in sizes:

        def rows(a: mx.array | None, lo: int = start, hi: int = start + n) -> mx.array | None:
            return None if a is None else a[lo:hi]

        weight = rows(fused.weight)
        assert weight is not None
        out.append(
            Linear(weight, rows(fused.bias), quant=fused.quant, scales=rows(fused.scales), biases=rows(fused.biases))
        )
        start += n
    parts = [a for p in out for a in (p.weight, p.bias, p.scales, p.biases) if a is not None]
    mx.eval(parts)  # views of the fused buffers (no copies)
    return out


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: mx.array | str | None = None,
    merge_heads: bool = False,
) -> mx.array:
    """``mx.fast.scaled_dot_product_attention``; one native op on the CPU.

    Families call it for attention over their caches and for prefill: it is
    then one op instead of MLX's CPU composition of about ten (whose softmax
    runs scalar exponentials), and each query's result is the same however
    many run together. ``merge_heads``: the result ``[B, L, H * Dv]``, the
    heads side by side as the output projection reads them (written so
    natively; a transpose and a reshape elsewhere).
    """
    if native.decode_attention_supported(q, k, v, mask):
        return native.decode_attention(q, k, v, scale, mask, merge_heads)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return out.transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[2], -1) if merge_heads else out


def cached_attention(
    q: mx.array, k: mx.array, v: mx.array, cache: AttentionCache, *, scale: float, merge_heads: bool = False
) -> mx.array:
    """``k``/``v`` added to ``cache`` and ``q`` attending to what it holds (under its mask).

    A full float cache on the CPU (or a ring still below its window) does both
    in one native op (the new rows written into its buffers in place, attention
    over their filled part); otherwise :meth:`update_and_fetch`, the cache's mask and :func:`attention`.
    """
    if isinstance(cache, (KVCache, RingKVCache)):
        out = cache.attend(q, k, v, scale, merge_heads)
        if out is not None:
            return out
    keys, values = cache.update_and_fetch(k, v)
    return attention(q, keys, values, scale=scale, mask=cache.mask(q.shape[2]), merge_heads=merge_heads)


def rope_heads(
    projections: mx.array | Sequence[mx.array],
    rope: Rope,
    *,
    heads: int,
    kv_heads: int,
    offset: int | mx.array,
    norms: tuple[mx.array, mx.array] | None = None,
    eps: float = 0.0,
) -> tuple[mx.array, mx.array, mx.array]:
    """Attention's q, k and v heads ``[B, H, L, D]`` from its projections, q and k rotated by ``rope``.

    ``projections``: the fused q/k/v product ``[B, L, (heads + 2 kv_heads) * D]``,
    or ``(q, k, v)`` each ``[B, L, H * D]``. ``norms``: q's and k's RMSNorm
    weights ``[D]``, applied to each head before the rotation (a per-head
    "qk norm", with ``eps``). One native op on the CPU; elsewhere the split,
    reshapes, transposes, norms and RoPEs it stands for.
    """
    parts = [projections] if isinstance(projections, mx.array) else list(projections)
    if native.rope_heads_supported(parts, heads, kv_heads, offset, norms):
        return native.rope_heads(
            parts, heads, kv_heads, dims=rope.dims, scale=rope.scale, mscale=rope.mscale, offset=offset,
            freqs=rope.freqs, norms=norms, eps=eps,
        )  # fmt: skip
    if len(parts) == 1:
        d = parts[0].shape[-1] // (heads + 2 * kv_heads)
        q, k, v = mx.split(parts[0], [heads * d, (heads + kv_heads) * d], axis=-1)
    else:
        q, k, v = parts
    B, L = q.shape[:2]
    q = q.reshape(B, L, heads, -1).transpose(0, 2, 1, 3)
    k = k.reshape(B, L, kv_heads, -1).transpose(0, 2, 1, 3)
    v = v.reshape(B, L, kv_heads, -1).transpose(0, 2, 1, 3)
    if norms is not None:
        q, k = rms_norm(q, norms[0], eps), rms_norm(k, norms[1], eps)
    return rope(q, offset), rope(k, offset), v


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """``mx.fast.rms_norm``; one native op on the CPU (where MLX composes three).

    Families call it for every RMSNorm: a thin model's decode step runs
    dozens of them.
    """
    if native.rms_norm_supported(x, weight):
        return native.rms_norm(x, weight, eps)
    return mx.fast.rms_norm(x, weight, eps)


def silu_mul(gate: mx.array, up: mx.array | None = None) -> mx.array:
    """``silu(gate) * up`` (the SwiGLU activation); one vectorized native op on the CPU.

    ``up=None``: ``gate`` is a fused gate/up product ``[..., 2n]`` (gate's half
    first), read in place without a split.
    """
    if native.gated_supported(gate, up):
        return native.silu_mul(gate, up)
    if up is None:
        gate, up = mx.split(gate, 2, axis=-1)
    return gate * mx.sigmoid(gate) * up


def gelu_tanh_mul(gate: mx.array, up: mx.array | None = None) -> mx.array:
    """``gelu_tanh(gate) * up`` (GeGLU with the tanh GELU, ``mlx.nn.gelu_approx``); one native op on the CPU.

    ``up=None``: ``gate`` is a fused gate/up product, as :func:`silu_mul` takes it.
    """
    if native.gated_supported(gate, up):
        return native.gelu_tanh_mul(gate, up)
    if up is None:
        gate, up = mx.split(gate, 2, axis=-1)
    out: mx.array = nn.gelu_approx(gate) * up  # mlx.nn's activations are unannotated
    return out


GATED: dict[str, Callable[[mx.array, mx.array | None], mx.array]] = {
    "silu_mul": silu_mul,
    "gelu_tanh_mul": gelu_tanh_mul,
}
"""The gated activations :func:`linear_gated` takes, by name."""


def _held_natively(proj: Linear) -> bool:
    # a plain quantized Linear without a bias: anything else (a distributed rank's subclass, a wrapper that
    # observes its inputs) is called as itself
    return type(proj) is Linear and proj.quant is not None and proj.scales is not None and proj.bias is None


PostNorm = tuple[mx.array | None, float]
"""An RMSNorm applied to a projection's output before its residual add: ``(weight, eps)``."""


def linear_plus(proj: Linear, x: mx.array, residual: mx.array, *, post_norm: PostNorm | None = None) -> mx.array:
    """``residual + proj(x)``: a projection that feeds the residual stream (attention's output, the MLP's down).

    ``post_norm``: ``residual + rms_norm(proj(x), *post_norm)`` (Gemma's
    sandwich norms). A quantized matrix on the CPU normalizes and adds as its
    product is written (one op instead of up to three; the same result).
    """
    return _fused(proj, x, residual, post_norm, "", None, 0.0, lambda: proj(x))


def linear_normed(proj: Linear, x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """``proj(rms_norm(x, weight, eps))``: a projection of a normalized input (q/k/v, the MLP's gate/up).

    A quantized matrix on the CPU normalizes the rows of ``x`` inside its
    product (the same kernel as :func:`rms_norm`; one op instead of two).
    """
    if weight is not None and weight.shape != (x.shape[-1],):
        return proj(rms_norm(x, weight, eps))
    return _fused(proj, x, None, None, "rms_norm", weight, eps, lambda: proj(rms_norm(x, weight, eps)))


def linear_gated(
    proj: Linear,
    gate_up: mx.array,
    activation: str,
    residual: mx.array | None = None,
    *,
    post_norm: PostNorm | None = None,
) -> mx.array:
    """``residual + proj(act(gate) * up)`` from the fused gate/up product ``[..., 2F]`` (a gated MLP's down).

    ``activation``: ``"silu_mul"`` (SwiGLU) or ``"gelu_tanh_mul"`` (GeGLU);
    ``residual`` optional; ``post_norm`` as :func:`linear_plus`. A quantized
    matrix on the CPU applies the activation inside its product (the same
    kernel as :func:`silu_mul` / :func:`gelu_tanh_mul`; one op instead of two).
    """
    if activation not in GATED:
        msg = f"gated activation {activation!r} is not one of {sorted(GATED)}; pass 'silu_mul' or 'gelu_tanh_mul'"
        raise ValueError(msg)
    act = GATED[activation]
    return _fused(proj, gate_up, residual, post_norm, activation, None, 0.0, lambda: proj(act(gate_up, None)))


def _fused(
    proj: Linear,
    x: mx.array,
    residual: mx.array | None,
    post_norm: PostNorm | None,
    prologue: str,
    weight: mx.array | None,
    eps: float,
    apart: Callable[[], mx.array],
) -> mx.array:
    """``residual + post_norm(proj(prologue(x)))``: one native product where it can be, else ``apart()`` and so on."""
    post_weight = None if post_norm is None else post_norm[0]
    if _held_natively(proj):
        assert proj.quant is not None and proj.scales is not None
        held = [w for w in (weight, post_weight) if w is not None]
        if native.prologue_supported(x, proj.quant) and all(native.prologue_supported(w, proj.quant) for w in held):
            return native.quantized_matmul(
                x, proj.weight, proj.scales, proj.biases, proj.quant, residual, prologue=prologue,
                prologue_weight=weight, eps=eps, post_norm=post_norm,
            )  # fmt: skip
    y = apart()
    if post_norm is not None:
        y = rms_norm(y, *post_norm)
    return y if residual is None else residual + y


_FUSED = {"off": 0, "steps": 0}  # parts_only() depth; steps the fused layers have built


@contextlib.contextmanager
def parts_only() -> Iterator[None]:
    """Fused layers decline inside (every :class:`FusedLayer` answers ``None``): the flows run their parts.

    For checks that a fused step equals its parts (the conformance harness).
    """
    _FUSED["off"] += 1
    try:
        yield
    finally:
        _FUSED["off"] -= 1


def fused_steps() -> int:
    """How many layer steps :class:`FusedLayer` has built as one op so far (in this process)."""
    return _FUSED["steps"]


class FusedLayer:
    """A pre-norm decoder layer's step as one native op (CPU, float32 activations).

    What a family's layer of these parts computes::

        q, k, v = heads(qkv(rms_norm(x, input_norm)))      # rotated (q/k head norms optional)
        h = x + post_attention_norm(o_proj(attention(q, k, v over the cache)))
        y = h + post_mlp_norm(down(activation(gate_up(rms_norm(h, mlp_norm)))))

    with the post norms optional (Gemma's sandwich norms). Build it once per
    layer with :func:`fused_layer`; call it with the step's input and the
    layer's cache. The result is the parts' bit for bit (the same kernels in
    the same order: :func:`linear_normed`, :func:`rope_heads`,
    :func:`cached_attention`, :func:`linear_plus`, :func:`linear_gated`), in
    one graph node instead of about six. The cache: a full one, a ring below
    its window, or a batch's (each row rotated at its own positions and
    attending under the batch's mask, as the batched parts do). ``None`` (the
    cache untouched) where the step cannot run so: activations not float32 on
    the CPU, rows quantized or rotated, a ring past its window; the family
    then runs its parts.
    """

    def __init__(
        self,
        norms: list[mx.array | None],
        matrices: list[native.QuantizedMatrix],
        *,
        heads: int,
        kv_heads: int,
        rope: Rope,
        scale: float,
        eps: float,
        activation: str,
        projections: int = 1,
    ) -> None:
        self.norms = norms
        self.matrices = matrices
        self.heads, self.kv_heads, self.rope, self.scale, self.eps = heads, kv_heads, rope, scale, eps
        self.activation = activation
        self.projections = projections
        self.next: native.QuantizedMatrix | None = None
        self._op = self._build()

    def _build(self) -> native.LayerStep:
        return native.decoder_layer_op(
            self.norms, self.matrices if self.next is None else [*self.matrices, self.next], heads=self.heads,
            kv_heads=self.kv_heads, rope=self.rope, eps=self.eps, scale=self.scale, activation=self.activation,
            projections=self.projections,
        )  # fmt: skip

    def read_ahead(self, following: FusedLayer | None) -> None:
        """Prefetch ``following``'s first matrix while this layer's last product ends (the next layer's step)."""
        self.next = None if following is None else following.matrices[0]
        self._op = self._build()

    def __call__(self, x: mx.array, cache: AttentionCache) -> mx.array | None:
        if _FUSED["off"] or not isinstance(cache, (KVCache, RingKVCache, BatchKVCache)):
            return None
        if not native.decoder_layer_supported(x):
            return None
        step = cache.step_buffers(x.shape[0], x.shape[1])  # a batch takes its step's columns here
        if step is None or step.keys.dtype != mx.float32 or step.values.dtype != mx.float32:
            return None
        y, k_buf, v_buf = self._op(x, step.keys, step.values, step.column, step.positions, step.mask)
        cache.commit_step(k_buf, v_buf, x.shape[1])
        _FUSED["steps"] += 1
        return y


def fused_layer(
    *,
    input_norm: mx.array,
    qkv: Linear | Sequence[Linear] | None,
    o_proj: Linear,
    mlp_norm: mx.array,
    gate_up: Linear | None,
    down: Linear,
    heads: int,
    kv_heads: int,
    rope: Rope,
    scale: float,
    eps: float,
    activation: str = "silu_mul",
    head_norms: tuple[mx.array, mx.array] | None = None,
    post_attention_norm: mx.array | None = None,
    post_mlp_norm: mx.array | None = None,
) -> FusedLayer | None:
    """A layer's :class:`FusedLayer`, or ``None`` where its parts cannot run as one native op.

    ``qkv``: the fused q/k/v product (:func:`fuse_linears`), or q, k and v
    apart; ``gate_up``: the fused gate/up product; every matrix held
    natively (quantized, no bias, a plain :class:`Linear`: not on a
    distributed rank or observed by a diagnostic); every norm weight float32;
    ``eps`` every norm's; ``activation`` one of :data:`GATED`.
    """
    norms = [input_norm, mlp_norm, post_attention_norm, post_mlp_norm, *(head_norms or (None, None))]
    if not native.available() or activation not in GATED or any(w is not None and w.dtype != mx.float32 for w in norms):
        return None
    projections = [qkv] if qkv is None or isinstance(qkv, Linear) else list(qkv)
    if len(projections) not in (1, 3):
        return None
    matrices: list[native.QuantizedMatrix] = []
    for p in (*projections, o_proj, gate_up, down):
        if p is None or not _held_natively(p) or p.quant is None or p.scales is None or not native.keeps(p.quant):
            return None
        matrices.append((p.weight, p.scales, p.biases, p.quant))
    return FusedLayer(
        norms, matrices, heads=heads, kv_heads=kv_heads, rope=rope, scale=scale, eps=eps, activation=activation,
        projections=len(projections),
    )  # fmt: skip


class Embedding:
    """Token embedding table, also usable as a tied output head.

    Rows come back in ``dtype`` (the compute dtype), whatever the storage.
    """

    def __init__(self, table: Linear, dtype: mx.Dtype | None = None) -> None:
        self.table = table
        self.dtype = dtype

    def __call__(self, ids: mx.array) -> mx.array:
        rows = self._rows(ids)
        return rows if self.dtype is None or rows.dtype == self.dtype else rows.astype(self.dtype)

    def _rows(self, ids: mx.array) -> mx.array:
        t = self.table
        if t.quant is None or t.scales is None:
            return t.weight[ids]
        w, scales, biases = t.weight[ids], t.scales[ids], None if t.biases is None else t.biases[ids]
        float32 = self.dtype is not None and self.dtype == mx.float32  # rows in the dtype dequantize gives
        if t.quant.mode == "affine" and float32 and native.kv_rows_supported(w, scales):
            # one native op (MLX composes about twenty on the CPU); scale * code is exact in float32, so
            # its fused multiply-add has dequantize's bits
            return native.kv_rows(w, scales, biases, t.quant.bits, False)
        # only the gathered rows are dequantized; affine scales widened first, as at unpacking
        return dequant.dequantize(w, scales, biases, t.quant, self.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        """Project hidden states onto the vocabulary (tied head)."""
        return self.table(x)


@runtime_checkable
class Experts(Protocol):
    """Routed experts of one MoE layer, as families call them.

    Families route, then call :meth:`glu` with the chosen expert indices; how
    the experts are held (all resident, or streamed through slots) is the core's
    business. :class:`ExpertBank` and the streamed bank both satisfy it.
    """

    @property
    def num_experts(self) -> int:
        """How many experts the layer has."""
        ...

    def glu(
        self, x: mx.array, indices: mx.array, activation: Activation, weights: mx.array | None = None
    ) -> mx.array:
        """Gated expert MLP for each chosen expert.

        Args:
            x: Hidden states ``[..., D]``.
            indices: Chosen experts ``[..., k]`` (integer).
            activation: ``(gate, up) -> hidden``, e.g. ``silu(gate) * up``.
            weights: The routing weights ``[..., k]`` the family applies
                afterwards; only observed (the router histogram's weight
                mass), never applied here.

        Returns:
            ``[..., k, D]``: each chosen expert's output (unweighted).
        """
        ...


class ExpertBank:
    """Every expert of one routed layer in memory: stacked ``[num_experts, out, in]`` projections."""

    def __init__(self, gate: Linear, up: Linear, down: Linear) -> None:
        self.gate, self.up, self.down = gate, up, down

    @property
    def num_experts(self) -> int:
        """How many experts the layer has."""
        return self.gate.weight.shape[0]

    def glu(
        self, x: mx.array, indices: mx.array, activation: Activation, weights: mx.array | None = None
    ) -> mx.array:
        """Gated expert MLP for each chosen expert (see :meth:`Experts.glu`; ``weights`` is not used)."""
        if indices.size >= SORT_THRESHOLD:
            return self._glu_sorted(x, indices, activation)
        xe = mx.expand_dims(x, (-2, -3))
        h = activation(_gather(self.gate, xe, indices), _gather(self.up, xe, indices))
        return _gather(self.down, h, indices).squeeze(-2)

    def _glu_sorted(self, x: mx.array, indices: mx.array, activation: Activation) -> mx.array:
        # Many (token, expert) pairs: group them by expert so each expert's rows are contiguous
        k = indices.shape[-1]
        flat = indices.flatten()
        order = mx.argsort(flat)
        rows = mx.expand_dims(x.reshape(-1, x.shape[-1])[order // k], -2)
        idx = flat[order]
        h = activation(_gather(self.gate, rows, idx, True), _gather(self.up, rows, idx, True))
        y = _gather(self.down, h, idx, True).squeeze(-2)
        return y[mx.argsort(order)].reshape(*indices.shape, y.shape[-1])


def _gather(proj: Linear, x: mx.array, indices: mx.array, is_sorted: bool = False) -> mx.array:
    if proj.quant is None or proj.scales is None:
        y = mx.gather_mm(x, proj.weight.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=is_sorted)
    else:
        y = native.gather_quantized_matmul(x, proj.weight, proj.scales, proj.biases, indices, proj.quant)
    if proj.bias is not None:
        y = y + mx.expand_dims(proj.bias[indices], -2)
    return y
