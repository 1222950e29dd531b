"""Connection-level bounds of ``turbospark serve`` on uvicorn's h11 protocol: a connection cap and a header deadline.

* **Connection cap**: a connection opened while ``max_connections`` are
  already open gets its request answered 503 with ``Retry-After`` (OpenAI's
  error body, ``Connection: close``); connections already open are not
  touched. (Requests beyond the scheduler's queue get 429 from the scheduler.)
* **Header deadline** (slowloris): a connection must deliver a complete
  request head within ``header_timeout`` seconds of opening, or of its
  previous answer; otherwise it is closed. uvicorn's own keep-alive timeout
  stops counting once any byte arrives, so a client sending one header byte
  at a time would otherwise hold its connection for ever. Request bodies are
  bounded by the app (``body_timeout``), stalled readers of a stream by its
  ``write_timeout``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import attrs
from uvicorn.protocols.http.h11_impl import H11Protocol

RETRY_AFTER_S = 1  # what a 503 for too many connections asks a client to wait, in seconds


@attrs.frozen(kw_only=True)
class ConnectionLimits:
    """The bounds :func:`protocol_class` applies to each connection."""

    max_connections: int
    header_timeout: float


def _over_capacity_app(limit: int) -> Any:
    """An ASGI app answering 503 + Retry-After (too many open connections) and closing."""
    body = json.dumps(
        {
            "error": {
                "message": f"this server already holds {limit} open connections (--max-connections); retry later",
                "type": "server_error",
                "param": None,
                "code": "too_many_connections",
            }
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
        (b"connection", b"close"),
    ]

    async def refuse(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return refuse


def protocol_class(limits: ConnectionLimits, on_refused: Any = None) -> type[H11Protocol]:
    """uvicorn's h11 protocol with ``limits`` (pass it as ``uvicorn.Config(http=...)``)."""
    refuse = _over_capacity_app(limits.max_connections)

    class BoundedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self.app = refuse
                if on_refused is not None:
                    on_refused()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(limits.header_timeout, self._head_overdue)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _head_overdue(self) -> None:
            self._deadline = None
            cycle = getattr(self, "cycle", None)
            waiting_for_head = cycle is None or cycle.response_complete
            if waiting_for_head and not self.transport.is_closing():
                self.transport.close()

    return BoundedH11Protocol
