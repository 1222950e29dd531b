"""The residency plan: resident or streamed, how many slots, and the open's refusals by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core.errors import MemoryBudgetError, OptionError
from turbospark_core.experts.layout import ExpertLayout
from turbospark_core.experts.plan import (
    RESIDENT,
    STREAMED,
    check_slots,
    minimal_plan,
    plan_experts,
    refuse_streaming_without_file,
    residencies,
)
from turbospark_core.manifest import EXPERTS, WEIGHTS, load_manifest

LAYER0 = "model.layers.0.mlp.experts"


def test_plans_fit_the_room_they_are_given(synthetic: Callable[[str], ExpertLayout]) -> None:
    layout = synthetic("f32")
    everything = layout.slot_bytes(6, unpack=True)
    resident = plan_experts(layout, RESIDENT, "auto", everything, unpack=True)
    assert resident is not None
    assert (resident.residency, resident.slots, resident.held_bytes) == (RESIDENT, 6, everything)
    assert plan_experts(layout, RESIDENT, "auto", everything - 1, unpack=True) is None
    three = layout.slot_bytes(3, unpack=True) + layout.staging_bytes(3)
    streamed = plan_experts(layout, STREAMED, "auto", three, unpack=True)  # the most slots that fit
    assert streamed is not None and (streamed.slots, streamed.held_bytes) == (3, three)
    assert plan_experts(layout, STREAMED, 99, 10**12, unpack=True).slots == 6  # capped at the expert count
    assert plan_experts(layout, STREAMED, "auto", 1, unpack=True) is None  # not even top_k slots fit
    assert minimal_plan(layout, STREAMED, "auto", unpack=False).slots == layout.top_k == 2
    assert (
        "streamed: 2 slots per routed layer, stored form" in minimal_plan(layout, STREAMED, 2, unpack=False).describe()
    )


def test_residencies_tried_in_order(synthetic: Callable[[str], ExpertLayout]) -> None:
    layout = synthetic("f32")
    assert residencies("auto", "auto", layout) == (RESIDENT, STREAMED)
    assert residencies("auto", 3, layout) == (STREAMED,)  # explicit slots below the expert count stream
    assert residencies("auto", 6, layout) == (RESIDENT, STREAMED)
    assert residencies(RESIDENT, 3, layout) == (RESIDENT,)
    with pytest.raises(OptionError, match=r"expert_slots=1 is below the model's top_k=2"):
        check_slots(layout, 1)
    check_slots(layout, "auto")


def test_streaming_needs_experts_bin() -> None:
    with pytest.raises(OptionError, match=r"needs experts.bin.*'m\.experts\.up\.weight'"):
        refuse_streaming_without_file(["m.experts.up.weight", "m.norm.weight"], STREAMED)
    refuse_streaming_without_file(["m.experts.up.weight"], RESIDENT)


def test_no_experts_file_keeps_the_old_layout(moe_install: Callable[..., Path], refs_of: Callable) -> None:
    root = moe_install("qwen3_moe", experts_file=False)
    m = load_manifest(root)
    assert EXPERTS not in m.files and m.experts is None
    assert f"{LAYER0}.gate_proj.weight" in mx.load(str(root / WEIGHTS))
    refs = refs_of("qwen3_moe")
    assert np.abs(turbospark_core.open(root).logits(refs["prompt_ids"].tolist()) - refs["logits"]).max() < 1e-4
    with pytest.raises(OptionError, match=r"residency='streamed' needs experts\.bin"):
        turbospark_core.open(root, residency="streamed")


def test_dense_installs_have_no_experts_bin(f32_install: Path) -> None:
    assert EXPERTS not in load_manifest(f32_install).files
    runner = turbospark_core.open(f32_install, residency="streamed", expert_slots=2)
    assert runner.expert_stats() is None and runner.opened.estimate.experts == 0


# ------------------------------------------------------------------ open: options, plan, estimate
def test_slots_below_top_k_are_refused_by_name(moe_install: Callable[..., Path], names) -> None:
    root = moe_install("qwen3_moe")
    with pytest.raises(OptionError) as e:
        turbospark_core.open(root, residency="streamed", expert_slots=1)
    names(e, "expert_slots=1", "top_k=2")
    with pytest.raises(OptionError):
        turbospark_core.open(root, expert_slots=1)  # auto with explicit slots streams
    turbospark_core.open(root, residency="resident", expert_slots=1)  # resident ignores the slot count
    plan = turbospark_core.open(root, expert_slots=4).opened.experts.plan  # auto with explicit slots streams
    assert (plan.residency, plan.slots) == ("streamed", 4)
    plan = turbospark_core.open(root, residency="streamed", expert_slots=99).opened.experts.plan
    assert (plan.residency, plan.slots) == ("streamed", 8)  # capped at the expert count


def test_auto_is_resident_when_the_experts_fit(moe_install: Callable[..., Path]) -> None:
    opened = turbospark_core.open(moe_install("qwen3_moe")).opened
    assert opened.experts.plan.residency == "resident" and opened.policy.unpack
    layout = opened.experts.layout
    assert opened.estimate.experts == layout.slot_bytes(layout.max_experts, unpack=True)


def test_auto_streams_with_the_most_slots_the_budget_allows(moe_install: Callable[..., Path]) -> None:
    root = moe_install("qwen3_moe")
    full = turbospark_core.open(root, max_context=64).opened
    layout = full.experts.layout
    non_expert = full.estimate.weights + full.estimate.kv
    per_slot = layout.slot_bytes(1, unpack=True)
    budget = non_expert + 5 * per_slot + layout.staging_bytes(5) + 1  # 6 slots, or all 8, would not fit
    opened = turbospark_core.open(root, max_context=64, memory_budget=budget).opened
    assert opened.policy.unpack and opened.experts.plan.residency == "streamed" and opened.experts.plan.slots == 5
    assert opened.estimate.experts == 5 * per_slot + layout.staging_bytes(5) and opened.estimate.total <= budget
    assert opened.startup_stats.expert_setup > 0


def test_over_budget_streamed_open_names_expert_slots(moe_install: Callable[..., Path], names) -> None:
    root = moe_install("qwen3_moe")
    with pytest.raises(MemoryBudgetError) as e:
        turbospark_core.open(root, residency="streamed", expert_slots=8, memory_budget=700_000, max_context=64)
    names(e, "lower expert_slots (now 8)", "memory_budget")
    with pytest.raises(MemoryBudgetError) as e:
        turbospark_core.open(root, residency="resident", memory_budget=300_000, max_context=64)
    names(e, "residency='streamed'")
