"""Client bounds of ``turbospark serve`` (issue 20): connections, header deadline, body time and size, JSON depth."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from turbospark_core.server import Server
from turbospark_core.server.app import MAX_JSON_DEPTH, json_depth_exceeds

GOOD = json.dumps({"prompt": "hello there", "max_tokens": 2, "temperature": 0}).encode()


@pytest.fixture(scope="module")
def server(turbospark_install: Any) -> Iterator[Server]:
    install: Path = turbospark_install("llama", "float32")
    srv = Server.from_install(
        install, port=0, session_slots=2, max_connections=4, header_timeout=1.0, body_timeout=1.0, max_body=4096
    ).start()
    yield srv
    srv.close()


def _connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _head(length: int | None = None, extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else ""
    return f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{size}{extra}\r\n".encode()


def _reply(sock: socket.socket) -> bytes:
    data = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def _json(reply: bytes) -> dict[str, Any]:
    return json.loads(reply.split(b"\r\n\r\n", 1)[1])


def _good(server: Server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=GOOD)
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    resp.read()
    conn.close()


def _wait_for_connections(server: Server, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(server._uvicorn.server_state.connections) > n and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_connection_past_the_cap_gets_503_with_retry_after(turbospark_install: Any) -> None:
    install: Path = turbospark_install("llama", "float32")
    with Server.from_install(install, port=0, session_slots=2, max_connections=4, header_timeout=30.0).start() as srv:
        _check_the_cap(srv)


def _check_the_cap(server: Server) -> None:
    held = [_connect(server) for _ in range(4)]
    try:
        time.sleep(0.1)
        extra = _connect(server)
        extra.sendall(_head(len(GOOD)) + GOOD)
        reply = _reply(extra)
        extra.close()
        assert _status(reply) == 503, reply[:300]
        assert b"\r\nretry-after: 1\r\n" in reply.lower()
        assert _json(reply)["error"]["code"] == "too_many_connections"
        held[0].sendall(_head(len(GOOD)) + GOOD)  # the connections already open are not disturbed
        first = held[0].recv(65536)
        assert _status(first) == 200, first[:300]
    finally:
        for sock in held:
            sock.close()
    _wait_for_connections(server, 0)
    _good(server)


def test_a_request_head_trickled_past_the_deadline_is_dropped(server: Server) -> None:
    _wait_for_connections(server, 0)
    sock = _connect(server)
    t0 = time.monotonic()
    closed = False
    head = _head(len(GOOD))
    for i in range(len(head) - 2):  # one byte every 0.1 s: never a whole head within 1 s
        try:
            sock.sendall(head[i : i + 1])
        except OSError:
            closed = True
            break
        time.sleep(0.1)
        if time.monotonic() - t0 > 5:
            break
    if not closed:
        closed = _reply(sock) == b""
    sock.close()
    assert closed and time.monotonic() - t0 < 5
    _good(server)


def test_idle_keep_alive_outlives_the_head_deadline_but_a_trickled_next_head_does_not(server: Server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    for _ in range(2):  # idle for longer than header_timeout between requests: still served (keep-alive)
        conn.request("POST", "/v1/completions", body=GOOD)
        resp = conn.getresponse()
        assert resp.status == 200
        resp.read()
        time.sleep(1.3)
    sock = conn.sock
    assert sock is not None
    t0 = time.monotonic()
    closed = False
    for byte in _head(len(GOOD))[:-2]:  # the next head, one byte every 0.1 s
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            closed = True
            break
        time.sleep(0.1)
        if time.monotonic() - t0 > 5:
            break
    closed = closed or _reply(sock) == b""
    conn.close()
    assert closed and time.monotonic() - t0 < 5


def test_a_body_that_stalls_gets_408(server: Server) -> None:
    sock = _connect(server)
    sock.sendall(_head(100) + b'{"prompt": ')
    t0 = time.monotonic()
    reply = _reply(sock)
    sock.close()
    assert _status(reply) == 408 and time.monotonic() - t0 < 5, reply[:300]
    assert _json(reply)["error"]["code"] == "request_timeout"
    _good(server)


def test_chunked_bodies_are_bounded_too(server: Server) -> None:
    def chunked(body: bytes) -> bytes:
        return _head(None, "Transfer-Encoding: chunked\r\n") + b"%X\r\n%s\r\n0\r\n\r\n" % (len(body), body)

    sock = _connect(server)
    sock.sendall(chunked(GOOD))
    ok = sock.recv(65536)
    sock.close()
    assert _status(ok) == 200, ok[:300]
    sock = _connect(server)
    sock.sendall(chunked(b" " * 5000 + GOOD))
    reply = _reply(sock)
    sock.close()
    assert _status(reply) == 413 and _json(reply)["error"]["code"] == "request_too_large"


def test_a_body_without_a_length_gets_411(server: Server) -> None:
    sock = _connect(server)
    sock.sendall(_head(None, "Connection: close\r\n"))
    reply = _reply(sock)
    sock.close()
    assert _status(reply) == 411 and _json(reply)["error"]["code"] == "length_required"


def test_too_many_headers_get_431(server: Server) -> None:
    extra = "".join(f"X-{i}: v\r\n" for i in range(120))
    sock = _connect(server)
    sock.sendall(_head(len(GOOD), extra) + GOOD)
    reply = _reply(sock)
    sock.close()
    assert _status(reply) == 431 and "error" in _json(reply)


def test_json_depth_counts_brackets_outside_strings() -> None:
    deep = b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1)
    assert json_depth_exceeds(deep)
    assert not json_depth_exceeds(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH)
    in_string = json.dumps({"prompt": "[" * 500 + '\\"{' * 100}).encode()
    assert not json_depth_exceeds(in_string)
    wide = json.dumps({"prompt": [[1]] * 1000}).encode()  # many brackets, shallow
    assert not json_depth_exceeds(wide)


def test_a_deep_body_is_refused_by_name(server: Server) -> None:
    depth = MAX_JSON_DEPTH + 4
    nested = '{"prompt": "x", "stop": ' + "[" * depth + "]" * depth + "}"
    sock = _connect(server)
    sock.sendall(_head(len(nested), "Connection: close\r\n") + nested.encode())
    reply = _reply(sock)
    sock.close()
    assert _status(reply) == 400 and "deeper than" in _json(reply)["error"]["message"]


def test_a_stream_nobody_reads_is_dropped() -> None:
    """A client that stops reading (the send never completes) is cut off after ``write_timeout``; its job cancelled."""
    import asyncio
    from types import SimpleNamespace

    from turbospark_core.server.app import ClientGoneError, _SSEResponse, _SSEStream
    from turbospark_core.server.protocol import GenerationRequest
    from turbospark_core.server.scheduler import PIECE, Job, Piece

    req = GenerationRequest(kind="completion", prompt=[1], max_tokens=4, sampling={}, stream=True)
    job = Job(req)
    fake_server = SimpleNamespace(model_id="m", facts=SimpleNamespace(decode=lambda ids: "x"))
    sent: list[str] = []

    async def stalled_send(message: Any) -> None:
        sent.append(message["type"])
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()  # the client's window is full: never drains

    async def run() -> float:
        inbox: asyncio.Queue[Any] = asyncio.Queue()
        watcher = asyncio.ensure_future(asyncio.Event().wait())
        stream = _SSEStream(fake_server, job, inbox, (PIECE, Piece("a")), write_timeout=0.3)  # type: ignore[arg-type]
        t0 = time.monotonic()
        with pytest.raises(ClientGoneError):
            await _SSEResponse(stream, watcher)({}, None, stalled_send)  # type: ignore[arg-type]
        await asyncio.sleep(0)
        assert watcher.cancelled()
        return time.monotonic() - t0

    took = asyncio.run(run())
    assert 0.3 <= took < 2.0 and job.cancelled and sent == ["http.response.start", "http.response.body"]


def test_serving_without_the_serve_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from turbospark_core.errors import TurbosparkError

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed
    with pytest.raises(TurbosparkError, match=r"pip install 'turbospark\[serve\]'"):
        Server(lambda: None, model_id="m", port=0)  # type: ignore[arg-type, return-value]
