"""deepseek_v3 (sigmoid scores + e_score_correction_bias, noaux_tc group routing, top-k renormalised):
a tiny random checkpoint against mlx-lm's deepseek_v3 as the oracle, and the structural harness."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core.convert import convert
from turbospark_core.testing import TinyRandomConformance, write_tiny_checkpoint

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


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def config(request: pytest.FixtureRequest) -> dict[str, Any]:
    return CONFIGS[request.param]


@pytest.fixture(scope="module")
def v3_checkpoint(tmp_path_factory: pytest.TempPathFactory, config: dict[str, Any]) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("v3") / "hf", config, v3_tensors(config), seed=3)


@pytest.fixture(scope="module")
def v3_runner(v3_checkpoint: Path) -> turbospark_core.Runner:
    dst = v3_checkpoint.parent / "install"
    convert(v3_checkpoint, dst)
    return turbospark_core.open(dst)


@pytest.fixture(scope="module")
def oracle(v3_checkpoint: Path, config: dict[str, Any]) -> Any:
    """mlx-lm's deepseek_v3 on the same weights (its MTP layer filtered out as its sanitize would for V3's 61)."""
    from mlx_lm.models import deepseek_v3

    model = deepseek_v3.Model(deepseek_v3.ModelArgs.from_dict(config))
    last = f"model.layers.{config['num_hidden_layers']}."
    weights = {k: v for k, v in mx.load(str(v3_checkpoint / "model.safetensors")).items() if not k.startswith(last)}
    model.load_weights(list(model.sanitize(weights).items()))
    mx.eval(model.parameters())
    return model


PROMPT = np.random.default_rng(5).integers(3, 256, size=40).tolist()


def test_mtp_layer_dropped_and_routing_recorded(v3_runner: turbospark_core.Runner, config: dict[str, Any]) -> None:
    arch = v3_runner.manifest.arch
    n = config["num_hidden_layers"]
    assert arch["num_hidden_layers"] == n and len(v3_runner.model.layers) == n
    moe = arch["moe"]
    assert (moe["scoring"], moe["topk_method"]) == ("sigmoid", "noaux_tc")
    assert moe["norm_topk_prob"] == config["norm_topk_prob"]
    assert moe["sparse_layers"] == [i for i in range(1, n) if i % config["moe_layer_freq"] == 0]


def test_float32_logits_match_mlx_lm(v3_runner: turbospark_core.Runner, oracle: Any) -> None:
    want = np.array(oracle(mx.array([PROMPT]))[0])
    got = v3_runner.logits(PROMPT)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_greedy_matches_mlx_lm_with_its_latent_cache(v3_runner: turbospark_core.Runner, oracle: Any) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(oracle)
    logits = oracle(mx.array([PROMPT]), cache=cache)[0, -1]
    want, steps = [], []
    for _ in range(12):
        token = int(mx.argmax(logits))
        want.append(token)
        steps.append(np.array(logits))
        logits = oracle(mx.array([[token]]), cache=cache)[0, -1]
    assert v3_runner.generate(PROMPT, max_tokens=12, temperature=0.0).tokens == want
    got = v3_runner.logits(PROMPT + want[:-1])[len(PROMPT) - 1 :]
    assert np.abs(got - np.stack(steps)).max() <= 1e-5 * np.abs(np.stack(steps)).max()


class TestDeepSeekV3Tiny(TinyRandomConformance):
    """Caching, batching, sessions, steering and the hook contract on the V3 routing."""

    compiled_decode = True  # its one-token decode step runs compiled
    tiny_configs: ClassVar[Mapping[str, Mapping[str, Any]]] = {"deepseek_v3": V3, "deepseek_v3_plain": V3_PLAIN}

    def tiny_tensors(self, hf_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        return v3_tensors(hf_config)
