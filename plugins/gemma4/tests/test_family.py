"""The flow's own refusals, KV-sharing plan and proportional RoPE."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core.family import ArchConfigError, CacheSpec, VisionInputs

from turbospark_gemma4.family import Args, RopeArgs, make_rope

SLIDING, FULL = "sliding_attention", "full_attention"
BASE: dict[str, Any] = {
    "model_type": "gemma4", "hidden_size": 64, "num_hidden_layers": 5, "intermediate_size": 96,
    "vocab_size": 512, "max_position_embeddings": 256, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": None,
    "layer_types": [SLIDING, SLIDING, FULL, SLIDING, FULL], "sliding_window": 16,
    "rope_parameters": {
        SLIDING: {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0, "factor": 1.0},
        FULL: {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25, "factor": 1.0},
    },
    "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 10.0,
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 512, "num_kv_shared_layers": 2,
    "attention_k_eq_v": False, "use_double_wide_mlp": True, "moe": None, "tie_word_embeddings": True,
}


def test_valid_arch_and_kv_sharing_plan() -> None:
    assert Args.problems(BASE) == []
    args = Args.from_arch(BASE)
    # the last layer of each type before the shared block stores K/V for the shared layers
    assert [args.kv_source(i) for i in range(5)] == [0, 1, 2, 1, 2]
    assert args.cache_layout() == [
        CacheSpec.sliding(1, 16, 16), CacheSpec.sliding(1, 16, 16), CacheSpec.full(1, 32)
    ]


def test_k_eq_v_full_layers_use_global_kv_heads() -> None:
    args = Args.from_arch({**BASE, "attention_k_eq_v": True, "num_global_key_value_heads": 2,
                           "num_kv_shared_layers": 0})
    assert [s.n_kv_heads for s in args.cache_layout()] == [1, 1, 2, 1, 2]


def _with(change: dict[str, Any]) -> dict[str, Any]:
    arch = copy.deepcopy(BASE)
    for key, value in change.items():
        if key == "full_rope_type":
            arch["rope_parameters"][FULL]["rope_type"] = value
        else:
            arch[key] = value
    return arch


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"layer_types": [SLIDING, "chunked_attention", FULL, SLIDING, FULL]}, "layer_types"),
        ({"layer_types": [SLIDING, FULL]}, "layer_types"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"full_rope_type": "yarn"}, "yarn"),
        ({"rope_parameters": {SLIDING: BASE["rope_parameters"][SLIDING]}}, "full_attention"),
        ({"num_kv_shared_layers": 5}, "num_kv_shared_layers"),
        ({"layer_types": [FULL, FULL, FULL, SLIDING, FULL]}, "sliding_attention"),
        ({"moe": {"num_experts": 4, "top_k": 5, "moe_intermediate_size": 8}}, "top_k"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ],
)
def test_unsupported_arch_refused_by_name(change: dict[str, Any], named: str) -> None:
    arch = _with(change)
    assert any(named in p for p in Args.problems(arch))
    with pytest.raises(ArchConfigError, match=named):
        Args.from_arch(arch)


def _hf_rope(x: np.ndarray, inv_freq: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """transformers' apply_rotary_pos_emb (half-split layout) on [L, D]."""
    freqs = positions[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def test_proportional_rope_matches_transformers_formula() -> None:
    head_dim, theta = 32, 1e6
    angles = int(0.25 * head_dim // 2)
    inv = np.zeros(head_dim // 2)
    inv[:angles] = 1.0 / theta ** (np.arange(0, 2 * angles, 2) / head_dim)
    x = np.random.default_rng(0).standard_normal((6, head_dim)).astype(np.float32)
    rope = make_rope(head_dim, RopeArgs(rope_type="proportional", rope_theta=theta, partial_rotary_factor=0.25))
    got = np.array(rope(mx.array(x)[None, None], offset=5)[0, 0])
    want = _hf_rope(x.astype(np.float64), inv, np.arange(5, 11, dtype=np.float64))
    assert np.abs(got - want).max() < 1e-5
    assert np.array_equal(got[:, angles : head_dim // 2], x[:, angles : head_dim // 2])  # unrotated pairs


def test_kv_shared_layers_compute_no_keys(turbospark_install: Any) -> None:
    runner = turbospark_core.open(turbospark_install("gemma4_e"))
    attn = [block.self_attn for block in runner.model.layers]
    assert [a.owns_kv for a in attn] == [True, True, True, False, False]
    assert len(runner.opened.new_cache()) == 3
    # double-wide MLP on the KV-shared layers
    assert runner.model.layers[4].mlp.gate_proj.out_features == 2 * runner.model.layers[0].mlp.gate_proj.out_features


def _vision(ref: Any, case: str) -> tuple[mx.array, VisionInputs]:
    ids = mx.array(ref[f"{case}_input_ids"])[None]
    return ids, VisionInputs(mask=ids == 11, embeds=mx.array(ref[f"{case}_image_embeds"]))


@pytest.mark.parametrize("name", ["gemma4_e", "gemma4_moe"])
@pytest.mark.parametrize("case", ["one", "two"])
def test_image_rows_enter_unscaled_and_logits_match(
    turbospark_install: Any, turbospark_fixtures: Path, name: str, case: str
) -> None:
    """From the stored expanded ids and image embeddings: layer-0 input, logits, greedy steps with the cache."""
    ref = np.load(turbospark_fixtures / name / "references_vision.npz")
    runner = turbospark_core.open(turbospark_install(name))
    model = runner.model
    ids, vision = _vision(ref, case)
    h, _ = model.embed(ids, vision)
    assert np.abs(np.array(h[0]) - ref[f"{case}_inputs_embeds"]).max() <= 1e-5
    assert np.abs(np.array(model(ids, None, vision=vision)[0]) - ref[f"{case}_logits"]).max() <= 1e-4
    cache = runner.opened.new_cache()
    logits = model(ids, cache, vision=vision)[0, -1]
    for step, want in enumerate(ref[f"{case}_greedy_tokens"]):
        assert np.abs(np.array(logits) - ref[f"{case}_greedy_step_logits"][step]).max() <= 1e-4
        assert int(mx.argmax(logits).item()) == want
        logits = model(mx.array([[int(want)]]), cache, vision=VisionInputs())[0, -1]


def test_image_rows_per_layer_inputs_read_the_pad_id(turbospark_install: Any, turbospark_fixtures: Path) -> None:
    """The reference match above depends on it: the image id in the per-layer token part moves the logits."""
    ref = np.load(turbospark_fixtures / "gemma4_e" / "references_vision.npz")
    model = turbospark_core.open(turbospark_install("gemma4_e")).model
    assert model.args.pad_token_id == 0
    ids, vision = _vision(ref, "one")
    model.args = attrs.evolve(model.args, pad_token_id=11)
    assert np.abs(np.array(model(ids, None, vision=vision)[0]) - ref["one_logits"]).max() > 0.1


def test_arch_without_a_pad_id_reads_zero() -> None:
    arch = {k: v for k, v in BASE.items() if k != "pad_token_id"}
    assert Args.from_arch(arch).pad_token_id == 0
    assert Args.from_arch({**arch, "pad_token_id": 3}).pad_token_id == 3
    with pytest.raises(ArchConfigError, match="pad_token_id"):
        Args.from_arch({**arch, "pad_token_id": -1})
