# Copyright 2026 the turbospark authors. Apache-2.0.
"""The gemma4 plugin's refusals of image input."""

from __future__ import annotations

from turbospark_core.family import ImageError


class ImageInputError(ImageError):
    """An image the gemma4 preprocessing or tower cannot take (shape, size): a bad request, not a fault."""
