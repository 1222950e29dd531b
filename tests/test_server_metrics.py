"""GET /metrics: Prometheus text that parses, and counters that move by exactly what N known requests did."""

from __future__ import annotations

import http.client
import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from turbospark_core.server import Server
from turbospark_core.server.metrics import NullMetrics, ServerMetrics, server_metrics


@pytest.fixture(scope="module")
def server(turbospark_install: Any) -> Iterator[Server]:
    srv = Server.from_install(
        turbospark_install("qwen3_moe"), port=0, session_slots=2, residency="streamed", expert_slots=4
    ).start()
    yield srv
    srv.close()


def call(server: Server, method: str, path: str, body: Any = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request(
        method, path, body=None if body is None else json.dumps(body), headers={"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, {k.title(): v for k, v in resp.getheaders()}, data


def scrape(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, keyed by (name, sorted labels); parsed with prometheus_client's parser."""
    status, headers, data = call(server, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(data.decode())
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_counters_move_by_exactly_the_requests_made(server: Server) -> None:
    before = scrape(server)
    usages = []
    for prompt in ("hello there", "hello there my friend", "a different start"):
        status, _, body = call(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0})
        assert status == 200
        usages.append(json.loads(body)["usage"])
    assert call(server, "GET", "/no/such/route")[0] == 404
    assert call(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": -1})[0] == 400
    after = scrape(server)

    assert delta(before, after, "turbospark_requests_total", endpoint="/v1/completions", status="200") == 3
    assert delta(before, after, "turbospark_requests_total", endpoint="/v1/completions", status="400") == 1
    assert delta(before, after, "turbospark_requests_total", endpoint="other", status="404") == 1
    assert delta(before, after, "turbospark_requests_total", endpoint="/metrics", status="200") == 1  # the first scrape
    assert delta(before, after, "turbospark_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta(before, after, "turbospark_completion_tokens_total") == sum(u["completion_tokens"] for u in usages)
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached[1] > 0  # the second prompt extends the first: its parked session is reused
    assert delta(before, after, "turbospark_reused_prompt_tokens_total") == sum(cached)
    assert delta(before, after, "turbospark_session_slot_hits_total") == sum(c > 0 for c in cached)
    assert delta(before, after, "turbospark_time_to_first_token_seconds_count") == 3
    assert delta(before, after, "turbospark_generations_total", outcome="completed") == 3
    assert value(after, "turbospark_queue_depth") == 0 and value(after, "turbospark_active_rows") == 0
    assert value(after, "turbospark_kv_cache_bytes") > 0
    stats = server.runner.expert_stats()
    assert value(after, "turbospark_expert_cache_hits_total") == stats.hits
    assert value(after, "turbospark_expert_cache_misses_total") == stats.misses
    assert value(after, "turbospark_expert_cache_hit_rate") == pytest.approx(stats.hit_rate)


def test_streamed_pieces_feed_the_latency_histograms(server: Server) -> None:
    before = scrape(server)
    body = {"prompt": "tell me", "max_tokens": 6, "temperature": 0, "stream": True}
    status, _, data = call(server, "POST", "/v1/completions", body)
    assert status == 200
    events = [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: {")]
    pieces = sum(1 for e in events if e["choices"] and e["choices"][0].get("text"))
    after = scrape(server)
    assert pieces >= 2
    assert delta(before, after, "turbospark_time_to_first_token_seconds_count") == 1
    assert delta(before, after, "turbospark_inter_token_latency_seconds_count") == pieces - 1
    assert delta(before, after, "turbospark_inter_token_latency_seconds_bucket", le="+Inf") == pieces - 1
    assert delta(before, after, "turbospark_time_to_first_token_seconds_sum") > 0


def test_metrics_without_prometheus_client_answer_501_naming_the_extra(
    turbospark_install: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    assert type(server_metrics()) is NullMetrics
    with Server.from_install(turbospark_install("llama"), port=0).start() as srv:
        status, _, data = call(srv, "GET", "/metrics")
        assert status == 501
        assert "pip install 'turbospark[serve]'" in json.loads(data)["error"]["message"]
        assert call(srv, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200  # serving goes on


def test_with_prometheus_client_the_server_has_real_metrics(server: Server) -> None:
    assert type(server.metrics) is ServerMetrics and server.scheduler.observer is server.metrics
