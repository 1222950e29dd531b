"""Session slots: prefix reuse equals a fresh run, LRU eviction, rewind through checkpoints."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core.cache_spec import CacheSpec, StateSpec
from turbospark_core.errors import ContextOverflowError, OptionError
from turbospark_core.kv_cache import make_caches
from turbospark_core.sessions import SequenceState, SessionPool, common_prefix


@pytest.fixture(scope="module")
def runner(turbospark_install) -> turbospark_core.Runner:
    return turbospark_core.open(turbospark_install("llama", "float32"), session_slots=2)


@pytest.fixture(scope="module")
def prompt(turbospark_fixtures: Path) -> list[int]:
    return np.load(turbospark_fixtures / "llama" / "references.npz")["prompt_ids"].tolist()


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2


def test_second_turn_reuses_the_first_and_matches_fresh(runner: turbospark_core.Runner, prompt: list[int]) -> None:
    session = runner.session("a")
    first = session.generate(prompt[:20], max_tokens=5)
    assert first.stats.reused_tokens == 0
    follow = prompt[:20] + first.tokens + [7, 8, 9]
    second = session.generate(follow, max_tokens=6)
    assert second.stats.reused_tokens == 20 + len(first.tokens) - 1  # the last sampled token was never fed
    assert second.tokens == runner.generate(follow, max_tokens=6).tokens


def test_identical_prompt_recomputes_only_the_last_token(runner: turbospark_core.Runner, prompt: list[int]) -> None:
    session = runner.session("same")
    session.reset()
    session.generate(prompt, max_tokens=2)
    again = session.generate(prompt, max_tokens=4)
    assert again.stats.reused_tokens == len(prompt) - 1
    assert again.tokens == runner.generate(prompt, max_tokens=4).tokens


def test_switching_sessions_gives_dedicated_results(runner: turbospark_core.Runner, prompt: list[int]) -> None:
    a, b = runner.session("x"), runner.session("y")
    a.reset(), b.reset()
    a.generate(prompt[:10], max_tokens=3)
    b.generate(prompt[::-1][:12], max_tokens=3)
    got = a.generate([*prompt[:10], 5, 6], max_tokens=5)
    assert got.stats.reused_tokens == 10
    assert got.tokens == runner.generate([*prompt[:10], 5, 6], max_tokens=5).tokens


def test_lru_eviction(runner: turbospark_core.Runner, prompt: list[int]) -> None:
    for sid in ("e1", "e2", "e3"):
        runner.session(sid).generate(prompt[:8], max_tokens=2)
    assert "e1" not in runner.sessions and {"e2", "e3"} <= {s for s in ("e2", "e3") if s in runner.sessions}
    assert runner.session("e1").generate(prompt[:8], max_tokens=2).stats.reused_tokens == 0


def test_overflow_keeps_session_usable(runner: turbospark_core.Runner, prompt: list[int]) -> None:
    session = runner.session("o")
    session.reset()
    session.generate(prompt[:10], max_tokens=2)
    with pytest.raises(ContextOverflowError, match="max_context"):
        session.generate(prompt, max_tokens=runner.max_context)
    assert session.generate([*prompt[:10], 3], max_tokens=2).stats.reused_tokens == 10


def test_quantized_kv_with_exact_recent_tokens_reuses_and_matches_fresh(
    turbospark_install, turbospark_fixtures: Path
) -> None:
    """q4 KV with its recent tokens read exact: a parked session's next turn equals a fresh run."""
    quantized = turbospark_core.open(turbospark_install("qwen3", "float32"), kv_quant="q4", kv_recent=4)
    ids = np.load(turbospark_fixtures / "qwen3" / "references.npz")["prompt_ids"].tolist()
    session = quantized.session("q")
    first = session.generate(ids[:20], max_tokens=5)
    follow = ids[:20] + first.tokens + [7, 8, 9]
    second = session.generate(follow, max_tokens=6)
    assert second.stats.reused_tokens == 20 + len(first.tokens) - 1
    assert second.tokens == quantized.generate(follow, max_tokens=6).tokens
    again = session.generate(ids[:12], max_tokens=4)  # back to an earlier point: a checkpoint, then prefill
    assert again.tokens == quantized.generate(ids[:12], max_tokens=4).tokens


def test_bad_slot_count_refused() -> None:
    with pytest.raises(OptionError, match="session_slots"):
        SessionPool(0, lambda: [])


def test_session_slots_option_checked_at_open(turbospark_install) -> None:
    with pytest.raises(OptionError, match="session_slots"):
        turbospark_core.open(turbospark_install("llama", "float32"), session_slots=0)


def _ring_and_state_caches() -> list:
    specs = [CacheSpec.sliding(1, 4, window=3), StateSpec(shapes={"h": (2,)})]
    return make_caches(specs, 100, mx.float32)


def _filled_ring_state(checkpoints: tuple[int, ...] = (2,)) -> SequenceState:
    """Tokens 1-5 in a ring and a recurrent state, checkpointed after the given counts of tokens."""
    state = SequenceState(_ring_and_state_caches)
    ring, rec = state.caches
    for n, tok in enumerate([1, 2, 3, 4, 5], 1):
        ring.update_and_fetch(mx.full((1, 1, 1, 4), float(tok)), mx.full((1, 1, 1, 4), float(tok)))
        rec.set("h", mx.full((1, 2), float(tok)))
        state.tokens.append(tok)
        if n in checkpoints:
            state.checkpoint()
    return state


def test_untrimmable_state_rewinds_to_latest_checkpoint() -> None:
    state = _filled_ring_state(checkpoints=(2, 4))
    ring, rec = state.caches
    assert not state.trimmable
    assert state.rewind(3) == 2
    assert state.tokens == [1, 2] and ring.offset == 2
    assert rec.get("h", 1).tolist() == [[2.0, 2.0]]
    assert state.rewind(1) == 0 and state.tokens == []


def test_a_ring_and_recurrent_donor_is_forked_only_at_its_end_or_a_checkpoint() -> None:
    donor = _filled_ring_state()
    assert [donor.reusable(n) for n in (1, 2, 4, 5, 9)] == [0, 2, 2, 5, 5]
    fresh = SequenceState(_ring_and_state_caches)
    assert fresh.share_prefix([1, 2, 3, 4, 5, 6], [donor]) == 5  # the donor's whole state: its end is the prefix
    ring, rec = fresh.caches
    assert fresh.tokens == [1, 2, 3, 4, 5] and ring.offset == 5 and rec.get("h", 1).tolist() == [[5.0, 5.0]]
    held = [np.array(a.parts[0] if hasattr(a, "parts") else a) for a in donor.caches[0].export_rows()]
    copied = [np.array(a.parts[0] if hasattr(a, "parts") else a) for a in ring.export_rows()]
    assert all(np.array_equal(a, b) for a, b in zip(held, copied, strict=True))  # keys, values, positions
    ring.update_and_fetch(mx.full((1, 1, 1, 4), 9.0), mx.full((1, 1, 1, 4), 9.0))  # the copy's writes stay its own
    assert donor.caches[0].offset == 5 and not (np.array(donor.caches[0].keys) == 9.0).any()
    other = SequenceState(_ring_and_state_caches)
    assert other.share_prefix([1, 2, 3, 4, 7, 8], [donor]) == 2  # mid-state: only the checkpoint at 2
    assert other.tokens == [1, 2] and other.caches[1].get("h", 1).tolist() == [[2.0, 2.0]]
    assert SequenceState(_ring_and_state_caches).share_prefix([1, 9], [donor]) == 0  # nothing reusable: no copy


def test_a_state_forks_a_shared_prefix_of_full_kv_and_continues_as_a_fresh_run(
    runner: turbospark_core.Runner, prompt: list[int]
) -> None:
    donor_session = runner.session("donor")
    donor_session.reset()
    donor_session.generate(prompt[:30], max_tokens=3)
    donor = runner.sessions.peek("donor")
    assert donor is not None
    held = list(donor.tokens)
    follow = [*prompt[:24], 7, 8, 9]
    state = SequenceState(runner.opened.new_cache)
    assert state.share_prefix(follow, [donor]) == 24 and state.tokens == prompt[:24]
    assert state.share_prefix(follow, [donor]) == 0  # it already holds as much as the donor offers
    batch = runner.batch(max_rows=1)
    got = batch.add(follow, 6, state=state)
    batch.run()
    assert got.result is not None and got.result.stats.reused_tokens == 24
    assert got.result.tokens == runner.generate(follow, max_tokens=6).tokens
    assert donor.tokens == held  # the donor is untouched: its next turn still equals a fresh run
    again = donor_session.generate([*prompt[:30], 5, 6], max_tokens=4)
    assert again.stats.reused_tokens == 30
    assert again.tokens == runner.generate([*prompt[:30], 5, 6], max_tokens=4).tokens
