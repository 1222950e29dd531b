"""The vision hook's contract: what a family's tower is handed, what it returns, and what the trunk receives.

A vision *sidecar* is an install of its own kind (see :mod:`turbospark_core.vision.sidecar`)
holding one family's vision tower, its preprocessing config and the placeholder
token ids. Attaching it to an opened trunk asks the trunk family's plugin for a
tower (hook ``build_vision``). The flow of one image request:

1. The core decodes each image to RGB ``uint8`` ``[H, W, 3]`` (Pillow; bounded).
2. ``tower.prepare(rgb)`` preprocesses it exactly as the sidecar's processor
   config says (resize rule, rescale, normalisation, patch order) into a
   :class:`PreparedImage`: the tower's input, and the token ids the image's
   placeholder expands to.
3. The chat template renders one placeholder token (``tower.placeholder_id``)
   per image; the core replaces the k-th occurrence by image k's
   ``PreparedImage.expansion``. Positions holding ``tower.soft_token_id``
   inside an expansion are the image's *soft tokens*: one row of the image's
   embeddings each, in order.
4. ``tower.encode(images)`` returns :class:`ImageFeatures`: the embeddings that
   replace the soft-token rows (in sequence order, ``[n_soft, hidden]``) and
   optional per-layer features (DeepStack) added after early decoder layers.
5. ``tower.positions(ids, images)`` returns explicit positions for the whole
   expanded prompt (M-RoPE; sequence axis last) or ``None`` (plain positions),
   and the *shift*: a token at sequence index ``j`` after the prompt gets
   position ``j + shift`` (Qwen3-VL's ``rope_delta``; 0 for plain positions).
6. The trunk's forward is called as ``model(inputs, cache, vision=VisionInputs)``
   for every chunk of a sequence that holds images and needs it: prefill
   chunks holding soft tokens or explicit positions, and decode steps when the
   shift is not 0 (only the shift). Any other forward is the text-only one,
   ``model(inputs, cache)``, unchanged. A trunk that serves vision takes the
   ``vision`` keyword.

What each family does with :class:`VisionInputs` (Gemma 4: placeholder ids
become the pad id for the token embedding and the per-layer inputs, the
image rows are inserted *after* the text embedding scale; Qwen3-VL: rows
inserted, DeepStack features added after layer k, M-RoPE positions) is the
family's business; the core only slices and carries the arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core.weights import WeightStore


@attrs.frozen(kw_only=True)
class VisionSpec:
    """A family's answer to ``vision_arch_from_hf_config``: what the sidecar records about its tower.

    Attributes:
        vision: The vision arch (JSON-able): the tower's config and any
            text-side facts the flow needs (e.g. M-RoPE sections), stored as
            the sidecar's ``vision`` section and handed back in
            :attr:`VisionContext.vision`.
        tokens: Placeholder token ids by name; must include ``"image"`` (the
            token the chat template renders per image).
        hidden_size: The width of the embeddings the tower emits (must equal
            the trunk's ``hidden_size``).
    """

    vision: dict[str, Any]
    tokens: dict[str, int]
    hidden_size: int


@attrs.frozen(kw_only=True)
class VisionContext:
    """Everything ``build_vision`` may use.

    Attributes:
        arch: The trunk install's arch config.
        vision: The sidecar's ``vision`` section: the family's vision arch
            (what its ``vision_arch_from_hf_config`` returned at conversion:
            the tower config and any text-side facts such as M-RoPE sections).
        processor: The sidecar's preprocessing config (the checkpoint's
            ``preprocessor_config.json``, or ``processor_config.json``'s
            ``image_processor`` merged over it), as read; the tower applies it.
        tokens: The placeholder token ids recorded in the sidecar (name -> id,
            e.g. ``{"image": 7, "vision_start": 5, "vision_end": 6}``),
            checked against the trunk's vocabulary and tokenizer at attach.
        weights: The sidecar's weight store (names as the family's
            ``vision_tensor_target`` placed them).
        compute_dtype: Activation dtype of the trunk's compute policy.
    """

    arch: dict[str, Any]
    vision: dict[str, Any]
    processor: dict[str, Any]
    tokens: dict[str, int]
    weights: WeightStore = attrs.field(eq=False)
    compute_dtype: mx.Dtype = attrs.field(eq=False)


@attrs.frozen(kw_only=True, eq=False)
class PreparedImage:
    """One preprocessed image: the tower's input and what its placeholder expands to.

    Attributes:
        pixel_values: The processor's output for this image (float32; the
            family's layout, e.g. Qwen3-VL ``[patches, 3*2*p*p]`` in
            merge-block order, Gemma 4 ``[patches, p*p*3]``, the real patches only).
        grid: Family-defined shape facts (Qwen3-VL ``(t, gh, gw)`` in patches;
            Gemma 4 the patch grid ``(rows, cols)``).
        expansion: The token ids that replace this image's placeholder token.
        extra: Any further per-image arrays the tower needs (Gemma 4's patch
            position ids), by name.
    """

    pixel_values: np.ndarray
    grid: tuple[int, ...]
    expansion: tuple[int, ...]
    extra: dict[str, np.ndarray] = attrs.Factory(dict)


@attrs.frozen(kw_only=True, eq=False)
class ImageFeatures:
    """What a tower returns for the images of one prompt, in prompt order.

    Attributes:
        embeds: ``[n_soft, hidden]``: the rows that replace the soft-token
            embeddings, image after image, in sequence order.
        layer_features: Per-layer extras at the soft-token rows, each
            ``[n_soft, hidden]``: entry ``k`` is added to the hidden state after
            decoder layer ``k`` (Qwen3-VL DeepStack); empty for none.
    """

    embeds: mx.array
    layer_features: tuple[mx.array, ...] = ()


@attrs.frozen(kw_only=True, eq=False)
class VisionInputs:
    """The image part of one trunk forward over ``inputs`` ``[B, L]`` (the core builds it per chunk).

    Attributes:
        mask: ``[B, L]`` bool: the soft-token positions of this chunk, or
            ``None`` when the chunk holds none (a decode step).
        embeds: ``[n, hidden]``: the rows for the ``True`` positions of
            ``mask``, in row-major order (``None`` with ``mask``).
        layer_features: As :attr:`ImageFeatures.layer_features`, restricted
            to this chunk's soft tokens.
        positions: Explicit positions of this chunk, family-defined, sequence
            axis last (Qwen3-VL ``[3, B, L]`` int32 (t, h, w)), or ``None``:
            then token ``j`` (its cache position) takes ``j + shift``.
        shift: Added to the cache position of tokens without explicit
            positions: an int, or ``[B]`` int32 per row.
    """

    mask: mx.array | None = None
    embeds: mx.array | None = None
    layer_features: tuple[mx.array, ...] = ()
    positions: mx.array | None = None
    shift: int | mx.array = 0


class VisionTower(Protocol):
    """A family's vision tower, built by ``build_vision`` from a :class:`VisionContext`.

    Attributes (read by the core):
        placeholder_id: The token the chat template renders once per image.
        soft_token_id: The token that marks an image's soft-token rows inside
            an expansion (may equal ``placeholder_id``).
    """

    placeholder_id: int
    soft_token_id: int

    def prepare(self, rgb: np.ndarray) -> PreparedImage:
        """Preprocess one decoded image (``[H, W, 3]`` uint8) as the processor config says.

        Raises:
            TurbosparkError: (a subclass, e.g. ``OptionError``) an image the
                tower cannot take (too small, too large), naming the size.
        """
        ...

    def encode(self, images: Sequence[PreparedImage]) -> ImageFeatures:
        """Run the tower over ``images`` (one prompt's, in order)."""
        ...

    def positions(self, ids: np.ndarray, images: Sequence[PreparedImage]) -> tuple[np.ndarray | None, int]:
        """Explicit positions for the expanded prompt ``ids`` ``[T]`` (sequence axis last), or ``None``; and the shift.

        ``ids`` holds every expansion in place, in the order of ``images``.
        """
        ...
