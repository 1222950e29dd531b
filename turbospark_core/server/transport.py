"""Connection-level bounds of ``turbospark serve`` on uvicorn's h11 protocol: a connection cap and a header deadline.

* **Connection cap**: a connection opened while ``max_connections`` are
  already open gets its request answered 503 with ``Retry-After`` (OpenAI's
  error body, ``Connection: close``); connections already open are not
  touched. (Requests beyond the scheduler's queue get 429 from the scheduler.)
* **Header deadline** (slowloris): a connection must deliver a complete
  request head within ``header_timeout`` seconds of opening, or of the first
  byte of a later request; otherwise it is closed. (An idle keep-alive
  connection is closed by uvicorn's keep-alive timeout, which stops counting
  once any byte arrives: a client sending one header byte at a time would
  otherwise hold its connection for ever.) Request bodies are
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


def protocol_class(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with ``limits`` (pass it as ``uvicorn.Config(http=...)``)."""
    refuse = _over_capacity_app(limits.max_connections)

    class BoundedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _answered = False  # a response was sent on this connection
        _partial = False  # bytes of a request head arrived since the last response

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self.app = refuse
            self._arm()  # the first request's head is due within the deadline

        def data_received(self, data: bytes) -> None:
            if self._answered and not self._partial and self._waiting_for_head():
                self._partial = True
                self._arm()  # a later request's head is due within the deadline of its first byte
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._answered, self._partial = True, False
            self._disarm()  # idle now: uvicorn's keep-alive timeout applies

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(limits.header_timeout, self._head_overdue)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _waiting_for_head(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return cycle is None or bool(cycle.response_complete)

        def _head_overdue(self) -> None:
            self._deadline = None
            if self._waiting_for_head() and not self.transport.is_closing():
                self.transport.close()

    return BoundedH11Protocol
