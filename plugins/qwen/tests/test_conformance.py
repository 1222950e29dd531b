"""The qwen plugin runs the core's conformance harness on its two reference fixtures."""

from __future__ import annotations

from turbospark_core.testing import FamilyConformance


class TestQwenFamily(FamilyConformance):
    compiled_decode = True  # its one-token decode step runs compiled
    fixtures = ("qwen3_5", "qwen3_5_moe")
