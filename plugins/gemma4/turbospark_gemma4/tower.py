# Copyright 2026 the turbospark authors. Apache-2.0.
"""The gemma4 answer to ``build_vision``: preprocessing, placeholder expansion and the encoder, for the core.

An image's placeholder ``<|image|>`` expands to ``<|boi|>``, ``<|image|>`` once
per soft token, ``<|eoi|>``; the soft tokens take plain positions (the trunk's
``vision`` input carries no positions and no shift).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from turbospark_core.family import ArchConfigError, ImageFeatures, PreparedImage, VisionContext

from turbospark_gemma4.image_processing import ImagePatches, ImageProcessing, prepare
from turbospark_gemma4.vision import Encoder
from turbospark_gemma4.vision_config import VisionArgs


class Gemma4Tower:
    """The :class:`~turbospark_core.family.VisionTower` of Gemma 4 (a sidecar attached to a gemma4 trunk)."""

    def __init__(self, context: VisionContext) -> None:
        """Read the sidecar's tower config, processor config and tensors.

        Raises:
            ArchConfigError: The tower config (by key), or a processor config whose
                patch or pooling size differs from the tower's.
        """
        args = VisionArgs.from_arch(context.vision)
        self.processing = ImageProcessing.from_config(context.processor)
        p = self.processing
        if (p.patch_size, p.pooling_kernel_size) != (args.patch_size, args.pooling_kernel_size):
            msg = (
                f"the sidecar's processor config (patch_size {p.patch_size}, pooling_kernel_size "
                f"{p.pooling_kernel_size}) does not match its tower (patch_size {args.patch_size}, "
                f"pooling_kernel_size {args.pooling_kernel_size}); re-run the sidecar conversion"
            )
            raise ArchConfigError(msg)
        self.encoder = Encoder(args, context.weights.tensor)
        self.placeholder_id = int(context.tokens["image"])
        self.soft_token_id = self.placeholder_id
        self.boi_id = int(context.tokens["boi"])
        self.eoi_id = int(context.tokens["eoi"])

    def prepare(self, rgb: np.ndarray) -> PreparedImage:
        """Preprocess one decoded image; ``pixel_values`` holds its real patches only (no padding rows).

        Raises:
            ImageInputError: An image the processor config or the tower cannot take, naming its size.
        """
        image = prepare(rgb, self.processing)
        self.encoder.check_grid(image.rows, image.cols)
        expansion = (self.boi_id, *([self.soft_token_id] * image.num_soft_tokens), self.eoi_id)
        return PreparedImage(pixel_values=image.patches, grid=(image.rows, image.cols), expansion=expansion)

    def encode(self, images: Sequence[PreparedImage]) -> ImageFeatures:
        """Every image's soft-token embeddings, image after image."""
        k2 = self.processing.pooling_kernel_size**2
        patches = [
            ImagePatches(patches=im.pixel_values, rows=im.grid[0], cols=im.grid[1],
                         num_soft_tokens=im.grid[0] * im.grid[1] // k2)
            for im in images
        ]
        return ImageFeatures(embeds=self.encoder.embed_images(patches))

    def positions(self, ids: np.ndarray, images: Sequence[PreparedImage]) -> tuple[np.ndarray | None, int]:
        """Plain positions: every image token takes one, as text does."""
        return None, 0

