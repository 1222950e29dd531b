"""``turbospark serve`` with a vision sidecar: ``image_url`` data URLs in chat messages; bad images are 400s."""

from __future__ import annotations

import base64
import http.client
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import turbospark_core
from turbospark_core.server import Server

Made = Callable[[str], tuple[Path, Path]]


@pytest.fixture(scope="module")
def pair(turbospark_vision_install: Made) -> tuple[Path, Path]:
    return turbospark_vision_install("qwen3_vl")


@pytest.fixture(scope="module")
def server(pair: tuple[Path, Path]) -> Iterator[Server]:
    srv = Server.from_install(pair[0], port=0, session_slots=2, vision=pair[1]).start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def data_url(turbospark_fixtures: Path) -> str:
    png = (turbospark_fixtures / "qwen3_vl" / "image_0.png").read_bytes()
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _post(server: Server, body: dict[str, Any]) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    headers = {"Content-Type": "application/json"}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(), headers=headers)
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    conn.close()
    return resp.status, payload


def _ask(url: str) -> list[dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what?"}]
    return [{"role": "user", "content": parts}]


def test_image_url_data_urls_answer_as_the_runner_does(server: Server, pair: tuple[Path, Path], data_url: str) -> None:
    status, body = _post(server, {"messages": _ask(data_url), "max_tokens": 5, "temperature": 0})
    assert status == 200, body
    reference = turbospark_core.open(pair[0], vision=pair[1]).chat(_ask(data_url), max_tokens=5)
    assert body["choices"][0]["message"]["content"] == reference.text
    assert body["usage"]["prompt_tokens"] == reference.stats.prompt_tokens  # the expanded prompt


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("https://example.com/cat.png", "remote image URL"),
        ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "cannot be decoded"),
        ("data:image/png;base64,@@@", "malformed"),
    ],
)
def test_bad_images_are_400s_and_nothing_is_disturbed(server: Server, data_url: str, url: str, match: str) -> None:
    status, body = _post(server, {"messages": _ask(url), "max_tokens": 2})
    assert status == 400 and match in body["error"]["message"], body
    assert _post(server, {"messages": _ask(data_url), "max_tokens": 2})[0] == 200


def test_an_image_part_without_a_url_is_a_400(server: Server) -> None:
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 3}}]}]
    status, body = _post(server, {"messages": bad, "max_tokens": 2})
    assert status == 400 and "image_url.url" in body["error"]["message"]


def test_an_image_to_a_text_only_server_is_a_400(pair: tuple[Path, Path], data_url: str) -> None:
    srv = Server.from_install(pair[0], port=0, session_slots=1).start()
    try:
        status, body = _post(srv, {"messages": _ask(data_url), "max_tokens": 2})
        assert status == 400 and "no vision tower" in body["error"]["message"]
    finally:
        srv.close()


def test_a_session_reuses_its_prefix_only_with_the_same_image(
    server: Server, data_url: str, turbospark_fixtures: Path
) -> None:
    import io

    import numpy as np
    from PIL import Image

    flipped_png = io.BytesIO()
    pixels = np.array(Image.open(turbospark_fixtures / "qwen3_vl" / "image_0.png"))
    Image.fromarray(pixels[::-1]).save(flipped_png, "PNG")
    other = "data:image/png;base64," + base64.b64encode(flipped_png.getvalue()).decode()
    base = {"max_tokens": 2, "temperature": 0, "session_id": "pictures"}
    status, first = _post(server, {**base, "messages": _ask(data_url)})
    assert status == 200
    follow = [*_ask(data_url), first["choices"][0]["message"], {"role": "user", "content": "and?"}]
    status, again = _post(server, {**base, "messages": follow})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > first["usage"]["prompt_tokens"] - 1
    swapped = [*_ask(other), *follow[1:]]
    status, body = _post(server, {**base, "messages": swapped})
    assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] < 10  # stops at the image
