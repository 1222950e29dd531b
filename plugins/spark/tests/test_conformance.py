"""The spark plugin runs the core's conformance harness on its reference fixture."""

from __future__ import annotations

from turbospark_core.testing import FamilyConformance


class TestSparkFamily(FamilyConformance):
    compiled_decode = True  # its one-token decode step runs compiled
    fixtures = ("spark2_5",)
