"""turbospark family plugin for Qwen 3.5: gated-DeltaNet / gated-attention hybrids, dense or MoE.

Installed as its own distribution; the core finds it through the entry point::

    [project.entry-points.turbospark]
    qwen = "turbospark_qwen.plugin"
"""

from __future__ import annotations

FAMILY = "qwen"
DISTRIBUTION = "turbospark-qwen"
MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
