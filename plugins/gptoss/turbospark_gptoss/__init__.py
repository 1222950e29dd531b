"""turbospark family plugin for gpt-oss (OpenAI's open-weight MoE decoders)."""

from __future__ import annotations

FAMILY = "gptoss"
DISTRIBUTION = "turbospark-gptoss"
MODEL_TYPES = ("gpt_oss",)
