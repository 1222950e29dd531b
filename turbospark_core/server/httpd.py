"""``turbospark serve``'s HTTP server: the Starlette app (:mod:`.app`) on uvicorn, over the batching scheduler.

uvicorn runs the event loop on its own thread (:meth:`Server.start`) or on
the caller's (:meth:`Server.serve_forever`); the model runs on the
scheduler's worker thread. The listening socket is bound before the model
opens, so a busy port fails fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from turbospark_core.errors import TurbosparkError
from turbospark_core.runner import Runner
from turbospark_core.server.app import Limits, as_api_error, build_app
from turbospark_core.server.metrics import server_metrics
from turbospark_core.server.protocol import ModelFacts
from turbospark_core.server.scheduler import DEFAULT_MAX_QUEUE, Scheduler

log = logging.getLogger("turbospark.server")

__all__ = ["DEFAULT_MAX_BODY", "Server", "as_api_error", "serve"]

DEFAULT_MAX_BODY = 4 * 1024 * 1024
DEFAULT_MAX_CONNECTIONS = 256  # open connections (503 + Retry-After beyond)
HEADER_TIMEOUT_S = 10.0  # a request head must arrive within this of connecting (or of its first byte)
BODY_TIMEOUT_S = 30.0  # a request body must arrive within this once its head has
WRITE_TIMEOUT_S = 120.0  # a streaming client that reads nothing for this long is dropped
KEEP_ALIVE_S = 30.0  # idle keep-alive connections are closed after this
PARSE_THREADS = 4  # request validation (JSON, tokenizing, chat templates) off the event loop
MAX_HEAD_BYTES = 64 * 1024  # request line and headers (400 and closed beyond)
SHUTDOWN_S = 5.0  # open streams get this long to finish (they are failed with 503 first)


def _missing_extra() -> TurbosparkError:
    return TurbosparkError(
        "turbospark serve needs uvicorn and starlette, which are not installed; "
        "install the serve extra: pip install 'turbospark[serve]'"
    )


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        msg = f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port or --host"
        raise TurbosparkError(msg) from None
    sock.setblocking(False)
    return sock


class Server:
    """An OpenAI-compatible HTTP server over one install.

    The event loop answers HTTP, a few threads validate requests, one worker
    thread (see :class:`~turbospark_core.server.scheduler.Scheduler`) runs the model.

    Args:
        opener: Builds the Runner; called on the worker thread.
        model_id: The name ``/v1/models`` lists and responses carry.
        host: Address to bind (loopback by default).
        port: TCP port; 0 picks a free one (see :attr:`port`).
        max_body: Largest request body accepted, in bytes (413 beyond).
        max_queue: Most requests waiting for a session slot (429 with Retry-After beyond).
        max_batch: Most requests decoding in one forward (default: every session slot).
        max_connections: Most open connections; a request on one beyond gets
            503 with Retry-After (the others are not disturbed).
        header_timeout: Seconds a connection has to send a request head (closed after).
        body_timeout: Seconds a request has to send its body once its head has arrived (408 after).
        write_timeout: Seconds a streaming client may read nothing before it is dropped (its row freed).
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
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        header_timeout: float = HEADER_TIMEOUT_S,
        body_timeout: float = BODY_TIMEOUT_S,
        write_timeout: float = WRITE_TIMEOUT_S,
        steering_sets: dict[str, Any] | None = None,
        verbose: bool = False,
    ) -> None:
        try:
            import uvicorn

            from turbospark_core.server.transport import ConnectionLimits, protocol_class
        except ImportError:
            raise _missing_extra() from None
        self.model_id = model_id
        self.max_body = max_body
        self._sock = _listen(host, port)  # bind first: a busy port fails before the slow open
        self.metrics = server_metrics()
        self.scheduler = Scheduler(opener, max_queue=max_queue, max_batch=max_batch, observer=self.metrics)
        try:
            self.runner = self.scheduler.start()
        except BaseException:
            self._sock.close()
            raise
        self.metrics.bind(self.scheduler)
        self.created = int(time.time())
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="turbospark-parse")
        ready = threading.Barrier(PARSE_THREADS)  # start every pool thread now: the thread count stays flat
        for started in [self._pool.submit(ready.wait, 30.0) for _ in range(PARSE_THREADS)]:
            started.result()
        try:
            self.facts: ModelFacts = _facts(self.runner, model_id, steering_sets or {})
        except BaseException:
            self.close()
            raise
        limits = Limits(max_body=max_body, body_timeout=body_timeout, write_timeout=write_timeout)
        conn_limits = ConnectionLimits(max_connections=max_connections, header_timeout=header_timeout)
        config = uvicorn.Config(
            build_app(self, limits, self._pool),
            http=protocol_class(conn_limits),
            lifespan="off",
            log_config=None,
            access_log=verbose,
            timeout_keep_alive=int(KEEP_ALIVE_S),
            timeout_graceful_shutdown=int(SHUTDOWN_S),
            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
            server_header=False,
        )
        self._uvicorn = uvicorn.Server(config)

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
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        header_timeout: float = HEADER_TIMEOUT_S,
        body_timeout: float = BODY_TIMEOUT_S,
        write_timeout: float = WRITE_TIMEOUT_S,
        model_id: str | None = None,
        steering_sets: dict[str, Any] | None = None,
        verbose: bool = False,
        **open_options: Any,
    ) -> Server:
        """Open ``install`` (with :func:`turbospark_core.open` options such as ``session_slots``) and bind."""
        import turbospark_core

        name = model_id or Path(install).resolve().name

        def opener() -> Runner:
            return turbospark_core.open(install, **open_options)

        if open_options.get("distributed") is not None:  # rank 0 of a group: the other ranks repeat its work
            from turbospark_core.distributed.mirror import leading

            opener = leading(opener)
        return cls(
            opener,
            model_id=name,
            host=host,
            port=port,
            max_body=max_body,
            max_queue=max_queue,
            max_batch=max_batch,
            max_connections=max_connections,
            header_timeout=header_timeout,
            body_timeout=body_timeout,
            write_timeout=write_timeout,
            steering_sets=steering_sets,
            verbose=verbose,
        )

    @property
    def port(self) -> int:
        """The bound TCP port."""
        return int(self._sock.getsockname()[1])

    @property
    def url(self) -> str:
        """``http://host:port`` (append ``/v1`` for an OpenAI client's base URL)."""
        host = str(self._sock.getsockname()[0])
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
        """Serve on this thread until :meth:`close`, Ctrl-C or SIGTERM."""
        try:
            asyncio.run(self._uvicorn.serve(sockets=[self._sock]))
        finally:
            self.close()

    def start(self) -> Server:
        """Serve on a background thread; returns ``self`` once it accepts connections."""
        self._thread = threading.Thread(target=self._run_in_thread, name="turbospark-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30.0
        while not self._uvicorn.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._uvicorn.started:
            self.close()
            raise TurbosparkError("the HTTP server did not start within 30 s")
        return self

    def _run_in_thread(self) -> None:
        asyncio.run(self._uvicorn.serve(sockets=[self._sock]))

    def close(self) -> None:
        """Stop accepting, fail what is in flight with 503, stop the worker."""
        self.scheduler.stop()  # in-flight requests get their 503 first, so open streams end
        if getattr(self, "runner", None) is not None:
            self.runner.close()  # after the worker: rank 0 of a group tells the others to stop
        server = getattr(self, "_uvicorn", None)
        if server is not None:
            server.should_exit = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(SHUTDOWN_S + 10.0)
            self._thread = None
        self._sock.close()
        self._pool.shutdown(wait=False)

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
    server = Server.from_install(install, verbose=verbose, **options)
    print(
        f"turbospark: serving {server.model_id!r} at {server.url}/v1 "
        f"({server.runner.sessions.slots} session slots, max context {server.runner.max_context})",
        file=sys.stderr,
        flush=True,
    )
    if threading.current_thread() is threading.main_thread():
        # uvicorn stops gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler it found
        signal.signal(signal.SIGTERM, _interrupt)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
