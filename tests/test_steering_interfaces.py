"""Steering through the CLI (generate/chat/serve flags, `steer compute`), the server's `steering` field and inspect."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import turbospark_core
from turbospark_core.cli import main
from turbospark_core.server import Server
from turbospark_core.steering import DirectionSet, difference_of_means

HIDDEN = 64


def _unit(seed: int) -> np.ndarray:
    d = np.random.default_rng(seed).standard_normal(HIDDEN).astype(np.float32)
    return d / np.linalg.norm(d)


@pytest.fixture(scope="module")
def install(turbospark_install: Any) -> Path:
    return turbospark_install("llama", "float32")


@pytest.fixture(scope="module")
def reference(install: Path) -> turbospark_core.Runner:
    return turbospark_core.open(install)


@pytest.fixture(scope="module")
def strong(reference: turbospark_core.Runner) -> DirectionSet:
    """An addition strong enough to change the greedy continuation of every prompt used here."""
    return DirectionSet.from_arrays({0: _unit(11)}, mode="add", scale=2.0, model_type="llama")


@pytest.fixture(scope="module")
def set_file(strong: DirectionSet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return strong.save(tmp_path_factory.mktemp("sets") / "strong.safetensors")


PROMPT = [5, 17, 99, 230, 41, 7]


def test_the_edit_changes_the_greedy_continuation(reference, strong) -> None:
    plain = reference.generate(PROMPT, max_tokens=8, temperature=0.0).tokens
    assert reference.generate(PROMPT, max_tokens=8, temperature=0.0, steering=strong).tokens != plain


# ------------------------------------------------------------------ CLI
def test_cli_generate_with_steering_flags(install, set_file, reference, strong, capsys) -> None:
    prompt = reference.tokenizer.decode(PROMPT)
    ids = reference.tokenizer.encode(prompt)
    want = reference.generate(ids, max_tokens=6, temperature=0.0, steering=strong.with_scale(1.0)).text
    assert main(["generate", str(install), prompt, "--max-tokens", "6", "--steering", str(set_file),
                 "--steering-scale", "1"]) == 0  # fmt: skip
    assert capsys.readouterr().out == want + "\n"
    plain = reference.generate(ids, max_tokens=6, temperature=0.0).text
    # a layer range that keeps none of the set's layers is refused; one that keeps layer 0 applies it
    assert main(["generate", str(install), prompt, "--max-tokens", "6", "--steering", str(set_file),
                 "--steering-layers", "1:2"]) == 2  # fmt: skip
    assert "keep none of the set's layers [0]" in capsys.readouterr().err
    assert main(["generate", str(install), prompt, "--max-tokens", "6", "--steering", str(set_file),
                 "--steering-scale", "0"]) == 0  # fmt: skip
    assert capsys.readouterr().out == plain + "\n"


def test_cli_steering_refusals(install, tmp_path, capsys) -> None:
    assert main(["generate", str(install), "hi", "--steering-scale", "2"]) == 2
    assert "need --steering FILE" in capsys.readouterr().err
    assert main(["chat", str(install), "hi", "--steering", str(tmp_path / "none.safetensors")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = DirectionSet.from_arrays({5: _unit(1)}, mode="add").save(tmp_path / "deep.safetensors")
    assert main(["chat", str(install), "hi", "--steering", str(bad)]) == 2
    assert "steers layer 5 but the model has 2 decoder layers" in capsys.readouterr().err
    assert main(["serve", str(install), "--steering-set", "oops"]) == 2
    assert "--steering-set 'oops' is invalid; write NAME=FILE" in capsys.readouterr().err


def test_cli_inspect_shows_the_steering_answer(install, capsys) -> None:
    assert main(["inspect", str(install)]) == 0
    assert "steering     applied at decoder-layer outputs" in capsys.readouterr().out


def test_cli_steer_compute(install, tmp_path, reference, capsys) -> None:
    pos = tmp_path / "pos.txt"
    neg = tmp_path / "neg.txt"
    pos.write_text("\n".join(["w10 w11 w12 w13", "w10 w11 w14", "w10 w15 w12", ""]))
    neg.write_text("\n".join(["w200 w201 w202", "w200 w203 w204 w205", "w206 w201"]))
    out = tmp_path / "set.safetensors"
    assert main(["steer", "compute", str(install), "--positive", str(pos), "--negative", str(neg), "-o", str(out),
                 "--mode", "add", "--layers", "0:2"]) == 0  # fmt: skip
    report = capsys.readouterr().out
    assert "wrote" in report and "best separated: layer" in report and report.count("%") == 2
    made = DirectionSet.load(out)
    assert made.mode == "add" and made.layers == (0, 1) and made.model_type == "llama"
    # the same numbers from the Python API
    p = reference.capture(pos.read_text().split("\n")[:3], steering=False)
    n = reference.capture(neg.read_text().split("\n"), steering=False)
    want, rows = difference_of_means(p, n, [0, 1], mode="add")
    assert np.allclose(made.directions[1], want.directions[1], atol=1e-6) and abs(made.scale - want.scale) < 1e-4
    assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in made.directions.values())
    assert [r.layer for r in rows] == [0, 1] and all(0.0 <= r.accuracy <= 1.0 for r in rows)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    argv = ["steer", "compute", str(install), "--positive", str(empty), "--negative", str(neg), "-o", str(out)]
    assert main(argv) == 2
    assert "has no prompts" in capsys.readouterr().err


# ------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def server(install: Path, set_file: Path, strong: DirectionSet) -> Iterator[Server]:
    other = DirectionSet.from_arrays({1: _unit(12)}, mode="ablate")
    srv = Server.from_install(install, port=0, session_slots=4, steering_sets={"strong": strong, "flat": other}).start()
    yield srv
    srv.close()


def _post(server: Server, body: dict[str, Any]) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    headers = {"Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers=headers)
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def _complete(server: Server, **extra: Any) -> tuple[int, Any]:
    return _post(server, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **extra})


def test_models_entry_reports_steering(server: Server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/v1/models")
    card = json.loads(conn.getresponse().read())["data"][0]
    assert card["steering"] == {"supported": True, "refusal": None, "sets": ["flat", "strong"], "default": None}


def test_concurrent_requests_each_get_their_own_steering(server: Server, reference, strong) -> None:
    want = {
        "strong": reference.generate(PROMPT, max_tokens=8, temperature=0.0, steering=strong).text,
        "half": reference.generate(PROMPT, max_tokens=8, temperature=0.0, steering=strong.with_scale(1.0)).text,
        None: reference.generate(PROMPT, max_tokens=8, temperature=0.0).text,
    }
    asks: dict[Any, dict[str, Any]] = {"strong": {"steering": "strong"},
                                       "half": {"steering": {"name": "strong", "scale": 1.0}}, None: {}}  # fmt: skip
    got: dict[Any, list[str]] = {k: [] for k in asks}

    def ask(key: Any) -> None:
        status, body = _complete(server, **asks[key])
        assert status == 200, body
        got[key].append(body["choices"][0]["text"])

    threads = [threading.Thread(target=ask, args=(k,)) for k in list(asks) * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {k: set(v) for k, v in got.items()} == {k: {v} for k, v in want.items()}
    assert len(set(want.values())) == 3  # the three edits differ


@pytest.mark.parametrize(
    ("steering", "match"),
    [
        ("nope", "names no registered direction set 'nope'; registered: flat, strong"),
        (3, "Invalid type for 'steering'"),
        ({"name": "strong", "scale": "big"}, "Invalid type for 'scale'"),
        ({"name": "strong", "layers": "0:1"}, "Invalid type for 'steering'"),
    ],
)
def test_bad_steering_fields_are_400(server: Server, steering: Any, match: str) -> None:
    status, body = _complete(server, steering=steering)
    assert status == 400 and match in body["error"]["message"]


def test_server_refuses_sets_that_do_not_fit(install: Path) -> None:
    from turbospark_core.steering import DirectionMismatchError

    with pytest.raises(DirectionMismatchError, match="steers layer 9"):
        deep = DirectionSet.from_arrays({9: _unit(1)}, mode="add")
        Server.from_install(install, port=0, steering_sets={"deep": deep})


def test_server_default_set_and_opting_out(install: Path, set_file: Path, strong, reference) -> None:
    with Server.from_install(install, port=0, steering=strong, steering_sets={"strong": strong}).start() as srv:
        assert _complete(srv)[1]["choices"][0]["text"] == reference.generate(
            PROMPT, max_tokens=8, temperature=0.0, steering=strong
        ).text
        assert _complete(srv, steering=False)[1]["choices"][0]["text"] == reference.generate(
            PROMPT, max_tokens=8, temperature=0.0
        ).text
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("GET", "/v1/models")
        assert json.loads(conn.getresponse().read())["data"][0]["steering"]["default"] == "strong"
