"""Sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

import attrs
import mlx.core as mx

from turbospark_core import native
from turbospark_core.errors import OptionError, refuse_unknown


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        msg = f"{name}={value!r} is out of range; use a value in [{low}, {high}]"
        raise OptionError(msg)


class SamplingOptions(TypedDict, total=False):
    """The sampling options of ``generate``/``stream``/``chat``/``chat_stream``.

    Keyword-only options of :class:`~turbospark_core.runner.Runner` and
    :class:`~turbospark_core.runner.Session`, documented once, here; each may
    be left out (the defaults are :class:`SamplingParams`'). A bad value or an
    unknown name raises ``OptionError`` naming it.

    Attributes:
        temperature: 0 (the default) is greedy; else logits are divided by it (at most 100).
        top_p: Nucleus sampling: keep the most likely tokens whose mass reaches
            it, in (0, 1]; 1 disables it.
        top_k: Keep only the ``top_k`` most likely tokens; 0 disables it.
        min_p: Drop tokens less likely than ``min_p`` times the top one, in [0, 1].
        repetition_penalty: Divide the logits of recently seen tokens by it
            (multiply negative ones); 1 disables it.
        repetition_context: How many recent tokens the penalty looks at (default 64).
        seed: Makes sampling reproducible.
        stop: A string or list of strings that ends the text (not included).
    """

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    repetition_context: int
    seed: int | None
    stop: str | list[str] | None


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How the next token is chosen (the :class:`SamplingOptions` but ``stop``); ``temperature == 0`` is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 64
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        _check_range("temperature", self.temperature, 0.0, 100.0)
        if not 0.0 < self.top_p <= 1.0:
            msg = f"top_p={self.top_p!r} is out of range; use a value in (0, 1] (1 disables it)"
            raise OptionError(msg)
        if self.repetition_context < 1:
            msg = f"repetition_context={self.repetition_context!r} must be >= 1 token"
            raise OptionError(msg)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("repetition_penalty", self.repetition_penalty, 1e-3, 100.0)
        if self.top_k < 0:
            msg = f"top_k={self.top_k} must be >= 0 (0 disables it)"
            raise OptionError(msg)

    @classmethod
    def from_kwargs(cls, options: Mapping[str, Any]) -> SamplingParams:
        """Build from ``generate(**sampling)`` without ``stop``, refusing unknown option names."""
        refuse_unknown(options, {a.name for a in attrs.fields(cls)}, "sampling")
        return cls(**options)

    @property
    def greedy(self) -> bool:
        """Whether sampling is argmax."""
        return self.temperature == 0.0


class Sampler:
    """Draws tokens from logits with :class:`SamplingParams`, reproducibly under a seed."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._key = mx.random.key(params.seed) if params.seed is not None else None

    def _next_key(self) -> mx.array | None:
        if self._key is None:
            return None
        self._key, sub = mx.random.split(self._key)
        return sub

    def penalize(self, logits: mx.array, history: mx.array | None) -> mx.array:
        """Apply the repetition penalty for tokens in ``history`` (``[n]`` ids)."""
        p = self.params.repetition_penalty
        if p == 1.0 or history is None or history.size == 0:
            return logits
        picked = logits[:, history]
        picked = mx.where(picked < 0, picked * p, picked / p)
        logits[:, history] = picked
        return logits

    def __call__(self, logits: mx.array) -> mx.array:
        """Next token ids ``[B]`` from last-position logits ``[B, V]`` (float32)."""
        if self.params.greedy:
            return native.argmax(logits)
        return mx.random.categorical(self._filtered(logits), axis=-1, key=self._next_key())

    def next_key(self) -> mx.array | None:
        """A fresh subkey of this sampler's seeded stream (``None`` unseeded: MLX's global generator)."""
        return self._next_key()

    def logprobs(self, logits: mx.array) -> mx.array:
        """The normalized log-distribution ``[B, V]`` sampling draws from (temperature > 0).

        Temperature, then top-k, min-p and top-p, exactly as :meth:`__call__`
        samples; the repetition penalty is :meth:`penalize`'s, applied before.
        Speculative decoding builds both the target's ``p`` and a drafter's
        ``q`` with it, so accepted output is distributed as plain sampling.
        Removed tokens hold ``-inf``.
        """
        filtered = self._filtered(logits)
        return filtered - mx.logsumexp(filtered, axis=-1, keepdims=True)

    def _filtered(self, logits: mx.array) -> mx.array:
        p = self.params
        if p.greedy:
            raise ValueError("logprobs() is the sampled distribution; greedy decoding takes the argmax")
        logprobs = logits.astype(mx.float32) / p.temperature
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        if p.top_k > 0 and p.top_k < logprobs.shape[-1]:
            kth = mx.sort(logprobs, axis=-1)[:, -p.top_k][:, None]
            logprobs = mx.where(logprobs < kth, -mx.inf, logprobs)
        if p.min_p > 0.0:
            top = mx.max(logprobs, axis=-1, keepdims=True)
            logprobs = mx.where(logprobs < top + mx.log(mx.array(p.min_p)), -mx.inf, logprobs)
        if p.top_p < 1.0:
            logprobs = _top_p(logprobs, p.top_p)
        return logprobs


def _top_p(logprobs: mx.array, top_p: float) -> mx.array:
    order = mx.argsort(-logprobs, axis=-1)
    sorted_lp = mx.take_along_axis(logprobs, order, axis=-1)
    cum = mx.cumsum(mx.exp(sorted_lp), axis=-1)
    # keep a token if the mass before it is below top_p (the first is always kept)
    keep_sorted = (cum - mx.exp(sorted_lp)) < top_p
    masked = mx.where(keep_sorted, sorted_lp, -mx.inf)
    inverse = mx.argsort(order, axis=-1)
    return mx.take_along_axis(masked, inverse, axis=-1)
