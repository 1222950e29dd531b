"""Speculative decoding through the CLI (generate/chat/inspect flags) and `turbospark serve`."""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

import turbospark_core
from turbospark_core.cli import main
from turbospark_core.server import Server

PROMPT = "hello there my friend"


def test_inspect_says_which_drafter_is_open(f32_install: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(f32_install)]) == 0
    assert "drafter      none (plain decoding)" in capsys.readouterr().out
    assert main(["inspect", str(f32_install), "--ngram", "3"]) == 0
    assert "drafter      ngram (prompt lookup, up to 3 tokens per verify)" in capsys.readouterr().out
    assert main(["inspect", str(f32_install), "--draft-model", str(f32_install), "--num-draft-tokens", "2"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("drafter"))
    assert f"draft_model {f32_install} (llama, up to 2 tokens per verify" in line


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_generate_and_chat_with_a_drafter_print_plain_decodings_text(
    f32_install: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    assert main([command, str(f32_install), PROMPT, "--max-tokens", "24"]) == 0
    plain = capsys.readouterr().out
    flags = ["--draft-model", str(f32_install), "--num-draft-tokens", "3", "-v"]
    assert main([command, str(f32_install), PROMPT, "--max-tokens", "24", *flags]) == 0
    got = capsys.readouterr()
    assert got.out == plain
    assert "drafted tokens accepted (100%)" in got.err


def test_two_drafter_flags_are_one_error_line(f32_install: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", str(f32_install), PROMPT, "--ngram", "2", "--draft-model", str(f32_install)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "name two speculative drafters" in err[-1]


def test_serve_with_a_drafter_keeps_batching_and_answers_as_plain_decoding(
    f32_install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from turbospark_core.batch import Batch

    verified: list[int] = []  # rows per batched verify
    real = Batch._verify

    def spy(self: Batch, out: Any, plans: Any, width: int, t0: float, c0: float) -> None:
        verified.append(len(plans))
        real(self, out, plans, width, t0, c0)

    monkeypatch.setattr(Batch, "_verify", spy)
    reference = turbospark_core.open(f32_install)
    srv = Server.from_install(f32_install, port=0, session_slots=3, draft_model=f32_install, num_draft_tokens=3).start()
    try:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        prompts = [PROMPT, "the quick brown fox", "one two three four"]
        want = [reference.generate(p, 20).text for p in prompts]
        alone = client.completions.create(model="m", prompt=prompts[0], max_tokens=20, temperature=0)
        assert alone.choices[0].text == want[0]
        got: dict[int, str] = {}

        def ask(i: int) -> None:
            r = client.completions.create(model="m", prompt=prompts[i], max_tokens=20, temperature=0)
            got[i] = r.choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [got[i] for i in range(3)] == want
        assert max(verified) >= 2  # concurrent requests were verified together, in one forward
        stream = client.completions.create(model="m", prompt=prompts[1], max_tokens=20, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream) == want[1]
        with urllib.request.urlopen(f"{srv.url}/metrics", timeout=30) as answer:
            metrics = answer.read().decode()
        drafted = next(line for line in metrics.splitlines() if line.startswith("turbospark_draft_tokens_total"))
        accepted = next(
            line for line in metrics.splitlines() if line.startswith("turbospark_accepted_draft_tokens_total")
        )
        assert float(drafted.split()[-1]) == float(accepted.split()[-1]) > 0  # drafting for itself: all kept
    finally:
        srv.close()


def test_serve_flags_reach_the_open(f32_install: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_serve(path: str, **kwargs: Any) -> None:
        seen.update(kwargs)

    monkeypatch.setattr("turbospark_core.server.serve", fake_serve)
    assert main(["serve", str(f32_install), "--ngram", "5", "--num-draft-tokens", "3"]) == 0
    assert seen["ngram"] == 5 and seen["num_draft_tokens"] == 3
