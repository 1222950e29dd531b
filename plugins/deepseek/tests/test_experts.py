"""Routed experts live in experts.bin; streamed through top_k slots per layer they give bit-identical results."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import turbospark_core


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v2_qlora"])
def test_streamed_experts_equal_resident_bit_for_bit(
    turbospark_install: Any, turbospark_fixtures: Any, name: str
) -> None:
    path = turbospark_install(name)
    assert "experts" in json.loads((path / "manifest.json").read_text())
    ids = np.load(turbospark_fixtures / name / "references.npz")["prompt_ids"].tolist()
    resident = turbospark_core.open(path, residency="resident")
    streamed = turbospark_core.open(path, residency="streamed", expert_slots=3)
    assert np.array_equal(streamed.logits(ids), resident.logits(ids))
    assert streamed.generate(ids, max_tokens=8).tokens == resident.generate(ids, max_tokens=8).tokens
    stats = streamed.expert_stats()
    assert stats is not None and stats.residency == "streamed" and stats.misses > 0
