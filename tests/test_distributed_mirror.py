"""Serving from a group, in one process: the calls rank 0 hands on, replayed by a follower, leave it where rank 0 is."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import turbospark_core
from turbospark_core.distributed.mirror import Channel, LeaderRunner, follow, leading
from turbospark_core.errors import DistributedError
from turbospark_core.runner import Runner
from turbospark_core.sessions import SequenceState
from turbospark_core.steering import DirectionSet


class Recording(Channel):
    """Rank 0's side: keeps what it would broadcast."""

    def __init__(self) -> None:
        self.ops: list[dict[str, Any]] = []
        self.stopped = False

    def send(self, op: dict[str, Any]) -> None:
        self.ops.append(json.loads(json.dumps(op)))  # what crosses the wire


class Replay(Channel):
    """Another rank's side: the recorded calls, then stop."""

    def __init__(self, ops: list[dict[str, Any]]) -> None:
        self._ops: Iterator[dict[str, Any]] = iter([*ops, {"op": "stop"}])

    def receive(self) -> dict[str, Any]:
        return next(self._ops)


STEERING = DirectionSet.from_arrays({0: np.linspace(-1, 1, 64, dtype=np.float32)}, mode="add", scale=4.0)


def _serve_like_the_scheduler(leader: LeaderRunner) -> list[str]:
    batch = leader.batch(max_rows=2)
    a = batch.add([1, 2, 3, 4], 6, state=leader.sessions.acquire("a"), temperature=0.0)
    b = batch.add("Once upon a time", 5, state=leader.sessions.acquire("b"), steering=STEERING, temperature=0.8, seed=3)
    with pytest.raises(turbospark_core.TurbosparkError):
        batch.add([1] * 10, 10_000)  # refused on every rank alike
    while not (a.done and b.done):
        batch.step()
    c = batch.add([5, 6, 7, 8, 9], 8, state=leader.sessions.acquire("a"))
    batch.step()
    batch.cancel(c)
    leader.sessions.drop("b")
    return [a.text, b.text, c.text]


def test_a_follower_repeating_rank_0s_calls_ends_where_rank_0_is(turbospark_install: Callable[..., Path]) -> None:
    path = turbospark_install("llama")
    channel = Recording()
    leader = LeaderRunner(turbospark_core.open(path, session_slots=2), channel)
    texts = _serve_like_the_scheduler(leader)
    assert [op["op"] for op in channel.ops[:4]] == ["batch", "acquire", "add", "acquire"]
    assert isinstance(channel.ops[4]["steering"], str)  # a set goes by its fingerprint
    follower = turbospark_core.open(path, session_slots=2)
    follow(follower, Replay(channel.ops), {"s": STEERING})
    assert texts[0] and texts[1]
    mine, theirs = leader.sessions.peek("a"), follower.sessions.peek("a")
    assert mine is not None and theirs is not None and mine.tokens == theirs.tokens
    assert "b" not in follower.sessions and len(follower.sessions) == len(leader.sessions) == 1


def test_a_prefix_copied_from_another_session_is_copied_on_every_rank(turbospark_install: Callable[..., Path]) -> None:
    path = turbospark_install("llama")
    shared = [5 + (i * 7) % 50 for i in range(30)]
    channel = Recording()
    leader = LeaderRunner(turbospark_core.open(path, session_slots=2), channel)
    batch = leader.batch(max_rows=2)
    donor = leader.sessions.acquire("a")
    batch.add([*shared, 3, 4], 3, state=donor)
    batch.run()
    row = batch.add([*shared, 8, 9], 4, state=leader.sessions.acquire("b"), donors=[donor])
    batch.run()
    assert row.result is not None and row.result.stats.reused_tokens == len(shared)
    assert [op["donors"] for op in channel.ops if op["op"] == "add"] == [[], ["a"]]
    follower = turbospark_core.open(path, session_slots=2)
    follow(follower, Replay(channel.ops), {})
    mine, theirs = leader.sessions.peek("b"), follower.sessions.peek("b")
    assert mine is not None and theirs is not None and mine.tokens == theirs.tokens
    follow_up = [*mine.tokens, 12, 13]  # each rank continues from its own copy alike
    results = []
    for runner, held in ((leader, mine), (follower, theirs)):
        again = runner.batch(max_rows=1)
        row = again.add(follow_up, 4, state=held)
        again.run()
        assert row.result is not None
        results.append((row.result.tokens, row.result.stats.reused_tokens))
    assert results[0] == results[1] and results[0][1] > len(shared)


def test_a_row_state_must_come_from_the_mirrored_sessions(turbospark_install: Callable[..., Path]) -> None:
    leader = LeaderRunner(turbospark_core.open(turbospark_install("llama")), Recording())
    stray = SequenceState(leader.opened.new_cache)
    with pytest.raises(DistributedError, match=r"must be a session taken from runner\.sessions"):
        leader.batch().add([1, 2], 2, state=stray)


def test_rank_0_stops_the_others_once_and_a_group_of_one_is_not_wrapped(
    turbospark_install: Callable[..., Path],
) -> None:
    channel = Recording()
    leader = LeaderRunner(turbospark_core.open(turbospark_install("llama")), channel)
    leader.close()
    leader.close()
    assert channel.ops == [{"op": "stop"}]

    def opener() -> Runner:
        raise AssertionError("not called")

    assert leading(opener) is opener  # no mlx.launch: nothing changes
