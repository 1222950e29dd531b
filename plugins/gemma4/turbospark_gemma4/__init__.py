"""turbospark family plugin for Gemma 4: the text decoder of ``gemma4`` checkpoints, its vision tower as a sidecar."""

from __future__ import annotations

FAMILY = "gemma4"
DISTRIBUTION = "turbospark-gemma4"
MODEL_TYPES = ("gemma4", "gemma4_text")
