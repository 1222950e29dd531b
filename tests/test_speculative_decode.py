"""Speculative decoding end to end (turbospark_core.speculative.decode): lossless on every family fixture."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import turbospark_core
from turbospark_core.errors import UnknownFamilyError
from turbospark_core.testing import chi_square, find_fixtures_root

ROOT = Path(os.environ.get("TURBOSPARK_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures"))
FAMILY_FIXTURES = sorted(
    p.name for p in ROOT.glob("*") if (p / "references.npz").is_file() and not p.name.endswith(("_mtp", "_dflash"))
)
TOKENS = 64


@pytest.fixture
def make(turbospark_install: Any, request: pytest.FixtureRequest) -> Callable[[str], Path]:
    root = find_fixtures_root(request.config)

    def _make(name: str) -> Path:
        if not (root / name / "references.npz").is_file():
            pytest.skip(f"reference fixture {name} is not available")
        try:
            path: Path = turbospark_install(name, "float32", root=root)
        except UnknownFamilyError:
            pytest.skip(f"no installed plugin serves the {name} fixture")
        return path

    return _make


def _prompt(name: str, root: Path = ROOT) -> list[int]:
    with np.load(root / name / "references.npz") as refs:
        return [int(t) for t in refs["prompt_ids"]]


@pytest.mark.parametrize("name", FAMILY_FIXTURES)
def test_greedy_is_lossless_with_every_drafter_on_every_family(make: Callable[[str], Path], name: str) -> None:
    path = make(name)
    prompt = _prompt(name)
    plain = turbospark_core.open(path).generate(prompt, TOKENS)
    assert plain.stats.draft_tokens == plain.stats.accepted_tokens == 0
    # the model drafting for itself: every drafted token is accepted
    selfdraft = turbospark_core.open(path, draft_model=path, num_draft_tokens=4).generate(prompt, TOKENS)
    assert selfdraft.tokens == plain.tokens
    assert selfdraft.stats.draft_tokens > 0
    assert selfdraft.stats.accepted_tokens == selfdraft.stats.draft_tokens
    # prompt lookup: whatever it proposes, the output is plain greedy's
    lookup = turbospark_core.open(path, ngram=4, num_draft_tokens=4).generate(prompt + prompt[:24], TOKENS)
    reference = turbospark_core.open(path).generate(prompt + prompt[:24], TOKENS)
    assert lookup.tokens == reference.tokens
    assert lookup.stats.draft_tokens > 0


@pytest.mark.parametrize("num_draft_tokens", [3, None])
def test_a_draft_model_of_another_family_is_lossless(make: Callable[[str], Path], num_draft_tokens: int | None) -> None:
    target, draft = make("qwen3_5"), make("llama")
    prompt = _prompt("qwen3_5")
    plain = turbospark_core.open(target).generate(prompt, TOKENS)
    runner = turbospark_core.open(target, draft_model=draft, num_draft_tokens=num_draft_tokens)
    got = runner.generate(prompt, TOKENS)
    assert got.tokens == plain.tokens
    # random weights: rejections happen and are rewound (adaptive: it soon decodes plainly, probing now and then)
    assert got.stats.draft_tokens > got.stats.accepted_tokens


class _Oracle:
    """A free drafter that knows plain greedy's continuation but proposes only at the positions ``where`` says."""

    name = "oracle"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, truth: list[int], where: Callable[[int], bool]) -> None:
        self.truth, self.where = truth, where

    def reset(self) -> None:
        """Stateless."""

    def observe(self, start: int, hidden: Any) -> None:
        """Never called."""

    def rewind(self, length: int) -> None:
        """Stateless."""

    def propose(self, context: Any, k: int, sampler: Any) -> Any:
        from turbospark_core.speculative.drafter import Draft

        n = len(context)
        return Draft(tokens=self.truth[n : n + k] if self.where(n) else [], source=1)


def test_adaptive_decoding_goes_plain_where_nothing_is_proposed_and_verifies_where_it_is(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain stretches run pipelined (the drafter asked after every token); a proposal whose first token is the
    one in flight ends them, and the rest of it is what the next verify checks."""
    import attrs

    from turbospark_core.speculative.decode import SpeculativeLoop
    from turbospark_core.speculative.factory import DrafterSetup

    prompt = _prompt("llama")
    plain = turbospark_core.open(llama).generate(prompt, 48)
    truth = [*prompt, *plain.tokens]
    runner = turbospark_core.open(llama)
    oracle = _Oracle(truth, lambda n: (n - len(prompt)) % 16 >= 8)  # proposes for 8 tokens, then not for 8
    setup = DrafterSetup(name="oracle", new=lambda: oracle, num_draft_tokens=4)
    runner._opened = attrs.evolve(runner.opened, drafter=setup)
    plain_tokens = []
    real = SpeculativeLoop._plain

    def counted(self: SpeculativeLoop, budget: int) -> Any:
        for tok in real(self, budget):
            plain_tokens.append(tok)
            yield tok

    monkeypatch.setattr(SpeculativeLoop, "_plain", counted)
    got = runner.generate(prompt, 48)
    assert got.tokens == plain.tokens
    assert got.stats.accepted_tokens == got.stats.draft_tokens > 0  # every oracle token kept
    assert 8 <= len(plain_tokens) < 40  # the stretches without proposals decoded plainly, the rest verified


def test_step_costs_are_one_forward_per_token_whatever_the_stretch(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The policy's step times, on a clock that advances one unit per token a forward runs: every plain
    stretch (one or two tokens included) is timed 1 per token, every verify of ``T`` tokens ``T``.

    A plain stretch's forwards overlap, so timing it read to read would give its first token two
    forwards and its last none; the stretch is timed as a whole instead.
    """
    import attrs

    from turbospark_core.runner import Runner
    from turbospark_core.speculative import decode
    from turbospark_core.speculative.factory import DrafterSetup

    prompt = _prompt("llama")
    plain = turbospark_core.open(llama).generate(prompt, 48)
    truth = [*prompt, *plain.tokens]
    ticks = [0.0]
    real = Runner._forward

    def counted(self: Runner, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        ticks[0] += inputs.shape[1]
        return real(self, inputs, *args, **kwargs)

    monkeypatch.setattr(Runner, "_forward", counted)
    monkeypatch.setattr(decode, "clock", lambda: ticks[0])
    runner = turbospark_core.open(llama)
    for period in (16, 3):  # long stretches, then stretches of one or two tokens between short proposals
        oracle = _Oracle(truth, lambda n, p=period: (n - len(prompt)) % (2 * p) >= p)
        setup = DrafterSetup(name="oracle", new=lambda o=oracle: o, num_draft_tokens=4)
        runner._opened = attrs.evolve(runner.opened, drafter=setup)
        got = runner.generate(prompt, 48)
        assert got.tokens == plain.tokens and got.stats.draft_tokens > 0
        samples = setup.history.times._samples
        assert samples[1] and set(samples[1]) == {1.0}  # plain stretches: one unit per token
        assert all(set(v) == {float(t)} for t, v in samples.items())  # verifies: one per token they ran


@pytest.fixture
def llama(make: Callable[[str], Path]) -> Path:
    return make("llama")


def test_eos_inside_an_accepted_block_ends_the_output_there(llama: Path) -> None:
    prompt = _prompt("llama")
    plain = turbospark_core.open(llama).generate(prompt, TOKENS)
    runner = turbospark_core.open(llama, draft_model=llama, num_draft_tokens=8)
    runner.eos_token_ids = frozenset({plain.tokens[10]})
    got = runner.generate(prompt, TOKENS)
    first = plain.tokens.index(plain.tokens[10])
    assert got.tokens == plain.tokens[:first]
    assert got.finish_reason == "stop"


def test_a_stop_string_inside_an_accepted_block_ends_the_text_there(llama: Path) -> None:
    prompt = _prompt("llama")
    plain_runner = turbospark_core.open(llama)
    plain = plain_runner.generate(prompt, 40)
    stop = plain.text[len(plain.text) // 2 : len(plain.text) // 2 + 3]
    want = plain_runner.generate(prompt, 40, stop=stop)
    got = turbospark_core.open(llama, draft_model=llama, num_draft_tokens=8).generate(prompt, 40, stop=stop)
    assert got.text == want.text
    assert got.finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 9])
def test_max_tokens_is_exact_whatever_the_block_size(llama: Path, max_tokens: int) -> None:
    prompt = _prompt("llama")
    plain = turbospark_core.open(llama).generate(prompt, max_tokens)
    got = turbospark_core.open(llama, draft_model=llama, num_draft_tokens=4).generate(prompt, max_tokens)
    assert got.tokens == plain.tokens
    assert len(got.tokens) == max_tokens


def test_sessions_reuse_their_prefix_with_a_drafter(make: Callable[[str], Path]) -> None:
    path = make("qwen3_5")  # recurrent state: prefix reuse goes through checkpoints
    prompt = _prompt("qwen3_5")
    runner = turbospark_core.open(path, ngram=3)
    plain = turbospark_core.open(path)
    session = runner.session("a")
    first = session.generate(prompt, 12)
    follow = [*prompt, *first.tokens, *prompt[:10]]
    second = session.generate(follow, 12)
    assert second.stats.reused_tokens > len(prompt)
    assert first.tokens == plain.generate(prompt, 12).tokens
    assert second.tokens == plain.generate(follow, 12).tokens


def test_a_steered_target_verifies_steered(make: Callable[[str], Path]) -> None:
    from turbospark_core.steering import DirectionSet

    path = make("llama")
    prompt = _prompt("llama")
    plain = turbospark_core.open(path)
    hidden = int(plain.manifest.arch["hidden_size"])
    direction = np.random.default_rng(0).standard_normal(hidden).astype(np.float32)
    steering = DirectionSet.from_arrays({1: direction}, mode="add", scale=4.0, model_type="llama")
    want = plain.generate(prompt, 32, steering=steering)
    assert want.tokens != plain.generate(prompt, 32).tokens  # the steering changes the output
    got = turbospark_core.open(path, draft_model=path, num_draft_tokens=4).generate(prompt, 32, steering=steering)
    assert got.tokens == want.tokens


def test_sampling_with_a_self_draft_accepts_everything_and_is_reproducible(llama: Path) -> None:
    prompt = _prompt("llama")
    runner = turbospark_core.open(llama, draft_model=llama, num_draft_tokens=4)
    opts: dict[str, Any] = {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "repetition_penalty": 1.3, "seed": 5}
    a = runner.generate(prompt, 24, **opts)
    b = runner.generate(prompt, 24, **opts)
    assert a.tokens == b.tokens
    assert a.stats.accepted_tokens == a.stats.draft_tokens > 0  # q == p exactly: the same transforms on both


def test_sampled_continuations_are_distributed_as_plain_sampling(llama: Path) -> None:
    """Chi-square over 1500 seeded verifies: the first two committed tokens follow plain sampling's law."""
    import mlx.core as mx

    from turbospark_core.kv_cache import trim_caches
    from turbospark_core.sampling import Sampler, SamplingParams
    from turbospark_core.speculative.decode import SpeculativeLoop
    from turbospark_core.speculative.factory import DrafterSetup
    from turbospark_core.speculative.ngram import NgramDrafter

    runner = turbospark_core.open(llama)
    prompt = _prompt("llama")[:20]
    params = SamplingParams(temperature=1.0, top_k=4, repetition_penalty=1.2, seed=7)
    sampler = Sampler(params)
    first = int(np.argmax(runner.logits(prompt)[-1]))
    context = [*prompt, first]

    # the plain law of the two tokens after ``context``: p(a) p(b | a), with plain decoding's penalty history
    def law(ctx: list[int]) -> np.ndarray:
        logits = mx.array(runner.logits(ctx)[-1:])
        logits = sampler.penalize(logits, mx.array(ctx[-params.repetition_context :]))
        return np.exp(np.array(sampler.logprobs(logits))[0])

    p_a = law(context)
    expected = {
        (a, b): float(p_a[a] * pb)
        for a in np.flatnonzero(p_a)
        for b, pb in enumerate(law([*context, int(a)]))
        if pb > 0
    }

    tops: dict[tuple[int, ...], int] = {}

    class Guess(NgramDrafter):  # deterministic: the plain argmax twice (often, not always, accepted)
        def propose(self, ctx: Any, k: int, s: Sampler) -> Any:
            from turbospark_core.speculative.drafter import Draft

            key = tuple(ctx)
            if key not in tops:
                tops[key] = int(np.argmax(runner.logits(list(ctx))[-1]))
            return Draft(tokens=[tops[key], tops[key]][:k])

    caches = runner.opened.new_cache()
    runner._prefill(prompt, caches)
    setup = DrafterSetup(name="guess", new=Guess, num_draft_tokens=2, adaptive=False)

    def forward(tokens: list[int], cs: Any, capture: Any) -> mx.array:
        return runner.model(tokens, cs)

    n = 1500
    counts: dict[tuple[int, int], int] = {}
    drafter = Guess()
    for _ in range(n):
        loop = SpeculativeLoop(forward, caches, drafter, setup, sampler, list(context), len(prompt))
        got = loop.step(10)
        if len(got) == 1:
            got += loop.step(10)
        key = (got[0], got[1])
        counts[key] = counts.get(key, 0) + 1
        trim_caches(caches, loop.held - len(prompt))
    stat, critical = chi_square(counts, expected, n)
    assert stat < critical, (stat, critical)
