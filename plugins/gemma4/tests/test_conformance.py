"""The gemma4 plugin runs the core's conformance harness on its two reference fixtures."""

from __future__ import annotations

from turbospark_core.testing import FamilyConformance


class TestGemma4Family(FamilyConformance):
    compiled_decode = True  # its one-token decode step runs compiled
    fixtures = ("gemma4_e", "gemma4_moe")
