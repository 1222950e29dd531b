"""The Runner: logits, generate, stream and chat over an opened install."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core.diagnostics import Diagnostics, FFNHistogram, RouterHistogram
from turbospark_core.errors import ContextOverflowError, OptionError
from turbospark_core.kv_cache import Cache, reserve_caches
from turbospark_core.loader import OpenedModel
from turbospark_core.manifest import Manifest
from turbospark_core.sampling import Sampler, SamplingOptions, SamplingParams
from turbospark_core.sessions import SequenceState, SessionPool, common_prefix
from turbospark_core.speculative.decode import DraftCounts, SpeculativeLoop, observe
from turbospark_core.speculative.drafter import Drafter
from turbospark_core.stats import ExpertStats, GenerationStats, StartupStats
from turbospark_core.steering import DirectionSet, Edit, applying, fingerprint
from turbospark_core.stop import StopMatcher
from turbospark_core.thread_exit import note_thread
from turbospark_core.tokenizer import Tokenizer
from turbospark_core.vision.prompt import HeldImages, VisionPrompt

if TYPE_CHECKING:
    from pathlib import Path

    from typing_extensions import Unpack

    from turbospark_core.batch import Batch
    from turbospark_core.vision.attach import AttachedVision
    from turbospark_core.vision.tower import VisionInputs

PREFILL_CHUNK = 512
# Per-request steering: a DirectionSet, None (the open's set, if any) or False (unsteered)
Steering = DirectionSet | Literal[False] | None
# A prompt: text, token ids, or a chat prompt with images (Runner.chat_input)
Prompt = str | Sequence[int] | VisionPrompt


def check_budget(prompt_tokens: int, max_tokens: int, max_context: int) -> None:
    """Refuse a ``max_tokens`` that is not a count, or a prompt + ``max_tokens`` past ``max_context``."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise OptionError(f"max_tokens={max_tokens!r} must be a non-negative integer")
    if prompt_tokens + max_tokens > max_context:
        msg = (
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
            f"max_context={max_context}; lower max_tokens or open with a larger max_context"
        )
        raise ContextOverflowError(msg)


@attrs.frozen(kw_only=True)
class Generation:
    """A finished generation."""

    text: str
    tokens: list[int]
    stats: GenerationStats

    @property
    def finish_reason(self) -> str:
        """``"stop"`` (EOS or stop string) or ``"length"`` (max_tokens)."""
        return self.stats.finish_reason


@attrs.define
class _Progress:
    prompt_tokens: int = 0
    prompt_s: float = 0.0
    tokens: list[int] = attrs.Factory(list)
    decode_s: float = 0.0
    reused_tokens: int = 0
    finish_reason: str = "length"
    expert_source: Callable[[], ExpertStats | None] = lambda: None
    experts_before: ExpertStats | None = None
    drafts: DraftCounts = attrs.Factory(DraftCounts)

    def stats(self) -> GenerationStats:
        n = len(self.tokens)
        now = self.expert_source()
        return GenerationStats(
            experts=None if now is None or self.experts_before is None else now.since(self.experts_before),
            prompt_tokens=self.prompt_tokens,
            # tokens actually prefilled per second (a session's reused prefix is not recomputed)
            prompt_tps=(self.prompt_tokens - self.reused_tokens) / self.prompt_s if self.prompt_s else 0.0,
            generation_tokens=n,
            generation_tps=n / self.decode_s if self.decode_s else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=self.finish_reason,
            reused_tokens=self.reused_tokens,
            draft_tokens=self.drafts.drafted,
            accepted_tokens=self.drafts.accepted,
            verify_steps=self.drafts.verifies,
        )


class Runner:
    """An opened model: the Python API (built by :func:`turbospark_core.open`)."""

    def __init__(self, opened: OpenedModel, tokenizer: Tokenizer) -> None:
        self._opened = opened
        self.tokenizer = tokenizer
        self.model = opened.model
        self.sessions: SessionPool = opened.sessions
        eos = opened.generation_config.get("eos_token_id")
        extra = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_token_ids = frozenset([*tokenizer.eos_token_ids, *extra])
        # id(state) -> (state, fingerprint of the steering its caches were computed under)
        self._cache_steering: dict[int, tuple[weakref.ref[SequenceState], str | None]] = {}
        # id(state) -> (state, its drafter): a session keeps its drafter's state between requests
        self._drafters: dict[int, tuple[weakref.ref[SequenceState], Drafter]] = {}
        self._held_images = HeldImages()  # which images each state's caches hold (prefix reuse)
        self.vision: AttachedVision | None = None

    # ------------------------------------------------------------- vision (issue 22)
    def attach_vision(self, sidecar: str | Path) -> AttachedVision:
        """Attach a vision sidecar (``turbospark convert SRC DST --vision SIDECAR``): images in chat messages.

        Raises:
            SidecarError: The sidecar is malformed or does not fit this model (family, hidden size,
                placeholder ids), naming the mismatch.
            FamilyRefusalError: The family serves no vision flow.
            MemoryBudgetError: The tower does not fit the open's memory budget.
        """
        from turbospark_core.vision.attach import attach_vision

        self.vision = attach_vision(sidecar, self._opened, self.tokenizer)
        return self.vision

    def chat_input(self, messages: list[dict[str, Any]]) -> list[int] | VisionPrompt:
        """The prompt of ``messages``: token ids, or a :class:`VisionPrompt` when they hold images.

        Image parts are ``{"type": "image", "image": X}`` (X: a path, bytes, a base64
        ``data:`` URL, a PIL image or a numpy array) or OpenAI's
        ``{"type": "image_url", "image_url": {"url": "data:..."}}``.

        Raises:
            ImageError: An image part on a runner without a vision sidecar, an undecodable or
                too large image, a remote URL.
            ContextOverflowError: The images do not fit ``max_context``.
        """
        from turbospark_core.vision.prompt import image_prompt, split_images

        if not messages:
            raise OptionError("messages is empty; pass at least one {'role', 'content'} message")
        rendered, images = split_images(messages)
        if not images:
            return self.chat_prompt(messages)
        return image_prompt(rendered, images, self.tokenizer, self.vision, self.max_context)

    def _image_reuse(self, state: SequenceState, prompt: VisionPrompt | None, common: int) -> int:
        """The reusable prefix of a parked state: up to the first image its caches hold that the prompt lacks."""
        return self._held_images.reusable(state, prompt, common)

    def _remember_images(self, state: SequenceState, prompt: VisionPrompt | None) -> None:
        """Record the images ``state``'s caches are filled with (``prompt``'s)."""
        self._held_images.remember(state, prompt)

    # ------------------------------------------------------------- facts
    def expert_stats(self) -> ExpertStats | None:
        """MoE expert counters since open (hits, misses, bytes read, load time); ``None`` without experts.bin."""
        experts = self._opened.experts
        return None if experts is None else experts.stats()

    def router_histogram(self, *, reset: bool = False) -> RouterHistogram:
        """Per routed layer x expert: selections and routing-weight mass since open (or the last reset).

        Alongside, per layer: tokens routed, ``top_k``, and the streamed
        residency's slot hits and misses (``.hit_rate``), to size
        ``expert_slots`` from data. Reading synchronises once.

        Args:
            reset: Start counting afresh after this read.

        Raises:
            OptionError: The install was opened without ``router_histogram=True``.
        """
        diagnostics = self._diagnostics("router_histogram")
        out = diagnostics.router_histogram()
        if reset:
            diagnostics.reset(ffn=False)
        return out

    def ffn_histogram(self, *, reset: bool = False) -> FFNHistogram:
        """Per layer, the fixed-bin histogram of the FFN intermediate (the down projection's input) since open.

        Raises:
            OptionError: The install was opened without ``ffn_histogram=True``.
        """
        diagnostics = self._diagnostics("ffn_histogram")
        out = diagnostics.ffn_histogram()
        if reset:
            diagnostics.reset(router=False)
        return out

    def _diagnostics(self, option: str) -> Diagnostics:
        diagnostics = self._opened.diagnostics
        if diagnostics is None or not getattr(self._opened.options, option):
            msg = f"{option} is off for this Runner; open the install with {option}=True"
            raise OptionError(msg)
        return diagnostics

    @property
    def startup_stats(self) -> StartupStats:
        """Milliseconds per open phase."""
        return self._opened.startup_stats

    @property
    def manifest(self) -> Manifest:
        """The install's manifest."""
        return self._opened.manifest

    @property
    def opened(self) -> OpenedModel:
        """Everything the open sequence built (policy, capabilities, estimate)."""
        return self._opened

    @property
    def max_context(self) -> int:
        """The most tokens a sequence may hold."""
        return self._opened.max_context

    def close(self) -> None:
        """Release what the runner holds beyond memory (a no-op; rank 0 of a served group stops the others)."""

    # ------------------------------------------------------------- logits
    def logits(self, token_ids: Sequence[int] | VisionPrompt, *, steering: Steering = None) -> np.ndarray:
        """Full-sequence logits ``(len(token_ids), vocab)`` float32, on a fresh context.

        ``token_ids`` may be a :class:`VisionPrompt` (:meth:`chat_input` of messages with images).
        ``steering``: as in :meth:`generate`.
        """
        ids = self._encode_prompt(token_ids) if isinstance(token_ids, VisionPrompt) else self._check_ids(token_ids)
        vision = None
        if isinstance(token_ids, VisionPrompt) and self.vision is not None:
            vision = token_ids.chunk(self.vision.tower, 0, len(ids))
        cache = self._opened.new_cache()
        out = self._forward(mx.array([ids]), cache, self.steering_edit(steering), vision)[0].astype(mx.float32)
        return np.array(out)

    def draft_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """The install's MTP head's logits ``(T-1, vocab)`` float32 over ``token_ids`` on a fresh context.

        Row ``t`` is the head's slot ``t`` (the trunk's hidden at ``t`` with token
        ``t + 1``), predicting token ``t + 2``. See :mod:`turbospark_core.speculative.mtp`.
        """
        from turbospark_core.speculative import mtp

        return mtp.runner_draft_logits(self._opened, self._check_ids(token_ids))

    def _check_ids(self, token_ids: Sequence[int]) -> list[int]:
        ids = [int(t) for t in token_ids]
        if not ids:
            raise OptionError("token_ids is empty; pass at least one token id")
        vocab = int(self._opened.manifest.arch["vocab_size"])
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            msg = f"token id {bad[0]} is outside the vocabulary [0, {vocab})"
            raise OptionError(msg)
        if len(ids) > self.max_context:
            msg = f"{len(ids)} tokens exceed max_context={self.max_context}; open with a larger max_context"
            raise ContextOverflowError(msg)
        return ids

    # ------------------------------------------------------------- decoding
    def _prefill(
        self,
        ids: list[int],
        cache: list[Cache],
        edit: Edit = Edit({}),  # noqa: B008 - frozen, never mutated
        vision: VisionPrompt | None = None,
        first: int = 0,
        drafter: Drafter | None = None,
    ) -> mx.array:
        """Run the prompt through the model; returns last-position logits ``[1, V]``.

        ``vision``: the prompt's images, ``ids`` being ``vision.ids[first:]``;
        ``first``: the position of ``ids[0]`` (a session's reused prefix);
        ``drafter``: observes each chunk's residuals (when it reads any).
        """

        def part(a: int, b: int) -> VisionInputs | None:
            if vision is None or self.vision is None:
                return None
            return vision.chunk(self.vision.tower, first + a, first + b)

        layers = frozenset(drafter.capture_layers) if drafter is not None and drafter.capture_layers else None
        reserve_caches(cache, len(ids))
        for start in range(0, len(ids) - 1, PREFILL_CHUNK):
            end = min(start + PREFILL_CHUNK, len(ids) - 1)
            got: dict[int, mx.array] | None = {} if layers else None
            self._forward(mx.array([ids[start:end]]), cache, edit, part(start, end), got, layers)
            if drafter is not None:
                observe(drafter, first + start, got)
            mx.eval([c.state for c in cache])
        got = {} if layers else None
        logits = self._forward(mx.array([ids[-1:]]), cache, edit, part(len(ids) - 1, len(ids)), got, layers)
        if drafter is not None:
            observe(drafter, first + len(ids) - 1, got)
        return logits[:, -1, :]

    def _drafter(self, state: SequenceState, reused: int) -> Drafter | None:
        """This sequence's drafter (made on first use), told what the run keeps of its state."""
        setup = self._opened.drafter
        if setup is None:
            return None
        entry = self._drafters.get(id(state))
        drafter = entry[1] if entry is not None and entry[0]() is state else None
        if drafter is None:
            drafter = setup.new()
            self._drafters = {k: v for k, v in self._drafters.items() if v[0]() is not None}
            self._drafters[id(state)] = (weakref.ref(state), drafter)
        if reused == 0:
            drafter.reset()
        else:
            drafter.rewind(reused)
        return drafter

    def _token_stream(
        self,
        ids: list[int],
        sampler: Sampler,
        max_tokens: int,
        progress: _Progress,
        state: SequenceState,
        edit: Edit = Edit({}),  # noqa: B008 - a frozen Edit, never mutated
        vision: VisionPrompt | None = None,
    ) -> Iterator[int]:
        reused = self._image_reuse(state, vision, common_prefix(state.tokens, ids))
        reused = state.rewind(min(reused, len(ids) - 1))  # the last prompt token is always run
        self._remember_images(state, vision)
        step_vision = None if vision is None else vision.decode_step()
        progress.reused_tokens = reused
        drafter = self._drafter(state, reused)
        if drafter is not None:
            yield from self._speculative_stream(
                ids, sampler, max_tokens, progress, state, edit, drafter, reused, vision
            )
            return
        history = mx.array(ids[-sampler.params.repetition_context :])
        produced: list[int] = []
        fed = reused
        t0 = time.perf_counter()

        def step(logits: mx.array) -> mx.array:
            logits = sampler.penalize(logits.astype(mx.float32), history)
            return sampler(logits)

        try:
            token = step(self._prefill(ids[reused:], state.caches, edit, vision, reused))
            fed = len(ids)
            mx.eval(token)
            state.tokens = list(ids)
            state.checkpoint()
            progress.prompt_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for n in range(max_tokens):
                current = token
                if n + 1 < max_tokens:
                    history = mx.concatenate([history, current])[-sampler.params.repetition_context :]
                    token = step(self._forward(current[:, None], state.caches, edit, step_vision)[:, -1, :])
                    fed += 1
                    mx.async_eval(token)  # type: ignore[no-untyped-call]  # mlx's stub leaves it unannotated
                tok = int(cast(int, current.item()))
                produced.append(tok)
                progress.decode_s = time.perf_counter() - t0
                yield tok
        except GeneratorExit:
            raise
        except BaseException:
            state.reset()  # a failed step leaves the caches unknown: start the session afresh
            raise
        finally:
            if fed > len(ids):
                mx.eval([c.state for c in state.caches])
                state.tokens = (list(ids) + produced)[:fed]
                state.checkpoint()

    def _speculative_stream(
        self,
        ids: list[int],
        sampler: Sampler,
        max_tokens: int,
        progress: _Progress,
        state: SequenceState,
        edit: Edit,
        drafter: Drafter,
        reused: int,
        vision: VisionPrompt | None = None,
    ) -> Iterator[int]:
        """As :meth:`_token_stream`, drafting and verifying (:mod:`turbospark_core.speculative`)."""
        setup = self._opened.drafter
        assert setup is not None
        layers = frozenset(drafter.capture_layers) or None
        step_vision = None if vision is None else vision.decode_step()

        def forward(tokens: mx.array, caches: list[Cache], capture: dict[int, mx.array] | None) -> mx.array:
            wanted = layers if capture is not None else None
            return self._forward(tokens, caches, edit, step_vision, capture, wanted)

        loop: SpeculativeLoop | None = None
        t0 = time.perf_counter()
        try:
            logits = self._prefill(ids[reused:], state.caches, edit, vision, reused, drafter)
            history = mx.array(ids[-sampler.params.repetition_context :])
            first = int(cast(int, sampler(sampler.penalize(logits.astype(mx.float32), history)).item()))
            state.tokens = list(ids)
            state.checkpoint()
            progress.prompt_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            drafter.rewind(len(ids) + 1)
            loop = SpeculativeLoop(
                forward, state.caches, drafter, setup, sampler, [*ids, first], len(ids), progress.drafts
            )
            progress.decode_s = time.perf_counter() - t0
            yield first
            for tok in loop.tokens(max_tokens - 1):
                progress.decode_s = time.perf_counter() - t0
                yield tok
        except GeneratorExit:
            raise
        except BaseException:
            state.reset()  # a failed step leaves the caches unknown: start the session afresh
            raise
        finally:
            if loop is not None and loop.held > len(ids):
                mx.eval([c.state for c in state.caches])
                state.tokens = loop.context[: loop.held]
                state.checkpoint()

    def _encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, VisionPrompt):
            return self._check_ids(prompt.ids)
        if isinstance(prompt, str):
            return self._check_ids(self.tokenizer.encode(prompt))
        return self._check_ids(prompt)

    def stream(
        self,
        prompt: Prompt,
        max_tokens: int = 256,
        *,
        steering: Steering = None,
        **sampling: Unpack[SamplingOptions],
    ) -> TextStream:
        """Text pieces as they decode (stop strings and EOS honoured); arguments as :meth:`generate`.

        Returns:
            An iterable of ``str``; once exhausted its ``.result`` is the
            :class:`Generation` (text, tokens, stats).
        """
        return TextStream(self, prompt, max_tokens, sampling, steering=steering)

    def _run(
        self,
        prompt: Prompt,
        max_tokens: int,
        sampling: SamplingOptions,
        progress: _Progress,
        state: SequenceState | None = None,
        steering: Steering = None,
    ) -> Generator[str, None, None]:
        chosen = self.steering_set(steering)
        edit = Edit.of_rows([chosen])
        stop = sampling.get("stop")
        params = SamplingParams.from_kwargs({k: v for k, v in sampling.items() if k != "stop"})
        ids = self._encode_prompt(prompt)
        check_budget(len(ids), max_tokens, self.max_context)
        progress.prompt_tokens = len(ids)
        if max_tokens == 0:
            return
        mx.reset_peak_memory()
        progress.expert_source, progress.experts_before = self.expert_stats, self.expert_stats()
        detok = self.tokenizer.detokenizer()
        matcher = StopMatcher(stop)
        state = state if state is not None else SequenceState(self._opened.new_cache)
        self._match_cache_steering(state, fingerprint(chosen))
        vision = prompt if isinstance(prompt, VisionPrompt) else None
        for tok in self._token_stream(ids, Sampler(params), max_tokens, progress, state, edit, vision):
            if tok in self.eos_token_ids:
                progress.finish_reason = "stop"
                break
            progress.tokens.append(tok)
            piece, stopped = matcher.feed(detok.add(tok))
            if piece:
                yield piece
            if stopped:
                progress.finish_reason = "stop"
                return
        tail, _ = matcher.feed(detok.flush(), final=True)
        if tail:
            yield tail

    def generate(
        self,
        prompt: Prompt,
        max_tokens: int = 256,
        *,
        steering: Steering = None,
        **sampling: Unpack[SamplingOptions],
    ) -> Generation:
        """Generate a completion.

        Args:
            prompt: Text (tokenized with the install's tokenizer) or token ids.
            max_tokens: Most tokens to generate.
            steering: This request's steering: a
                :class:`~turbospark_core.steering.DirectionSet`, ``None`` (the
                set given to :func:`~turbospark_core.open`, if any) or
                ``False`` (unsteered). Checked like the open's set.
            **sampling: Keyword-only sampling options, typed and documented in
                :class:`~turbospark_core.sampling.SamplingOptions`
                (``temperature``, ``top_p``, ``top_k``, ``min_p``,
                ``repetition_penalty``, ``repetition_context``, ``seed``, ``stop``).

        Returns:
            The text, the generated ids (EOS excluded) and mlx-lm-style stats.
        """
        stream = self.stream(prompt, max_tokens, steering=steering, **sampling)
        for _ in stream:
            pass
        return stream.result

    def chat(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int = 256,
        *,
        steering: Steering = None,
        **sampling: Unpack[SamplingOptions],
    ) -> Generation:
        """Generate the assistant's reply to ``messages`` through the install's chat template.

        Messages may hold image parts when a vision sidecar is attached (see :meth:`chat_input`).
        """
        return self.generate(self.chat_input(messages), max_tokens, steering=steering, **sampling)

    def chat_stream(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int = 256,
        *,
        steering: Steering = None,
        **sampling: Unpack[SamplingOptions],
    ) -> TextStream:
        """Like :meth:`chat`, yielding text pieces."""
        return self.stream(self.chat_input(messages), max_tokens, steering=steering, **sampling)

    def generate_many(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_tokens: int | Sequence[int] = 256,
        *,
        max_rows: int | None = None,
        per_row: Sequence[SamplingOptions] | None = None,
        **sampling: Unpack[SamplingOptions],
    ) -> list[Generation]:
        """Generate one completion per prompt, decoding them together in one forward per step.

        Args:
            prompts: Texts or token-id lists.
            max_tokens: One limit for all, or one per prompt.
            max_rows: The most rows decoding at once (default: all prompts).
            per_row: Per-prompt sampling options laid over ``**sampling`` (seed, stop...).
            **sampling: Options shared by every prompt, as :meth:`generate`.

        Returns:
            One :class:`Generation` per prompt, in order; greedy rows equal :meth:`generate`'s.
        """
        from turbospark_core.batch import generate_many

        return generate_many(self, prompts, max_tokens, max_rows=max_rows, per_row=per_row, **sampling)

    def batch(self, *, max_rows: int = 8, prefill_chunk: int = PREFILL_CHUNK) -> Batch:
        """A :class:`~turbospark_core.batch.Batch`: add rows any time; iterate it for ``(row, piece)``."""
        from turbospark_core.batch import Batch

        return Batch(self, max_rows=max_rows, prefill_chunk=prefill_chunk)

    def session(self, session_id: str) -> Session:
        """A parked conversation: its generate/chat continue from its cached tokens.

        At most ``session_slots`` (an open option) are parked; the least
        recently used is evicted. A request whose tokens extend what the
        session holds reuses the cached prefix.
        """
        return Session(self, str(session_id))

    # ------------------------------------------------------------- steering and capture (issue 17)
    @property
    def steering(self) -> DirectionSet | None:
        """The direction set given to :func:`~turbospark_core.open` (``None``: unsteered)."""
        return self._opened.steering

    def steering_set(self, steering: Steering = None) -> DirectionSet | None:
        """The set a request asking for ``steering`` gets, checked against this model.

        Raises:
            FamilyRefusalError: The family cannot apply steering.
            SteeringError: The set does not fit the model (a subclass naming why).
        """
        from turbospark_core.loader import open_steering

        if steering is None:
            return self._opened.steering
        if steering is False:
            return None
        given: object = steering  # callers may pass anything at runtime
        if not isinstance(given, DirectionSet):
            msg = f"steering={given!r} is invalid; pass a DirectionSet, None (the open's set) or False (none)"
            raise OptionError(msg)
        return open_steering(given, self.manifest.arch, self._opened.capabilities)

    def steering_edit(self, steering: Steering = None) -> Edit:
        """The runtime edit of :meth:`steering_set` (empty when unsteered)."""
        return Edit.of_rows([self.steering_set(steering)])

    def cached_steering(self, state: SequenceState) -> str | None:
        """The steering fingerprint ``state``'s caches were filled under (``None``: unsteered, or not run here)."""
        entry = self._cache_steering.get(id(state))
        return entry[1] if entry is not None and entry[0]() is state else None

    def _match_cache_steering(self, state: SequenceState, key: str | None) -> None:
        """A parked state filled under other steering is not reused: its caches hold other residuals.

        A state this runner has not run yet counts as unsteered.
        """
        if self.cached_steering(state) != key and state.tokens:
            state.reset()
        self._cache_steering = {k: v for k, v in self._cache_steering.items() if v[0]() is not None}
        self._cache_steering[id(state)] = (weakref.ref(state), key)

    def _forward(
        self,
        inputs: mx.array,
        cache: list[Cache] | None,
        edit: Edit,
        vision: VisionInputs | None = None,
        capture: dict[int, mx.array] | None = None,
        capture_layers: frozenset[int] | None = None,
    ) -> mx.array:
        """One forward of the family's model with ``edit`` active (nothing set up when it is empty).

        ``vision``: the image part of this forward (only then is the ``vision`` keyword passed);
        ``capture``: filled with the output residuals of ``capture_layers``.
        """
        note_thread()  # compiled traces live in this thread's storage: see thread_exit
        family = self._opened.capabilities.family
        with applying(edit, family=family, capture=capture, capture_layers=capture_layers):
            if vision is None:
                return self.model(inputs, cache)
            return self.model(inputs, cache, vision=vision)  # type: ignore[call-arg]

    def capture(
        self,
        prompts: Sequence[str | Sequence[int]],
        layers: Sequence[int] | None = None,
        position: Literal["last", "mean", "all"] = "last",
        *,
        steering: Steering = None,
    ) -> np.ndarray | list[np.ndarray]:
        """Decoder-layer output residuals (the points steering edits, after the edit) as float32 numpy.

        Args:
            prompts: Texts (tokenized as :meth:`generate` does) or token id lists.
            layers: 0-based decoder layers (default: every layer).
            position: ``"last"`` (the last prompt token) or ``"mean"`` (over the
                prompt's tokens): one ``[len(prompts), len(layers), hidden]``
                array; ``"all"``: a list of ``[tokens, len(layers), hidden]``
                arrays, one per prompt.
            steering: As in :meth:`generate` (the captured residuals are edited).

        Raises:
            FamilyRefusalError: The family's flow does not expose its layer outputs.
            OptionError: A bad layer or position.
        """
        from turbospark_core.loader import refuse_steering

        refuse_steering(self.manifest.arch, self._opened.capabilities)
        chosen = self._capture_layers(layers)
        if position not in ("last", "mean", "all"):
            raise OptionError(f"position={position!r} is invalid; use 'last', 'mean' or 'all'")
        edit = self.steering_edit(steering)
        out = [self._capture_one(self._encode_prompt(p), chosen, position, edit) for p in prompts]
        if position == "all":
            return out
        hidden = int(self.manifest.arch["hidden_size"])
        return np.stack(out) if out else np.zeros((0, len(chosen), hidden), np.float32)

    def _capture_layers(self, layers: Sequence[int] | None) -> list[int]:
        n = int(self.manifest.arch["num_hidden_layers"])
        chosen = list(range(n)) if layers is None else [int(i) for i in layers]
        bad = [i for i in chosen if not 0 <= i < n]
        if bad or not chosen:
            msg = f"capture layer {bad[0] if bad else '(none)'} is invalid; the model has decoder layers 0..{n - 1}"
            raise OptionError(msg)
        return chosen

    def _capture_one(self, ids: list[int], layers: list[int], position: str, edit: Edit) -> np.ndarray:
        got: dict[int, mx.array] = {}
        family = self._opened.capabilities.family
        with applying(edit, family=family, capture=got, capture_layers=frozenset(layers)):
            self.model(mx.array([ids]), self._opened.new_cache())
        stacked = mx.stack([got[i][0].astype(mx.float32) for i in layers], axis=1)  # [T, layers, H]
        if position == "last":
            stacked = stacked[-1]
        elif position == "mean":
            stacked = stacked.mean(axis=0)
        return np.array(stacked)

    def dflash_block_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """The DFlash drafter's logits ``(block_size - 1, vocab)`` float32 for the block anchored at
        ``token_ids[-1]``, with the model's states of ``token_ids[:-1]`` as its context (by the math,
        what the incremental rounds of a generation compute).

        Raises:
            OptionError: The runner has no DFlash drafter (open with ``dflash=PATH``), or fewer than 2 ids.
        """
        from turbospark_core.speculative.dflash import dflash_factory

        factory = dflash_factory(self._opened.drafter)
        ids = self._check_ids(token_ids)
        if len(ids) < 2:
            raise OptionError("dflash_block_logits needs at least 2 token ids: the context and the anchor")
        got: dict[int, mx.array] = {}
        layers = factory.capture_layers
        cache = self._opened.new_cache()
        self._forward(mx.array([ids[:-1]]), cache, self.steering_edit(), capture=got, capture_layers=frozenset(layers))
        return np.array(factory.block_logits({layer: got[layer][0] for layer in layers}, ids[-1]))

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """The token ids of ``messages`` rendered with the chat template (images expanded: :meth:`chat_input`)."""
        if not messages:
            raise OptionError("messages is empty; pass at least one {'role', 'content'} message")
        from turbospark_core.vision.prompt import split_images

        if split_images(messages)[1]:
            prompt = self.chat_input(messages)
            return prompt.ids if isinstance(prompt, VisionPrompt) else prompt
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)


class TextStream:
    """Iterates a generation's text pieces; ``.result`` holds the :class:`Generation` after."""

    def __init__(
        self,
        runner: Runner,
        prompt: Prompt,
        max_tokens: int,
        sampling: SamplingOptions,
        state: SequenceState | None = None,
        *,
        steering: Steering = None,
    ) -> None:
        self._progress = _Progress()
        self._pieces: list[str] = []
        self._iter = runner._run(prompt, max_tokens, sampling, self._progress, state, steering)
        self._result: Generation | None = None

    def __iter__(self) -> Generator[str, None, None]:
        for piece in self._iter:
            self._pieces.append(piece)
            yield piece
        p = self._progress
        self._result = Generation(text="".join(self._pieces), tokens=list(p.tokens), stats=p.stats())

    def close(self) -> None:
        """Stop early: the session (if any) keeps exactly the tokens its caches hold."""
        self._iter.close()

    @property
    def result(self) -> Generation:
        """The finished generation (raises if the stream was not exhausted)."""
        if self._result is None:
            raise RuntimeError("the stream has not finished; iterate it to the end first")
        return self._result


class Session:
    """A handle on one parked conversation of a :class:`Runner` (see :meth:`Runner.session`)."""

    def __init__(self, runner: Runner, session_id: str) -> None:
        self.runner = runner
        self.id = session_id

    def _state(self) -> SequenceState:
        return self.runner.sessions.acquire(self.id)

    @property
    def tokens(self) -> list[int]:
        """The tokens this session's caches hold."""
        return list(self._state().tokens)

    def stream(
        self,
        prompt: Prompt,
        max_tokens: int = 256,
        *,
        steering: Steering = None,
        **sampling: Unpack[SamplingOptions],
    ) -> TextStream:
        """Like :meth:`Runner.stream`, reusing the session's cached prefix.

        The cached prefix was computed under the steering of the requests
        that filled it: change a session's steering and ``reset`` it first.
        """
        return TextStream(self.runner, prompt, max_tokens, sampling, self._state(), steering=steering)

    def generate(
        self,
        prompt: Prompt,
        max_tokens: int = 256,
        *,
        steering: Steering = None,
        **sampling: Unpack[SamplingOptions],
    ) -> Generation:
        """Like :meth:`Runner.generate`, reusing the session's cached prefix."""
        stream = self.stream(prompt, max_tokens, steering=steering, **sampling)
        for _ in stream:
            pass
        return stream.result

    def chat(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int = 256,
        *,
        steering: Steering = None,
        **sampling: Unpack[SamplingOptions],
    ) -> Generation:
        """Like :meth:`Runner.chat`; pass the whole conversation, the shared prefix (images included) is reused."""
        return self.generate(self.runner.chat_input(messages), max_tokens, steering=steering, **sampling)

    def chat_stream(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int = 256,
        *,
        steering: Steering = None,
        **sampling: Unpack[SamplingOptions],
    ) -> TextStream:
        """Like :meth:`Runner.chat_stream`, reusing the session's cached prefix."""
        return self.stream(self.runner.chat_input(messages), max_tokens, steering=steering, **sampling)

    def reset(self) -> None:
        """Forget this session's cached tokens."""
        self.runner.sessions.drop(self.id)
