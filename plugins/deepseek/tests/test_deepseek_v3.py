"""deepseek_v3 (sigmoid scores + e_score_correction_bias, noaux_tc group routing, top-k renormalised):
a tiny random checkpoint against mlx-lm's deepseek_v3 as the oracle, and the structural harness."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np
import pytest
from tiny_v3 import CONFIGS, V3, V3_PLAIN, v3_tensors

import turbospark_core
from turbospark_core.convert import convert
from turbospark_core.testing import TinyRandomConformance, write_tiny_checkpoint


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
