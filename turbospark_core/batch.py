"""Continuous batching: many sequences decoded in one forward, joining and leaving between steps.

A :class:`Batch` owns rows. Each :meth:`Batch.step` prefills joining
rows (one row alone, exactly as the single-sequence path runs it; several in
one ``[B, L]`` forward), then one decode forward over every decoding row
(``[B, 1]`` tokens, per-row positions and masks from
:class:`~turbospark_core.batch_cache.BatchCaches`). Sampling parameters,
seeds, repetition history, stop strings, EOS and ``max_tokens`` are per row; a
finished row leaves the batch at once.

A step's prefill costs at most what ``prefill_chunk`` prompt tokens cost from
an empty cache, so a long prompt stalls the others by at most one chunk while
several short prompts join in one step. A late chunk of a long prompt attends
over everything before it, so it carries fewer tokens: the batch times its
prefill forwards and sizes each chunk by the measured cost of attention
against weight products (:mod:`turbospark_core.batch_prefill`; never fewer
than 32 tokens, or ``prefill_chunk`` when smaller). Rows prefilled together
share one step's budget.

A joining row's last prompt token runs
in that decode forward (its first token is sampled there), so N rows arriving
together get their first tokens after one step, not N. Greedy rows without a
repetition penalty or log probabilities are sampled by one argmax over the
batch; every row's token comes back in one host sync.

Exactness: a row's prompt but its last token is prefilled alone (or with
rows joining in the same step); its last prompt token and its decode steps run
in the batch (see :mod:`turbospark_core.batch_cache` for where float32 can
differ, ~1e-6). A prompt longer than one chunk is cut where the cost model
says, not every ``PREFILL_CHUNK`` tokens as the single-sequence path cuts it;
chunked prefill agrees with a full forward within float32 rounding wherever it
is cut (tested on every cache kind against the single-sequence answer).

Speculative decoding (a drafter opened with the runner): every row has its
own drafter. Rows decoding together are verified together
(:mod:`turbospark_core.speculative.batched`): each proposes its own drafts,
one ``[B, L]`` forward checks them all, each row accepts by its own sampler's
rules (log probabilities come from the verify's rows) and is rewound exactly
in the batched caches; ``L`` is chosen for the most tokens per second over
every row. A row decoding alone (nothing else decoding, prefilling or queued;
no log probabilities asked for) leaves the batched caches and decodes on its
own, exactly as the single-sequence path does, until another row joins.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core import native
from turbospark_core.batch_cache import BatchCaches
from turbospark_core.batch_prefill import ChunkSizer, PrefillCost
from turbospark_core.errors import OptionError
from turbospark_core.kv_cache import Cache, reserve_caches
from turbospark_core.sampling import Sampler, SamplingOptions, SamplingParams
from turbospark_core.sessions import SequenceState, common_prefix
from turbospark_core.speculative import batched
from turbospark_core.speculative.adaptive import DraftPolicy, clock
from turbospark_core.speculative.decode import SpeculativeLoop, new_policy, observe
from turbospark_core.speculative.drafter import Drafter
from turbospark_core.steering import DirectionSet, Edit, fingerprint
from turbospark_core.stop import StopMatcher
from turbospark_core.vision.prompt import VisionPrompt
from turbospark_core.vision.tower import VisionInputs

if TYPE_CHECKING:
    from turbospark_core.runner import Generation, Runner, Steering, _Progress

PREFILL_CHUNK = 512
MAX_TOP_LOGPROBS = 20  # alternatives a row may ask for per token (OpenAI's bound)
SHARED_PREFIX_MIN = 16  # the shortest prefix a row copies from another parked session (shorter: prefill it)
PAD_TOKENS = 8  # padding tokens a multi-row prefill may carry per forward it saves (~a forward's fixed cost)
COMPACT_SLACK = 32  # holes (rewound columns) a full-attention layer keeps before compacting (or a quarter of its rows)


@attrs.frozen
class TokenLogprob:
    """A sampled token's log probability and the ``top`` most likely alternatives ``(id, logprob)``, best first.

    From the distribution the sampler draws from: the logits after the
    repetition penalty, divided by the temperature (1 when greedy), log-softmaxed;
    before top-k / top-p / min-p truncation.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@attrs.define(eq=False)
class BatchRow:
    """One sequence in a :class:`Batch`: its text so far and, once done, its :class:`Generation`.

    ``status`` is ``"queued"``, ``"prefill"``, ``"decoding"`` or ``"done"``.
    """

    id: int
    prompt_tokens: int
    status: str = "queued"
    pieces: list[str] = attrs.Factory(list)
    result: Generation | None = None
    logprobs: list[TokenLogprob] = attrs.Factory(list)  # one per generated token but EOS, when asked for

    @property
    def text(self) -> str:
        """The text emitted so far."""
        return "".join(self.pieces)

    @property
    def done(self) -> bool:
        """Whether the row has finished (or was cancelled)."""
        return self.status == "done"


@attrs.define(eq=False)
class _Seq:
    """A row's private decoding state."""

    row: BatchRow
    ids: list[int]
    max_tokens: int
    sampler: Sampler
    matcher: StopMatcher
    detok: Any
    progress: _Progress
    history: mx.array
    caches: list[Cache] | None = None
    state: SequenceState | None = None  # a parked session the row continues, and is saved back into
    vision: VisionPrompt | None = None  # the prompt's images (issue 22)
    steering: DirectionSet | None = None  # this row's own edit (per-row inside a batched forward)
    sampled: list[int] = attrs.Factory(list)  # every sampled token, EOS included
    fed: int = 0
    pending: mx.array | None = None  # the last sampled token, not yet fed
    generated: int = 0
    t0: float = 0.0
    top_logprobs: int | None = None  # None: no log probabilities; k: the sampled token's and k alternatives
    drafter: Drafter | None = None  # with a drafter open: this row's
    policy: DraftPolicy | None = None  # and its draft length
    spec: SpeculativeLoop | None = None  # decoding alone, speculatively, on ``caches``
    joining: bool = False  # in the batch with its last prompt token pending: the next decode samples its first token
    chunk: int = 0  # prompt tokens this step's prefill feeds the row (sized by the step's cost budget)
    passed: int = 0  # short prompts prefilled ahead of this long one (at most ``max_rows``)

    @property
    def left(self) -> int:
        """Prompt tokens still to prefill before the last one (which runs with the row's first sample)."""
        return len(self.ids) - 1 - self.fed

    @property
    def context(self) -> list[int]:
        """Every committed token: the prompt and all sampled (past a stop, the rest of a verify's block too)."""
        return [*self.ids, *self.sampled]


@attrs.define(eq=False)
class _Launched:
    """A plain decode step in flight: its rows (in batch order), which of them sample their first token, the tokens."""

    rows: list[_Seq]
    first: list[bool]
    tokens: mx.array  # [B] int32, evaluating
    scores: list[list[mx.array]]  # each row's log probability arrays ([] when not asked for)
    t0: float
    c0: float

    def may_continue(self) -> bool:
        """Whether a row of this step can go on after it (not done, and short of its ``max_tokens``)."""
        return any(not s.row.done and s.generated + 1 < s.max_tokens for s in self.rows)


class Batch:
    """Rows decoded together; add rows any time, call :meth:`step` (or iterate) to advance.

    Args:
        runner: The opened model.
        max_rows: The most rows decoding at once; more wait in a queue.
        prefill_chunk: A step's prefill budget: what this many prompt tokens
            cost from an empty cache. A chunk later in a long prompt carries
            fewer tokens (its attention reads the prefix), by the cost model
            :attr:`prefill_cost` measures on this batch's own prefill
            forwards; at least 32 tokens (or ``prefill_chunk``, when smaller).

    In a group of processes every rank must cut the same chunks, and each
    rank's clock differs: there the cost model does not learn (ratio 0: chunks
    of ``prefill_chunk`` tokens). A step plans with the ratio it starts with,
    so rank 0 could hand its measured ratio to the others with each step.
    """

    def __init__(self, runner: Runner, *, max_rows: int = 8, prefill_chunk: int = PREFILL_CHUNK) -> None:
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise OptionError(f"max_rows={max_rows!r} must be a positive integer")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise OptionError(f"prefill_chunk={prefill_chunk!r} must be a positive integer")
        self.runner = runner
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk
        group = runner.opened.distributed
        alone = group is None or group.size == 1
        self.prefill_cost = PrefillCost(prefill_chunk) if alone else PrefillCost(prefill_chunk, learn=False, ratio=0.0)
        self._next_id = 0
        self._waiting: deque[_Seq] = deque()
        self._prefilling: _Seq | None = None
        self._join_later: list[_Seq] = []  # prefilled long prompts joining the batch at the next step
        self._decoding: list[_Seq] = []
        self._solo: list[_Seq] = []  # a row decoding speculatively on its own caches (at most one)
        self._caches: BatchCaches | None = None
        self._inflight: _Launched | None = None  # a plain decode step launched, its tokens not handled yet

    # ------------------------------------------------------------- rows
    def add(
        self,
        prompt: str | Sequence[int] | VisionPrompt,
        max_tokens: int = 256,
        *,
        state: SequenceState | None = None,
        donors: Sequence[SequenceState] = (),
        steering: Steering = None,
        logprobs: int | None = None,
        **sampling: Any,
    ) -> BatchRow:
        """Queue a sequence; options as :meth:`Runner.generate` (its own sampling, seed, stop, steering).

        ``state`` (a parked session, e.g. ``runner.sessions.acquire(key)``): the
        row reuses the prefix its caches hold and, when it leaves, the state
        holds exactly the tokens fed, as :meth:`Session.generate` leaves it.
        The caller keeps it out of other rows' hands until the row is done.
        ``donors`` (other parked sessions, idle): when one holds a longer
        reusable prefix of the prompt than ``state`` (e.g. the same system
        prompt), ``state`` becomes a copy of that prefix first
        (:meth:`SequenceState.share_prefix`: any prefix of full-attention
        caches; rings and recurrent state only at the donor's end or a
        checkpoint), of at least ``SHARED_PREFIX_MIN`` tokens. Not with a
        drafter open (its drafter saw no such prefix) nor with images; only
        donors filled under the row's steering.
        ``logprobs`` (0 to 20): record each generated token's log probability
        and that many alternatives in ``row.logprobs`` (see :class:`TokenLogprob`).
        """
        from turbospark_core.runner import _Progress, check_budget

        options: SamplingOptions = sampling  # type: ignore[assignment]
        stop = options.get("stop")
        params = SamplingParams.from_kwargs({k: v for k, v in options.items() if k != "stop"})
        chosen = self.runner.steering_set(steering)
        ids = self.runner._encode_prompt(prompt)
        check_budget(len(ids), max_tokens, self.runner.max_context)
        if logprobs is not None and (
            isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS
        ):
            raise OptionError(f"logprobs={logprobs!r} must be an integer in [0, {MAX_TOP_LOGPROBS}] (or None)")
        if state is not None:
            key = fingerprint(chosen)
            self.runner._match_cache_steering(state, key)
            if donors and self.runner.opened.drafter is None and not isinstance(prompt, VisionPrompt):
                same = [d for d in donors if self.runner.cached_steering(d) == key]
                state.share_prefix(ids, same, at_least=SHARED_PREFIX_MIN)
        row = BatchRow(id=self._next_id, prompt_tokens=len(ids))
        self._next_id += 1
        progress = _Progress(prompt_tokens=len(ids))
        seq = _Seq(
            row=row,
            ids=ids,
            max_tokens=max_tokens,
            sampler=Sampler(params),
            matcher=StopMatcher(stop),
            detok=self.runner.tokenizer.detokenizer(),
            progress=progress,
            history=mx.array(ids[-params.repetition_context :]),
            state=state,
            steering=chosen,
            top_logprobs=logprobs,
            vision=prompt if isinstance(prompt, VisionPrompt) else None,
        )
        if max_tokens == 0:
            self._finish(seq, "length", flush=False)
        else:
            self._waiting.append(seq)
        return row

    def cancel(self, row: BatchRow) -> None:
        """Stop a row now (its row leaves the batch before the next step); its result keeps what it had."""
        prefilling = [self._prefilling] if self._prefilling else []
        for seq in [*self._waiting, *self._decoding, *self._solo, *prefilling, *self._join_later]:
            if seq.row is row and not row.done:
                if seq.caches is not None and seq.state is not None:  # prefilling, or paused mid-prefill
                    seq.state.reset()  # a half-prefilled session holds no known prefix
                self._finish(seq, "stop", flush=False)
        self._drop_finished()

    @property
    def idle(self) -> bool:
        """Whether no row is queued, prefilling or decoding."""
        busy = self._waiting or self._prefilling is not None or self._join_later
        return not busy and not self._decoding and not self._solo

    @property
    def decoding_rows(self) -> int:
        """How many rows the last decode forward carried (rows now in the batch)."""
        return len(self._decoding) + len(self._solo)

    # ------------------------------------------------------------- stepping
    def step(self) -> list[tuple[BatchRow, str]]:
        """Prefill joining rows (at most one ``prefill_chunk``'s cost, in one forward) and one decode forward.

        Returns the pieces emitted. Without a drafter the decode forward is
        pipelined: this step launches its forward, then handles the previous
        step's tokens while it runs, so a row's pieces come out one call later.
        When a prompt's prefill is due while a step is in flight, this call
        only hands out that step's tokens and runs no forward: the prefill
        would wait for it anyway, and its tokens (a just-joined row's first
        one among them) would otherwise reach the caller a whole chunk later.
        """
        out: list[tuple[BatchRow, str]] = []
        if self._inflight is not None and self._prefill_due():
            self._settle(out)
            return out
        if self._join_later:  # this step's work is their join (no prefill)
            for joining in self._join_later:
                self._join_with_last_token(joining)
            self._join_later = []
            self._place_rows()
            self._decode_step(out)
            return out
        together: list[_Seq] = []  # rows whose chunks this step runs in one [B, L] forward
        sizer = self.prefill_cost.sizer()
        budget = sizer.budget  # what the prompt tokens prefilled this step may cost, across joining rows
        while budget > 0:
            head = self._waiting[0] if self._waiting else None
            if budget < sizer.budget and head is not None and not sizer.fits(head.left, head.fed, budget):
                break  # the next prompt does not fit what is left of this step's budget: it starts next step
            self._let_short_prompt_pass(sizer, budget, len(together))
            self._admit(len(together))
            seq = self._prefilling
            if seq is None:
                break
            left = seq.left
            seq.chunk = sizer.tokens(seq.fed, left, budget)
            if left > 0 and seq.vision is None:
                together.append(seq)
                budget -= sizer.cost(seq.chunk, seq.fed)
                if seq.chunk < left:
                    break  # a long prompt: its next chunk next step (it stays the prefilling row)
                self._prefilling = None  # the next row may be admitted
                continue
            before = seq.fed
            self._prefill_chunk(seq, out)
            budget -= sizer.cost(max(seq.fed - before, 1), before)
            if self._prefilling is seq:
                break  # a long prompt: its next chunk next step
        self._prefill_rows(together, out)
        self._place_rows()
        if self._solo:
            self._speculate(self._solo[0], out)
        if self._decoding or self._inflight is not None:
            self._decode_step(out)
        return out

    def __iter__(self) -> Iterator[tuple[BatchRow, str]]:
        """``(row, piece)`` as rows decode, until every row is done."""
        while not self.idle:
            yield from self.step()

    def run(self) -> None:
        """Step until every row is done."""
        for _ in self:
            pass

    def _rows_taken(self) -> int:
        """Rows in the batch, and prefilled ones joining it at the next step."""
        return len(self._decoding) + len(self._join_later)

    def _prefill_due(self) -> bool:
        """Whether this step prefills: a row is mid-prefill or due to join, or a waiting one can be admitted."""
        if self._prefilling is not None or self._join_later:
            return True
        return bool(self._waiting) and self._rows_taken() < self.max_rows

    def _let_short_prompt_pass(self, sizer: ChunkSizer, budget: float, planned: int = 0) -> None:
        """A waiting prompt that fits ``budget`` goes ahead of a long one mid-prefill (which keeps its progress).

        So a short request behind a long prompt gets its first token after one
        of the long prompt's chunks, not after all of them; a long prompt lets
        at most ``max_rows`` pass, so it is never starved.
        """
        long = self._prefilling
        if long is None or long.passed >= self.max_rows or sizer.fits(long.left, long.fed, budget):
            return
        short = next((q for q in self._waiting if q.caches is None and sizer.fits(len(q.ids) - 1, 0, budget)), None)
        if short is None or self._rows_taken() + planned >= self.max_rows:
            return
        long.passed += 1
        long.row.status = "queued"
        self._waiting.remove(short)
        self._waiting.appendleft(long)
        self._waiting.appendleft(short)
        self._prefilling = None

    def _admit(self, planned: int = 0) -> None:
        """The next waiting row becomes the prefilling one, when a row is free (``planned``: rows joining this step)."""
        if self._prefilling is None and self._waiting and self._rows_taken() + planned < self.max_rows:
            seq = self._waiting.popleft()
            seq.row.status = "prefill"
            self._prefilling = seq
            if seq.caches is not None:
                return  # a long prompt resuming after short ones passed it: its caches hold what it fed
            setup = self.runner.opened.drafter
            seq.policy = None if setup is None else new_policy(setup)
            if seq.state is None:
                seq.caches = self.runner.opened.new_cache()
                seq.drafter = None if setup is None else setup.new()
                return
            reused = self.runner._image_reuse(seq.state, seq.vision, common_prefix(seq.state.tokens, seq.ids))
            reused = seq.state.rewind(min(reused, len(seq.ids) - 1))  # the last prompt token is always run
            self.runner._remember_images(seq.state, seq.vision)
            seq.progress.reused_tokens = reused
            seq.fed = reused
            seq.caches = seq.state.caches
            seq.drafter = self.runner._drafter(seq.state, reused)

    def _prefill_chunk(self, seq: _Seq, out: list[tuple[BatchRow, str]]) -> None:
        """The single-sequence prefill, one chunk per call: chunks of all but the last token, then it."""
        assert seq.caches is not None
        try:
            self._prefill_step(seq, out)
        except BaseException:
            if seq.state is not None:
                seq.state.reset()  # a failed step leaves the caches unknown: start the session afresh
            raise

    def _prefill_rows(self, rows: list[_Seq], out: list[tuple[BatchRow, str]]) -> None:
        """This step's prompt chunks: one row's alone (the single-sequence path), several rows' in one forward.

        A row that has then fed all but its last prompt token joins the batch
        with that token pending (or runs it alone first, when it cannot run batched).
        """
        if len(rows) == 1:
            self._prefill_chunk(rows[0], out)
            return
        if rows:
            self._prefill_together(rows, out)
        for seq in rows:
            if seq.fed == len(seq.ids) - 1:
                self._prefill_chunk(seq, out)

    def _prefill_together(self, rows: list[_Seq], out: list[tuple[BatchRow, str]]) -> None:
        """The next chunk (``chunk`` tokens, sized by the step) of every row's prompt in ``[B, L]`` forwards.

        The rows' caches join a batch of their own (each at its own offset: a
        session's reused prefix stays). Where every layer cuts anywhere, rows
        are right-padded to a common width when the padding costs less than
        the forwards it saves (:func:`_prefill_width`); the padding's columns
        are rewound at once, so no real token ever sees them. Otherwise
        (recurrent layers) a forward feeds every remaining row the same number
        of tokens, and rows whose chunk is done leave. Each row's caches are
        then exported back into single-sequence caches (its session's, if it has one).
        """
        t0 = time.perf_counter()
        ends = [s.fed + s.chunk for s in rows]
        template = rows[0].caches
        assert template is not None
        caches = BatchCaches(template)
        try:
            for seq in rows:
                assert seq.caches is not None
                caches.add_row(seq.caches, seq.fed)
            live = list(range(len(rows)))
            while live:
                members, held = [rows[i] for i in live], list(caches.rows.offsets)
                left = [ends[i] - h for i, h in zip(live, held, strict=True)]
                width = _prefill_width(left, caches.cuts_anywhere)
                feed = [min(n, width) for n in left]
                tokens = [  # each row's chunk, right-padded with its last token
                    s.ids[h : h + n] + [s.ids[h + n - 1]] * (width - n)
                    for s, h, n in zip(members, held, feed, strict=True)
                ]
                layers = frozenset(i for s in members if s.drafter is not None for i in s.drafter.capture_layers)
                capture: dict[int, mx.array] | None = {} if layers else None
                edit = Edit.of_rows([s.steering for s in members])
                started = self._settle_before_prefill(out)
                self.runner._forward(mx.array(tokens), caches.caches, edit, None, capture, layers or None)
                for b, (seq, h, n) in enumerate(zip(members, held, feed, strict=True)):
                    if seq.drafter is not None:
                        observe(seq.drafter, h, capture, b, n)
                caches.step_done(width)
                caches.rewind([h + n for h, n in zip(held, feed, strict=True)])  # the padding's columns
                mx.eval(caches.state)
                self.prefill_cost.record([(width, h) for h in held], time.perf_counter() - started)
                for b, (seq, n, todo) in enumerate(zip(members, feed, left, strict=True)):
                    if n == todo:
                        seq.caches = self.runner.opened.new_cache()
                        caches.export_row(b, seq.caches)
                        seq.fed = held[b] + n
                        if seq.state is not None:
                            seq.state.caches = seq.caches
                keep = [b for b, (n, todo) in enumerate(zip(feed, left, strict=True)) if n < todo]
                caches.keep_rows(keep)
                live = [live[b] for b in keep]
        except BaseException:
            for seq in rows:
                if seq.state is not None:
                    seq.state.reset()  # a failed step leaves the caches unknown: start the session afresh
            raise
        spent = time.perf_counter() - t0
        for seq in rows:
            seq.progress.prompt_s += spent

    def _prefill_step(self, seq: _Seq, out: list[tuple[BatchRow, str]]) -> None:
        assert seq.caches is not None
        if self._foldable(seq):  # e.g. a session holding all but the last prompt token
            self._join_with_last_token(seq)
            return
        t0 = time.perf_counter()
        ids, edit = seq.ids, Edit.of_rows([seq.steering])
        layers = frozenset(seq.drafter.capture_layers) if seq.drafter is not None else frozenset()
        got: dict[int, mx.array] | None = {} if layers else None
        if seq.fed < len(ids) - 1:
            chunk = ids[seq.fed : seq.fed + seq.chunk]  # sized by the step (at most what is left)
            images = self._images(seq, seq.fed, seq.fed + len(chunk))
            reserve_caches(seq.caches, len(ids) - seq.fed)  # the prompt's room once, at its first chunk
            started = self._settle_before_prefill(out)
            self.runner._forward(mx.array([chunk]), seq.caches, edit, images, got, layers or None)
            if seq.drafter is not None:
                observe(seq.drafter, seq.fed, got)
            mx.eval([c.state for c in seq.caches])
            if images is None:  # an image chunk's time is mostly the vision tower's
                self.prefill_cost.record([(len(chunk), seq.fed)], time.perf_counter() - started)
            seq.fed += len(chunk)
            seq.progress.prompt_s += time.perf_counter() - t0
            if seq.fed == len(ids) - 1 and self._foldable(seq):
                if len(chunk) < len(ids) - 1 and self._decoding:
                    # a prompt of several chunks joins running rows as the next step's work: its join
                    # re-lays every row out to its width (2,000 tokens joining three rows: about half a
                    # chunk's time), which with its last chunk would stall them longer than one chunk
                    self._join_later.append(seq)
                    if self._prefilling is seq:
                        self._prefilling = None
                else:
                    self._join_with_last_token(seq)
            return
        images = self._images(seq, len(ids) - 1, len(ids))
        logits = self.runner._forward(mx.array([ids[-1:]]), seq.caches, edit, images, got, layers or None)
        if seq.drafter is not None:
            observe(seq.drafter, len(ids) - 1, got)
        logits = logits[:, -1, :]
        penalized = seq.sampler.penalize(logits.astype(mx.float32), seq.history)
        token = seq.sampler(penalized)
        scores = _logprob_arrays(seq, penalized, token)
        mx.eval(token, scores)
        seq.fed = len(ids)
        seq.progress.prompt_s += time.perf_counter() - t0
        if seq.state is not None:
            seq.state.tokens = list(ids)
            seq.state.checkpoint()
        if self._prefilling is seq:
            self._prefilling = None
        seq.t0 = time.perf_counter()
        seq.row.status = "decoding"
        seq.sampled.append(_token_id(token))
        self._accept(seq, seq.sampled[-1], out, scores)
        if seq.row.done:
            return
        if seq.drafter is not None:
            seq.drafter.rewind(len(ids) + 1)
        if self._caches is None:
            self._caches = BatchCaches(seq.caches)
        self._caches.add_row(seq.caches, len(ids))
        seq.caches = None
        seq.pending = token
        self._decoding.append(seq)

    def _settle_before_prefill(self, out: list[tuple[BatchRow, str]]) -> float:
        """Handle the decode step still in flight (if any), so a prefill forward's time is its own; the time then."""
        self._settle(out)
        return time.perf_counter()

    def _foldable(self, seq: _Seq) -> bool:
        """Whether a row's last prompt token can run in the batched decode forward (its first token sampled there).

        Not for rows with images (their positions shift). A session whose
        caches cannot be cut anywhere (rings, recurrent state) is checkpointed
        at that point first, so a later turn or a retry of the prompt returns there.
        """
        return seq.vision is None and 0 < seq.fed == len(seq.ids) - 1

    def _join_with_last_token(self, seq: _Seq) -> None:
        """Move a prefilled row (all but its last prompt token) into the batch, that token pending."""
        assert seq.caches is not None
        if seq.state is not None and not seq.state.trimmable:
            seq.state.tokens = seq.ids[: seq.fed]
            seq.state.checkpoint()
        if self._caches is None:
            self._caches = BatchCaches(seq.caches)
        self._caches.add_row(seq.caches, seq.fed)
        seq.caches = None
        seq.pending = mx.array([seq.ids[-1]])
        seq.joining = True
        if self._prefilling is seq:
            self._prefilling = None
        self._decoding.append(seq)

    def _decode_step(self, out: list[tuple[BatchRow, str]]) -> None:
        """One forward over every row in the batch: a verify when a row drafts or must catch up, else plain."""
        setup = self.runner.opened.drafter
        if setup is None:
            self._decode(out, ahead=True)
            return
        self._settle(out)
        if not self._decoding:
            return
        assert self._caches is not None
        t0, c0 = time.perf_counter(), clock()
        held = self._caches.rows.offsets
        plans = [
            batched.propose(s.policy, s.drafter, s.context, held[b], s.max_tokens - s.generated - 1, s.sampler)
            for b, s in enumerate(self._decoding)
        ]
        width = batched.choose_width(plans, [s.policy for s in self._decoding], setup.history.batch_times)
        if width == 1:
            self._decode(out, t0, c0)
        else:
            self._verify(out, [batched.fit(p, width) for p in plans], width, t0, c0)

    def _forward_rows(self, tokens: mx.array, capture: dict[int, mx.array] | None = None) -> mx.array:
        """The batched forward of ``tokens`` ``[B, L]``: each row's steering and image shift; residuals for drafters."""
        assert self._caches is not None
        rows = self._decoding
        edit = Edit.of_rows([s.steering for s in rows])
        shifts = [0 if s.vision is None else s.vision.shift for s in rows]  # positions after a row's images
        vision = VisionInputs(shift=mx.array(shifts, dtype=mx.int32)) if any(shifts) else None
        layers = frozenset(layer for s in rows if s.drafter is not None for layer in s.drafter.capture_layers)
        if capture is not None and not layers:
            capture = None
        return self.runner._forward(tokens, self._caches.caches, edit, vision, capture, layers or None)

    def _observe(self, capture: dict[int, mx.array], held: Sequence[int], lengths: Sequence[int]) -> None:
        """Hand each row's drafter its residuals of the forward (its first ``lengths[b]`` tokens)."""
        for b, seq in enumerate(self._decoding):
            if seq.drafter is not None and seq.drafter.capture_layers:
                observe(seq.drafter, held[b], capture, b, lengths[b])

    def _decode(
        self, out: list[tuple[BatchRow, str]], t0: float | None = None, c0: float | None = None, *, ahead: bool = False
    ) -> None:
        """One plain step of every row (``t0``, ``c0``: the wall and CPU clocks when the step began).

        ``ahead``: launch this step's forward before handling the step still in
        flight (when a row of it can go on), and leave this one in flight.
        """
        if self._inflight is not None and not (ahead and self._inflight.may_continue()):
            self._settle(out)
        launched = self._launch(t0, c0) if self._decoding else None
        self._settle(out)  # the previous step, handled while this one runs
        self._inflight = launched
        if not ahead:
            self._settle(out)

    def _launch(self, t0: float | None, c0: float | None) -> _Launched:
        """Build one plain step's forward and sampling over every row and start evaluating it."""
        assert self._caches is not None
        rows = list(self._decoding)
        pending = mx.concatenate([s.pending.reshape(1) for s in rows if s.pending is not None])
        t0 = time.perf_counter() if t0 is None else t0
        c0 = clock() if c0 is None else c0
        capture: dict[int, mx.array] = {}
        held = list(self._caches.rows.offsets)
        logits = self._forward_rows(pending[:, None], capture)[:, -1, :]
        self._observe(capture, held, [1] * len(rows))
        first = [s.joining for s in rows]
        for seq in rows:
            assert seq.pending is not None
            if seq.joining:  # its history already ends with its last prompt token; its first token is sampled now
                seq.joining = False
                seq.fed = len(seq.ids)
                seq.row.status = "decoding"
            else:
                ctx = seq.sampler.params.repetition_context
                seq.history = mx.concatenate([seq.history, seq.pending])[-ctx:]
        scores: list[list[mx.array]]
        if all(s.sampler.params.greedy and s.sampler.params.repetition_penalty == 1.0 for s in rows) and all(
            s.top_logprobs is None for s in rows
        ):
            # one argmax over every row (what each row's greedy sampler computes on its own row)
            stacked = native.argmax(logits.astype(mx.float32))
            scores = [[] for _ in rows]
        else:
            tokens, scores = [], []
            for b, seq in enumerate(rows):
                penalized = seq.sampler.penalize(logits[b : b + 1].astype(mx.float32), seq.history)
                tokens.append(seq.sampler(penalized))
                scores.append(_logprob_arrays(seq, penalized, tokens[-1]))
            stacked = mx.concatenate([t.reshape(1) for t in tokens])
        for b, seq in enumerate(rows):
            seq.pending = stacked[b : b + 1]
        # mlx's stub leaves async_eval unannotated
        mx.async_eval(stacked, scores, self._caches.step_state)  # type: ignore[no-untyped-call]
        self._caches.step_done(1)
        return _Launched(rows, first, stacked, scores, t0, c0)

    def _settle(self, out: list[tuple[BatchRow, str]]) -> None:
        """Handle the step in flight: one host sync for every row's token, then each row's token in turn."""
        launched, self._inflight = self._inflight, None
        if launched is None:
            return
        ids: list[int] = np.asarray(launched.tokens).tolist()  # one host sync for every row's token
        now = time.perf_counter()
        setup = self.runner.opened.drafter
        if setup is not None:
            setup.history.batch_times.record(len(launched.rows), clock() - launched.c0)
        for seq, first, tok, score in zip(launched.rows, launched.first, ids, launched.scores, strict=True):
            if seq.row.done:
                continue  # it finished (or was cancelled) while this step ran: the token is not its
            if first:
                seq.progress.prompt_s += now - launched.t0
                seq.t0 = now
            if seq.drafter is not None:
                seq.progress.drafts.verifies += 1  # a plain step of a drafted-for row counts too
            seq.sampled.append(tok)
            self._accept(seq, tok, out, score)
        self._drop_finished()

    def _joined(self, seq: _Seq, now: float, t0: float) -> None:
        """A joining row's first token was sampled in the step that began at ``t0``: its prompt is done."""
        if seq.joining:
            seq.joining = False
            seq.fed = len(seq.ids)
            seq.progress.prompt_s += now - t0
            seq.t0 = now
            seq.row.status = "decoding"

    def _verify(
        self, out: list[tuple[BatchRow, str]], plans: list[batched.RowPlan], width: int, t0: float, c0: float
    ) -> None:
        """One ``[B, width]`` forward verifying every row's drafts; each row commits its own tokens and is rewound."""
        assert self._caches is not None
        caches, rows = self._caches, self._decoding
        held = list(caches.rows.offsets)
        capture: dict[int, mx.array] = {}
        logits = self._forward_rows(batched.padded(plans, width), capture)  # [B, width, V]
        self._observe(capture, held, [len(p.feed) for p in plans])
        fast = [s.sampler.params.greedy and s.sampler.params.repetition_penalty == 1.0 for s in rows]
        best = native.argmax(logits.astype(mx.float32)) if any(fast) else None
        mx.eval(best, caches.state)
        caches.step_done(width)
        best_ids = None if best is None else np.asarray(best)
        judged = [
            batched.judge(
                logits[b], plan, seq.context, seq.sampler,
                best_ids[b] if fast[b] and best_ids is not None else None, seq.top_logprobs is not None,
            )
            for b, (seq, plan) in enumerate(zip(rows, plans, strict=True))
        ]  # fmt: skip
        keep = []
        for b, (plan, verdict) in enumerate(zip(plans, judged, strict=True)):
            kept = len(plan.backlog) + verdict.accepted  # fed tokens the row keeps (the bonus is run next)
            keep.append(held[b] + kept if caches.cuts_anywhere or kept == width else held[b])
        caches.rewind(keep)
        caches.compact(max(COMPACT_SLACK, max(keep) // 4))
        now = time.perf_counter()
        setup = self.runner.opened.drafter
        assert setup is not None
        setup.history.batch_times.record(len(rows) * width, clock() - c0)
        for seq, plan, verdict in zip(rows, plans, judged, strict=True):
            self._joined(seq, now, t0)
            self._commit(seq, plan, verdict, out)
        self._drop_finished()

    def _commit(
        self, seq: _Seq, plan: batched.RowPlan, verdict: batched.Judged, out: list[tuple[BatchRow, str]]
    ) -> None:
        """Record a row's verify (stats, policy, drafter) and emit its committed tokens until it finishes."""
        drafted = plan.verify
        seq.progress.drafts.drafted += drafted
        seq.progress.drafts.accepted += verdict.accepted
        seq.progress.drafts.verifies += 1
        if seq.policy is not None:
            seq.policy.update(drafted, verdict.accepted, plan.draft.source)
        seq.sampled.extend(verdict.committed)
        if seq.drafter is not None:
            seq.drafter.rewind(len(seq.ids) + len(seq.sampled))
        seq.pending = mx.array(verdict.committed[-1:])
        seq.history = mx.array(seq.context[:-1][-seq.sampler.params.repetition_context :])
        for i, tok in enumerate(verdict.committed):
            scores = [] if verdict.scores is None else _logprob_arrays(seq, verdict.scores[i : i + 1], mx.array([tok]))
            self._accept(seq, tok, out, scores)
            if seq.row.done:
                return

    # ------------------------------------------------------------- speculative rows
    def _go_solo(self, seq: _Seq, caches: list[Cache], held: int) -> None:
        """Decode ``seq`` speculatively on ``caches`` (holding ``held`` of its tokens)."""
        setup = self.runner.opened.drafter
        assert setup is not None and seq.drafter is not None
        edit = Edit.of_rows([seq.steering])
        layers = frozenset(seq.drafter.capture_layers) or None
        step_vision = None if seq.vision is None else seq.vision.decode_step()
        runner = self.runner

        def forward(tokens: mx.array, cs: list[Cache], capture: dict[int, mx.array] | None) -> mx.array:
            return runner._forward(tokens, cs, edit, step_vision, capture, layers if capture is not None else None)

        policy = seq.policy if seq.policy is not None else new_policy(setup)
        seq.spec = SpeculativeLoop(
            forward, caches, seq.drafter, setup, seq.sampler, seq.context, held, seq.progress.drafts, policy
        )
        self._solo.append(seq)

    def _place_rows(self) -> None:
        """A row alone decodes speculatively; with company, every row decodes in the batch."""
        alone = len(self._decoding) + len(self._solo) == 1 and not self._waiting and self._prefilling is None
        alone = alone and not self._join_later
        if alone and self._decoding and self._solo_ready(self._decoding[0]):
            assert self._caches is not None
            seq = self._decoding[0]
            fresh = self.runner.opened.new_cache()
            self._caches.export_row(0, fresh)
            held = self._caches.rows.offsets[0]
            mx.eval([c.state for c in fresh])
            self._caches.keep_rows([])
            self._decoding = []
            self._go_solo(seq, fresh, held)
        elif not alone:
            for seq in self._solo:
                assert seq.spec is not None
                loop = seq.spec
                if self._caches is None:
                    self._caches = BatchCaches(loop.caches)
                self._caches.add_row(loop.caches, loop.held)
                seq.pending = mx.array([loop.context[-1]])
                seq.history = mx.array(loop.context[:-1][-seq.sampler.params.repetition_context :])
                seq.spec = None
                self._decoding.append(seq)
            self._solo = []

    def _solo_ready(self, seq: _Seq) -> bool:
        """Whether a lone row can leave the batch to decode on its own caches (the single-sequence loop).

        It needs a drafter, its first token, no log probabilities (the loop
        reports none) and caches holding all its context but the last token.
        """
        assert self._caches is not None
        caught_up = self._caches.rows.offsets[0] == len(seq.ids) + len(seq.sampled) - 1
        return seq.drafter is not None and not seq.joining and seq.top_logprobs is None and caught_up

    def _speculate(self, seq: _Seq, out: list[tuple[BatchRow, str]]) -> None:
        """One verify of the row decoding alone; its committed tokens are handled one by one."""
        assert seq.spec is not None
        committed = seq.spec.step(seq.max_tokens - seq.generated)
        seq.sampled.extend(committed)
        for tok in committed:
            self._accept(seq, tok, out)
            if seq.row.done:
                break
        self._drop_finished()

    def _park_solo(self, seq: _Seq) -> None:
        """Save a finished speculative row into its session: its caches and exactly the tokens they hold."""
        assert seq.spec is not None and seq.state is not None
        loop = seq.spec
        mx.eval([c.state for c in loop.caches])
        seq.state.caches = loop.caches
        seq.state.tokens = loop.context[: loop.held]
        seq.state.checkpoint()

    def _images(self, seq: _Seq, start: int, end: int) -> VisionInputs | None:
        """The image part of a row's prefill forward over ``ids[start:end]`` (``None`` for text)."""
        tower = self.runner.vision
        return None if seq.vision is None or tower is None else seq.vision.chunk(tower.tower, start, end)

    def _accept(
        self, seq: _Seq, tok: int, out: list[tuple[BatchRow, str]], scores: list[mx.array] | None = None
    ) -> None:
        """The single-sequence path's handling of one committed token (EOS, stop strings, max_tokens)."""
        seq.generated += 1
        seq.progress.decode_s = time.perf_counter() - seq.t0
        if tok in self.runner.eos_token_ids:
            self._finish(seq, "stop", flush=True, out=out)
            return
        seq.progress.tokens.append(tok)
        if scores:
            seq.row.logprobs.append(_token_logprob(tok, scores))
        piece, stopped = seq.matcher.feed(seq.detok.add(tok))
        if piece:
            seq.row.pieces.append(piece)
            out.append((seq.row, piece))
        if stopped:
            self._finish(seq, "stop", flush=False)
        elif seq.generated >= seq.max_tokens:
            self._finish(seq, "length", flush=True, out=out)

    def _finish(self, seq: _Seq, reason: str, *, flush: bool, out: list[tuple[BatchRow, str]] | None = None) -> None:
        from turbospark_core.runner import Generation

        if flush:
            tail, _ = seq.matcher.feed(seq.detok.flush(), final=True)
            if tail:
                seq.row.pieces.append(tail)
                if out is not None:
                    out.append((seq.row, tail))
        seq.progress.finish_reason = reason
        seq.row.status = "done"
        seq.row.result = Generation(text=seq.row.text, tokens=list(seq.progress.tokens), stats=seq.progress.stats())

    def _drop_finished(self) -> None:
        if self._prefilling is not None and self._prefilling.row.done:
            self._prefilling = None
        self._join_later = [s for s in self._join_later if not s.row.done]
        self._waiting = deque(s for s in self._waiting if not s.row.done)
        for seq in self._solo:
            if seq.row.done and seq.state is not None:
                self._park_solo(seq)
        self._solo = [s for s in self._solo if not s.row.done]
        keep = [i for i, s in enumerate(self._decoding) if not s.row.done]
        if len(keep) == len(self._decoding):
            return
        assert self._caches is not None
        for b, seq in enumerate(self._decoding):
            if seq.row.done and seq.state is not None:
                self._park(seq, b)
        self._caches.keep_rows(keep)
        self._decoding = [self._decoding[i] for i in keep]

    def _park(self, seq: _Seq, row: int) -> None:
        """Save a leaving row into its session: its caches and exactly the tokens they hold.

        A row that reached ``max_tokens`` while a pipelined step fed its last
        token is first cut back to before it (the latest step, so exact for
        every cache kind): as the single-sequence path, which never feeds it.
        """
        assert self._caches is not None and seq.state is not None
        if seq.progress.finish_reason == "length" and self._caches.rows.offsets[row] == len(seq.context):
            self._caches.truncate(row, len(seq.context) - 1)
        fresh = self.runner.opened.new_cache()
        self._caches.export_row(row, fresh)
        fed = self._caches.rows.offsets[row]
        mx.eval([c.state for c in fresh])
        seq.state.caches = fresh
        seq.state.tokens = (seq.ids + seq.sampled)[:fed]
        seq.state.checkpoint()


def _prefill_width(left: Sequence[int], pad: bool) -> int:
    """The width of the next multi-row prefill forward, for rows with ``left`` prompt tokens to go.

    Without padding (``pad`` false: recurrent layers) the shortest row's;
    else the widest whose padding costs at most :data:`PAD_TOKENS` per forward it saves.
    """
    widths = sorted(set(left))
    if not pad:
        return widths[0]
    best = widths[0]
    for saved, width in enumerate(widths[1:], start=1):
        if sum(width - n for n in left if n < width) <= PAD_TOKENS * saved:
            best = width
    return best


def generate_many(
    runner: Runner,
    prompts: Sequence[str | Sequence[int]],
    max_tokens: int | Sequence[int] = 256,
    *,
    max_rows: int | None = None,
    per_row: Sequence[SamplingOptions] | None = None,
    **sampling: Any,
) -> list[Generation]:
    """Generate a completion per prompt, decoding them together; see :meth:`Runner.generate_many`."""
    n = len(prompts)
    limits = [max_tokens] * n if isinstance(max_tokens, int) else list(max_tokens)
    extra = [{}] * n if per_row is None else [dict(o) for o in per_row]
    if len(limits) != n or len(extra) != n:
        msg = f"max_tokens and per_row must give one entry per prompt ({n}); got {len(limits)} and {len(extra)}"
        raise OptionError(msg)
    batch = Batch(runner, max_rows=max_rows or max(n, 1))
    rows = [batch.add(p, m, **{**sampling, **o}) for p, m, o in zip(prompts, limits, extra, strict=False)]
    batch.run()
    return [r.result for r in rows if r.result is not None]


def _logprob_arrays(seq: _Seq, logits: mx.array, token: mx.array) -> list[mx.array]:
    """Lazily, the sampled token's log probability and the row's top alternatives (ids, values); [] when off.

    The sampler's distribution: ``logits`` (``[1, V]``, penalized) over the
    temperature (1 when greedy), log-softmaxed, as :class:`Sampler` computes it.
    """
    k = seq.top_logprobs
    if k is None:
        return []
    scaled = logits / (seq.sampler.params.temperature or 1.0)
    lp = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, token.reshape(1, 1).astype(mx.int32), axis=-1)
    if k == 0:
        return [chosen]
    ids = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
    return [chosen, ids, mx.take_along_axis(lp, ids, axis=-1)]


def _token_logprob(tok: int, scores: list[mx.array]) -> TokenLogprob:
    """A :class:`TokenLogprob` from :func:`_logprob_arrays`' evaluated arrays."""
    top: tuple[tuple[int, float], ...] = ()
    if len(scores) == 3:
        ids, values = np.array(scores[1]).reshape(-1), np.array(scores[2]).reshape(-1)
        pairs = zip(ids.tolist(), values.tolist(), strict=True)
        top = tuple(sorted(((int(i), float(v)) for i, v in pairs), key=lambda p: (-p[1], p[0])))
    return TokenLogprob(token=tok, logprob=float(np.array(scores[0]).reshape(-1)[0]), top=top)


def _token_id(token: mx.array) -> int:
    """A sampled one-element token array as a Python int."""
    value = token.item()
    assert isinstance(value, int)
    return value
