"""KV quantization of the latent rows: q8 measured close to float, q4 refused by name."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core.convert import convert
from turbospark_core.errors import FamilyRefusalError, OptionError
from turbospark_core.testing import write_tiny_checkpoint

# A dense V2-Lite-style config whose cache row (kv_lora_rank + qk_rope_head_dim = 64) a 64-group divides
CFG = {
    "model_type": "deepseek_v2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "q_lora_rank": None, "kv_lora_rank": 48,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": None,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
    "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                     "mscale": 0.707, "mscale_all_dim": 0.707},
}  # fmt: skip


def _shapes() -> dict[str, tuple[int, ...]]:
    h, H, r, dr, dn, dv, inter = 64, 4, 48, 16, 16, 16, 96
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (256, h), "model.norm.weight": (h,),
                                       "lm_head.weight": (256, h)}  # fmt: skip
    for i in range(2):
        p = f"model.layers.{i}"
        out |= {
            f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (H * (dn + dr), h),
            f"{p}.self_attn.kv_a_proj_with_mqa.weight": (r + dr, h), f"{p}.self_attn.kv_a_layernorm.weight": (r,),
            f"{p}.self_attn.kv_b_proj.weight": (H * (dn + dv), r), f"{p}.self_attn.o_proj.weight": (h, H * dv),
            f"{p}.mlp.gate_proj.weight": (inter, h), f"{p}.mlp.up_proj.weight": (inter, h),
            f"{p}.mlp.down_proj.weight": (h, inter),
        }  # fmt: skip
    return out


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("kvq")
    convert(write_tiny_checkpoint(work / "hf", CFG, _shapes(), seed=4), work / "install")
    return work / "install"


def _decoded(runner: turbospark_core.Runner, ids: list[int]) -> np.ndarray:
    cache = runner.opened.new_cache()
    runner.model(mx.array([ids[:20]]), cache)
    return np.stack([np.array(runner.model(mx.array([[t]]), cache)[0, -1]) for t in ids[20:]])


def test_q8_latent_stays_close_and_is_smaller(install: Path) -> None:
    ids = np.random.default_rng(5).integers(3, 256, size=40).tolist()
    plain = turbospark_core.open(install)
    q8 = turbospark_core.open(install, kv_quant="q8")
    ref = _decoded(plain, ids)
    err = float(np.abs(_decoded(q8, ids) - ref).max() / np.abs(ref).max())
    assert err < 0.05, err  # a plain cache's q8 on a same-size random llama: ~0.015
    assert q8.opened.estimate.kv < plain.opened.estimate.kv / 3


def test_q4_latent_refused_by_name(install: Path) -> None:
    with pytest.raises(FamilyRefusalError, match=r"kv_quant='q4' refused by family 'deepseek'.*latent"):
        turbospark_core.open(install, kv_quant="q4")


def test_fixture_rows_no_group_divides_are_refused(turbospark_install: object) -> None:
    make = turbospark_install
    with pytest.raises(OptionError, match="head_dim 48"):  # kv_lora_rank 32 + qk_rope_head_dim 16
        turbospark_core.open(make("deepseek_v2"), kv_quant="q8")  # type: ignore[operator]
