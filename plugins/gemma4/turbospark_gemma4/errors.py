# Copyright 2026 the turbospark authors. Apache-2.0.
"""The gemma4 plugin's refusals of image input."""

from __future__ import annotations

from turbospark_core.family import TurbosparkError


class ImageInputError(TurbosparkError):
    """An image, or image placeholders, the gemma4 flow cannot take (shape, size, count)."""
