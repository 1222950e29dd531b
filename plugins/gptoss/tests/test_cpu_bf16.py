"""A bf16 MoE install runs on the CPU: the core unpacks it to float32 (gather_mm is float32-only there)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core


@pytest.fixture(scope="module")
def on_cpu() -> Iterator[None]:
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(before)


@pytest.fixture(scope="module")
def bf16_runner(on_cpu: None, turbospark_install: Any) -> turbospark_core.Runner:
    return turbospark_core.open(turbospark_install("gpt_oss", "bf16"))


def test_bf16_experts_held_as_float32_on_cpu(bf16_runner: turbospark_core.Runner) -> None:
    policy = bf16_runner.opened.policy
    assert policy.unpack and policy.compute_dtype == mx.float32
    experts = bf16_runner.model.layers[0].mlp.experts
    assert {experts.gate.weight.dtype, experts.up.weight.dtype, experts.down.weight.dtype} == {mx.float32}
    assert bf16_runner.opened.manifest.arch["model_type"] == "gpt_oss"


def test_bf16_install_generates_the_bf16_reference(
    bf16_runner: turbospark_core.Runner, turbospark_fixtures: Path
) -> None:
    refs = np.load(turbospark_fixtures / "gpt_oss" / "references.npz")
    want = refs["greedy_tokens_bf16_weights"].tolist()
    gen = bf16_runner.generate(refs["prompt_ids"].tolist(), max_tokens=len(want), temperature=0.0)
    assert gen.tokens == want
    assert gen.stats.generation_tokens == len(want) and gen.stats.generation_tps > 0
