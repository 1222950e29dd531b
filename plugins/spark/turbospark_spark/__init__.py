"""turbospark family plugin for Spark 2.5 decoders (sliding/full attention with head-wise output gates)."""

from __future__ import annotations

FAMILY = "spark"
DISTRIBUTION = "turbospark-spark"
MODEL_TYPES = ("spark2_5",)
