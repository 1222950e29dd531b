"""The draft-model drafter (turbospark_core.speculative.draft_model): its caches follow the context exactly."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import turbospark_core
from turbospark_core.sampling import Sampler, SamplingParams
from turbospark_core.speculative.draft_model import ModelDrafter
from turbospark_core.testing import find_fixtures_root

ROOT = Path(os.environ.get("TURBOSPARK_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures"))


@pytest.mark.parametrize("name", ["llama", "qwen3_5", "gemma4_e"])
def test_proposals_after_rejections_equal_a_fresh_drafters(
    turbospark_install: Any, request: pytest.FixtureRequest, name: str
) -> None:
    root = find_fixtures_root(request.config)
    if not (root / name / "references.npz").is_file():
        pytest.skip(f"reference fixture {name} is not available")
    path = turbospark_install(name, "float32", root=root)
    with np.load(root / name / "references.npz") as refs:
        prompt = [int(t) for t in refs["prompt_ids"]]
    runner = turbospark_core.open(path, ngram=4)  # caches with ring slack, as a draft install gets
    greedy = Sampler(SamplingParams())

    def fresh() -> ModelDrafter:
        return ModelDrafter(runner.model, runner.opened.new_cache)

    drafter = fresh()
    rng = np.random.default_rng(0)
    context = [*prompt, 5]
    for _ in range(8):
        draft = drafter.propose(context, 4, greedy)
        assert draft.tokens == fresh().propose(context, 4, greedy).tokens
        kept = int(rng.integers(0, 5))  # accept a prefix, then a bonus token that differs
        context = [*context, *draft.tokens[:kept], int(rng.integers(3, 500))]
        drafter.rewind(len(context))
    # a context that diverges earlier (another conversation) is followed too
    other = [*prompt[:30], 7, 8, 9]
    assert drafter.propose(other, 3, greedy).tokens == fresh().propose(other, 3, greedy).tokens


def test_the_draft_model_counts_in_the_open_estimate_and_budget(turbospark_install: Any) -> None:
    """The draft install's weights and KV (for every session slot) join the target's estimate; over budget: refused."""
    from turbospark_core.errors import MemoryBudgetError

    path = turbospark_install("llama", "float32")
    plain = turbospark_core.open(path, max_context=256, session_slots=2).opened.estimate
    runner = turbospark_core.open(path, max_context=256, session_slots=2, draft_model=path, num_draft_tokens=2)
    estimate = runner.opened.estimate
    assert estimate.drafter == plain.total  # a model drafting for itself: the same weights and KV again
    assert estimate.total == plain.total + estimate.drafter
    fits = plain.total + estimate.drafter
    opened = turbospark_core.open(path, max_context=256, session_slots=2, memory_budget=fits, draft_model=path)
    assert opened.opened.drafter is not None
    with pytest.raises(
        MemoryBudgetError, match=r"draft_model=.* does not fit beside the model.*open without draft_model"
    ):
        turbospark_core.open(path, max_context=256, session_slots=2, memory_budget=fits - 1, draft_model=path)
