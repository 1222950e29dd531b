"""Image input: vision sidecars, image decoding, preprocessing helpers and the tower contract.

The contract a family implements is in :mod:`turbospark_core.vision.tower`.
"""

from __future__ import annotations

from turbospark_core.vision.tower import (
    ImageFeatures,
    PreparedImage,
    VisionContext,
    VisionInputs,
    VisionSpec,
    VisionTower,
)

__all__ = ["ImageFeatures", "PreparedImage", "VisionContext", "VisionInputs", "VisionSpec", "VisionTower"]
