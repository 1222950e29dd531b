"""The batch engine with a drafter open (turbospark_core.batch): a row alone speculates, rows together batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import turbospark_core
from turbospark_core.testing import find_fixtures_root


@pytest.fixture(params=["llama", "qwen3_5", "gemma4_e"])
def fixture(request: pytest.FixtureRequest, turbospark_install: Any) -> tuple[Path, list[int]]:
    root = find_fixtures_root(request.config)
    name = request.param
    if not (root / name / "references.npz").is_file():
        pytest.skip(f"reference fixture {name} is not available")
    with np.load(root / name / "references.npz") as refs:
        prompt = [int(t) for t in refs["prompt_ids"]]
    return turbospark_install(name, "float32", root=root), prompt


def test_rows_joining_and_leaving_decode_as_plain_greedy(fixture: tuple[Path, list[int]]) -> None:
    path, prompt = fixture
    prompts = [prompt, prompt[5:], prompt[:20] + prompt[:20]]
    limits = [40, 8, 24]
    plain = turbospark_core.open(path)
    want = [plain.generate(p, m).tokens for p, m in zip(prompts, limits, strict=True)]
    runner = turbospark_core.open(path, draft_model=path, num_draft_tokens=3)
    got = runner.generate_many(prompts, limits, max_rows=2)
    assert [g.tokens for g in got] == want
    # the longest row ends alone: it speculates then (a model drafting for itself accepts all)
    assert got[0].stats.draft_tokens > 0
    assert got[0].stats.accepted_tokens == got[0].stats.draft_tokens
    alone = runner.generate_many([prompt], 30)[0]
    assert alone.tokens == plain.generate(prompt, 30).tokens
    assert alone.stats.draft_tokens > 0


def test_a_session_row_parks_exactly_what_its_caches_hold(fixture: tuple[Path, list[int]]) -> None:
    path, prompt = fixture
    runner = turbospark_core.open(path, ngram=3, session_slots=2)
    plain = turbospark_core.open(path)
    state = runner.sessions.acquire("s")
    batch = runner.batch()
    row = batch.add(prompt, 20, state=state)
    batch.run()
    assert row.result is not None
    assert row.result.tokens == plain.generate(prompt, 20).tokens
    assert state.tokens == [*prompt, *row.result.tokens][: len(state.tokens)]
    follow = [*prompt, *row.result.tokens, *prompt[:6]]
    again = runner.session("s").generate(follow, 10)
    assert again.stats.reused_tokens >= len(prompt)
    assert again.tokens == plain.generate(follow, 10).tokens
