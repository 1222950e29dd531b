"""The ``mtp`` drafter: the install's own multi-token-prediction head, built only when asked.

An install with a head carries it in ``mtp.safetensors`` (manifest section
``mtp``); a plain open never reads that file. :func:`load_head` builds the head
through the family's ``build_mtp_head`` hook over a weight store of its own.
:class:`MtpDrafter` keeps the head's KV cache in step with the target: it
reads the residual after the target's last decoder layer (``capture_layers``),
turns it into ``h_t`` with the trunk's final norm, and appends slot ``t``
(``h_t`` with token ``x_{t+1}``) once ``x_{t+1}`` is committed. A draft of
``k`` tokens chains the head: the first from the last committed slot, each
next one from the previous slot's output hidden and drafted token; the
chained slots are dropped again, so the cache only ever holds committed slots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, cast

import mlx.core as mx
import numpy as np

from turbospark_core.context import DraftHead, HeadContext
from turbospark_core.errors import DrafterError, InstallError, OptionError
from turbospark_core.kv_cache import Cache, KVCache, make_caches
from turbospark_core.manifest import MTP_HEAD
from turbospark_core.speculative.drafter import Draft
from turbospark_core.speculative.factory import check_budget
from turbospark_core.steering import Edit, applying
from turbospark_core.tensor_index import build_index
from turbospark_core.weights import WeightStore

if TYPE_CHECKING:
    from turbospark_core.loader import OpenedModel
    from turbospark_core.sampling import Sampler
    from turbospark_core.speculative.factory import DrafterSetup

#: Hiddens kept before the next slot (a rewind deeper than this restarts the head's cache)
HIDDEN_TAIL = 32
#: Observed hidden parts held between drafts before they are merged into one
MAX_PARTS = 64
#: Positions of hiddens held for slots not yet computed (drafting paused longer: the head restarts after a gap)
MAX_PENDING = 1024
#: ``mtp="auto"``: draft this many tokens per step when the install has a head
AUTO_DEPTH = 1
AUTO = "auto"


class MtpFactory:
    """Makes one :class:`MtpDrafter` per sequence over the one head built at open."""

    def __init__(self, opened: OpenedModel, head: DraftHead, depth: int) -> None:
        self.opened, self.head, self.depth = opened, head, depth

    @property
    def memory(self) -> int:
        """Bytes the head adds: its weights, and its KV cache at ``max_context`` for every session slot."""
        kv = sum(spec.bytes_at(self.opened.max_context, 4) for spec in self.head.cache_layout())
        return head_bytes(self.opened) + kv * self.opened.options.session_slots

    def __call__(self) -> MtpDrafter:
        return MtpDrafter(self.opened, self.head, self.depth)


def open_mtp(opened: OpenedModel, requested: int | str) -> MtpFactory | None:
    """Build the head once for ``mtp=requested`` (a depth, or ``"auto"``).

    ``"auto"`` on an install without a head (or a family without a head flow)
    decodes plainly (``None``); a depth there is refused naming what is missing.

    Raises:
        DrafterError: A depth on an install without a head, or on a family whose plugin has no head flow.
        MemoryBudgetError: The head (weights, KV cache at ``max_context``) does not fit ``memory_budget``.
    """
    if requested == AUTO:
        if refusal(opened) is not None:
            return None
        depth = AUTO_DEPTH
    else:
        depth = int(requested)
    if refusal(opened) is None:
        _check_budget(opened, head_bytes(opened))  # before the head is read
    head = load_head(opened)
    factory = MtpFactory(opened, head, depth)
    _check_budget(opened, factory.memory)
    return factory


def _check_budget(opened: OpenedModel, extra: int) -> None:
    """The open's estimate plus what the head adds must fit ``memory_budget``.

    Raises:
        MemoryBudgetError: Naming the head's share and the knobs.
    """
    slots = f"max_context={opened.max_context} x {opened.options.session_slots} slot(s)"
    check_budget(opened, "mtp", extra, f"the MTP head: its weights, and its KV cache at {slots}")


def build_setup(opened: OpenedModel, requested: int | str) -> DrafterSetup | None:
    """Open step 12 for ``mtp=``: the :class:`DrafterSetup` (``None``: decode plainly)."""
    from turbospark_core.speculative.factory import DrafterSetup, draft_length

    factory = open_mtp(opened, requested)
    if factory is None:
        return None
    k = draft_length(opened.options)
    cost = draft_cost(opened)
    return DrafterSetup(
        name="mtp",
        new=factory,
        num_draft_tokens=k,
        draft_cost=cost,
        adaptive=opened.options.num_draft_tokens is None,
        description=(
            f"mtp (the install's multi-token-prediction head, up to {k} tokens per verify, "
            f"{cost:.2f}x the target's weights)"
        ),
        memory=factory.memory,
    )


def draft_cost(opened: OpenedModel) -> float:
    """One drafted token's cost in target decode steps, by bytes read: the head's own tensors plus the
    trunk's output head it reuses (vocab x hidden, at the trunk's average bytes per weight)."""
    weights = max(opened.estimate.weights, 1)
    per_weight = weights / max(opened.index.float_bytes(1), 1)
    arch = opened.manifest.arch
    output_head = int(arch["vocab_size"]) * int(arch["hidden_size"]) * per_weight
    return min(1.0, (head_bytes(opened) + output_head) / weights)


def default_length(requested: int | str) -> int:
    """``num_draft_tokens`` when not given: the depth, or :data:`AUTO_DEPTH` for ``"auto"``."""
    return AUTO_DEPTH if requested == AUTO else int(requested)


def head_bytes(opened: OpenedModel) -> int:
    """What the head's tensors add to the memory estimate when ``mtp`` is open (0 without a head)."""
    if not has_head(opened):
        return 0
    manifest = opened.manifest
    assert manifest.mtp is not None
    index = build_index(manifest.path(MTP_HEAD), manifest.files[MTP_HEAD].size, manifest.mtp.get("quantization") or {})
    return index.float_bytes(4) if opened.policy.unpack else index.stored_bytes()


def has_head(opened: OpenedModel) -> bool:
    """Whether the install carries a multi-token-prediction head (``mtp.safetensors``)."""
    return opened.manifest.mtp is not None and MTP_HEAD in opened.manifest.files


def refusal(opened: OpenedModel) -> str | None:
    """Why ``mtp=DEPTH`` cannot be served on this install (``None`` when it can)."""
    hooks, manifest = opened.hooks, opened.manifest
    if not has_head(opened):
        return (
            f"{manifest.root} has no multi-token-prediction head (no 'mtp' section and no {MTP_HEAD!r} in its "
            f"file table); convert a checkpoint that carries mtp.* tensors, or open without mtp "
            f"(mtp='auto' decodes plainly when there is no head)"
        )
    if not hooks.has_mtp_head_flow():
        return (
            f"family {hooks.spec.name!r} ({hooks.spec.distribution}) has no flow for multi-token-prediction heads "
            f"(its plugin does not implement the build_mtp_head hook); open without mtp"
        )
    return None


def load_head(opened: OpenedModel) -> DraftHead:
    """Read ``mtp.safetensors`` and build the head with the family's ``build_mtp_head`` hook.

    Raises:
        DrafterError: The install has no head, or the family has no head flow.
        InstallError: The head's tensors do not fit its flow.
    """
    why = refusal(opened)
    if why is not None:
        raise DrafterError(f"mtp refused: {why}")
    manifest = opened.manifest
    assert manifest.mtp is not None
    path = manifest.path(MTP_HEAD)
    quantization = manifest.mtp.get("quantization") or {}
    if not isinstance(quantization, dict):
        msg = f"{manifest.root}: the 'mtp' section's 'quantization' must be an object; re-run `turbospark convert`"
        raise InstallError(msg)
    index = build_index(path, manifest.files[MTP_HEAD].size, quantization)
    weights = WeightStore(path, index, opened.policy)
    context = HeadContext(
        arch=manifest.arch, trunk=opened.model, weights=weights, compute_dtype=opened.policy.compute_dtype
    )
    head = opened.hooks.build_mtp_head(context)
    if head is None:
        msg = f"plugin {opened.hooks.spec.distribution!r} returned no MTP head for {manifest.root}; reinstall it"
        raise InstallError(msg)
    unused = weights.unused()
    if unused:
        msg = (
            f"{manifest.root}: {len(unused)} tensor(s) of {MTP_HEAD} are not used by family "
            f"{opened.hooks.spec.name!r}'s MTP head, first {unused[0]!r}; re-run `turbospark convert`"
        )
        raise InstallError(msg)
    weights.materialize()
    return head


def last_layer(opened: OpenedModel) -> int:
    """The target decoder layer whose output residual the head reads (the last)."""
    return int(opened.manifest.arch["num_hidden_layers"]) - 1


def trunk_residual(opened: OpenedModel, ids: Sequence[int], cache: list[Cache] | None = None) -> mx.array:
    """The residual after the last decoder layer ``[1, T, H]`` for ``ids`` (one target forward)."""
    got: dict[int, mx.array] = {}
    layer = last_layer(opened)
    with applying(Edit({}), family=opened.capabilities.family, capture=got, capture_layers=frozenset([layer])):
        opened.model(mx.array([list(ids)]), cache if cache is not None else opened.new_cache())
    return got[layer]


def draft_logits(opened: OpenedModel, head: DraftHead, ids: Sequence[int]) -> np.ndarray:
    """The head's logits ``(T-1, vocab)`` float32 over ``ids`` on a fresh context: row ``t`` is slot ``t``
    (``h_t`` with ``x_{t+1}``, predicting ``x_{t+2}``)."""
    if len(ids) < 2:
        raise OptionError(f"draft_logits needs at least two token ids (got {len(ids)})")
    hidden = head.trunk_hidden(trunk_residual(opened, ids))
    cache = new_head_cache(opened, head)
    logits, _ = head(hidden[:, :-1], mx.array([list(ids[1:])]), cache)
    return np.array(logits[0].astype(mx.float32))


def runner_draft_logits(opened: OpenedModel, ids: Sequence[int]) -> np.ndarray:
    """:meth:`Runner.draft_logits`: the open's head when ``mtp`` is open, else one built for the call
    (refused as ``mtp=DEPTH`` would be)."""
    setup = opened.drafter
    head = setup.new.head if setup is not None and isinstance(setup.new, MtpFactory) else load_head(opened)
    return draft_logits(opened, head, ids)


def new_head_cache(opened: OpenedModel, head: DraftHead) -> list[Cache]:
    """Fresh KV caches for the head (unquantized; one per MTP layer)."""
    return make_caches(list(head.cache_layout()), opened.max_context, opened.policy.compute_dtype)


class MtpDrafter:
    """Drafts with the install's MTP head, keeping the head's own KV cache in step with the target.

    Args:
        opened: The target's opened model.
        head: The head (:func:`load_head`).
        depth: Tokens drafted per step (chained head calls).
    """

    name = "mtp"

    def __init__(self, opened: OpenedModel, head: DraftHead, depth: int) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise OptionError(f"mtp={depth!r}: the draft depth must be a positive integer (or 'auto')")
        self.head = head
        self.depth = depth
        self.capture_layers: tuple[int, ...] = (last_layer(opened),)
        self._opened = opened
        self._cache = new_head_cache(opened, head)
        self._base = 0  # the position of the first slot the cache holds
        # h_t for consecutive positions, as observed ([1, T, H] parts left lazy: concatenated once, at a draft)
        self._parts: list[tuple[int, mx.array]] = []

    # ------------------------------------------------------------- state
    @property
    def slots(self) -> int:
        """Committed slots: the next slot the head computes is ``slots`` (reads ``h_slots``, ``x_{slots+1}``)."""
        return self._base + self._offset()

    def _offset(self) -> int:
        first = self._cache[0]
        assert isinstance(first, KVCache)
        return first.offset

    @property
    def _hbase(self) -> int:
        return self._parts[0][0] if self._parts else 0

    def _hidden_end(self) -> int:
        if not self._parts:
            return 0
        start, last = self._parts[-1]
        return start + int(last.shape[1])

    def _cut(self, end: int) -> None:
        """Keep the hiddens of positions ``< end``."""
        while self._parts and self._parts[-1][0] >= end:
            self._parts.pop()
        if self._parts and self._hidden_end() > end:
            start, last = self._parts[-1]
            self._parts[-1] = (start, last[:, : end - start])

    def _span(self, first: int, stop: int) -> mx.array:
        """The hiddens of positions ``first .. stop-1`` (observed)."""
        pieces = [
            arr[:, max(first - start, 0) : stop - start]
            for start, arr in self._parts
            if start < stop and start + arr.shape[1] > first
        ]
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=1)

    def reset(self) -> None:
        """A new sequence: forget every slot and hidden."""
        self._restart(0)
        self._parts = []

    def _restart(self, start: int) -> None:
        """An empty head cache whose first slot will be ``start`` (the hiddens are kept)."""
        self._cache = new_head_cache(self._opened, self.head)
        self._base = start

    def _trim_slots(self, keep: int) -> None:
        """Keep slots ``< keep``."""
        keep = max(keep, 0)
        if keep >= self.slots:
            return
        if keep <= self._base:
            self._restart(keep)
            return
        drop = self.slots - keep
        for cache in self._cache:
            assert isinstance(cache, KVCache)
            cache.trim(drop)

    def observe(self, start: int, hidden: Mapping[int, mx.array]) -> None:
        """The target ran positions ``start ..``: ``hidden[last layer]`` (``[T, H]``) is its residual there.

        Hiddens and slots from ``start`` on are replaced. Positions never
        observed (a session's reused prefix) leave a gap: the head's cache then
        starts at the first slot it can compute (lossless, perhaps less accepted).
        """
        residual = hidden[self.capture_layers[0]]
        h = self.head.trunk_hidden(residual if residual.ndim == 3 else residual[None])
        self._trim_slots(start)
        if not self._parts or not self._hbase <= start <= self._hidden_end():
            self._parts = [(start, h)]
        else:
            self._cut(start)
            self._parts.append((start, h))
        if len(self._parts) > MAX_PARTS:  # drafting paused for a while: one part, the pending slots' hiddens
            end = self._hidden_end()
            begin = max(self._hbase, min(self.slots - HIDDEN_TAIL, end - MAX_PENDING))
            merged = self._span(begin, end)
            self._parts = [(begin, merged)]

    def rewind(self, length: int) -> None:
        """The committed context is ``length`` tokens: hiddens stay valid for positions ``< length - 1``.

        Slots up to ``length - 3`` are kept; slot ``length - 2`` (the one the next
        draft starts from) is recomputed when it exists, from its kept hidden.
        """
        self._trim_slots(length - 2)
        self._cut(max(length - 1, 0))

    # ------------------------------------------------------------- drafting
    def _commit(self, context: Sequence[int]) -> tuple[mx.array, mx.array] | None:
        """Append the committed slots ``slots .. n-2``; the last one's (logits, hidden), or ``None``
        when the hidden of position ``n-2`` has not been observed."""
        last = len(context) - 2
        if self.slots > last:  # the slot the draft starts from was committed: recompute it
            self._trim_slots(last)
        if self.slots < self._hbase:  # hiddens never observed: start the head where they begin
            self._restart(self._hbase)
        first = self.slots
        if last < first or last >= self._hidden_end():
            return None
        end = self._hidden_end()
        begin = max(self._hbase, min(first, last + 1 - HIDDEN_TAIL))
        hidden = self._span(begin, end)
        h = hidden[:, first - begin : last + 1 - begin]
        logits, out = self.head(h, mx.array([list(context[first + 1 : last + 2])]), self._cache)
        # keep a short tail of hiddens (one part), so a rewind a few tokens back recomputes without a gap
        keep = max(begin, last + 1 - HIDDEN_TAIL)
        self._parts = [(keep, hidden[:, keep - begin :])]
        return logits[:, -1:], out[:, -1:]

    def propose(self, context: Sequence[int], k: int, sampler: Sampler) -> Draft:
        """Up to ``k`` tokens after ``context`` (its last token not yet run by the target), chaining the head.

        Greedy: argmax tokens. Sampling: each token drawn from the head's
        distribution after the request's transforms (``q`` in :class:`Draft`).
        Nothing when the head has not seen the hidden it needs.
        """
        step = self._commit(context)
        if step is None or k < 1:
            return Draft(tokens=())
        logits, hidden = step
        params = sampler.params
        penalized = not params.greedy and params.repetition_penalty != 1.0
        history = mx.array(list(context[-params.repetition_context :])) if penalized else None
        drawn: list[mx.array] = []  # [1] each, left lazy: one evaluation for the whole chain
        rows: list[mx.array] = []
        while True:
            last = logits[:, -1]  # [1, V]
            if params.greedy:
                token = mx.argmax(last, axis=-1)
            else:
                if history is not None and drawn:
                    history = mx.concatenate([history, drawn[-1]])[-params.repetition_context :]
                logprobs = sampler.logprobs(sampler.penalize(last, history))
                token = mx.random.categorical(logprobs, axis=-1, key=sampler.next_key())
                rows.append(mx.exp(logprobs[0]))
            drawn.append(token.astype(mx.int32))
            if len(drawn) == k:
                break
            logits, hidden = self.head(hidden, drawn[-1][None], self._cache)
        chain = mx.concatenate(drawn)
        mx.eval(chain, *rows)
        tokens = [int(t) for t in cast(list[int], chain.tolist())]
        chained = len(tokens) - 1
        if chained:
            for cache in self._cache:
                assert isinstance(cache, KVCache)
                cache.trim(chained)
        return Draft(tokens=tokens, probs=None if params.greedy else mx.stack(rows))
