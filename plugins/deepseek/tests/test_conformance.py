"""The deepseek plugin runs the core's conformance harness on its two reference fixtures."""

from __future__ import annotations

from turbospark_core.testing import FamilyConformance


class TestDeepSeekFamily(FamilyConformance):
    compiled_decode = True  # its one-token decode step runs compiled
    fixtures = ("deepseek_v2", "deepseek_v2_qlora")
    float32_rel_tol = 1e-5  # the references agree to <= 3.9e-6 absolute
