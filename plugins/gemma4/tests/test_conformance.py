"""The gemma4 plugin runs the core's conformance harness on its two reference fixtures."""

from __future__ import annotations

from turbospark_core.testing import FamilyConformance


class TestGemma4Family(FamilyConformance):
    fixtures = ("gemma4_e", "gemma4_moe")
