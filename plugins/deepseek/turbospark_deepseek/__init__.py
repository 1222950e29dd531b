"""turbospark family plugin for DeepSeek-V2 / V2-Lite / V3: latent attention with a compressed cache, DeepSeekMoE."""

from __future__ import annotations

FAMILY = "deepseek"
DISTRIBUTION = "turbospark-deepseek"
MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
# Claimed so that they are refused by name (with the reason) instead of "no plugin serves it"
REFUSED_MODEL_TYPES = {
    "deepseek_v4": "DeepSeek-V4 (deepseek_v4*) has no decode flow in turbospark-deepseek",
    "deepseek_v4_flash": "DeepSeek-V4-Flash (deepseek_v4*) has no decode flow in turbospark-deepseek",
    "deepseek_v32": "DeepSeek-V3.2 (deepseek_v32) uses sparse indexer attention (DSA), which this flow does not run",
}
