"""Attaching a vision sidecar to an opened trunk: fit checks, memory guard, the family's tower."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from turbospark_core.errors import FamilyRefusalError, MemoryBudgetError
from turbospark_core.tensor_index import build_index
from turbospark_core.vision.sidecar import VISION_WEIGHTS, Sidecar, SidecarError, load_sidecar
from turbospark_core.vision.tower import VisionContext, VisionTower
from turbospark_core.weights import WeightStore

if TYPE_CHECKING:
    from turbospark_core.loader import OpenedModel
    from turbospark_core.tokenizer import Tokenizer


@attrs.frozen(kw_only=True, eq=False)
class AttachedVision:
    """A sidecar attached to a runner: the tower, its record, and the chat template to render images with.

    Attributes:
        sidecar: The validated sidecar.
        tower: The family's tower (``build_vision``'s answer).
        chat_template: The sidecar's template, or ``None`` (the trunk's is used).
        weight_bytes: What the tower's weights hold (counted by the memory guard).
    """

    sidecar: Sidecar
    tower: VisionTower
    chat_template: str | None
    weight_bytes: int


def check_fit(sidecar: Sidecar, opened: OpenedModel, tokenizer: Tokenizer) -> None:
    """The sidecar fits the trunk: same family and model type, hidden size, vocabulary, placeholder tokens.

    Raises:
        SidecarError: Naming the first mismatch (both values) and the fix.
    """
    arch = opened.manifest.arch
    root, trunk = sidecar.root, opened.manifest.root
    fix = f"attach the sidecar converted from the same checkpoint as {trunk}"
    if sidecar.family != opened.capabilities.family or sidecar.trunk["model_type"] != arch["model_type"]:
        msg = (
            f"vision sidecar {root} is for family {sidecar.family!r} (model type {sidecar.trunk['model_type']!r}), "
            f"but {trunk} is family {opened.capabilities.family!r} (model type {arch['model_type']!r}); {fix}"
        )
        raise SidecarError(msg)
    for key in ("hidden_size", "vocab_size"):
        if sidecar.trunk[key] != arch.get(key):
            msg = f"vision sidecar {root} is for {key} {sidecar.trunk[key]}, {trunk} has {key} {arch.get(key)}; {fix}"
            raise SidecarError(msg)
    for name, token_id in sidecar.tokens.items():
        if not 0 <= token_id < int(arch["vocab_size"]):
            msg = (
                f"vision sidecar {root}: placeholder {name!r} id {token_id} is outside the vocabulary "
                f"[0, {arch['vocab_size']}); {fix}"
            )
            raise SidecarError(msg)
        text = sidecar.token_texts.get(name)
        if text is not None and tokenizer.token_to_id(text) != token_id:
            msg = (
                f"vision sidecar {root}: placeholder {name!r} is token {text!r} = id {token_id}, but the trunk's "
                f"tokenizer has {text!r} at id {tokenizer.token_to_id(text)}; {fix}"
            )
            raise SidecarError(msg)


def attach_vision(path: str | Path, opened: OpenedModel, tokenizer: Tokenizer) -> AttachedVision:
    """Load a sidecar, check it against the trunk and the memory budget, and build the family's tower.

    Raises:
        NotAnInstallError: ``path`` is no sidecar.
        SidecarError: A malformed sidecar, or one that does not fit the trunk.
        FamilyRefusalError: The family serves no vision flow.
        MemoryBudgetError: Trunk + tower exceed the open's ``memory_budget``.
    """
    sidecar = load_sidecar(path)
    check_fit(sidecar, opened, tokenizer)
    index = build_index(sidecar.path(VISION_WEIGHTS), sidecar.files[VISION_WEIGHTS].size, sidecar.quantization)
    weight_bytes = index.float_bytes(4) if opened.policy.unpack else index.stored_bytes()
    budget = opened.options.memory_budget
    if opened.estimate.total + weight_bytes > budget:
        msg = (
            f"attaching vision sidecar {sidecar.root} needs ~{weight_bytes / 1e9:.3f} GB for the tower on top of "
            f"the open's ~{opened.estimate.total / 1e9:.2f} GB, but memory_budget is {budget / 1e9:.2f} GB; "
            f"raise memory_budget, or lower max_context or session_slots"
        )
        raise MemoryBudgetError(msg)
    weights = WeightStore(sidecar.path(VISION_WEIGHTS), index, opened.policy)
    context = VisionContext(
        arch=opened.manifest.arch,
        vision=sidecar.vision,
        processor=sidecar.processor,
        tokens=sidecar.tokens,
        weights=weights,
        compute_dtype=opened.policy.compute_dtype,
    )
    tower = opened.hooks.build_vision(context)
    if tower is None:
        msg = (
            f"family {opened.capabilities.family!r} ({opened.capabilities.distribution}) has no vision flow for model "
            f"type {opened.manifest.model_type!r}; open {opened.manifest.root} without a vision sidecar"
        )
        raise FamilyRefusalError(msg)
    unused = weights.unused()
    if unused:
        msg = (
            f"vision sidecar {sidecar.root}: {len(unused)} tensor(s) are not used by family "
            f"{opened.capabilities.family!r}'s tower, first {unused[0]!r}; re-run the sidecar conversion"
        )
        raise SidecarError(msg)
    weights.materialize()
    return AttachedVision(
        sidecar=sidecar, tower=tower, chat_template=sidecar.chat_template(), weight_bytes=weight_bytes
    )
