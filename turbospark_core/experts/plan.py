"""The residency plan: every expert in memory (``resident``) or ``slots`` per routed layer (``streamed``).

Open step 10 picks the plan that fits the memory budget; both give bit-identical results.
"""

from __future__ import annotations

from typing import Any

import attrs

from turbospark_core.errors import OptionError
from turbospark_core.experts.layout import EXPERT_TENSOR, ExpertLayout

RESIDENT, STREAMED = "resident", "streamed"


@attrs.frozen(kw_only=True)
class ExpertPlan:
    """How the experts are held: every expert (``resident``) or ``slots`` per routed layer (``streamed``)."""

    residency: str
    slots: int
    unpack: bool
    held_bytes: int

    def describe(self) -> str:
        """One line for ``turbospark inspect`` and refusals."""
        form = "float32" if self.unpack else "stored form"
        what = "all experts" if self.residency == RESIDENT else f"{self.slots} slots per routed layer"
        return f"{self.residency}: {what}, {form}, {self.held_bytes / 1e9:.3f} GB"


def refuse_streaming_without_file(tensor_names: Any, residency: str) -> None:
    """``residency='streamed'`` on an install whose experts live in model_weights.safetensors."""
    stacked = sorted(n for n in tensor_names if EXPERT_TENSOR.match(n))
    if residency == STREAMED and stacked:
        msg = (
            f"residency='streamed' needs experts.bin, but this install keeps its routed experts (e.g. "
            f"{stacked[0]!r}) in model_weights.safetensors; re-convert with `turbospark convert --experts-file` "
            f"or open with residency='resident'"
        )
        raise OptionError(msg)


def check_slots(layout: ExpertLayout, expert_slots: int | str) -> None:
    """Open step 10: explicit slots must hold one token's experts (``top_k``, when the install records it)."""
    if isinstance(expert_slots, int) and layout.top_k is not None and expert_slots < layout.top_k:
        msg = (
            f"expert_slots={expert_slots} is below the model's top_k={layout.top_k} (experts routed per "
            f"token): one token could not have all its experts in memory; use expert_slots>={layout.top_k} or 'auto'"
        )
        raise OptionError(msg)


def plan_experts(
    layout: ExpertLayout, residency: str, expert_slots: int | str, room: int, unpack: bool
) -> ExpertPlan | None:
    """The plan for ``residency`` in ``room`` bytes with experts held unpacked or not; ``None`` if it does not fit."""
    if residency == RESIDENT:
        need = layout.slot_bytes(layout.max_experts, unpack)
        return (
            ExpertPlan(residency=RESIDENT, slots=layout.max_experts, unpack=unpack, held_bytes=need)
            if need <= room
            else None
        )
    fewest = layout.top_k or 1

    def need_for(slots: int) -> int:
        return layout.slot_bytes(slots, unpack) + layout.staging_bytes(slots)

    if isinstance(expert_slots, int):
        slots = min(expert_slots, layout.max_experts)
    else:  # the most slots that fit: bisect, the need grows with the slot count
        lo, hi = 0, layout.max_experts
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if need_for(mid) <= room else (lo, mid - 1)
        slots = lo
    need = need_for(slots)
    if slots < fewest or need > room:
        return None
    return ExpertPlan(residency=STREAMED, slots=slots, unpack=unpack, held_bytes=need)


def residencies(residency: str, expert_slots: int | str, layout: ExpertLayout) -> tuple[str, ...]:
    """Residencies to try, preferred first. ``auto`` with an explicit slot count below the expert count streams."""
    if residency == "auto" and isinstance(expert_slots, int) and expert_slots < layout.max_experts:
        return (STREAMED,)
    return {"auto": (RESIDENT, STREAMED), RESIDENT: (RESIDENT,), STREAMED: (STREAMED,)}[residency]


def minimal_plan(layout: ExpertLayout, residency: str, expert_slots: int | str, unpack: bool) -> ExpertPlan:
    """The smallest plan for ``residency`` (for the over-budget refusal's figures)."""
    if residency == RESIDENT:
        return ExpertPlan(
            residency=RESIDENT,
            slots=layout.max_experts,
            unpack=unpack,
            held_bytes=layout.slot_bytes(layout.max_experts, unpack),
        )
    slots = min(expert_slots if isinstance(expert_slots, int) else (layout.top_k or 1), layout.max_experts)
    need = layout.slot_bytes(slots, unpack) + layout.staging_bytes(slots)
    return ExpertPlan(residency=STREAMED, slots=slots, unpack=unpack, held_bytes=need)
