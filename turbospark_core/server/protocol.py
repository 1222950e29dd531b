"""The OpenAI wire format: request validation into generation requests, response and error bodies.

Decisions:

* ``model`` may be omitted or name anything: one install is served, and every
  response carries its id (``GET /v1/models`` lists it).
* Unknown request fields are refused with 400, as OpenAI does. Standard
  fields the runtime cannot honour are refused by name when set to anything
  but their neutral value: ``n``/``best_of`` > 1, ``frequency_penalty``/
  ``presence_penalty`` (use ``repetition_penalty``), ``logit_bias``, ``tools``,
  ``tool_choice``, ``suffix``, a ``response_format`` other than text.
  ``user``, ``metadata``, ``store``, ``service_tier`` and
  ``parallel_tool_calls`` are accepted and ignored.
* Sampling defaults are OpenAI's (``temperature`` 1, ``top_p`` 1); pass
  ``temperature=0`` for greedy decoding. ``seed`` is taken modulo 2**64.
  Extensions: ``top_k``, ``min_p``, ``repetition_penalty``,
  ``session_id`` (pin the request to a named parked conversation), and
  ``steering``: the name of a direction set registered at serve time, or
  ``{"name": ..., "scale": x}`` to override its scale, or ``false`` for no
  steering; absent or ``null``, the server's default set (if any) applies.
  ``GET /v1/models`` says whether the family applies steering and names the sets.
* ``max_tokens`` (or ``max_completion_tokens``) defaults to the rest of the
  context for chat and to 16 for completions; asking past ``max_context`` is a
  400 with code ``context_length_exceeded``.
* Log probabilities: chat's ``logprobs: true`` with ``top_logprobs`` 0 to 20,
  completions' ``logprobs`` 0 to 20 (the alternatives per token), in
  OpenAI's shapes, streamed with each delta. They come from the distribution
  the sampler draws from: the logits after ``repetition_penalty``, divided by
  ``temperature`` (1 when greedy), log-softmaxed, before top-k/top-p/min-p
  truncation (vLLM's "processed" log probabilities). A token's ``bytes`` are
  the UTF-8 of its text (a token holding part of a character shows U+FFFD);
  ``-inf`` is sent as -9999.0. Prompt log probabilities are not computed,
  so ``echo`` with ``logprobs`` is refused.
* ``usage.prompt_tokens_details.cached_tokens`` reports the prompt tokens
  served from a parked session's cache instead of being prefilled again.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from turbospark_core.batch import MAX_TOP_LOGPROBS, TokenLogprob
from turbospark_core.errors import OptionError, TurbosparkError
from turbospark_core.sampling import SamplingParams
from turbospark_core.stop import StopMatcher
from turbospark_core.vision.prompt import VisionPrompt, is_image_part

SEED_MODULUS = 2**64
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_SESSION_ID = 256
ROLES = {"system", "developer", "user", "assistant", "tool"}

_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
    "stop", "n", "stream", "stream_options", "logprobs", "user", "session_id",
    "frequency_penalty", "presence_penalty", "logit_bias", "steering",
}  # fmt: skip
CHAT_FIELDS = _COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls", "functions", "function_call", "metadata", "store", "service_tier",
}  # fmt: skip
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}


class APIError(Exception):
    """A request the server answers with an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - the wire name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}  # extra response headers (e.g. Retry-After on a 429)

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@attrs.frozen(kw_only=True)
class ModelFacts:
    """What validation needs to know of the served model (no MLX: safe on HTTP threads)."""

    model_id: str
    max_context: int
    vocab_size: int
    encode: Callable[[str], list[int]] = attrs.field(eq=False)
    decode: Callable[[list[int]], str] = attrs.field(eq=False)
    # the prompt of chat messages: token ids, or a VisionPrompt when they hold images (Runner.chat_input)
    chat_prompt: Callable[[list[dict[str, Any]]], list[int] | VisionPrompt] = attrs.field(eq=False)
    steering_sets: dict[str, Any] = attrs.field(factory=dict, eq=False)  # name -> DirectionSet
    steering_refusal: str | None = None  # the family's steering_supported answer
    steering_default: str | None = None  # the name of the set applied when a request names none


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """A validated request: what the scheduler runs and how the answer is shaped."""

    kind: str  # "chat" | "completion"
    prompt: list[int] = attrs.field(eq=False)
    max_tokens: int
    sampling: dict[str, Any] = attrs.field(eq=False)  # Runner sampling kwargs, ``stop`` included
    stream: bool = False
    include_usage: bool = False
    session_id: str | None = None
    steering: Any = attrs.field(default=None, eq=False)  # DirectionSet, None (the default) or False (none)
    echo: str | None = None  # completions: the prompt text to put before the completion
    logprobs: int | None = None  # None: no log probabilities; k: each token's and its k best alternatives
    vision: VisionPrompt | None = attrs.field(default=None, eq=False)  # chat: the prompt with its images
    request_id: str = attrs.Factory(lambda self: _new_id(self.kind), takes_self=True)
    created: int = attrs.Factory(lambda: int(time.time()))


def _new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


# ------------------------------------------------------------------ field readers
def _bad_type(name: str, expected: str, value: Any) -> APIError:
    msg = f"Invalid type for '{name}': expected {expected}, but got {type(value).__name__} {value!r}"
    return APIError(400, msg, param=name, code="invalid_type")


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad_type(name, "a number", value)
    return float(value)


def _integer(body: dict[str, Any], name: str, *, low: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad_type(name, "an integer", value)
    if low is not None and value < low:
        raise APIError(400, f"'{name}' must be at least {low} (got {value})", param=name, code="invalid_value")
    return value


def _boolean(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad_type(name, "a boolean", value)
    return value


def _string(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise _bad_type(name, "a string", value)
    return value


def _unsupported(name: str, why: str) -> APIError:
    return APIError(400, f"'{name}' is not supported by this server: {why}", param=name, code="unsupported_parameter")


# ------------------------------------------------------------------ shared checks
def _check_fields(body: dict[str, Any], known: set[str], required: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        msg = f"Unrecognized request argument supplied: {', '.join(unknown)}"
        raise APIError(400, msg, param=unknown[0], code="unknown_parameter")
    if body.get(required) is None:
        raise APIError(
            400, f"Missing required parameter: '{required}'", param=required, code="missing_required_parameter"
        )
    _string(body, "model")
    _string(body, "user")


def _refuse_unsupported(body: dict[str, Any]) -> None:
    n = _integer(body, "n", low=1)
    if n not in (None, 1):
        raise _unsupported("n", "one choice per request; send n requests instead")
    best_of = _integer(body, "best_of", low=1)
    if best_of not in (None, 1):
        raise _unsupported("best_of", "one candidate per request")
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name) not in (None, 0.0):
            raise _unsupported(name, "use the 'repetition_penalty' extension (e.g. 1.1) instead")
    for name in ("logit_bias", "tools", "functions", "suffix"):
        if body.get(name):
            raise _unsupported(name, "this runtime cannot honour it; omit it")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none", "auto"):
            raise _unsupported(name, "tool calling is not available")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _unsupported("response_format", "only {'type': 'text'} is available")


def _top_count(body: dict[str, Any], name: str) -> int | None:
    value = _integer(body, name, low=0)
    if value is not None and value > MAX_TOP_LOGPROBS:
        msg = f"'{name}' must be at most {MAX_TOP_LOGPROBS} (got {value})"
        raise APIError(400, msg, param=name, code="invalid_value")
    return value


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat: ``logprobs`` (bool) and ``top_logprobs`` (0 to 20, only with ``logprobs: true``)."""
    wanted = _boolean(body, "logprobs")
    top = _top_count(body, "top_logprobs")
    if top is not None and not wanted:
        msg = "'top_logprobs' requires 'logprobs' to be true"
        raise APIError(400, msg, param="top_logprobs", code="invalid_value")
    return (top or 0) if wanted else None


def _completion_logprobs(body: dict[str, Any], echo: bool) -> int | None:
    """Completions: ``logprobs`` is the number of alternatives per token (0 to 20)."""
    top = _top_count(body, "logprobs")
    if top is not None and echo:
        raise _unsupported("logprobs", "prompt log probabilities are not computed; drop 'echo' or 'logprobs'")
    return top


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        value = _number(body, name)
        if value is not None:
            out[name] = value
    top_k = _integer(body, "top_k", low=0)
    if top_k is not None:
        out["top_k"] = top_k
    seed = _integer(body, "seed")
    if seed is not None:
        out["seed"] = seed % SEED_MODULUS
    try:
        SamplingParams.from_kwargs(dict(out))
    except OptionError as e:
        name = str(e).split("=", 1)[0]
        raise APIError(400, str(e), param=name if name in out else None, code="invalid_value") from None
    stop = body.get("stop")
    if stop is not None:
        try:
            StopMatcher(stop)
        except OptionError as e:
            raise APIError(400, str(e), param="stop", code="invalid_value") from None
        out["stop"] = stop
    return out


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise _bad_type("stream_options", "an object {'include_usage': bool}", options)
    return stream, _boolean(options, "include_usage")


def _session_id(body: dict[str, Any]) -> str | None:
    sid = _string(body, "session_id")
    if sid is not None and not 0 < len(sid) <= MAX_SESSION_ID:
        msg = f"'session_id' must be 1 to {MAX_SESSION_ID} characters"
        raise APIError(400, msg, param="session_id", code="invalid_value")
    return sid


def _steering(body: dict[str, Any], facts: ModelFacts) -> Any:
    """The request's ``steering``: a registered set (scale optionally overridden), ``False``, or ``None``."""
    value = body.get("steering")
    if value is None or value is False:
        return value
    if facts.steering_refusal is not None:
        raise _unsupported("steering", facts.steering_refusal)
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"name", "scale"})
        if unknown or not isinstance(value.get("name"), str):
            raise _bad_type("steering", "a set name or {'name': str, 'scale': number}", value)
        name, scale = value["name"], _number(value, "scale")
    elif isinstance(value, str):
        name, scale = value, None
    else:
        raise _bad_type("steering", "a set name, {'name', 'scale'}, false or null", value)
    found = facts.steering_sets.get(name)
    if found is None:
        names = ", ".join(sorted(facts.steering_sets)) or "none (start the server with --steering-set NAME=FILE)"
        msg = f"'steering' names no registered direction set {name!r}; registered: {names}"
        raise APIError(400, msg, param="steering", code="invalid_value")
    return found if scale is None else found.with_scale(scale)


def _max_tokens(body: dict[str, Any], names: tuple[str, ...], prompt_len: int, facts: ModelFacts, *, chat: bool) -> int:
    low = 1 if chat else 0
    asked = [(n, v) for n in names if (v := _integer(body, n, low=low)) is not None]
    room = facts.max_context - prompt_len
    if room < 1 or prompt_len == 0:
        msg = (
            f"This model's maximum context length is {facts.max_context} tokens. "
            f"However, your prompt is {prompt_len} tokens, leaving no room for a completion."
        )
        raise APIError(400, msg, param="messages" if chat else "prompt", code="context_length_exceeded")
    if not asked:  # chat: the rest of the context (like vLLM); completions: OpenAI's 16
        return room if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
    name, value = asked[-1]  # max_completion_tokens wins over the deprecated max_tokens
    if value > room:
        msg = (
            f"This model's maximum context length is {facts.max_context} tokens. However, you requested "
            f"{prompt_len + value} tokens ({prompt_len} in the prompt, {value} for the completion). "
            f"Please reduce the prompt or '{name}' (at most {room} here)."
        )
        raise APIError(400, msg, param=name, code="context_length_exceeded")
    return value


# ------------------------------------------------------------------ chat
def _message_text(content: Any, where: str) -> str | list[dict[str, Any]]:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _bad_type(where, "a string or a list of text parts", content)
    if any(is_image_part(p) for p in content):
        return _image_parts(content, where)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _unsupported(where, f"only text content parts are served (got a {kind!r} part)")
        texts.append(part["text"])
    return "".join(texts)


def _image_parts(content: list[Any], where: str) -> list[dict[str, Any]]:
    """Text and ``image_url`` parts, as the chat template and :meth:`Runner.chat_input` take them."""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if is_image_part(part):
            value = part.get("image_url") if part.get("type") == "image_url" else part.get("image")
            url = value.get("url") if isinstance(value, dict) else value
            if not isinstance(url, str):
                raise _bad_type(f"{where}[{j}].image_url.url", "a base64 data: URL string", url)
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _unsupported(where, f"only text and image_url content parts are served (got a {kind!r} part)")
    return parts


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        msg = "'messages' must be a non-empty list of {'role', 'content'} objects"
        raise APIError(
            400, msg, param="messages", code="invalid_value" if isinstance(messages, list) else "invalid_type"
        )
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad_type(where, "an object", m)
        role = m.get("role")
        if role not in ROLES:
            msg = f"'{where}.role' must be one of {', '.join(sorted(ROLES))} (got {role!r})"
            raise APIError(400, msg, param=f"{where}.role", code="invalid_value")
        text = _message_text(m.get("content"), f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": text})
    return out


def parse_chat(body: dict[str, Any], facts: ModelFacts) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` body.

    Raises:
        APIError: 400 naming the offending field.
    """
    _check_fields(body, CHAT_FIELDS, "messages")
    _refuse_unsupported(body)
    messages = _messages(body)
    try:
        got = facts.chat_prompt(messages)
    except TurbosparkError as e:  # a template failure; images: undecodable, too large, too many for the context
        raise APIError(400, str(e), param="messages", code="invalid_value") from None
    vision = got if isinstance(got, VisionPrompt) else None
    prompt = got.ids if isinstance(got, VisionPrompt) else got
    sampling = _sampling(body)
    stream, include_usage = _stream_flags(body)
    return GenerationRequest(
        kind="chat",
        prompt=prompt,
        max_tokens=_max_tokens(body, ("max_tokens", "max_completion_tokens"), len(prompt), facts, chat=True),
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        session_id=_session_id(body),
        steering=_steering(body, facts),
        logprobs=_chat_logprobs(body),
        vision=vision,
    )


# ------------------------------------------------------------------ completions
def _prompt(body: dict[str, Any], facts: ModelFacts) -> tuple[list[int], str]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return facts.encode(prompt), prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < facts.vocab_size]
        if bad:
            msg = f"'prompt' token id {bad[0]} is outside the vocabulary [0, {facts.vocab_size})"
            raise APIError(400, msg, param="prompt", code="invalid_value")
        return list(prompt), facts.decode(list(prompt))
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise _unsupported("prompt", "one prompt per request; send a batch as separate requests")
    raise _bad_type("prompt", "a string or a non-empty list of token ids", prompt)


def parse_completion(body: dict[str, Any], facts: ModelFacts) -> GenerationRequest:
    """Validate a ``/v1/completions`` body.

    Raises:
        APIError: 400 naming the offending field.
    """
    _check_fields(body, COMPLETION_FIELDS, "prompt")
    _refuse_unsupported(body)
    ids, text = _prompt(body, facts)
    sampling = _sampling(body)
    stream, include_usage = _stream_flags(body)
    echo = _boolean(body, "echo")
    return GenerationRequest(
        kind="completion",
        prompt=ids,
        max_tokens=_max_tokens(body, ("max_tokens",), len(ids), facts, chat=False),
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        session_id=_session_id(body),
        steering=_steering(body, facts),
        echo=text if echo else None,
        logprobs=_completion_logprobs(body, echo),
    )


# ------------------------------------------------------------------ responses
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI usage, with ``prompt_tokens_details.cached_tokens`` = prompt tokens served from a parked session."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _envelope(req: GenerationRequest, model_id: str, *, chunk: bool) -> dict[str, Any]:
    if req.kind == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        obj = "text_completion"
    return {"id": req.request_id, "object": obj, "created": req.created, "model": model_id}


# ------------------------------------------------------------------ log probabilities
NEG_INF_LOGPROB = -9999.0  # what -inf is sent as (JSON has no infinity)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else NEG_INF_LOGPROB


def _token_object(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}


def chat_logprobs(entries: Sequence[TokenLogprob], decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """Chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": null}``."""
    content = []
    for e in entries:
        obj = _token_object(decode([e.token]), e.logprob)
        obj["top_logprobs"] = [_token_object(decode([i]), lp) for i, lp in e.top]
        content.append(obj)
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: Sequence[TokenLogprob], decode: Callable[[list[int]], str], offset: int = 0
) -> dict[str, Any]:
    """Completions' ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset`` from ``offset``."""
    texts = [decode([e.token]) for e in entries]
    offsets = [offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {
        "tokens": texts,
        "token_logprobs": [_finite(e.logprob) for e in entries],
        "top_logprobs": [_top_dict(e, decode) for e in entries],
        "text_offset": offsets,
    }


def _top_dict(entry: TokenLogprob, decode: Callable[[list[int]], str]) -> dict[str, float]:
    """``{token text: logprob}``, best first; tokens sharing a text keep the best one's value."""
    out: dict[str, float] = {}
    for i, lp in entry.top:
        out.setdefault(decode([i]), _finite(lp))
    return out


class LogprobsWriter:
    """Shapes a request's log probabilities, delta by delta (streamed) or all at once; ``None`` when not asked."""

    def __init__(self, req: GenerationRequest, decode: Callable[[list[int]], str]) -> None:
        self.req = req
        self.decode = decode
        self.offset = len(req.echo or "")  # completions' text_offset runs over the whole answer text
        self.sent = 0

    def __call__(self, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        self.sent += len(entries)
        if self.req.kind == "chat":
            return chat_logprobs(entries, self.decode)
        out = completion_logprobs(entries, self.decode, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out


# ------------------------------------------------------------------ responses
def completion_body(
    req: GenerationRequest, model_id: str, gen: Any, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The non-streamed response for a finished :class:`~turbospark_core.runner.Generation`."""
    body = _envelope(req, model_id, chunk=False)
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": gen.text}}
    else:
        choice = {"index": 0, "text": (req.echo or "") + gen.text}
    choice.update(logprobs=logprobs, finish_reason=gen.finish_reason)
    s = gen.stats
    body.update(choices=[choice], usage=usage(s.prompt_tokens, s.generation_tokens, s.reused_tokens))
    return body


def chunk_body(
    req: GenerationRequest,
    model_id: str,
    text: str | None = None,
    *,
    role: bool = False,
    finish: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk: a text delta (with its tokens' ``logprobs``), the opening role delta, or the finish."""
    body = _envelope(req, model_id, chunk=True)
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": text or ""}
    choice.update(logprobs=logprobs, finish_reason=finish)
    body["choices"] = [choice]
    if req.include_usage:
        body["usage"] = None
    return body


def usage_chunk(req: GenerationRequest, model_id: str, gen: Any) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage`` is set: no choices, the usage."""
    body = _envelope(req, model_id, chunk=True)
    s = gen.stats
    body.update(choices=[], usage=usage(s.prompt_tokens, s.generation_tokens, s.reused_tokens))
    return body


def models_body(model_id: str, created: int, facts: ModelFacts | None = None) -> dict[str, Any]:
    """``GET /v1/models``."""
    return {"object": "list", "data": [model_card(model_id, created, facts)]}


def model_card(model_id: str, created: int, facts: ModelFacts | None = None) -> dict[str, Any]:
    """One model object; with ``facts``, its ``steering`` capability (extension)."""
    card: dict[str, Any] = {"id": model_id, "object": "model", "created": created, "owned_by": "turbospark"}
    if facts is not None:
        card["steering"] = {
            "supported": facts.steering_refusal is None,
            "refusal": facts.steering_refusal,
            "sets": sorted(facts.steering_sets),
            "default": facts.steering_default,
        }
    return card
