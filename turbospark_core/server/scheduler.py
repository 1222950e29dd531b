"""The server's one MLX thread: admits requests onto session slots and decodes them in one batch.

HTTP handlers call :meth:`Scheduler.submit` and read the returned
:class:`Job`'s events (its ``events`` queue, or a ``sink`` callable the
worker calls, e.g. one handing them to an event loop); everything that touches MLX (opening the
install, prefill, decode, closing a generation) runs on the worker thread.
Each admitted request owns one parked session slot until it finishes; its
row in the :class:`~turbospark_core.batch.Batch` continues that session (the
prefix it holds is reused) and saves back into it when the row leaves. Every
decoding request advances in the same forward; a joining request's prompt is
prefilled one chunk per step, between the decode steps.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import attrs

from turbospark_core.batch import Batch, BatchRow, TokenLogprob
from turbospark_core.errors import OptionError, TurbosparkError
from turbospark_core.runner import Runner
from turbospark_core.server.metrics import NullMetrics
from turbospark_core.server.protocol import APIError, GenerationRequest
from turbospark_core.sessions import SequenceState, common_prefix

log = logging.getLogger("turbospark.server")

PIECE, DONE, ERROR = "piece", "done", "error"
RETRY_AFTER_S = 1  # what a 429 asks a client to wait, in seconds
DEFAULT_MAX_QUEUE = 256
PINNED, AUTO = "session:", "auto-"


Event = tuple[str, Any]


@attrs.frozen
class Piece:
    """A text piece of a generation and the log probabilities of the tokens sampled since the previous piece."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@attrs.define(eq=False)
class Job:
    """One request in flight: ``(PIECE, Piece)``... then ``(DONE, Generation)`` or ``(ERROR, exc)``.

    Events go to ``sink`` when one is given (called on the worker thread: it
    must not block), else into the ``events`` queue. ``logprobs`` holds every
    generated token's :class:`~turbospark_core.batch.TokenLogprob` once DONE
    (when the request asked for them).
    """

    request: GenerationRequest
    events: queue.SimpleQueue[Event] = attrs.Factory(queue.SimpleQueue)
    sink: Callable[[Event], None] | None = None
    submitted: float = attrs.Factory(time.perf_counter)
    slot: str | None = None
    logprobs: list[TokenLogprob] = attrs.Factory(list)
    _cancelled: threading.Event = attrs.Factory(threading.Event)
    _row: BatchRow | None = None
    _sent: int = 0  # log probabilities already handed out with pieces

    def emit(self, kind: str, value: Any) -> None:
        """Hand one event to the client side (worker thread)."""
        if self.sink is None:
            self.events.put((kind, value))
            return
        try:
            self.sink((kind, value))
        except RuntimeError:  # the client side's event loop is gone (server closing)
            self.cancel()

    def cancel(self) -> None:
        """Ask the worker to drop this request (the client went away); safe from any thread."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._cancelled.is_set()


class SlotTable:
    """Which parked session each request runs on (worker thread only).

    A request naming ``session_id`` gets that session (waiting while another
    request uses it). Otherwise it takes the idle parked session whose cached
    tokens share the longest prefix with its prompt, when that prefix covers
    at least half of what the session holds (a later turn, or a retry, of
    that conversation); a new conversation takes a free slot, else the least
    recently used idle one (whose common prefix, such as a shared system
    prompt, is still reused). The table mirrors the runner's session pool key
    for key and makes room itself, so the pool never evicts a busy session.
    """

    def __init__(self, runner: Runner) -> None:
        self._runner = runner
        self.capacity = runner.sessions.slots
        self._keys: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.busy: set[str] = set()
        self._made = 0

    def choose(self, request: GenerationRequest) -> str | None:
        """A slot key for ``request``, marked busy; ``None`` when it must wait."""
        if len(self.busy) >= self.capacity:
            return None
        if request.session_id is not None:
            key = PINNED + request.session_id
            if key in self.busy:
                return None
            if key not in self._keys:
                self._make_room()
            return self._take(key)
        return self._take(self._auto_slot(request.prompt))

    def release(self, key: str) -> None:
        """The request on ``key`` finished; the session stays parked."""
        self.busy.discard(key)

    def donors(self, key: str) -> list[SequenceState]:
        """The idle parked sessions but ``key``'s (a request may copy a shared prefix from them)."""
        states = [self._runner.sessions.peek(k) for k in self._keys if k != key and k not in self.busy]
        return [s for s in states if s is not None]

    def tokens(self, key: str) -> list[int]:
        """What the session ``key`` holds."""
        state = self._runner.sessions.peek(key)
        return [] if state is None else list(state.tokens)

    def _auto_slot(self, prompt: list[int]) -> str:
        idle = [k for k in reversed(self._keys) if k not in self.busy]  # most recent first: wins ties
        scored = [(common_prefix(self.tokens(k), prompt), k) for k in idle if k.startswith(AUTO)]
        match, best = max(scored, key=lambda s: s[0], default=(0, None))
        if best is not None and match > 0 and 2 * match >= len(self.tokens(best)):
            return best
        if len(self._keys) < self.capacity:
            return self._new_auto()
        victim = idle[-1]
        if victim.startswith(AUTO):
            return victim
        self._drop(victim)
        return self._new_auto()

    def _new_auto(self) -> str:
        self._made += 1
        return f"{AUTO}{self._made}"

    def _make_room(self) -> None:
        if len(self._keys) >= self.capacity:
            self._drop(next(k for k in self._keys if k not in self.busy))

    def _drop(self, key: str) -> None:
        del self._keys[key]
        self._runner.sessions.drop(key)

    def _take(self, key: str) -> str:
        self._keys[key] = None
        self._keys.move_to_end(key)
        self.busy.add(key)
        return key


@attrs.define
class Counters:
    """Requests the worker finished, by outcome."""

    completed: int = 0
    cancelled: int = 0
    failed: int = 0


class Scheduler:
    """Owns the Runner and the one thread that runs it.

    Args:
        opener: Builds the :class:`Runner`; called on the worker thread, since
            MLX streams are per thread (arrays made lazily on one thread
            cannot be evaluated on another).
        max_queue: Most requests waiting for a slot before new ones get 429 (with ``Retry-After``).
        max_batch: Most requests decoding in one forward (default: every
            session slot); more wait in the queue.
        observer: Metrics hooks, called on the worker thread (see
            :mod:`turbospark_core.server.metrics`).
    """

    def __init__(
        self,
        opener: Callable[[], Runner],
        *,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_batch: int | None = None,
        observer: NullMetrics | None = None,
    ) -> None:
        if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
            raise OptionError(f"max_batch={max_batch!r} must be a positive integer")
        self._opener = opener
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.observer = observer or NullMetrics()
        self._batch: Batch | None = None
        self.runner: Runner | None = None
        self.counters = Counters()
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._active: list[Job] = []
        self._slots: SlotTable | None = None
        self._stopping = False
        self._ready = threading.Event()
        self._open_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="turbospark-worker", daemon=True)

    # ------------------------------------------------------------- any thread
    def start(self) -> Runner:
        """Start the worker and open the install on it; re-raises an open failure."""
        self._thread.start()
        self._ready.wait()
        if self._open_error is not None:
            raise self._open_error
        assert self.runner is not None  # set before _ready when the open succeeded
        return self.runner

    def submit(self, request: GenerationRequest, sink: Callable[[Event], None] | None = None) -> Job:
        """Queue ``request``; read the answer from the returned job's ``events`` (or ``sink``: see :class:`Job`).

        Raises:
            APIError: 429 (``Retry-After``) when the queue is full; 503 when the server is stopping.
        """
        job = Job(request, sink=sink)
        with self._cond:
            if self._stopping:
                raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
            if len(self._pending) >= self.max_queue:
                msg = f"{len(self._pending)} requests are already waiting for a session slot; retry later"
                retry = {"Retry-After": str(RETRY_AFTER_S)}
                raise APIError(429, msg, type="requests", code="rate_limit_exceeded", headers=retry)
            self._pending.append(job)
            self._cond.notify()
        return job

    def snapshot(self) -> dict[str, int]:
        """Active and queued requests, and finished ones by outcome."""
        with self._cond:
            return {"active": len(self._active), "queued": len(self._pending), **attrs.asdict(self.counters)}

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the worker: requests still in flight get a 503 error event."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------- worker thread
    def _main(self) -> None:
        try:
            self.runner = self._opener()
            self._slots = SlotTable(self.runner)
            # requests beyond max_batch keep their slot and wait in the batch's queue
            rows = self.runner.sessions.slots if self.max_batch is None else self.max_batch
            self._batch = self.runner.batch(max_rows=rows)
        except BaseException as e:  # noqa: BLE001 - handed to start()'s caller
            self._open_error = e
            return
        finally:
            self._ready.set()
        try:
            self._loop()
        finally:
            self._drain()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._active or self._pending):
                    self._cond.wait()
                if self._stopping:
                    return
                admitted = self._admit()
            for job in admitted:
                self._begin(job)
            self._step()

    def _admit(self) -> list[Job]:
        """Make waiting jobs that can get a slot active (lock held), first come first served."""
        assert self._slots is not None
        admitted = []
        for job in list(self._pending):
            if job.cancelled:
                self._pending.remove(job)
                self.counters.cancelled += 1
                continue
            key = self._slots.choose(job.request)
            if key is not None:
                job.slot = key
                self._pending.remove(job)
                self._active.append(job)
                admitted.append(job)
        return admitted

    def _begin(self, job: Job) -> None:
        assert self.runner is not None and self._batch is not None and job.slot is not None
        req = job.request
        try:
            state = self.runner.sessions.acquire(job.slot)
            prompt = req.prompt if req.vision is None else req.vision  # a chat with images: the VisionPrompt
            job._row = self._batch.add(
                prompt,
                req.max_tokens,
                state=state,
                steering=req.steering,
                logprobs=req.logprobs,
                donors=[] if self._slots is None else self._slots.donors(job.slot),
                **req.sampling,
            )
        except Exception as e:  # noqa: BLE001 - reported to the request's client
            self._finish(job, ERROR, e)
        else:
            self.observer.begun(job)

    def _step(self) -> None:
        """Drop cancelled requests (their rows leave at once), then one batch step; route its pieces."""
        assert self._batch is not None
        for job in list(self._active):
            if job.cancelled:
                with self._cond:  # counted before the job leaves `active`: a snapshot never misses it
                    self.counters.cancelled += 1
                self._close(job)
        by_row = {id(job._row): job for job in self._active if job._row is not None}
        try:
            pieces = self._batch.step()
        except Exception as e:  # noqa: BLE001 - a failed forward fails every row it carried
            # a fresh batch first; each session still holds what it held when its row joined
            assert self.runner is not None
            self._batch = self.runner.batch(max_rows=self._batch.max_rows)
            for job in list(self._active):
                job._row = None
                self._finish(job, ERROR, e)
            return
        for row, piece in pieces:
            owner = by_row.get(id(row))
            if owner is not None:
                self.observer.piece(owner)
                scores = tuple(row.logprobs[owner._sent :])
                owner._sent += len(scores)
                owner.emit(PIECE, Piece(piece, scores))
        for job in list(self._active):
            if job._row is not None and job._row.done and job._row.result is not None:
                self._finish(job, DONE, job._row.result)

    def _finish(self, job: Job, kind: str, value: Any) -> None:
        if job._row is not None:
            job.logprobs = list(job._row.logprobs)
        with self._cond:  # counted before the job leaves `active`: a snapshot never misses it
            if kind == DONE:
                self.counters.completed += 1
            else:
                self.counters.failed += 1
        self._close(job)
        if kind != DONE and not isinstance(value, (APIError, TurbosparkError)):
            log.error("request %s failed", job.request.request_id, exc_info=value)
        self.observer.finished(job, kind, value)  # before the client hears of it: a scrape then sees it
        job.emit(kind, value)

    def _close(self, job: Job) -> None:
        """End ``job``'s generation here, on the worker, so its session is saved before the slot is reused."""
        with self._cond:
            if job in self._active:
                self._active.remove(job)
        # a row still in the batch leaves now, saving its session before the slot is reused
        if job._row is not None and not job._row.done and self._batch is not None:
            self._batch.cancel(job._row)
        job._row = None
        if job.slot is not None and self._slots is not None:
            self._slots.release(job.slot)

    def _drain(self) -> None:
        gone = APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        with self._cond:
            waiting = list(self._pending) + list(self._active)
            self._pending.clear()
        for job in waiting:
            self._close(job)
            job.emit(ERROR, gone)
