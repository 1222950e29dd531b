"""DeepSeekMoE: shared experts plus routed experts, softmax or sigmoid scoring, group-limited top-k."""

from __future__ import annotations

import mlx.core as mx

from turbospark_core.family import WeightStore, silu_mul

from turbospark_deepseek.args import MoEArgs


def float_matrix(w: WeightStore, base: str) -> mx.array:
    """The float matrix ``<base>.weight``, dequantized when the install quantized it (sliced, not multiplied)."""
    return w.tensor(base if base in w.index.quantization else f"{base}.weight")


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return silu_mul(gate, up)


class MLP:
    """A SwiGLU MLP (dense layers, and the shared experts as one MLP of their summed width)."""

    def __init__(self, w: WeightStore, prefix: str) -> None:
        self.gate_proj = w.linear(f"{prefix}.gate_proj")
        self.up_proj = w.linear(f"{prefix}.up_proj")
        self.down_proj = w.linear(f"{prefix}.down_proj")

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class Router:
    """Chooses ``top_k`` experts per token and their weights (float32 throughout).

    ``greedy``: top-k of the scores. ``group_limited_greedy`` (V2): the experts form
    ``n_group`` contiguous groups scored by their best expert; top-k among the
    ``topk_group`` best groups. ``noaux_tc`` (V3): sigmoid scores plus
    ``e_score_correction_bias`` choose (groups scored by their two best), the
    unbiased scores weigh. Weights are renormalised only when ``norm_topk_prob``,
    then multiplied by ``routed_scaling_factor``.
    """

    def __init__(self, args: MoEArgs, w: WeightStore, prefix: str) -> None:
        self.args = args
        self.weight = float_matrix(w, prefix).astype(mx.float32)
        noaux = args.topk_method == "noaux_tc"
        self.bias = w.tensor(f"{prefix}.e_score_correction_bias").astype(mx.float32) if noaux else None

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        a = self.args
        logits = x.astype(mx.float32) @ self.weight.T
        if a.scoring == "softmax":
            scores = mx.softmax(logits, axis=-1, precise=True)
            choice = scores
        else:
            scores = mx.sigmoid(logits)
            choice = scores if self.bias is None else scores + self.bias
        if a.topk_method != "greedy" and a.n_group > 1:
            choice = self._limit_groups(choice)
        inds = mx.stop_gradient(mx.argpartition(-choice, kth=a.top_k - 1, axis=-1)[..., : a.top_k])
        weights = mx.take_along_axis(scores, inds, axis=-1)
        if a.norm_topk_prob and a.top_k > 1:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return inds, weights * a.routed_scaling_factor

    def _limit_groups(self, choice: mx.array) -> mx.array:
        a = self.args
        grouped = mx.unflatten(choice, -1, (a.n_group, -1))
        if a.topk_method == "group_limited_greedy":
            group_scores = grouped.max(axis=-1, keepdims=True)
        else:
            group_scores = mx.topk(grouped, 2, axis=-1).sum(axis=-1, keepdims=True)
        dropped = a.n_group - a.topk_group
        if dropped == 0:
            return choice
        worst = mx.argpartition(group_scores, kth=dropped - 1, axis=-2)[..., :dropped, :]
        grouped = mx.put_along_axis(grouped, mx.stop_gradient(worst), mx.array(0.0, grouped.dtype), axis=-2)
        return mx.flatten(grouped, -2, -1)


class MoE:
    """Routed experts (from the core's expert objects: resident or streamed) plus shared experts."""

    def __init__(self, args: MoEArgs, w: WeightStore, prefix: str) -> None:
        self.router = Router(args, w, f"{prefix}.gate")
        self.experts = w.experts(f"{prefix}.experts", "gate_proj", "up_proj", "down_proj")
        self.shared = MLP(w, f"{prefix}.shared_experts") if args.n_shared_experts else None

    def __call__(self, x: mx.array) -> mx.array:
        inds, weights = self.router(x)
        return self.combine(x, self.experts.glu(x, inds, swiglu, weights=weights), weights)

    def combine(self, x: mx.array, y: mx.array, weights: mx.array) -> mx.array:
        """The chosen experts' outputs ``y`` ``[..., k, D]`` summed with their weights, plus the shared experts."""
        y = (y * weights[..., None]).sum(axis=-2).astype(x.dtype)
        return y if self.shared is None else y + self.shared(x)
