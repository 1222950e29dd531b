"""Installs without a chat template chat in harmony; installs with one keep it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import turbospark_core
from turbospark_core.convert import convert
from turbospark_core.errors import TokenizerError

from turbospark_gptoss import harmony


@pytest.fixture(scope="module")
def untemplated(turbospark_fixtures: Path, tmp_path_factory: pytest.TempPathFactory) -> turbospark_core.Runner:
    root = tmp_path_factory.mktemp("gpt_oss-no-template")
    src = root / "src"
    shutil.copytree(turbospark_fixtures / "gpt_oss", src, ignore=shutil.ignore_patterns("bf16", "references.npz"))
    config = json.loads((src / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    convert(src, root / "install")
    return turbospark_core.open(root / "install")


def _rendered(runner: turbospark_core.Runner, messages: list[dict[str, Any]]) -> str:
    return runner.tokenizer.decode(runner.chat_prompt(messages), skip_special_tokens=False)


def test_harmony_is_the_default_template(untemplated: turbospark_core.Runner) -> None:
    text = _rendered(
        untemplated,
        [
            {"role": "system", "content": "Reasoning: low"},
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": "Hi"},
        ],
    )
    assert text == (
        "<|bos|><|start|>system<|message|>Reasoning: low<|end|>"
        "<|start|>developer<|message|>Answer briefly.<|end|>"
        "<|start|>user<|message|>Hi<|end|><|start|>assistant"
    )


def test_assistant_turns_carry_channels(untemplated: turbospark_core.Runner) -> None:
    text = _rendered(
        untemplated,
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "thinking": "Add them.", "content": "4"},
            {"role": "tool", "name": "calc", "content": "4"},
            {"role": "user", "content": "Sure?"},
        ],
    )
    assert text == (
        "<|bos|><|start|>user<|message|>2+2?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Add them.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>4<|end|>"
        "<|start|>functions.calc to=assistant<|channel|>commentary<|message|>4<|end|>"
        "<|start|>user<|message|>Sure?<|end|><|start|>assistant"
    )


def test_chat_generates_through_harmony(untemplated: turbospark_core.Runner) -> None:
    reply = untemplated.chat([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0.0)
    assert len(reply.tokens) == 4 or reply.finish_reason == "stop"


def test_unknown_role_refused_by_name(untemplated: turbospark_core.Runner) -> None:
    with pytest.raises(TokenizerError, match="narrator"):
        untemplated.chat_prompt([{"role": "narrator", "content": "Once"}])


def test_own_template_wins(turbospark_install: Any) -> None:
    runner = turbospark_core.open(turbospark_install("gpt_oss", "float32"))
    text = _rendered(runner, [{"role": "user", "content": "Hi"}])
    assert text == "<|bos|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert runner.tokenizer.chat_template != harmony.TEMPLATE
