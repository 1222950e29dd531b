"""HTTP for ``turbospark serve``: stdlib ThreadingHTTPServer, JSON bodies and SSE streams on OpenAI's routes."""

from __future__ import annotations

import itertools
import json
import logging
import queue
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from turbospark_core.errors import ContextOverflowError, OptionError, TokenizerError, TurbosparkError
from turbospark_core.runner import Runner
from turbospark_core.server import protocol
from turbospark_core.server.metrics import endpoint_label, server_metrics
from turbospark_core.server.protocol import APIError, GenerationRequest, ModelFacts
from turbospark_core.server.scheduler import DEFAULT_MAX_QUEUE, DONE, ERROR, PIECE, Job, Scheduler

log = logging.getLogger("turbospark.server")

DEFAULT_MAX_BODY = 4 * 1024 * 1024
POLL_S = 0.1  # how often a waiting handler checks whether its client hung up
SOCKET_TIMEOUT_S = 120.0  # idle keep-alive connections, and clients that stop reading a stream
LINGER_S, LINGER_BYTES = 1.0, 16 * 1024 * 1024  # draining an unread body before closing

ROUTES: dict[str, dict[str, str]] = {
    "/v1/chat/completions": {"POST": "_chat"},
    "/v1/completions": {"POST": "_completions"},
    "/v1/models": {"GET": "_models"},
    "/health": {"GET": "_health"},
    "/metrics": {"GET": "_metrics"},
}
MODEL_PREFIX = "/v1/models/"


def as_api_error(exc: BaseException) -> APIError:
    """The HTTP answer for an error the worker raised."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextOverflowError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, (OptionError, TokenizerError)):
        return APIError(400, str(exc), code="invalid_value")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


def _lingering_close(conn: socket.socket) -> None:
    """Half-close, then discard what the client still sends for a moment.

    Closing with an unread request body makes the kernel reset the
    connection, which can destroy the error response before the client reads it.
    """
    try:
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(LINGER_S)
        deadline, seen = time.monotonic() + LINGER_S, 0
        while time.monotonic() < deadline and seen < LINGER_BYTES:
            data = conn.recv(65536)
            if not data:
                return
            seen += len(data)
    except OSError:
        pass


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64
    app: Server

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return  # a client hung up between requests: nothing to report
        log.exception("error serving %s", client_address)


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "turbospark"
    timeout = SOCKET_TIMEOUT_S
    server: _HTTPServer
    _status: int | None = None  # the answer's status once it has started (metrics)

    # ------------------------------------------------------------- routing
    # (do_<METHOD> is http.server's naming)
    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_OPTIONS(self) -> None:
        self._dispatch("OPTIONS")

    def setup(self) -> None:
        super().setup()
        self._linger = False
        self._endpoint: str | None = None  # the route being answered (metrics); None between requests

    def finish(self) -> None:
        super().finish()
        if self._linger:
            _lingering_close(self.connection)

    @property
    def app(self) -> Server:
        return self.server.app

    def send_response(self, code: int, message: str | None = None) -> None:
        self._status = code
        if self._endpoint is not None:  # counted as the answer starts (metrics hook)
            self.app.metrics.request(self._endpoint, code)
        super().send_response(code, message)

    def _dispatch(self, method: str) -> None:
        self._body_read = False
        self._headers_sent = False
        path = urlsplit(self.path).path
        self._status, self._endpoint = None, endpoint_label(path, ROUTES, MODEL_PREFIX)
        methods = ROUTES.get(path) or ({"GET": "_model"} if path.startswith(MODEL_PREFIX) else None)
        try:
            if methods is None:
                raise APIError(404, f"Unknown request URL: {method} {path}", code="unknown_url")
            name = methods.get(method)
            if name is None:
                msg = f"Method {method} is not allowed on {path}; use {', '.join(methods)}"
                raise APIError(405, msg, code="method_not_allowed")
            getattr(self, name)(path)
        except APIError as e:
            self._send_error(e, {"Allow": ", ".join(methods)} if e.status == 405 and methods else None)
        except OSError:  # the client went away (broken pipe, reset, timeout): nothing to answer
            self.close_connection = True
            if self._status is None:
                self.app.metrics.request(self._endpoint, None)
        except Exception:  # a bug must not take the server down
            log.exception("unexpected error serving %s %s", method, path)
            self._send_error(APIError(500, "internal server error", type="server_error"))
        finally:
            self._endpoint = None

    # ------------------------------------------------------------- bodies
    def _read_json(self) -> dict[str, Any]:
        if self.headers.get("Transfer-Encoding"):
            raise APIError(411, "chunked request bodies are not accepted; send Content-Length", code="length_required")
        raw = self.headers.get("Content-Length")
        if raw is None:
            raise APIError(411, "a JSON body with a Content-Length header is required", code="length_required")
        if not raw.strip().isdigit():
            raise APIError(400, f"invalid Content-Length {raw!r}", code="invalid_request")
        size = int(raw)
        if size > self.app.max_body:
            msg = (
                f"the request body ({size} bytes) exceeds this server's limit of {self.app.max_body} bytes (--max-body)"
            )
            raise APIError(413, msg, code="request_too_large")
        data = self.rfile.read(size)
        self._body_read = True
        if len(data) != size:
            raise ConnectionAbortedError("the client closed the connection mid-body")
        try:
            body = json.loads(data, parse_constant=_refuse_constant)
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"We could not parse the JSON body of your request: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    def _send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self._send_body(status, json.dumps(obj).encode(), "application/json", headers)

    def _send_body(self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        unread = not self._body_read and self.headers.get("Content-Length", "0").strip() not in ("", "0")
        if unread or self.headers.get("Transfer-Encoding"):
            self.send_header("Connection", "close")  # the unread body must not be taken for the next request
            self.close_connection = self._linger = True
        self.end_headers()
        self._headers_sent = True
        self.wfile.write(data)

    def _send_error(self, err: APIError, headers: dict[str, str] | None = None) -> None:
        if self._headers_sent:  # mid-stream: the stream already said what it could
            self.close_connection = True
            return
        self._send_json(err.status, err.body(), {**err.headers, **(headers or {})} or None)

    # ------------------------------------------------------------- simple routes
    def _models(self, path: str) -> None:
        self._send_json(200, protocol.models_body(self.app.model_id, self.app.created, self.app.facts))

    def _model(self, path: str) -> None:
        name = unquote(path[len(MODEL_PREFIX) :])
        if name != self.app.model_id:
            msg = f"The model {name!r} does not exist; this server serves {self.app.model_id!r}"
            raise APIError(404, msg, param="model", code="model_not_found")
        self._send_json(200, protocol.model_card(name, self.app.created, self.app.facts))

    def _health(self, path: str) -> None:
        self._send_json(200, self.app.health())

    def _metrics(self, path: str) -> None:
        self._send_body(200, self.app.metrics.render(), self.app.metrics.content_type)

    # ------------------------------------------------------------- generation
    def _chat(self, path: str) -> None:
        self._generate(protocol.parse_chat(self._read_json(), self.app.facts))

    def _completions(self, path: str) -> None:
        self._generate(protocol.parse_completion(self._read_json(), self.app.facts))

    def _generate(self, req: GenerationRequest) -> None:
        job = self.app.scheduler.submit(req)
        try:
            if req.stream:
                self._send_stream(job)
            else:
                self._send_whole(job)
        finally:
            job.cancel()  # no-op once finished; frees the slot if we leave early (client gone, error)

    def _events(self, job: Job) -> Iterator[tuple[str, Any]]:
        """The job's events through DONE or ERROR; raises if the client hangs up while waiting."""
        checked = time.monotonic()
        while True:
            try:
                kind, value = job.events.get(timeout=POLL_S)
            except queue.Empty:
                kind, value = "", None
            if time.monotonic() - checked >= POLL_S:  # also while pieces keep coming (non-streamed answers)
                checked = time.monotonic()
                if self._client_gone():
                    raise ConnectionAbortedError("the client closed the connection")
            if not kind:
                continue
            yield kind, value
            if kind != PIECE:
                return

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _send_whole(self, job: Job) -> None:
        for kind, value in self._events(job):
            if kind == ERROR:
                raise as_api_error(value)
            if kind == DONE:
                self._send_json(200, protocol.completion_body(job.request, self.app.model_id, value))

    def _send_stream(self, job: Job) -> None:
        req, model_id = job.request, self.app.model_id
        events = self._events(job)
        first = next(events)  # headers wait for the first event, so an early failure keeps its HTTP status
        if first[0] == ERROR:
            raise as_api_error(first[1])
        self._start_sse()
        if req.kind == "chat" or req.echo:
            self._sse(protocol.chunk_body(req, model_id, req.echo, role=True))
        for kind, value in itertools.chain([first], events):
            if kind == PIECE:
                self._sse(protocol.chunk_body(req, model_id, value))
            elif kind == DONE:
                self._sse(protocol.chunk_body(req, model_id, finish=value.finish_reason))
                if req.include_usage:
                    self._sse(protocol.usage_chunk(req, model_id, value))
            else:
                self._sse(as_api_error(value).body())
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _start_sse(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._headers_sent = True

    def _sse(self, obj: Any) -> None:
        self._chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%X\r\n%s\r\n" % (len(data), data))

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        log.info("%s %s", self.address_string(), format % args)


class Server:
    """An OpenAI-compatible HTTP server over one install.

    HTTP threads parse and validate; one worker thread (see
    :class:`~turbospark_core.server.scheduler.Scheduler`) runs the model.

    Args:
        opener: Builds the Runner; called on the worker thread.
        model_id: The name ``/v1/models`` lists and responses carry.
        host: Address to bind (loopback by default).
        port: TCP port; 0 picks a free one (see :attr:`port`).
        max_body: Largest request body accepted, in bytes (413 beyond).
        max_queue: Most requests waiting for a session slot (429 with Retry-After beyond).
        max_batch: Most requests decoding in one forward (default: every session slot).
        steering_sets: Direction sets requests may name in their ``steering``
            field (name -> :class:`~turbospark_core.steering.DirectionSet`),
            checked against the model once it is open.
    """

    def __init__(
        self,
        opener: Callable[[], Runner],
        *,
        model_id: str,
        host: str = "127.0.0.1",
        port: int = 8080,
        max_body: int = DEFAULT_MAX_BODY,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_batch: int | None = None,
        steering_sets: dict[str, Any] | None = None,
    ) -> None:
        self.model_id = model_id
        self.max_body = max_body
        server_class = _HTTPServer6 if ":" in host else _HTTPServer
        try:  # bind first: a busy port fails before the slow open
            self.httpd = server_class((host, port), _Handler)
        except OSError as e:
            msg = f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port or --host"
            raise TurbosparkError(msg) from None
        self.httpd.app = self
        self.metrics = server_metrics()
        self.scheduler = Scheduler(opener, max_queue=max_queue, max_batch=max_batch, observer=self.metrics)
        try:
            self.runner = self.scheduler.start()
        except BaseException:
            self.httpd.server_close()
            raise
        self.metrics.bind(self.scheduler)
        self.created = int(time.time())
        self._thread: threading.Thread | None = None
        self._serving = False
        try:
            self.facts = _facts(self.runner, model_id, steering_sets or {})
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_install(
        cls,
        install: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 8080,
        max_body: int = DEFAULT_MAX_BODY,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_batch: int | None = None,
        model_id: str | None = None,
        steering_sets: dict[str, Any] | None = None,
        **open_options: Any,
    ) -> Server:
        """Open ``install`` (with :func:`turbospark_core.open` options such as ``session_slots``) and bind."""
        import turbospark_core

        name = model_id or Path(install).resolve().name
        return cls(
            lambda: turbospark_core.open(install, **open_options),
            model_id=name,
            host=host,
            port=port,
            max_body=max_body,
            max_queue=max_queue,
            max_batch=max_batch,
            steering_sets=steering_sets,
        )

    @property
    def port(self) -> int:
        """The bound TCP port."""
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        """``http://host:port`` (append ``/v1`` for an OpenAI client's base URL)."""
        host = str(self.httpd.server_address[0])
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def health(self) -> dict[str, Any]:
        """What ``GET /health`` answers."""
        return {
            "status": "ok",
            "model": self.model_id,
            "session_slots": self.runner.sessions.slots,
            "max_context": self.runner.max_context,
            **self.scheduler.snapshot(),
        }

    def serve_forever(self) -> None:
        """Serve on this thread until :meth:`close` (or Ctrl-C)."""
        self._serving = True
        self.httpd.serve_forever(poll_interval=0.2)

    def start(self) -> Server:
        """Serve on a background thread; returns ``self``."""
        self._serving = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting, fail what is in flight with 503, stop the worker."""
        if self._serving:
            self.httpd.shutdown()
            self._serving = False
        self.httpd.server_close()
        self.scheduler.stop()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _facts(runner: Runner, model_id: str, steering_sets: dict[str, Any]) -> ModelFacts:
    for found in steering_sets.values():
        runner.steering_set(found)  # the family applies steering and each set fits the model (no MLX)
    default = runner.steering
    tok = runner.tokenizer
    return ModelFacts(
        steering_sets=dict(steering_sets),
        steering_refusal=runner.opened.capabilities.steering_refusal,
        steering_default=next((n for n, s in steering_sets.items() if s is default), None),
        model_id=model_id,
        max_context=runner.max_context,
        vocab_size=int(runner.manifest.arch["vocab_size"]),
        encode=tok.encode,
        decode=tok.decode,
        chat_prompt=runner.chat_input,
    )


def serve(install: str | Path, *, verbose: bool = False, **options: Any) -> None:
    """Run ``turbospark serve``: open, bind, print the address, serve until Ctrl-C."""
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = Server.from_install(install, **options)
    print(
        f"turbospark: serving {server.model_id!r} at {server.url}/v1 "
        f"({server.runner.sessions.slots} session slots, max context {server.runner.max_context})",
        file=sys.stderr,
        flush=True,
    )
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it as cleanly as Ctrl-C
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
