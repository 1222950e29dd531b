"""logprobs / top_logprobs on both endpoints, checked against log-softmax of the Runner's own full-sequence logits."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openai import OpenAI

import turbospark_core
from turbospark_core.runner import Runner
from turbospark_core.server import Server

PROMPT = "hello there my friend"
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
TOL = 1e-4  # float32 logits of a batched decode step vs a fresh full-sequence forward


@pytest.fixture(scope="module")
def install(turbospark_install: Any) -> Path:
    return turbospark_install("llama", "float32")


@pytest.fixture(scope="module")
def server(install: Path) -> Iterator[Server]:
    srv = Server.from_install(install, port=0, session_slots=4).start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def reference(install: Path) -> Runner:
    return turbospark_core.open(install)


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def expected_logprobs(
    runner: Runner, prompt: list[int], tokens: list[int], temperature: float = 0.0, penalty: float = 1.0
) -> list[np.ndarray]:
    """Per generated token, the sampler's distribution: penalized logits over the temperature, log-softmaxed."""
    logits = runner.logits(prompt + tokens[:-1])[len(prompt) - 1 :].astype(np.float64)
    out = []
    for i, row in enumerate(logits):
        row = row.copy()
        seen = np.unique(np.array((prompt + tokens[:i])[-64:]))
        row[seen] = np.where(row[seen] < 0, row[seen] * penalty, row[seen] / penalty)
        row /= temperature or 1.0
        out.append(row - np.log(np.exp(row - row.max()).sum()) - row.max())
    return out


def test_chat_logprobs_match_the_model_and_are_a_distribution(client: OpenAI, reference: Runner) -> None:
    got = client.chat.completions.create(
        model="m", messages=MESSAGES, temperature=0, max_tokens=8, logprobs=True, top_logprobs=5
    )
    want = reference.chat(MESSAGES, max_tokens=8)
    content = got.choices[0].logprobs.content
    assert len(content) == len(want.tokens) == got.usage.completion_tokens
    dists = expected_logprobs(reference, reference.chat_prompt(MESSAGES), want.tokens)
    for entry, token, dist in zip(content, want.tokens, dists, strict=True):
        assert entry.token == reference.tokenizer.decode([token])
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(dist[token], abs=TOL)
        top = [t.logprob for t in entry.top_logprobs]
        assert len(top) == 5 and top == sorted(top, reverse=True)
        assert top == pytest.approx(np.sort(dist)[::-1][:5].tolist(), abs=TOL)
        assert entry.logprob == pytest.approx(top[0], abs=TOL)  # greedy: the sampled token is the most likely
        assert sum(math.exp(v) for v in top) <= 1.0 + 1e-5


def test_sampled_logprobs_are_the_samplers_distribution(client: OpenAI, reference: Runner) -> None:
    """Temperature and repetition penalty shape what is reported (before top-k/top-p truncation)."""
    extra = {"repetition_penalty": 1.3, "top_k": 3}
    got = client.completions.create(
        model="m", prompt=PROMPT, temperature=0.7, seed=3, max_tokens=6, logprobs=2, extra_body=extra
    )
    lp = got.choices[0].logprobs
    ids = reference.tokenizer.encode(PROMPT)
    tokens = reference.generate(PROMPT, max_tokens=6, temperature=0.7, seed=3, repetition_penalty=1.3, top_k=3).tokens
    dists = expected_logprobs(reference, ids, tokens, temperature=0.7, penalty=1.3)
    assert lp.tokens == [reference.tokenizer.decode([t]) for t in tokens]
    assert lp.token_logprobs == pytest.approx([d[t] for d, t in zip(dists, tokens, strict=True)], abs=TOL)
    for top, dist in zip(lp.top_logprobs, dists, strict=True):
        assert sorted(top.values(), reverse=True)[0] == pytest.approx(dist.max(), abs=TOL)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def _sse(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    lines = conn.getresponse().read().decode().splitlines()
    conn.close()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_streamed_logprobs_concatenate_to_the_whole_answer(client: OpenAI, server: Server) -> None:
    body = {"model": "m", "messages": MESSAGES, "temperature": 0, "max_tokens": 10, "logprobs": True, "top_logprobs": 2}
    whole = client.chat.completions.create(**body).model_dump()["choices"][0]["logprobs"]["content"]
    chunks = _sse(server, "/v1/chat/completions", body)
    streamed = [e for c in chunks for e in ((c["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert streamed == whole
    cbody = {"model": "m", "prompt": PROMPT, "temperature": 0, "max_tokens": 10, "logprobs": 3}
    ref = client.completions.create(**cbody).choices[0].logprobs
    parts = [c["choices"][0]["logprobs"] for c in _sse(server, "/v1/completions", cbody)]
    parts = [p for p in parts if p]
    assert [t for p in parts for t in p["tokens"]] == ref.tokens
    assert [t for p in parts for t in p["text_offset"]] == ref.text_offset
    assert [t for p in parts for t in p["token_logprobs"]] == ref.token_logprobs


def test_no_logprobs_unless_asked(client: OpenAI) -> None:
    got = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=3)
    assert got.choices[0].logprobs is None
    zero = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=3, logprobs=0)
    assert zero.choices[0].logprobs.top_logprobs == [{}, {}, {}]


def test_rows_of_one_batch_report_their_own_logprobs(server: Server, reference: Runner) -> None:
    prompts = [PROMPT, "a different start", "the third one", "and a fourth"]
    out: dict[int, Any] = {}

    def ask(i: int) -> None:
        c = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        out[i] = c.completions.create(model="m", prompt=prompts[i], temperature=0, max_tokens=12, logprobs=1)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, prompt in enumerate(prompts):
        ids = reference.tokenizer.encode(prompt)
        tokens = reference.generate(prompt, max_tokens=12).tokens
        dists = expected_logprobs(reference, ids, tokens)
        got = out[i].choices[0].logprobs.token_logprobs
        assert got == pytest.approx([d[t] for d, t in zip(dists, tokens, strict=True)], abs=TOL)


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0])
def test_the_batch_engine_refuses_a_bad_logprobs_count(reference: Runner, bad: Any) -> None:
    from turbospark_core.errors import OptionError

    with pytest.raises(OptionError, match=r"logprobs=.* must be an integer in \[0, 20\]"):
        reference.batch().add(PROMPT, 2, logprobs=bad)
