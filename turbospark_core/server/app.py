"""The ASGI application of ``turbospark serve`` (Starlette): OpenAI's routes, bounded bodies, SSE streams.

Handlers run on the event loop; request parsing and validation (JSON,
tokenizing, chat templates) run on a small thread pool, the model on the
scheduler's worker thread. A generation's events come back through
``loop.call_soon_threadsafe`` into an :class:`asyncio.Queue` (see
:meth:`Scheduler.submit`'s ``sink``); a task watching the connection puts
:data:`GONE` there when the client hangs up, which cancels the request's row.

Bounds (each answered with an OpenAI error body): a body over ``max_body``
bytes (413, the connection closed), a body not received within
``body_timeout`` (408), JSON nested deeper than :data:`MAX_JSON_DEPTH` (400),
more than :data:`MAX_HEADERS` headers (431), a stream the client stops
reading for ``write_timeout`` (the connection is dropped, the row freed).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import attrs
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from turbospark_core.errors import ContextOverflowError, OptionError, TokenizerError
from turbospark_core.server import protocol
from turbospark_core.server.metrics import endpoint_label
from turbospark_core.server.protocol import APIError, GenerationRequest, LogprobsWriter, ModelFacts
from turbospark_core.server.scheduler import DONE, ERROR, PIECE, Event, Job

if TYPE_CHECKING:
    from turbospark_core.server.httpd import Server

log = logging.getLogger("turbospark.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

GONE = "gone"  # the event a connection watcher puts in a request's queue when its client hangs up
MAX_JSON_DEPTH = 64  # nesting of arrays and objects in a request body
MAX_HEADERS = 100  # request header lines (431 beyond), as http.server allowed
DRAIN_BYTES, DRAIN_S = 16 * 1024 * 1024, 1.0  # an oversized body read and discarded before the 413, at most

ROUTES: dict[str, tuple[str, ...]] = {
    "/v1/chat/completions": ("POST",),
    "/v1/completions": ("POST",),
    "/v1/models": ("GET",),
    "/health": ("GET",),
    "/metrics": ("GET",),
}
MODEL_PREFIX = "/v1/models/"


@attrs.frozen(kw_only=True)
class Limits:
    """The server's bounds on clients (see the module docstring and :class:`~turbospark_core.server.Server`)."""

    max_body: int
    body_timeout: float
    write_timeout: float


class ClientGoneError(Exception):
    """The client closed its connection; nothing is answered."""


def as_api_error(exc: BaseException) -> APIError:
    """The HTTP answer for an error the worker raised."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextOverflowError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, (OptionError, TokenizerError)):
        return APIError(400, str(exc), code="invalid_value")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


def error_response(err: APIError, headers: dict[str, str] | None = None) -> Response:
    """The OpenAI error body of ``err``, with its status and headers."""
    return JSONResponse(err.body(), status_code=err.status, headers={**err.headers, **(headers or {})} or None)


def json_depth_exceeds(data: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text ``data`` nests arrays/objects deeper than ``limit`` (brackets in strings ignored)."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False  # cannot nest deeper than it has brackets
    depth, in_string, escaped = 0, False, False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                return True
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return False


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(data: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or a 400 naming what is wrong."""
    if json_depth_exceeds(data):
        msg = f"the JSON body nests arrays/objects deeper than {MAX_JSON_DEPTH} levels"
        raise APIError(400, msg, code="invalid_json")
    try:
        body = json.loads(data, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"We could not parse the JSON body of your request: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


class Handlers:
    """The route handlers over one :class:`~turbospark_core.server.Server`."""

    def __init__(self, server: Server, limits: Limits, pool: ThreadPoolExecutor) -> None:
        self.server = server
        self.limits = limits
        self.pool = pool

    # ------------------------------------------------------------- bodies
    async def read_body(self, request: Request) -> bytes:
        """The body, bounded by ``max_body`` bytes and ``body_timeout`` seconds."""
        limit = self.limits.max_body
        raw = request.headers.get("content-length")
        chunked = "transfer-encoding" in request.headers
        if raw is None and not chunked:
            raise APIError(411, "a JSON body with a Content-Length header is required", code="length_required")
        if raw is not None and not raw.strip().isdigit():
            raise APIError(400, f"invalid Content-Length {raw!r}", code="invalid_request")
        if raw is not None and int(raw) > limit:
            await self._drain(request)
            msg = f"the request body ({int(raw)} bytes) exceeds this server's limit of {limit} bytes (--max-body)"
            raise APIError(413, msg, code="request_too_large", headers={"Connection": "close"})
        data = bytearray()
        deadline = time.monotonic() + self.limits.body_timeout
        more = True
        while more:
            message = await self._receive(request, deadline)
            data += message.get("body", b"")
            more = bool(message.get("more_body"))
            if len(data) > limit:
                msg = f"the request body exceeds this server's limit of {limit} bytes (--max-body)"
                raise APIError(413, msg, code="request_too_large", headers={"Connection": "close"})
        return bytes(data)

    async def _receive(self, request: Request, deadline: float) -> Message:
        try:
            message = await asyncio.wait_for(request.receive(), max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            msg = f"the request body did not arrive within {self.limits.body_timeout:g} s"
            raise APIError(408, msg, code="request_timeout", headers={"Connection": "close"}) from None
        if message["type"] == "http.disconnect":
            raise ClientGoneError
        return message

    async def _drain(self, request: Request) -> None:
        """Read and discard an unwanted body for a moment, so closing does not reset the error answer away."""
        deadline, seen = time.monotonic() + DRAIN_S, 0
        try:
            while seen < DRAIN_BYTES:
                message = await asyncio.wait_for(request.receive(), max(deadline - time.monotonic(), 0.0))
                seen += len(message.get("body", b""))
                if message["type"] != "http.request" or not message.get("more_body"):
                    return
        except asyncio.TimeoutError:
            return

    async def parse(self, request: Request, parse: Callable[[dict[str, Any], ModelFacts], GenerationRequest]) -> Any:
        data = await self.read_body(request)
        facts = self.server.facts
        return await asyncio.get_running_loop().run_in_executor(self.pool, lambda: parse(parse_json(data), facts))

    # ------------------------------------------------------------- simple routes
    async def models(self, request: Request) -> Response:
        s = self.server
        return JSONResponse(protocol.models_body(s.model_id, s.created, s.facts))

    async def model(self, request: Request) -> Response:
        s, name = self.server, request.path_params["name"]
        if name != s.model_id:
            msg = f"The model {name!r} does not exist; this server serves {s.model_id!r}"
            raise APIError(404, msg, param="model", code="model_not_found")
        return JSONResponse(protocol.model_card(name, s.created, s.facts))

    async def health(self, request: Request) -> Response:
        return JSONResponse(self.server.health())

    async def metrics(self, request: Request) -> Response:
        m = self.server.metrics
        return Response(m.render(), media_type=m.content_type)

    # ------------------------------------------------------------- generation
    async def chat(self, request: Request) -> Response:
        return await self.generate(request, await self.parse(request, protocol.parse_chat))

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, await self.parse(request, protocol.parse_completion))

    async def generate(self, request: Request, req: GenerationRequest) -> Response:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[Event] = asyncio.Queue()

        def sink(event: Event) -> None:  # on the worker thread
            loop.call_soon_threadsafe(inbox.put_nowait, event)

        job = self.server.scheduler.submit(req, sink=sink)
        watcher = asyncio.ensure_future(_watch_disconnect(request, inbox))
        streaming = False
        try:
            first = await _next(inbox)  # a stream's headers wait for it, so an early failure keeps its status
            if first[0] == ERROR:
                raise as_api_error(first[1])
            if req.stream:
                streaming = True  # the response owns the watcher and the job from here
                return _SSEResponse(_SSEStream(self.server, job, inbox, first, self.limits.write_timeout), watcher)
            kind, value = first
            while kind == PIECE:
                kind, value = await _next(inbox)
            if kind == ERROR:
                raise as_api_error(value)
            scores = LogprobsWriter(req, self.server.facts.decode)(job.logprobs)
            return JSONResponse(protocol.completion_body(req, self.server.model_id, value, scores))
        finally:
            if not streaming:
                watcher.cancel()
                job.cancel()  # a no-op once finished; frees the row when the client left or a step failed


async def _watch_disconnect(request: Request, inbox: asyncio.Queue[Event]) -> None:
    """Wait for the client to hang up (the body is already read), then tell the request's queue."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    inbox.put_nowait((GONE, None))


async def _next(inbox: asyncio.Queue[Event]) -> Event:
    event = await inbox.get()
    if event[0] == GONE:
        raise ClientGoneError
    return event


class _SSEStream:
    """The ``data: {...}`` events of one streamed generation, ending with ``data: [DONE]``."""

    def __init__(self, server: Server, job: Job, inbox: asyncio.Queue[Event], first: Event, write_timeout: float):
        self.server = server
        self.job = job
        self.inbox = inbox
        self.first = first
        self.write_timeout = write_timeout

    async def events(self) -> AsyncIterator[bytes]:
        req, model_id = self.job.request, self.server.model_id
        scores = LogprobsWriter(req, self.server.facts.decode)
        if req.kind == "chat" or req.echo:
            yield _sse(protocol.chunk_body(req, model_id, req.echo, role=True))
        kind, value = self.first
        while True:
            if kind == PIECE:
                yield _sse(protocol.chunk_body(req, model_id, value.text, logprobs=scores(value.logprobs)))
            elif kind == DONE:
                rest = scores(self.job.logprobs[scores.sent :]) if self.job.logprobs[scores.sent :] else None
                yield _sse(protocol.chunk_body(req, model_id, finish=value.finish_reason, logprobs=rest))
                if req.include_usage:
                    yield _sse(protocol.usage_chunk(req, model_id, value))
                break
            else:
                yield _sse(as_api_error(value).body())
                break
            kind, value = await _next(self.inbox)
        yield b"data: [DONE]\n\n"


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class _SSEResponse(Response):
    """Sends an :class:`_SSEStream`; a client that hangs up or stops reading ends it and frees the row."""

    media_type = "text/event-stream"

    def __init__(self, stream: _SSEStream, watcher: asyncio.Future[None]) -> None:
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        self.stream = stream
        self.watcher = watcher

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = self.stream.write_timeout

        async def write(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), timeout)
            except asyncio.TimeoutError:
                raise ClientGoneError from None  # the client stopped reading
            except OSError:
                raise ClientGoneError from None

        try:
            await write({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for data in self.stream.events():
                await write({"type": "http.response.body", "body": data, "more_body": True})
            await write({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.watcher.cancel()
            self.stream.job.cancel()  # a no-op once finished


def build_app(server: Server, limits: Limits, pool: ThreadPoolExecutor) -> Callable[[Scope, Receive, Send], Any]:
    """The Starlette app of ``server``, inside :class:`Guard` (metrics, header bound, error bodies)."""
    h = Handlers(server, limits, pool)

    def route(path: str, endpoint: Callable[[Request], Awaitable[Response]], methods: tuple[str, ...]) -> Route:
        return Route(path, _answering(endpoint), methods=list(methods))

    routes = [
        route("/v1/chat/completions", h.chat, ROUTES["/v1/chat/completions"]),
        route("/v1/completions", h.completions, ROUTES["/v1/completions"]),
        route("/v1/models", h.models, ROUTES["/v1/models"]),
        route(MODEL_PREFIX + "{name:path}", h.model, ("GET",)),
        route("/health", h.health, ROUTES["/health"]),
        route("/metrics", h.metrics, ROUTES["/metrics"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_exception})
    return Guard(app, server)


def _answering(
    endpoint: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """``endpoint`` answering an :class:`APIError` (or a bug, as a 500) with OpenAI's error body."""

    async def answer(request: Request) -> Response:
        try:
            return await endpoint(request)
        except APIError as e:
            return error_response(e)
        except ClientGoneError:
            raise
        except Exception:  # a bug must not take the server down
            log.exception("unexpected error serving %s %s", request.method, request.url.path)
            return error_response(APIError(500, "internal server error", type="server_error"))

    return answer


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's routing errors (404, 405) as OpenAI error bodies."""
    assert isinstance(exc, HTTPException)
    path, method = request.url.path, request.method
    if exc.status_code == 405:
        allowed = [m for m in (exc.headers or {}).get("Allow", "").split(", ") if m and m != "HEAD"]
        msg = f"Method {method} is not allowed on {path}; use {', '.join(allowed)}"
        return error_response(APIError(405, msg, code="method_not_allowed"), {"Allow": ", ".join(allowed)})
    if exc.status_code == 404:
        return error_response(APIError(404, f"Unknown request URL: {method} {path}", code="unknown_url"))
    return error_response(APIError(exc.status_code, str(exc.detail), code="invalid_request"))


class Guard:
    """The outermost ASGI layer: counts answers by route and status, bounds headers, swallows hang-ups."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], server: Server) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; websockets are not served
        endpoint = endpoint_label(scope["path"], ROUTES, MODEL_PREFIX)
        metrics = self.server.metrics
        started = False

        async def counted(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                metrics.request(endpoint, int(message["status"]))
            await send(message)

        try:
            if len(scope.get("headers", ())) > MAX_HEADERS:
                msg = f"more than {MAX_HEADERS} request headers"
                err = APIError(431, msg, code="request_header_fields_too_large", headers={"Connection": "close"})
                await error_response(err)(scope, receive, counted)
                return
            await self.app(scope, receive, counted)
        except (ClientGoneError, OSError):
            pass  # the client left: nothing to answer
        finally:
            if not started:
                metrics.request(endpoint, None)
