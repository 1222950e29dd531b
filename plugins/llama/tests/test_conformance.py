"""The llama plugin runs the core's conformance harness on its six reference fixtures."""

from __future__ import annotations

from turbospark_core.testing import FamilyConformance


class TestLlamaFamily(FamilyConformance):
    compiled_decode = True  # its one-token decode step runs compiled
    fixtures = ("llama", "qwen2", "qwen3", "qwen3_moe", "minimax_m2", "qwen3_vl")
