"""The batch engine with a drafter open (turbospark_core.batch): rows decoding together are verified together.

Every cache kind takes part (full KV, q8 KV, sliding rings, sinks + rings,
gated-DeltaNet recurrent state, streamed MoE experts); each row's output is
compared with plain greedy decoding of that row alone. The random-weight
fixtures reject most prompt-lookup drafts, so the per-row rewinds (and the
recurrent rows' catch-up) run on every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

import turbospark_core
from turbospark_core.runner import Runner
from turbospark_core.sampling import Sampler, SamplingParams
from turbospark_core.speculative.drafter import Draft
from turbospark_core.speculative.factory import DrafterSetup
from turbospark_core.steering import DirectionSet
from turbospark_core.testing import chi_square, find_fixtures_root

CASES = {
    "llama": ("llama", {}),
    "qwen3_5": ("qwen3_5", {}),
    "gemma4_e": ("gemma4_e", {}),
    "gpt_oss": ("gpt_oss", {}),
    "qwen3-q8": ("qwen3", {"kv_quant": "q8"}),
    "qwen3-q4": ("qwen3", {"kv_quant": "q4", "kv_recent": 0}),  # every token quantized
    "qwen3-q4-recent": ("qwen3", {"kv_quant": "q4"}),  # q4's default: the last 32 tokens read exact
    "qwen3_moe-streamed": ("qwen3_moe", {"residency": "streamed", "expert_slots": 2}),
}
@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest, turbospark_install: Any) -> tuple[Path, dict[str, Any], list[int]]:
    root = find_fixtures_root(request.config)
    name, options = CASES[request.param]
    if not (root / name / "references.npz").is_file():
        pytest.skip(f"reference fixture {name} is not available")
    with np.load(root / name / "references.npz") as refs:
        prompt = [int(t) for t in refs["prompt_ids"]]
    return turbospark_install(name, "float32", root=root), options, prompt


def _prompts(prompt: list[int]) -> list[list[int]]:
    """Four prompts that repeat themselves (so prompt lookup proposes), of different lengths."""
    return [prompt + prompt[:24], prompt[5:] + prompt[5:30], prompt[:20] * 3, prompt[::-1][:30] * 2]


DRAFTERS: dict[str, dict[str, Any]] = {
    "ngram": {"ngram": 4, "num_draft_tokens": 4},  # every proposal verified: mostly rejected on random weights
    "ngram-adaptive": {"ngram": 4},  # the default: the width adapts (drafting only where it pays)
    "self": {"draft_model": "SELF", "num_draft_tokens": 3},  # the model drafting for itself: all kept
}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_rows_verified_together_equal_plain_greedy(case: tuple[Path, dict[str, Any], list[int]], drafter: str) -> None:
    path, options, prompt = case
    prompts, limits = _prompts(prompt), [40, 12, 16, 12]
    plain = turbospark_core.open(path, **options)
    want = [plain.generate(p, m).tokens for p, m in zip(prompts, limits, strict=True)]
    named = {k: path if v == "SELF" else v for k, v in DRAFTERS[drafter].items()}
    runner = turbospark_core.open(path, **options, **named)
    got = runner.generate_many(prompts, limits)
    assert [g.tokens for g in got] == want
    if drafter != "ngram-adaptive":
        # the three short rows ended while the long one decoded: their drafts were verified in the batch
        assert all(g.stats.draft_tokens > 0 for g in got[1:])
    if drafter == "self":  # every drafted token is kept, in the batch too
        assert all(g.stats.accepted_tokens == g.stats.draft_tokens for g in got)


def test_rows_joining_and_leaving_mid_speculation(case: tuple[Path, dict[str, Any], list[int]]) -> None:
    path, options, prompt = case
    prompts = _prompts(prompt)[:3]
    limits = [40, 8, 24]
    plain = turbospark_core.open(path, **options)
    want = [plain.generate(p, m).tokens for p, m in zip(prompts, limits, strict=True)]
    runner = turbospark_core.open(path, **options, draft_model=path, num_draft_tokens=3)
    got = runner.generate_many(prompts, limits, max_rows=2)  # the third joins when the second leaves
    assert [g.tokens for g in got] == want
    assert got[0].stats.accepted_tokens == got[0].stats.draft_tokens > 0
    alone = runner.generate_many([prompt], 30)[0]  # a row alone decodes on its own caches
    assert alone.tokens == plain.generate(prompt, 30).tokens
    assert alone.stats.draft_tokens > 0


@pytest.fixture
def llama(turbospark_install: Any, request: pytest.FixtureRequest) -> tuple[Path, list[int]]:
    root = find_fixtures_root(request.config)
    if not (root / "llama" / "references.npz").is_file():
        pytest.skip("reference fixture llama is not available")
    with np.load(root / "llama" / "references.npz") as refs:
        prompt = [int(t) for t in refs["prompt_ids"]]
    return turbospark_install("llama", "float32", root=root), prompt


def test_session_rows_park_exactly_what_their_caches_hold(case: tuple[Path, dict[str, Any], list[int]]) -> None:
    path, options, prompt = case
    runner = turbospark_core.open(path, **options, ngram=3, session_slots=2)
    plain = turbospark_core.open(path, **options)
    prompts = _prompts(prompt)[:2]
    states = [runner.sessions.acquire(k) for k in ("a", "b")]
    batch = runner.batch()
    rows = [batch.add(p, 12 + 4 * i, state=s) for i, (p, s) in enumerate(zip(prompts, states, strict=True))]
    batch.run()
    for i, (row, p, s) in enumerate(zip(rows, prompts, states, strict=True)):
        assert row.result is not None and row.result.tokens == plain.generate(p, 12 + 4 * i).tokens
        assert s.tokens == [*p, *row.result.tokens][: len(s.tokens)]
    follows = [[*p, *r.result.tokens, *prompt[:6]] for p, r in zip(prompts, rows, strict=True) if r.result]
    batch = runner.batch()
    again = [batch.add(f, 10, state=s) for f, s in zip(follows, states, strict=True)]
    batch.run()
    for row, follow in zip(again, follows, strict=True):
        assert row.result is not None and row.result.stats.reused_tokens >= len(prompt)
        assert row.result.tokens == plain.generate(follow, 10).tokens


def test_a_row_asking_for_logprobs_is_drafted_for_and_gets_the_plain_logprobs(llama: tuple[Path, list[int]]) -> None:
    path, prompt = llama
    runner = turbospark_core.open(path, draft_model=path, num_draft_tokens=3)
    plain = turbospark_core.open(path).batch()
    want = plain.add(prompt, 12, logprobs=2)
    plain.run()
    batch = runner.batch()
    row = batch.add(prompt, 12, logprobs=2)
    batch.run()
    assert row.result is not None and want.result is not None
    assert row.result.tokens == want.result.tokens
    assert row.result.stats.draft_tokens > 0  # verified in the batch: logprobs from the verify's rows
    assert len(row.logprobs) == len(want.logprobs) == 12
    for got, ref in zip(row.logprobs, want.logprobs, strict=True):
        assert got.token == ref.token
        assert got.logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in ref.top]
        assert [v for _, v in got.top] == pytest.approx([v for _, v in ref.top], abs=1e-4)


def test_eos_and_stop_strings_inside_accepted_blocks_end_each_row_there(llama: tuple[Path, list[int]]) -> None:
    path, prompt = llama
    prompts = [prompt, prompt[7:]]
    plain_runner = turbospark_core.open(path)
    plain = [plain_runner.generate(p, 40) for p in prompts]
    stop = plain[1].text[len(plain[1].text) // 2 :][:3]
    want_stop = plain_runner.generate(prompts[1], 40, stop=stop)
    runner = turbospark_core.open(path, draft_model=path, num_draft_tokens=8)
    eos = plain[0].tokens[10]
    runner.eos_token_ids = frozenset({eos})
    got = runner.generate_many(prompts, 40, per_row=[{}, {"stop": stop}])
    assert got[0].tokens == plain[0].tokens[: plain[0].tokens.index(eos)]
    assert got[0].finish_reason == "stop"
    assert got[1].text == want_stop.text and got[1].finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 9])
def test_max_tokens_is_exact_for_every_row_whatever_the_block(llama: tuple[Path, list[int]], max_tokens: int) -> None:
    path, prompt = llama
    prompts = [prompt, prompt[3:], prompt[9:]]
    plain = turbospark_core.open(path)
    runner = turbospark_core.open(path, draft_model=path, num_draft_tokens=4)
    got = runner.generate_many(prompts, [max_tokens, max_tokens + 3, 12])
    for g, p, m in zip(got, prompts, [max_tokens, max_tokens + 3, 12], strict=True):
        assert g.tokens == plain.generate(p, m).tokens and len(g.tokens) == m


def test_each_row_verifies_under_its_own_steering(llama: tuple[Path, list[int]]) -> None:
    path, prompt = llama
    plain = turbospark_core.open(path)
    hidden = int(plain.manifest.arch["hidden_size"])
    rng = np.random.default_rng(0)
    add = DirectionSet.from_arrays(
        {1: rng.standard_normal(hidden).astype(np.float32)}, mode="add", scale=4.0, model_type="llama"
    )
    ablate = DirectionSet.from_arrays(
        {0: rng.standard_normal(hidden).astype(np.float32)}, mode="ablate", model_type="llama"
    )
    steerings: list[Any] = [add, False, ablate]
    prompts = [prompt, prompt[4:], prompt[8:]]
    want = [plain.generate(p, 24, steering=s).tokens for p, s in zip(prompts, steerings, strict=True)]
    assert want[0] != plain.generate(prompts[0], 24).tokens  # the steering changes the output
    runner = turbospark_core.open(path, draft_model=path, num_draft_tokens=4)  # the drafter is not steered
    batch = runner.batch()
    rows = [batch.add(p, 24, steering=s) for p, s in zip(prompts, steerings, strict=True)]
    batch.run()
    assert [r.result.tokens for r in rows if r.result] == want
    assert all(r.result and r.result.stats.draft_tokens > 0 for r in rows)


class _Guess:
    """Proposes the plain argmax twice after the context: often, not always, accepted."""

    name = "guess"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, runner: Runner, cache: dict[tuple[int, ...], int]) -> None:
        self.runner, self.cache = runner, cache

    def reset(self) -> None:
        """Stateless."""

    def observe(self, start: int, hidden: Any) -> None:
        """Never called."""

    def rewind(self, length: int) -> None:
        """Stateless."""

    def propose(self, context: Sequence[int], k: int, sampler: Sampler) -> Draft:
        key = tuple(context)
        if key not in self.cache:
            self.cache[key] = int(np.argmax(self.runner.logits(list(context))[-1]))
        return Draft(tokens=[self.cache[key]] * min(k, 2))


def test_sampled_rows_verified_together_are_distributed_as_plain_sampling(llama: tuple[Path, list[int]]) -> None:
    """Chi-square over 4 rows x 400 seeded batches: each row's first two tokens follow plain sampling's law."""
    import mlx.core as mx

    path, prompt = llama
    runner = turbospark_core.open(path)
    prompt = prompt[:20]
    opts: dict[str, Any] = {"temperature": 1.0, "top_k": 4, "repetition_penalty": 1.2}
    params = SamplingParams(**opts)
    sampler = Sampler(params)

    def law(ctx: list[int]) -> np.ndarray:
        logits = sampler.penalize(mx.array(runner.logits(ctx)[-1:]), mx.array(ctx[-params.repetition_context :]))
        return np.exp(np.array(sampler.logprobs(logits))[0])

    p_a = law(prompt)
    expected = {
        (int(a), b): float(p_a[a] * pb)
        for a in np.flatnonzero(p_a)
        for b, pb in enumerate(law([*prompt, int(a)]))
        if pb > 0
    }
    guesses: dict[tuple[int, ...], int] = {}
    setup = DrafterSetup(name="guess", new=lambda: _Guess(runner, guesses), num_draft_tokens=2, adaptive=False)
    runner._opened = attrs.evolve(runner.opened, drafter=setup)
    counts: dict[tuple[int, int], int] = {}
    trials, rows = 400, 4
    drafted = 0
    for t in range(trials):
        got = runner.generate_many([prompt] * rows, 2, per_row=[{"seed": rows * t + r} for r in range(rows)], **opts)
        for g in got:
            counts[(g.tokens[0], g.tokens[1])] = counts.get((g.tokens[0], g.tokens[1]), 0) + 1
            drafted += g.stats.draft_tokens
    assert drafted > 0
    n = trials * rows
    stat, critical = chi_square(counts, expected, n)
    assert stat < critical, (stat, critical)
