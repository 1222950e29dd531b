"""Image input: vision sidecars, image decoding, preprocessing helpers and the tower contract.

The contract a family implements is in :mod:`turbospark_core.vision.tower`; the
sidecar format in :mod:`turbospark_core.vision.sidecar`; ``turbospark convert
--vision`` in :mod:`turbospark_core.vision.convert`; attaching in
:mod:`turbospark_core.vision.attach`; images in chat messages in
:mod:`turbospark_core.vision.prompt`; decoding in :mod:`turbospark_core.vision.images`.
"""

from __future__ import annotations

from turbospark_core.vision.images import ImageError, load_image
from turbospark_core.vision.prompt import VisionPrompt
from turbospark_core.vision.tower import (
    ImageFeatures,
    PreparedImage,
    VisionContext,
    VisionInputs,
    VisionSpec,
    VisionTower,
)

__all__ = [
    "ImageError",
    "ImageFeatures",
    "PreparedImage",
    "VisionContext",
    "VisionInputs",
    "VisionPrompt",
    "VisionSpec",
    "VisionTower",
    "load_image",
]
