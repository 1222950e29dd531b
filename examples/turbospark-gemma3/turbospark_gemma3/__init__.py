"""A third-party turbospark family plugin for Gemma 3 text models (pip install turbospark-gemma3)."""

from __future__ import annotations

FAMILY = "gemma3"
DISTRIBUTION = "turbospark-gemma3"
MODEL_TYPES = ("gemma3_text",)
GGUF_ARCHITECTURES = ("gemma3",)
