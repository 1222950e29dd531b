"""The install's chat template drives ``Runner.chat`` exactly as transformers renders it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import turbospark_core

MESSAGES = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is the pressure doing?"},
        {"role": "assistant", "content": "It is falling quickly."},
        {"role": "user", "content": "Should the boats come home?"},
    ],
]


@pytest.mark.parametrize("messages", MESSAGES, ids=["one-turn", "multi-turn"])
def test_chat_prompt_matches_transformers(
    turbospark_install: Any, turbospark_fixtures: Path, messages: list[dict[str, str]]
) -> None:
    transformers = pytest.importorskip("transformers")
    fixture = turbospark_fixtures / "gemma4_e"
    want = transformers.AutoTokenizer.from_pretrained(str(fixture)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    runner = turbospark_core.open(turbospark_install("gemma4_e"))
    ids = runner.chat_prompt(messages)
    assert runner.tokenizer.decode(ids, skip_special_tokens=False) == want
    assert ids.count(runner.tokenizer.token_to_id("<|bos|>")) == 1


def test_chat_generates_through_the_template(turbospark_install: Any) -> None:
    runner = turbospark_core.open(turbospark_install("gemma4_e"))
    messages = MESSAGES[0]
    reply = runner.chat(messages, max_tokens=6, temperature=0.0)
    assert reply.tokens == runner.generate(runner.chat_prompt(messages), max_tokens=6, temperature=0.0).tokens
    assert 0 < len(reply.tokens) <= 6
