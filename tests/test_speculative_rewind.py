"""Rewind after rejected drafts (speculative.rewind, RingKVCache.trim): the state equals a fresh run's."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core.cache_spec import CacheSpec
from turbospark_core.kv_cache import RingKVCache
from turbospark_core.runner import Runner
from turbospark_core.sampling import Sampler, SamplingParams
from turbospark_core.speculative.decode import SpeculativeLoop
from turbospark_core.speculative.drafter import Draft
from turbospark_core.speculative.factory import DrafterSetup
from turbospark_core.testing import find_fixtures_root

ROOT = Path(os.environ.get("TURBOSPARK_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures"))


class PartlyRightDrafter:
    """Proposes the true greedy continuation for a random number of tokens, then wrong ones."""

    name = "test"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, truth: list[int], vocab: int) -> None:
        self.truth = truth
        self.vocab = vocab
        self.rng = np.random.default_rng(0)

    def reset(self) -> None:
        """Stateless."""

    def observe(self, start: int, hidden: Mapping[int, mx.array]) -> None:
        """Never called."""

    def rewind(self, length: int) -> None:
        """Stateless."""

    def propose(self, context: Sequence[int], k: int, sampler: Sampler) -> Draft:
        n = len(context)
        right = int(self.rng.integers(0, k + 1))
        out = list(self.truth[n : n + right])
        while len(out) < k:
            wrong = int(self.rng.integers(3, self.vocab))
            out.append(wrong if n + len(out) >= len(self.truth) or wrong != self.truth[n + len(out)] else 3)
        return Draft(tokens=out)


def _check_rewind(runner: Runner, prompt: list[int], steps: int = 10, k: int = 4) -> None:
    greedy = runner.generate(prompt, steps * (k + 1) + 2).tokens
    truth = [*prompt, *greedy]
    vocab = int(runner.manifest.arch["vocab_size"])
    caches = runner.opened.new_cache()
    first = int(np.argmax(np.array(runner._prefill(prompt, caches)[0])))
    assert first == greedy[0]

    def forward(tokens: list[int], cs: Any, capture: Any) -> mx.array:
        return runner.model(tokens, cs)

    setup = DrafterSetup(name="test", new=lambda: drafter, num_draft_tokens=k, adaptive=False)
    drafter = PartlyRightDrafter(truth, vocab)
    loop = SpeculativeLoop(forward, caches, drafter, setup, Sampler(SamplingParams()), [*prompt, first], len(prompt))
    for _ in range(steps):
        loop.step(1000)
    assert loop.context == truth[: len(loop.context)]  # greedy: lossless
    assert loop.counts.drafted > loop.counts.accepted > 0  # both rejections and acceptances happened
    assert loop.held == len(loop.context) - 1
    got = np.array(runner.model(mx.array([loop.context[-1:]]), caches)[0, -1].astype(mx.float32))
    want = runner.logits(loop.context)[-1]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("qwen3_5", {}),  # gated-DeltaNet recurrent + conv state: checkpoint and replay
        ("gemma4_e", {}),  # sliding-window rings: trimmed within their slack
        ("gpt_oss", {}),  # attention sinks + rings
        ("qwen3_moe", {"residency": "streamed", "expert_slots": 2}),  # streamed MoE experts
        ("qwen3", {"kv_quant": "q8"}),  # quantized KV
        ("qwen3_5", {"kv_quant": "q4"}),  # quantized KV beside recurrent state
        ("qwen3", {"kv_quant": "q4", "kv_recent": 2}),  # quantized KV, the last 2 tokens read exact
    ],
)
def test_state_after_rejected_drafts_equals_a_fresh_run(
    turbospark_install: Any, request: pytest.FixtureRequest, name: str, options: dict[str, Any]
) -> None:
    root = find_fixtures_root(request.config)
    if not (root / name / "references.npz").is_file():
        pytest.skip(f"reference fixture {name} is not available")
    path = turbospark_install(name, "float32", root=root)
    with np.load(root / name / "references.npz") as refs:
        prompt = [int(t) for t in refs["prompt_ids"]]
    # ring slack for 4 drafts + 1, as an open with a drafter asks for
    runner = turbospark_core.open(path, ngram=4, **options)
    _check_rewind(runner, prompt)


def _ring(window: int, slack: int) -> RingKVCache:
    return RingKVCache(CacheSpec(n_kv_heads=1, head_dim=4, window=window), 1000, mx.float32, slack=slack)


def _kv(n: int, start: int) -> mx.array:
    return mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1) * mx.ones((1, 1, n, 4))


@pytest.mark.parametrize("first", [3, 7, 12])
@pytest.mark.parametrize("kept", [0, 1, 3])
def test_a_trimmed_ring_keeps_its_window(first: int, kept: int) -> None:
    """Fill, add a verify block, trim part of it, go on: the attended keys equal an untrimmed ring's."""
    window, slack = 6, 4
    trimmed, fresh = _ring(window, slack), _ring(window, slack)
    for ring in (trimmed, fresh):
        ring.update_and_fetch(_kv(first, 0), _kv(first, 0))
    trimmed.update_and_fetch(_kv(slack, first), _kv(slack, first) + 100)  # a verify block of four
    assert trimmed.trim(slack - kept) == slack - kept
    if kept:
        fresh.update_and_fetch(_kv(kept, first), _kv(kept, first) + 100)
    assert trimmed.offset == fresh.offset == first + kept
    pos = first + kept
    for n in (3, 1, 1, 2, 1, 5, 1):
        outs = [ring.update_and_fetch(_kv(n, pos), _kv(n, pos) + 100) for ring in (trimmed, fresh)]
        masks = [np.array(ring.mask(n)) for ring in (trimmed, fresh)]
        for q in range(n):
            seen = [sorted(np.array(k[0, 0, :, 0])[m[q]].tolist()) for (k, _), m in zip(outs, masks, strict=True)]
            assert seen[0] == seen[1] == list(range(max(0, pos + q - window + 1), pos + q + 1))
        pos += n
