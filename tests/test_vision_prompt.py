"""Images in chat messages: parts, placeholder expansion, prefix-reuse keys, and the refusals of bad requests."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import turbospark_core
from turbospark_core.errors import ContextOverflowError
from turbospark_core.manifest import MANIFEST
from turbospark_core.runner import Runner
from turbospark_core.vision import prompt as prompt_module
from turbospark_core.vision.images import ImageError
from turbospark_core.vision.prompt import VisionPrompt, reusable, split_images
from turbospark_core.vision.sidecar import CHAT_TEMPLATE

Made = Callable[[str], tuple[Path, Path]]


@pytest.fixture
def pair(turbospark_vision_install: Made) -> tuple[Path, Path]:
    return turbospark_vision_install("qwen3_vl")


@pytest.fixture
def runner(pair: tuple[Path, Path]) -> Runner:
    return turbospark_core.open(pair[0], vision=pair[1])


@pytest.fixture
def image(turbospark_fixtures: Path) -> Path:
    return turbospark_fixtures / "qwen3_vl" / "image_0.png"


def _ask(*images: Any) -> list[dict[str, Any]]:
    parts = [*({"type": "image", "image": i} for i in images), {"type": "text", "text": "what?"}]
    return [{"role": "user", "content": parts}]


def test_split_images_keeps_text_and_reduces_image_parts() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "a"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "image", "image": "x.png"},
        ]},
    ]  # fmt: skip
    rendered, images = split_images(messages)
    assert rendered[0] is messages[0]
    assert rendered[1]["content"] == [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "image"}]
    assert images == [("data:image/png;base64,AAAA", "messages[1].content[1]"), ("x.png", "messages[1].content[2]")]
    with pytest.raises(ImageError, match=r"messages\[0\].content\[0\]: an 'image' part needs the image"):
        split_images([{"role": "user", "content": [{"type": "image"}]}])
    with pytest.raises(ImageError, match="'image_url' part needs"):
        split_images([{"role": "user", "content": [{"type": "image_url", "image_url": 3}]}])


def test_reusable_stops_at_the_first_image_that_differs() -> None:
    a, b = (10, "aa"), (40, "bb")
    assert reusable([a, b], [a, b], 90) == 90
    assert reusable([a, b], [a, (40, "cc")], 90) == 40
    assert reusable([a], [a, b], 90) == 40  # the state never held the second image
    assert reusable([a, b], [], 90) == 10  # a text-only prompt reuses nothing from the first image on
    assert reusable([], [], 90) == 90


def test_chat_input_expands_the_placeholders(runner: Runner, image: Path) -> None:
    prompt = runner.chat_input(_ask(image))
    assert isinstance(prompt, VisionPrompt)
    assert prompt.ids.count(7) == 20 and int(prompt.soft.sum()) == 20
    assert runner.chat_prompt(_ask(image)) == prompt.ids


def test_an_image_to_a_text_only_runner_is_refused(pair: tuple[Path, Path], image: Path) -> None:
    text_only = turbospark_core.open(pair[0])
    with pytest.raises(ImageError, match=r"content\[0\] is an image, but this runner has no vision tower"):
        text_only.chat(_ask(image), max_tokens=2)
    assert text_only.chat([{"role": "user", "content": "hi"}], max_tokens=2).tokens  # nothing else disturbed


def test_an_undecodable_image_is_refused_and_nothing_is_disturbed(runner: Runner, image: Path) -> None:
    before = runner.chat(_ask(image), max_tokens=3).tokens
    with pytest.raises(ImageError, match="cannot be decoded"):
        runner.chat(_ask(b"not a png"), max_tokens=3)
    with pytest.raises(ImageError, match="remote image URL"):
        runner.chat(_ask("https://example.com/cat.png"), max_tokens=3)
    assert runner.chat(_ask(image), max_tokens=3).tokens == before


def test_too_many_images_for_the_context_are_refused(
    pair: tuple[Path, Path], image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = turbospark_core.open(pair[0], vision=pair[1], max_context=60)
    with pytest.raises(ContextOverflowError, match=r"with its 2 image\(s\) is \d+ tokens, over max_context=60"):
        small.chat(_ask(image, image), max_tokens=1)
    with pytest.raises(ContextOverflowError, match="exceeds max_context=60"):
        small.chat(_ask(image), max_tokens=40)  # the prompt fits, the reply does not
    monkeypatch.setattr(prompt_module, "MAX_IMAGES", 1)
    with pytest.raises(ImageError, match="2 images in one request, over the bound of 1"):
        small.chat(_ask(image, image), max_tokens=1)


def test_images_too_large_for_the_processor_are_refused(runner: Runner) -> None:
    with pytest.raises(turbospark_core.TurbosparkError, match="aspect ratio over 200"):
        runner.chat(_ask(np.zeros((1, 300, 3), np.uint8)), max_tokens=1)


def test_a_template_without_image_parts_is_refused(pair: tuple[Path, Path], tmp_path: Path, image: Path) -> None:
    sidecar = tmp_path / "sidecar"
    shutil.copytree(pair[1], sidecar)
    raw = json.loads((sidecar / MANIFEST).read_text())
    raw["files"].pop(CHAT_TEMPLATE)
    (sidecar / MANIFEST).write_text(json.dumps(raw))
    runner = turbospark_core.open(pair[0], vision=sidecar)  # the trunk's template renders no image parts
    with pytest.raises(ImageError, match=r"rendered 0 image placeholder\(s\) \(token id 7\) for 1 image"):
        runner.chat(_ask(image), max_tokens=1)


def test_held_images_forgets_dead_states_and_tells_states_apart() -> None:
    from turbospark_core.vision.prompt import HeldImages

    class State:
        pass

    held, a, b = HeldImages(), State(), State()
    soft = np.array([0, 1, 0], bool)
    prompt = VisionPrompt(ids=[1, 7, 2], soft=soft, images=[], keys=((1, "x"),), positions=None, shift=0)
    held.remember(a, prompt)
    assert held.reusable(a, prompt, 3) == 3
    assert held.reusable(a, None, 3) == 1  # a text prompt: only the text before the image
    assert held.reusable(b, prompt, 3) == 1  # b's caches hold no image
    del a
    held.remember(b, None)
    assert len(held._held) == 1
