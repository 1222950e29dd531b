"""Serving from a group: rank 0 runs the HTTP server and its scheduler, every other rank repeats its work.

The scheduler drives the model through a few calls on the worker thread: make
a :class:`~turbospark_core.batch.Batch`, take or drop a session, add a row,
step, cancel a row. On rank 0 (:class:`LeaderRunner`) each call is first
broadcast to the group (JSON, from rank 0), then made; each other rank
(:func:`follow`) makes the same call on its own runner. Every step then runs
the same forwards on every rank, in the same order, which is what their
collectives need; sampling agrees because the logits are the same on every
rank and the open seeded MLX's generator alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from turbospark_core.batch import PREFILL_CHUNK, Batch, BatchRow
from turbospark_core.distributed.group import Group, world
from turbospark_core.errors import DistributedError, TurbosparkError
from turbospark_core.runner import Runner, Steering
from turbospark_core.sessions import SequenceState, SessionPool
from turbospark_core.steering import DirectionSet, fingerprint
from turbospark_core.vision.prompt import VisionPrompt

log = logging.getLogger("turbospark.distributed")

STOP = "stop"


class Channel:
    """The calls rank 0 hands to the other ranks (one JSON object per call)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.stopped = False

    def send(self, op: dict[str, Any]) -> None:
        """Rank 0: hand ``op`` to every other rank."""
        self.group.broadcast_json(op)

    def receive(self) -> dict[str, Any]:
        """Another rank: the next call of rank 0 (waits for it)."""
        op = self.group.broadcast_json(None)
        if not isinstance(op, dict):
            raise DistributedError(f"rank 0 sent {op!r:.80}, not a call; the ranks run different turbospark versions")
        return op

    def stop(self) -> None:
        """Rank 0: tell the others to return (once)."""
        if not self.stopped:
            self.stopped = True
            self.send({"op": STOP})


@attrs.define
class MirroredSessions(SessionPool):
    """Rank 0's session pool: taking or dropping a session is repeated on every rank."""

    channel: Channel | None = attrs.field(default=None, kw_only=True)
    keys: dict[int, str] = attrs.field(factory=dict, kw_only=True)

    def acquire(self, session_id: str) -> SequenceState:
        """As :meth:`SessionPool.acquire`, on every rank."""
        assert self.channel is not None
        self.channel.send({"op": "acquire", "key": session_id})
        state = super().acquire(session_id)
        self.keys[id(state)] = session_id
        return state

    def drop(self, session_id: str) -> None:
        """As :meth:`SessionPool.drop`, on every rank."""
        assert self.channel is not None
        self.channel.send({"op": "drop", "key": session_id})
        super().drop(session_id)

    def key_of(self, state: SequenceState) -> str:
        """The session key ``state`` was taken under."""
        key = self.keys.get(id(state))
        if key is None or self.peek(key) is not state:
            raise DistributedError("a distributed batch row's state must be a session taken from runner.sessions")
        return key


def _prompt(prompt: str | Sequence[int] | VisionPrompt) -> str | list[int]:
    if isinstance(prompt, VisionPrompt):
        raise DistributedError("image prompts are not served by a group of processes; serve them from one process")
    return prompt if isinstance(prompt, str) else [int(t) for t in prompt]


def _steering(steering: Steering) -> str | bool | None:
    if isinstance(steering, DirectionSet):
        return fingerprint(steering)
    return steering


class LeaderBatch(Batch):
    """Rank 0's batch: every row added, step and cancel is first handed to the other ranks."""

    def __init__(self, runner: LeaderRunner, *, max_rows: int, prefill_chunk: int) -> None:
        super().__init__(runner, max_rows=max_rows, prefill_chunk=prefill_chunk)
        self.leader = runner

    def add(
        self,
        prompt: str | Sequence[int] | VisionPrompt,
        max_tokens: int = 256,
        *,
        state: SequenceState | None = None,
        steering: Steering = None,
        logprobs: int | None = None,
        donors: Sequence[SequenceState] = (),
        **sampling: Any,
    ) -> BatchRow:
        """As :meth:`Batch.add`, on every rank (donors go by their session keys: each rank copies from its own)."""
        op = {
            "op": "add",
            "prompt": _prompt(prompt),
            "max_tokens": max_tokens,
            "state": None if state is None else self.leader.sessions.key_of(state),
            "steering": _steering(steering),
            "logprobs": logprobs,
            "donors": [self.leader.sessions.key_of(d) for d in donors],
            "sampling": sampling,
        }
        self.leader.channel.send(op)
        return super().add(
            prompt, max_tokens, state=state, steering=steering, logprobs=logprobs, donors=donors, **sampling
        )

    def step(self) -> list[tuple[BatchRow, str]]:
        """As :meth:`Batch.step`, on every rank."""
        self.leader.channel.send({"op": "step"})
        return super().step()

    def cancel(self, row: BatchRow) -> None:
        """As :meth:`Batch.cancel`, on every rank."""
        self.leader.channel.send({"op": "cancel", "row": row.id})
        super().cancel(row)


class LeaderRunner(Runner):
    """Rank 0's runner for the server: its batches and sessions are repeated on every rank.

    Only the calls the scheduler makes are mirrored (batches, sessions); other
    calls that run the model would run on rank 0 alone, so the scheduler is its only user.
    """

    def __init__(self, runner: Runner, channel: Channel) -> None:
        super().__init__(runner.opened, runner.tokenizer)
        self.channel = channel
        self.sessions: MirroredSessions = MirroredSessions(
            runner.sessions.slots, runner.opened.new_cache, channel=channel
        )

    def batch(self, *, max_rows: int = 8, prefill_chunk: int = PREFILL_CHUNK) -> Batch:
        """A :class:`LeaderBatch` (made on every rank)."""
        self.channel.send({"op": "batch", "max_rows": max_rows, "prefill_chunk": prefill_chunk})
        return LeaderBatch(self, max_rows=max_rows, prefill_chunk=prefill_chunk)

    def close(self) -> None:
        """Tell the other ranks to return from :func:`follow`."""
        self.channel.stop()


def leading(opener: Callable[[], Runner], group: Group | None = None) -> Callable[[], Runner]:
    """An opener for rank 0's scheduler: the runner ``opener`` makes, as a :class:`LeaderRunner`
    (``opener`` itself in a group of one process)."""
    group = group or world()
    if group.size == 1:
        return opener
    return lambda: LeaderRunner(opener(), Channel(group))


class Follower:
    """Another rank's side of a served group: rank 0's calls, made on this rank's runner (see :func:`follow`)."""

    def __init__(self, runner: Runner, steering_sets: Mapping[str, DirectionSet] | None = None) -> None:
        self.runner = runner
        known = [*(steering_sets or {}).values(), runner.steering]
        self.sets = {fingerprint(s): s for s in known if s is not None}
        self.batch: Batch | None = None
        self.rows: dict[int, BatchRow] = {}
        self.states: dict[str, SequenceState] = {}

    def make(self, op: dict[str, Any]) -> None:
        """Rank 0's call ``op`` (one of the kinds :class:`LeaderRunner` sends)."""
        kind = op.get("op")
        if kind == "batch":
            self.batch, self.rows = self.runner.batch(max_rows=op["max_rows"], prefill_chunk=op["prefill_chunk"]), {}
        elif kind == "acquire":
            self.states[op["key"]] = self.runner.sessions.acquire(op["key"])
        elif kind == "drop":
            self.runner.sessions.drop(op["key"])
            self.states.pop(op["key"], None)
        elif kind == "add" and self.batch is not None:
            state = None if op["state"] is None else self.states[op["state"]]
            row = self.batch.add(
                op["prompt"],
                op["max_tokens"],
                state=state,
                steering=self._steering(op["steering"]),
                logprobs=op["logprobs"],
                donors=[self.states[key] for key in op["donors"]],
                **op["sampling"],
            )
            self.rows[row.id] = row
        elif kind == "step" and self.batch is not None:
            self.batch.step()
            self.rows = {i: r for i, r in self.rows.items() if not r.done}
        elif kind == "cancel" and self.batch is not None and op["row"] in self.rows:
            self.batch.cancel(self.rows.pop(op["row"]))

    def _steering(self, ref: str | bool | None) -> Steering:
        if not isinstance(ref, str):
            return None if ref is None else False
        if ref not in self.sets:
            raise DistributedError(
                f"rank 0 steers with a set this rank was not given ({ref}); pass every rank the same "
                f"--steering and --steering-set options"
            )
        return self.sets[ref]


def follow(runner: Runner, channel: Channel, steering_sets: Mapping[str, DirectionSet] | None = None) -> None:
    """Another rank of a served group: make rank 0's calls (from ``channel``) on ``runner`` until it stops.

    ``steering_sets``: the sets requests may name (the server's), matched to
    rank 0's by their fingerprint. A call refused here was refused alike on
    rank 0 (same calls, same state), which reports it to its client; it is
    logged and the next call follows. Anything else (an error rank 0 cannot
    have had, a steering set this rank does not know) ends the follower: the
    ranks would no longer run the same forwards.
    """
    follower = Follower(runner, steering_sets)
    while (op := channel.receive()).get("op") != STOP:
        try:
            follower.make(op)
        except DistributedError:
            raise
        except TurbosparkError as e:  # rank 0 was refused alike and answers its client
            log.warning("%s call refused (as on rank 0): %s", op.get("op"), e)
