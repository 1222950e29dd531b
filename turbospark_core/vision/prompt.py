"""Images in chat messages: collect them, expand the placeholders, and slice the tower's output per forward."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core.errors import ContextOverflowError
from turbospark_core.vision.images import MAX_IMAGE_PIXELS, ImageError, image_key, load_image
from turbospark_core.vision.tower import ImageFeatures, PreparedImage, VisionInputs, VisionTower

if TYPE_CHECKING:
    from turbospark_core.tokenizer import Tokenizer
    from turbospark_core.vision.attach import AttachedVision

MAX_IMAGES = 64  # per request
_IMAGE_KEYS = ("image", "image_url", "url", "path")


def _part_image(part: dict[str, Any], where: str) -> Any:
    """The image a content part carries (``{"type": "image", "image": ...}`` or OpenAI's ``image_url``)."""
    if part.get("type") == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str):
            raise ImageError(f"{where}: an 'image_url' part needs {{'image_url': {{'url': ...}}}}")
        return url
    for key in _IMAGE_KEYS:
        if part.get(key) is not None:
            value = part[key]
            return value.get("url") if isinstance(value, dict) and "url" in value else value
    raise ImageError(f"{where}: an 'image' part needs the image under 'image' (path, bytes, data: URL, PIL, numpy)")


def is_image_part(part: object) -> bool:
    """Whether a content part is an image (``type`` ``image`` or ``image_url``)."""
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


def split_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[Any, str]]]:
    """Messages with every image part reduced to ``{"type": "image"}`` (what templates test), and the images.

    Returns:
        The messages to render, and ``(image, where)`` per image in order.
    """
    out: list[dict[str, Any]] = []
    images: list[tuple[Any, str]] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(is_image_part(p) for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if is_image_part(part):
                where = f"messages[{i}].content[{j}]"
                images.append((_part_image(part, where), where))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images


def decode_images(images: Sequence[tuple[Any, str]], max_pixels: int = MAX_IMAGE_PIXELS) -> list[np.ndarray]:
    """Every image decoded to RGB uint8 (bounded), refusing more than ``MAX_IMAGES``."""
    if len(images) > MAX_IMAGES:
        raise ImageError(f"{len(images)} images in one request, over the bound of {MAX_IMAGES}; send fewer")
    return [load_image(image, max_pixels=max_pixels, where=where) for image, where in images]


@attrs.frozen(kw_only=True, eq=False)
class VisionPrompt:
    """An expanded prompt with its images: token ids, soft-token mask, tower features, positions.

    Attributes:
        ids: The token ids with every placeholder expanded.
        soft: ``[T]`` bool: the soft-token positions.
        images: The prepared images, in order.
        keys: ``(first position of its expansion, content hash)`` per image (prefix reuse).
        positions: Explicit positions (sequence axis last), or ``None``.
        shift: Position shift of the tokens after the prompt.
    """

    ids: list[int]
    soft: np.ndarray
    images: list[PreparedImage]
    keys: tuple[tuple[int, str], ...]
    positions: np.ndarray | None
    shift: int
    _features: list[ImageFeatures] = attrs.field(factory=list, alias="_features")

    def features(self, tower: VisionTower) -> ImageFeatures:
        """The tower's output for the images (computed once)."""
        if not self._features:
            self._features.append(tower.encode(self.images))
        return self._features[0]

    def chunk(self, tower: VisionTower, start: int, end: int) -> VisionInputs | None:
        """The :class:`VisionInputs` of the forward over ``ids[start:end]`` (one row).

        ``None`` when the chunk is plain text at plain positions (the text-only forward).
        """
        soft = self.soft[start:end]
        positions = None if self.positions is None else mx.array(self.positions[..., None, start:end])
        if not soft.any():
            return None if positions is None and not self.shift else VisionInputs(positions=positions, shift=self.shift)
        feats = self.features(tower)
        first = int(self.soft[:start].sum())
        rows = slice(first, first + int(soft.sum()))
        return VisionInputs(
            mask=mx.array(soft[None, :]),
            embeds=feats.embeds[rows],
            layer_features=tuple(f[rows] for f in feats.layer_features),
            positions=positions,
            shift=self.shift,
        )

    def decode_step(self) -> VisionInputs | None:
        """The :class:`VisionInputs` of a decode step after the prompt (``None`` with no position shift)."""
        return VisionInputs(shift=self.shift) if self.shift else None


def expand(
    ids: list[int], rgbs: Sequence[np.ndarray], tower: VisionTower, max_context: int
) -> VisionPrompt:
    """Prepare each image and expand the k-th placeholder token into image k's expansion.

    Raises:
        ImageError: The template rendered a different number of placeholders than there are images.
        ContextOverflowError: The expanded prompt passes ``max_context`` (too many images for the context).
    """
    where = [i for i, t in enumerate(ids) if t == tower.placeholder_id]
    if len(where) != len(rgbs):
        msg = (
            f"the chat template rendered {len(where)} image placeholder(s) (token id {tower.placeholder_id}) for "
            f"{len(rgbs)} image(s); use a template that renders image parts (the sidecar's chat_template.jinja)"
        )
        raise ImageError(msg)
    images = [tower.prepare(rgb) for rgb in rgbs]
    total = len(ids) + sum(len(im.expansion) - 1 for im in images)
    if total > max_context:
        msg = (
            f"the prompt with its {len(images)} image(s) is {total} tokens, over max_context={max_context}; "
            "send fewer or smaller images, or open with a larger max_context"
        )
        raise ContextOverflowError(msg)
    out: list[int] = []
    soft: list[bool] = []
    keys: list[tuple[int, str]] = []
    last = 0
    for pos, image, rgb in zip(where, images, rgbs, strict=True):
        out += ids[last:pos]
        soft += [False] * (pos - last)
        keys.append((len(out), image_key(rgb)))
        out += image.expansion
        soft += [t == tower.soft_token_id for t in image.expansion]
        last = pos + 1
    out += ids[last:]
    soft += [False] * (len(ids) - last)
    arr = np.array(out, dtype=np.int64)
    positions, shift = tower.positions(arr, images)
    return VisionPrompt(
        ids=out, soft=np.array(soft, dtype=bool), images=images, keys=tuple(keys), positions=positions, shift=shift
    )


def reusable(held: Sequence[tuple[int, str]], wanted: Sequence[tuple[int, str]], common: int) -> int:
    """How much of a ``common`` token prefix may be reused: up to the first image that differs."""
    for a, b in zip(held, wanted, strict=False):
        if a != b:
            return min(common, a[0], b[0])
    longer = held[len(wanted) :] if len(held) > len(wanted) else wanted[len(held) :]
    return min([common, *(pos for pos, _ in longer)])


def image_prompt(
    rendered: list[dict[str, Any]],
    images: Sequence[tuple[Any, str]],
    tokenizer: Tokenizer,
    attached: AttachedVision | None,
    max_context: int,
) -> VisionPrompt:
    """The :class:`VisionPrompt` of messages with images (``split_images``'s output).

    Rendered with the sidecar's chat template when it has one (else the trunk's),
    tokenized without special tokens (the template writes them), placeholders expanded.

    Raises:
        ImageError: No vision tower is attached, or an image is unusable (each named).
        ContextOverflowError: The expanded prompt passes ``max_context``.
    """
    from turbospark_core.template import render_template

    if attached is None:
        msg = (
            f"{images[0][1]} is an image, but this runner has no vision tower; open the install with "
            "vision=SIDECAR (made by `turbospark convert SRC DST --vision SIDECAR`) or send text only"
        )
        raise ImageError(msg)
    rgbs = decode_images(images)
    if attached.chat_template is None:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True)
    else:
        variables = {
            "messages": rendered,
            "add_generation_prompt": True,
            "bos_token": tokenizer.bos_token or "",
            "eos_token": tokenizer.eos_token or "",
        }
        text = render_template(attached.chat_template, variables)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return expand(ids, rgbs, attached.tower, max_context)


class HeldImages:
    """Which images each parked state's caches were filled with: its prefix is reused only up to the first
    image that differs (content hash and position)."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[weakref.ref[Any], tuple[tuple[int, str], ...]]] = {}

    def reusable(self, state: object, prompt: VisionPrompt | None, common: int) -> int:
        """How much of ``common`` (the shared token prefix) ``state`` may reuse for ``prompt``."""
        entry = self._held.get(id(state))
        held = entry[1] if entry is not None and entry[0]() is state else ()
        return reusable(held, () if prompt is None else prompt.keys, common)

    def remember(self, state: object, prompt: VisionPrompt | None) -> None:
        """``state``'s caches now hold ``prompt``'s images (none for a text prompt)."""
        self._held = {k: v for k, v in self._held.items() if v[0]() is not None}
        self._held[id(state)] = (weakref.ref(state), () if prompt is None else prompt.keys)
