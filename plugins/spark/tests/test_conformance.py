"""The spark plugin runs the core's conformance harness on its reference fixture."""

from __future__ import annotations

from turbospark_core.testing import FamilyConformance


class TestSparkFamily(FamilyConformance):
    fixtures = ("spark2_5",)
