"""Tiny DeepSeek-V3 checkpoints: two configs and their Hugging Face tensor shapes (for ``write_tiny_checkpoint``).

Shared by this plugin's tests and the launched distributed checks (``tests/test_distributed_launch.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

V3: dict[str, Any] = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "qk_nope_head_dim": 16, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": True, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "moe_layer_freq": 1,
    "first_k_dense_replace": 1, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
    "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu", "num_nextn_predict_layers": 1,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


# V3 routing without groups or renormalisation, a plain q_proj, and MoE on every other layer only
V3_PLAIN: dict[str, Any] = V3 | {
    "num_hidden_layers": 4, "q_lora_rank": None, "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
    "moe_layer_freq": 2, "num_nextn_predict_layers": 0, "routed_scaling_factor": 1.5,
}  # fmt: skip
CONFIGS = {"v3": V3, "v3_plain": V3_PLAIN}


def v3_tensors(cfg: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names/shapes of a DeepSeek-V3 checkpoint, plus one MTP layer (dropped at conversion)."""
    h, H, r, dr = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    dn, dv, qr = cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["q_lora_rank"]
    E, mi = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,),
        "lm_head.weight": (cfg["vocab_size"], h),
    }  # fmt: skip

    def mlp(prefix: str, width: int) -> dict[str, tuple[int, ...]]:
        return {f"{prefix}.gate_proj.weight": (width, h), f"{prefix}.up_proj.weight": (width, h),
                f"{prefix}.down_proj.weight": (h, width)}  # fmt: skip

    for i in range(cfg["num_hidden_layers"] + cfg.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{i}"
        if qr is None:
            shapes[f"{p}.self_attn.q_proj.weight"] = (H * (dn + dr), h)
        else:
            shapes |= {
                f"{p}.self_attn.q_a_proj.weight": (qr, h), f"{p}.self_attn.q_a_layernorm.weight": (qr,),
                f"{p}.self_attn.q_b_proj.weight": (H * (dn + dr), qr),
            }  # fmt: skip
        shapes |= {
            f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.kv_a_proj_with_mqa.weight": (r + dr, h), f"{p}.self_attn.kv_a_layernorm.weight": (r,),
            f"{p}.self_attn.kv_b_proj.weight": (H * (dn + dv), r), f"{p}.self_attn.o_proj.weight": (h, H * dv),
        }  # fmt: skip
        if i < cfg["first_k_dense_replace"] or i % cfg.get("moe_layer_freq", 1):
            shapes |= mlp(f"{p}.mlp", cfg["intermediate_size"])
            continue
        shapes |= {f"{p}.mlp.gate.weight": (E, h), f"{p}.mlp.gate.e_score_correction_bias": (E,)}
        shapes |= mlp(f"{p}.mlp.shared_experts", mi * cfg["n_shared_experts"])
        for e in range(E):
            shapes |= mlp(f"{p}.mlp.experts.{e}", mi)
        if i >= cfg["num_hidden_layers"]:  # the MTP layer's own tensors
            shapes |= {f"{p}.eh_proj.weight": (h, 2 * h), f"{p}.enorm.weight": (h,), f"{p}.hnorm.weight": (h,)}
    return shapes
