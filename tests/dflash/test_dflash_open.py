"""``open(..., dflash=PATH)``: lossless greedy decoding, Runner.dflash_block_logits, the drafter rules, stats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core.convert import convert
from turbospark_core.errors import DrafterError, OptionError
from turbospark_core.runner import Runner

ABS_TOL = 1e-4


def test_block_logits_match_both_rounds(fx: Any) -> None:
    refs = fx.refs
    runner = fx.open(dflash=fx.drafter)
    prompt, k = refs["prompt_ids"].tolist(), int(refs["accept_k"])
    first = runner.dflash_block_logits([*prompt, int(refs["round1_block_ids"][0])])
    assert np.abs(first - refs["round1_logits"]).max() <= ABS_TOL
    assert first.argmax(-1).tolist() == refs["round1_draft_tokens"].tolist()
    # round 2 = prompt + b0 + the k accepted drafts, anchored at the round-2 anchor
    second = runner.dflash_block_logits(
        [*prompt, *refs["round1_verify_ids"][: k + 1].tolist(), int(refs["round2_block_ids"][0])]
    )
    assert np.abs(second - refs["round2_logits"]).max() <= ABS_TOL
    assert second.argmax(-1).tolist() == refs["round2_draft_tokens"].tolist()


@pytest.mark.parametrize("num_draft_tokens", [None, 15, 3])
def test_greedy_output_is_plain_greedy(fx: Any, num_draft_tokens: int | None) -> None:
    prompt = fx.refs["prompt_ids"].tolist()
    plain = fx.open().generate(prompt, 16)
    assert plain.tokens == fx.greedy.tolist()
    out = fx.open(dflash=fx.drafter, num_draft_tokens=num_draft_tokens).generate(prompt, 16)
    assert out.tokens == plain.tokens
    stats = out.stats
    assert stats.draft_tokens > 0 and stats.verify_steps > 0
    assert 0 <= stats.accepted_tokens <= stats.draft_tokens
    assert stats.mean_acceptance_length == (stats.accepted_tokens + stats.verify_steps) / stats.verify_steps
    if num_draft_tokens is not None and stats.accepted_tokens == 0:  # a random drafter: one token per verify
        # every verify drafts that many, but never past the budget (15 tokens after the prefill's)
        assert stats.draft_tokens == sum(min(num_draft_tokens, 14 - i) for i in range(stats.verify_steps))


def test_a_session_continues_losslessly(fx: Any) -> None:
    """A second request on a session reuses the cached prefix; the drafter keeps its context."""
    prompt = fx.refs["prompt_ids"].tolist()
    plain = fx.open().generate(prompt[:30], 12).tokens
    full = fx.open().generate(prompt, 12).tokens
    session = fx.open(dflash=fx.drafter, num_draft_tokens=15).session("s")
    assert session.generate(prompt[:30], 12).tokens == plain
    assert session.generate(prompt, 12).tokens == full


def test_sampling_opens_and_runs(fx: Any) -> None:
    runner = fx.open(dflash=fx.drafter, num_draft_tokens=15)
    out = runner.generate(fx.refs["prompt_ids"].tolist(), 10, temperature=0.7, seed=1)
    assert len(out.tokens) == 10 and out.stats.draft_tokens > 0
    again = runner.generate(fx.refs["prompt_ids"].tolist(), 10, temperature=0.7, seed=1)
    assert again.tokens == out.tokens


def test_default_draft_length_is_the_block(fx: Any) -> None:
    runner = fx.open(dflash=fx.drafter)
    setup = runner.opened.drafter
    assert setup is not None and setup.name == "dflash"
    assert setup.num_draft_tokens == 15 and setup.adaptive
    assert "block 16" in setup.description and setup.draft_cost > 0
    assert runner.startup_stats.drafter > 0


def test_states_are_captured_only_with_dflash_open(fx: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    captures: list[frozenset[int] | None] = []
    forward = Runner._forward

    def spy(
        self: Runner,
        inputs: mx.array,
        cache: Any,
        edit: Any,
        vision: Any = None,
        capture: Any = None,
        capture_layers: Any = None,
    ) -> mx.array:
        captures.append(None if capture is None else capture_layers)
        return forward(self, inputs, cache, edit, vision, capture, capture_layers)

    monkeypatch.setattr(Runner, "_forward", spy)
    prompt = fx.refs["prompt_ids"].tolist()
    for options in ({}, {"ngram": 3}):
        captures.clear()
        fx.open(**options).generate(prompt, 6)
        assert captures and all(c is None for c in captures)
    captures.clear()
    fx.open(dflash=fx.drafter).generate(prompt, 6)
    assert captures and all(c == frozenset({0}) for c in captures)


def test_block_logits_need_a_dflash_drafter(fx: Any) -> None:
    ids = fx.refs["prompt_ids"].tolist()
    with pytest.raises(OptionError, match="has no drafter, not a DFlash drafter; open the model with dflash=PATH"):
        fx.open().dflash_block_logits(ids)
    with pytest.raises(OptionError, match="has the 'ngram' drafter, not a DFlash drafter"):
        fx.open(ngram=3).dflash_block_logits(ids)
    with pytest.raises(OptionError, match="needs at least 2 token ids"):
        fx.open(dflash=fx.drafter).dflash_block_logits(ids[:1])


@pytest.mark.parametrize("other", [{"ngram": 4}, {"draft_model": "DRAFT"}])
def test_two_drafters_are_a_caller_error_naming_both(fx: Any, other: dict[str, Any]) -> None:
    other = {k: (fx.target if v == "DRAFT" else v) for k, v in other.items()}
    name = next(iter(other))
    with pytest.raises(OptionError, match=rf"dflash=.* and {name}=.* name two speculative drafters"):
        fx.open(dflash=fx.drafter, **other)


def test_a_hadamard_install_refuses_dflash(fx: Any, tmp_path: Path) -> None:
    rotated = tmp_path / "rotated"
    convert(fx.source, rotated, rotate=True)
    with pytest.raises(DrafterError, match=r"is hadamard-folded and cannot serve a speculative drafter \(dflash="):
        turbospark_core.open(rotated, dflash=fx.drafter)


def test_bad_option_values_are_refused() -> None:
    from turbospark_core.options import OpenOptions

    with pytest.raises(OptionError, match="dflash=3 is invalid; pass the path of a DFlash drafter install"):
        OpenOptions(dflash=3)
    assert OpenOptions(dflash="x").dflash == Path("x")


def test_open_refusals_surface_through_open(fx: Any) -> None:
    from turbospark_core.errors import NotAnInstallError

    with pytest.raises(NotAnInstallError, match="is a 'model' install"):
        fx.open(dflash=fx.target)


def test_rounds_with_accepted_drafts_equal_fresh_block_logits(fx: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts that the target accepts (an oracle stands in for a trained drafter): at every round the
    drafter's incremental context gives the logits of a fresh forward over the whole committed context."""
    from turbospark_core.speculative.dflash import DFlashDrafter
    from turbospark_core.speculative.drafter import Draft

    prompt = fx.refs["prompt_ids"].tolist()
    full = [*prompt, *fx.greedy.tolist()]
    runner = fx.open(dflash=fx.drafter, num_draft_tokens=3)
    checked: list[float] = []
    propose = DFlashDrafter.propose

    def oracle(self: DFlashDrafter, context: list[int], k: int, sampler: Any) -> Draft:
        incremental = np.array(self.round_logits(context[-1], len(context) - 1))
        checked.append(float(np.abs(incremental - runner.dflash_block_logits(context)).max()))
        propose(self, context, k, sampler)  # the real round runs too
        return Draft(tokens=full[len(context) : len(context) + k])

    monkeypatch.setattr(DFlashDrafter, "propose", oracle)
    out = runner.generate(prompt, 16)
    assert out.tokens == fx.greedy.tolist()
    assert out.stats.accepted_tokens > 0 and out.stats.mean_acceptance_length > 3
    assert len(checked) >= 3 and max(checked) <= ABS_TOL, checked


def test_the_drafter_counts_against_the_memory_budget(fx: Any) -> None:
    from turbospark_core.errors import MemoryBudgetError

    needed = fx.open().opened.estimate.total
    with pytest.raises(
        MemoryBudgetError, match=r"the DFlash drafter .* needs ~.* GB \(weights .* context K/V at max_context"
    ):
        fx.open(dflash=fx.drafter, memory_budget=needed + 1000)
    opened = fx.open(dflash=fx.drafter, memory_budget=needed + 10**7).opened
    assert opened.drafter is not None
    assert opened.estimate.drafter > 0 and opened.estimate.total == needed + opened.estimate.drafter


def test_dflash_and_an_mtp_depth_are_a_caller_error(fx: Any) -> None:
    with pytest.raises(OptionError, match=r"dflash=.* and mtp=2 name two speculative drafters"):
        fx.open(dflash=fx.drafter, mtp=2)


def test_mtp_auto_yields_to_dflash(turbospark_fixtures: Path, tmp_path: Path, random_drafter: Any) -> None:
    """On an install with an MTP head, mtp='auto' opens the head; beside dflash only the DFlash drafter opens."""
    src = turbospark_fixtures / "qwen3_5_mtp"
    if not (src / "config.json").is_file():
        pytest.skip(f"reference fixture {src} is not available")
    convert(src, tmp_path / "target")
    random_drafter(tmp_path / "ckpt", hidden=64, vocab=512, target_layers=[1], num_target_layers=4)
    convert(tmp_path / "ckpt", tmp_path / "drafter")
    auto = turbospark_core.open(tmp_path / "target", mtp="auto").opened.drafter
    assert auto is not None and auto.name == "mtp"
    runner = turbospark_core.open(tmp_path / "target", mtp="auto", dflash=tmp_path / "drafter")
    setup = runner.opened.drafter
    assert setup is not None and setup.name == "dflash"
    assert runner.opened.options.drafters_named() == ["dflash"]
    prompt = list(range(3, 40))
    plain = turbospark_core.open(tmp_path / "target").generate(prompt, 8).tokens
    assert runner.generate(prompt, 8).tokens == plain


def test_batched_generation_is_lossless(fx: Any) -> None:
    """generate_many: a row alone speculates with its own drafter, rows together decode plainly."""
    prompt = fx.refs["prompt_ids"].tolist()
    prompts = [prompt, prompt[:20], prompt[5:40]]
    budgets = [16, 4, 10]
    plain = [g.tokens for g in fx.open().generate_many(prompts, budgets)]
    runner = fx.open(dflash=fx.drafter, num_draft_tokens=7)
    assert [g.tokens for g in runner.generate_many(prompts, budgets)] == plain
    alone = runner.generate_many(prompts, budgets, max_rows=1)
    assert [g.tokens for g in alone] == plain
    assert sum(g.stats.draft_tokens for g in alone) > 0  # the last row, alone, drafted


def test_rows_decoding_together_verify_their_blocks_together(fx: Any) -> None:
    """Batched: each row's drafter reads its own rows of the batched forward's layer outputs; lossless."""
    prompt = fx.refs["prompt_ids"].tolist()
    prompts = [prompt, prompt[4:], prompt[:20] * 2]
    plain = fx.open()
    want = [plain.generate(p, m).tokens for p, m in zip(prompts, [16, 8, 10], strict=True)]
    got = fx.open(dflash=fx.drafter, num_draft_tokens=7).generate_many(prompts, [16, 8, 10])
    assert [g.tokens for g in got] == want
    assert all(g.stats.draft_tokens > 0 for g in got[1:])  # verified beside the longest row
