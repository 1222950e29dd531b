"""The expert store: each routed layer's bank handed out once, resident and streamed bit-identical, stats."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import turbospark_core
from turbospark_core.cli import main
from turbospark_core.errors import ExpertBankTakenError, InstallError, TurbosparkError
from turbospark_core.experts.layout import ExpertLayout
from turbospark_core.experts.plan import RESIDENT, STREAMED
from turbospark_core.manifest import EXPERTS, load_manifest

MOE_FIXTURES = ("qwen3_moe", "minimax_m2", "gpt_oss", "gpt_oss_mxfp4", "qwen3_5_moe", "gemma4_moe")
LAYER0 = "model.layers.0.mlp.experts"
ROLES = ("gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("residency", [RESIDENT, STREAMED])
def test_a_layer_bank_is_handed_out_once(
    synthetic: Callable[[str], ExpertLayout], expert_store: Callable, residency: str
) -> None:
    store = expert_store(synthetic("f32"), residency, 2, unpack=True)
    assert store.has(LAYER0) and not store.has("model.layers.9.mlp.experts")
    assert store.unused() == [LAYER0]
    store.bank(LAYER0, *ROLES)
    assert store.unused() == []
    with pytest.raises(ExpertBankTakenError) as e:
        store.bank(LAYER0, *ROLES)
    assert isinstance(e.value, TurbosparkError) and not isinstance(e.value, KeyError)
    assert repr(LAYER0) in str(e.value) and "each routed layer's bank is taken once" in str(e.value)


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_streamed_is_bit_identical_to_resident_for_every_slot_count(
    moe_install: Callable[..., Path], refs_of: Callable, name: str
) -> None:
    root = moe_install(name)
    refs = refs_of(name)
    ids = refs["prompt_ids"].tolist()
    layout = ExpertLayout.from_section(load_manifest(root).experts, load_manifest(root).files[EXPERTS].size, "t")
    resident = turbospark_core.open(root, residency="resident")
    assert resident.expert_stats().residency == "resident"
    want_logits = resident.logits(ids)
    want_tokens = resident.generate(ids, max_tokens=len(refs["greedy_tokens"]), temperature=0.0).tokens
    assert want_tokens == refs["greedy_tokens"].tolist()
    for slots in range(layout.top_k, layout.max_experts + 1):
        runner = turbospark_core.open(root, residency="streamed", expert_slots=slots)
        assert runner.opened.policy.unpack == resident.opened.policy.unpack
        assert np.array_equal(runner.logits(ids), want_logits), f"{name}: logits differ with {slots} slots"
        got = runner.generate(ids, max_tokens=len(want_tokens), temperature=0.0)
        assert got.tokens == want_tokens, f"{name}: greedy tokens differ with {slots} slots"
        stats = runner.expert_stats()
        assert stats.residency == "streamed" and stats.slots == slots and stats.misses >= len(layout.layers)


def test_stored_policy_streams_quantized_experts_bit_identically(
    moe_install: Callable[..., Path], refs_of: Callable
) -> None:
    root = moe_install("gpt_oss_mxfp4")
    ids = refs_of("gpt_oss_mxfp4")["prompt_ids"].tolist()
    resident = turbospark_core.open(root, memory_budget=600_000, max_context=256, residency="resident")
    streamed = turbospark_core.open(root, memory_budget=600_000, max_context=256, residency="streamed", expert_slots=2)
    # a budget that cannot hold the experts unpacked: they are held (and multiplied) as stored, mxfp4
    assert resident.opened.estimate.weights < 600_000
    assert np.array_equal(resident.logits(ids), streamed.logits(ids))


def test_an_unused_routed_layer_is_refused(moe_copy: Path, tamper) -> None:
    blob = (moe_copy / EXPERTS).read_bytes()
    tamper.put_file(moe_copy, EXPERTS, blob + blob)  # room for a layer the family never asks for

    def add(raw: dict) -> None:
        layers = raw["experts"]["layers"]
        layers["model.layers.7.mlp.experts"] = {**layers[LAYER0], "offset": len(blob)}

    tamper.edit(moe_copy, add)
    with pytest.raises(
        InstallError, match=r"not used by family 'llama', first 'model\.layers\.7\.mlp\.experts \(experts\.bin\)'"
    ):
        turbospark_core.open(moe_copy)


# ------------------------------------------------------------------ stats surfaces
def test_generation_stats_carry_the_expert_counters(moe_install: Callable[..., Path]) -> None:
    runner = turbospark_core.open(moe_install("qwen3_moe"), residency="streamed", expert_slots=2)
    first = runner.generate([1, 2, 3, 4], max_tokens=4, temperature=0.0).stats.experts
    second = runner.generate([1, 2, 3, 4], max_tokens=4, temperature=0.0).stats.experts
    total = runner.expert_stats()
    assert first.misses + second.misses == total.misses and first.hits + second.hits == total.hits
    assert first.tokens == 3 + 1 + 3 and total.load_ms_per_token > 0
    dense = turbospark_core.open(moe_install("qwen3_moe"), residency="resident")
    assert dense.generate([1, 2], max_tokens=2).stats.experts.residency == "resident"


def test_cli_prints_expert_stats(moe_install: Callable[..., Path], capsys: pytest.CaptureFixture[str]) -> None:
    root = str(moe_install("qwen3_moe"))
    assert (
        main(["inspect", root, "--stats", "--residency", "streamed", "--expert-slots", "3", "--stats-tokens", "4"]) == 0
    )
    out = capsys.readouterr().out
    assert (
        "experts      experts.bin: 2 routed layers x 8 experts" in out and "streamed: 3 slots per routed layer" in out
    )
    assert "experts: streamed, 3 slots/layer | hits" in out and "ms/token" in out
    assert (
        main(["generate", root, "Hi", "--max-tokens", "3", "-v", "--residency", "streamed", "--expert-slots", "2"]) == 0
    )
    assert "experts: streamed, 2 slots/layer | hits" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", root, "Hi", "--expert-slots", "many"])
