"""Test-only turbospark family plugin: a bigram model of the made-up type ``dummy_lm``.

Installed by CI (``pip install -e tests/plugins/turbospark_dummy``) so that one
test proves a third-party distribution is found through the ``turbospark``
entry-point group, and that the ``TURBOSPARK_PLUGINS`` allow-list can leave it out.
"""

from __future__ import annotations

FAMILY = "dummy"
DISTRIBUTION = "turbospark-dummy"
MODEL_TYPES = ("dummy_lm",)
