"""The Gemma 3 plugin runs the core's conformance harness on its own tiny fixture (see conftest.py)."""

from __future__ import annotations

from turbospark_core.testing import FamilyConformance


class TestGemma3Family(FamilyConformance):
    compiled_decode = True  # its one-token decode step runs compiled
    fixtures = ("gemma3_tiny",)
