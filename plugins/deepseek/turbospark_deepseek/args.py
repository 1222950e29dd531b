"""The DeepSeek flow's arch config: typed, bounded, every unsupported value refused by name."""

from __future__ import annotations

from typing import Any

import attrs

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
    bool_problem,
    float_problems,
    index_list_problem,
    int_problem,
    int_problems,
    is_int,
    keys_problem,
    rope_scaling_problems,
)

from turbospark_deepseek import MODEL_TYPES, REFUSED_MODEL_TYPES

LATENT_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm, whatever rms_norm_eps says (as every reference)
ROUTINGS = (("softmax", "greedy"), ("softmax", "group_limited_greedy"), ("sigmoid", "noaux_tc"))


@attrs.frozen(kw_only=True)
class MoEArgs:
    num_experts: int
    top_k: int
    scoring: str
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    n_shared_experts: int
    sparse_layers: tuple[int, ...] = attrs.field(converter=tuple)


@attrs.frozen(kw_only=True)
class Args:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int
    moe_intermediate_size: int | None
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = attrs.field(eq=False)
    tie_word_embeddings: bool
    moe: MoEArgs | None

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
            vocab_size=arch["vocab_size"],
            intermediate_size=arch["intermediate_size"],
            moe_intermediate_size=arch.get("moe_intermediate_size"),
            q_lora_rank=arch.get("q_lora_rank"),
            kv_lora_rank=arch["kv_lora_rank"],
            qk_nope_head_dim=arch["qk_nope_head_dim"],
            qk_rope_head_dim=arch["qk_rope_head_dim"],
            v_head_dim=arch["v_head_dim"],
            rms_norm_eps=float(arch["rms_norm_eps"]),
            rope_theta=float(arch["rope_theta"]),
            rope_scaling=arch.get("rope_scaling"),
            tie_word_embeddings=bool(arch.get("tie_word_embeddings", False)),
            moe=MoEArgs(**moe) if moe else None,
        )

    @staticmethod
    def problems(arch: dict[str, Any]) -> list[str]:
        """What in ``arch`` the flow cannot serve, each naming its key (empty when valid)."""
        model_type = arch.get("model_type")
        if model_type in REFUSED_MODEL_TYPES or str(model_type).startswith("deepseek_v4"):
            reason = REFUSED_MODEL_TYPES.get(str(model_type), "deepseek_v4* has no decode flow here")
            return [f"model type {model_type!r} is refused: {reason}"]
        if model_type not in MODEL_TYPES:
            return [f"model type {model_type!r} is not one of {MODEL_TYPES}"]
        out = _typed_problems(arch)
        if out:
            return out
        scaling = arch.get("rope_scaling")
        kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
        if kind not in (None, "default", "yarn"):
            out.append(f"rope_scaling type {kind!r} is not implemented by the DeepSeek flow (yarn or none)")
        if arch["qk_rope_head_dim"] % 2:
            out.append(f"qk_rope_head_dim={arch['qk_rope_head_dim']} must be even (rotary pairs)")
        moe = arch.get("moe")
        if moe:
            out += _moe_problems(moe, arch)
        return out

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def cache_layout(self) -> list[CacheSpec]:
        """Per layer: ONE shared key row ``[c | k_r]`` per token, no values (they are ``c``, read from the keys)."""
        spec = CacheSpec(n_kv_heads=1, head_dim=self.kv_lora_rank + self.qk_rope_head_dim, v_head_dim=0)
        return [spec] * self.num_hidden_layers


_INTS = {
    "hidden_size": MAX_HIDDEN, "num_hidden_layers": MAX_LAYERS, "num_attention_heads": MAX_HEADS,
    "vocab_size": MAX_VOCAB, "intermediate_size": MAX_INTERMEDIATE, "kv_lora_rank": MAX_HEAD_DIM,
    "qk_nope_head_dim": MAX_HEAD_DIM, "qk_rope_head_dim": MAX_HEAD_DIM, "v_head_dim": MAX_HEAD_DIM,
}  # fmt: skip
_OPTIONAL_INTS = {
    "q_lora_rank": MAX_HIDDEN, "moe_intermediate_size": MAX_INTERMEDIATE, "max_position_embeddings": MAX_POSITIONS,
}  # fmt: skip
_MOE_INTS = {
    "num_experts": MAX_EXPERTS, "top_k": MAX_EXPERTS, "n_group": MAX_EXPERTS, "topk_group": MAX_EXPERTS,
}  # fmt: skip


def _typed_problems(arch: dict[str, Any]) -> list[str]:
    """The type and range of every key :meth:`Args.from_arch` reads."""
    out = int_problems(arch, _INTS) + int_problems(arch, _OPTIONAL_INTS, optional=True)
    out += float_problems(arch, {"rms_norm_eps": 1.0}) + float_problems(arch, {"rope_theta": MAX_FLOAT}, low=1.0)
    out += rope_scaling_problems(arch.get("rope_scaling"))
    out += [p for p in [bool_problem(arch, "tie_word_embeddings", optional=True)] if p]
    moe = arch.get("moe")
    if moe is None or moe is False:
        return out
    if not isinstance(moe, dict):
        return [*out, f"'moe' must be an object or null (got {type(moe).__name__})"]
    problems = [keys_problem(moe, {a.name for a in attrs.fields(MoEArgs)}, "'moe'")]
    problems += int_problems(moe, _MOE_INTS, where="moe.")
    problems.append(int_problem(moe, "n_shared_experts", MAX_EXPERTS, low=0, where="moe."))
    problems.append(bool_problem(moe, "norm_topk_prob", where="moe."))
    problems += float_problems(moe, {"routed_scaling_factor": MAX_FLOAT}, where="moe.")
    layers = arch.get("num_hidden_layers")
    problems.append(index_list_problem(moe, "sparse_layers", layers if is_int(layers) else 0, where="moe."))
    if arch.get("moe_intermediate_size") is None:
        problems.append("'moe_intermediate_size' is needed by the MoE layers")
    return out + [p for p in problems if p]


def _moe_problems(moe: dict[str, Any], arch: dict[str, Any]) -> list[str]:
    out = []
    routing = (moe.get("scoring"), moe.get("topk_method"))
    if routing not in ROUTINGS:
        out.append(f"moe scoring/topk_method {routing!r} is not one of {ROUTINGS}")
    if routing[0] == "softmax" and moe["norm_topk_prob"]:
        out.append("moe.norm_topk_prob=true with softmax scoring is refused (the references disagree on it)")
    if not moe["top_k"] <= moe["num_experts"]:
        out.append(f"moe top_k={moe['top_k']} must be in [1, num_experts={moe['num_experts']}]")
    groups, keep = moe["n_group"], moe["topk_group"]
    if moe["num_experts"] % groups or keep > groups:
        out.append(
            f"moe n_group={groups} must divide num_experts={moe['num_experts']} and topk_group={keep} "
            f"must be at most n_group"
        )
    elif routing[1] != "greedy" and moe["top_k"] > keep * (moe["num_experts"] // groups):
        out.append(f"moe top_k={moe['top_k']} exceeds the experts of topk_group={keep} groups")
    elif routing[1] == "noaux_tc" and groups > 1 and moe["num_experts"] // groups < 2:
        out.append(f"moe noaux_tc group scores need at least 2 experts per group (n_group={groups})")
    del arch
    return out
