"""Images end to end: PNG files in chat messages, through a gemma4 sidecar, to transformers' logits and tokens."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import turbospark_core
from turbospark_core.family import ArchConfigError, ImageError
from turbospark_core.vision.convert import convert_sidecar
from turbospark_core.vision.prompt import VisionPrompt

from turbospark_gemma4.vision_config import vision_spec, vision_target

FIXTURES = ("gemma4_e", "gemma4_moe")


@pytest.fixture(scope="module")
def sidecars(turbospark_fixtures: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name in FIXTURES:
        dst = tmp_path_factory.mktemp(f"{name}-vision") / "sidecar"
        convert_sidecar(turbospark_fixtures / name, dst)
        out[name] = dst
    return out


def _messages(fixture: Path, case: str) -> list[dict[str, Any]]:
    content = json.loads((fixture / "references_vision.json").read_text())["cases"][case]["content"]
    ref = np.load(fixture / "references_vision.npz")
    images = iter(ref[f"{case}_image_indices"])
    parts = [{"type": "image", "image": str(fixture / f"image_{next(images)}.png")} if p["type"] == "image" else p
             for p in content]  # fmt: skip
    return [{"role": "user", "content": parts}]


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("case", ["one", "two"])
def test_png_chat_matches_transformers(
    turbospark_install: Any, turbospark_fixtures: Path, sidecars: dict[str, Path], name: str, case: str
) -> None:
    fixture = turbospark_fixtures / name
    ref = np.load(fixture / "references_vision.npz")
    runner = turbospark_core.open(turbospark_install(name), vision=sidecars[name])
    prompt = runner.chat_input(_messages(fixture, case))
    assert isinstance(prompt, VisionPrompt)
    assert prompt.ids == ref[f"{case}_input_ids"].tolist()
    assert np.array_equal(prompt.soft, ref[f"{case}_mm_token_type_ids"].astype(bool))
    assert np.abs(runner.logits(prompt) - ref[f"{case}_logits"]).max() <= 1e-4
    reply = runner.generate(prompt, max_tokens=16, temperature=0.0)
    assert list(reply.tokens) == ref[f"{case}_greedy_tokens"].tolist()


def test_openai_data_url_parts_give_the_same_prompt(
    turbospark_install: Any, turbospark_fixtures: Path, sidecars: dict[str, Path]
) -> None:
    fixture = turbospark_fixtures / "gemma4_e"
    runner = turbospark_core.open(turbospark_install("gemma4_e"), vision=sidecars["gemma4_e"])
    by_path = _messages(fixture, "two")
    by_url = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                  + base64.b64encode(Path(p["image"]).read_bytes()).decode()}}
        if p["type"] == "image" else p for p in by_path[0]["content"]
    ]}]  # fmt: skip
    a, b = runner.chat_input(by_path), runner.chat_input(by_url)
    assert isinstance(a, VisionPrompt) and isinstance(b, VisionPrompt) and a.ids == b.ids
    assert np.array_equal(runner.logits(a), runner.logits(b))


@pytest.mark.parametrize("name", FIXTURES)
def test_bf16_checkpoint_and_sidecar_match_their_reference(
    turbospark_install: Any, turbospark_fixtures: Path, tmp_path: Path, name: str
) -> None:
    fixture = turbospark_fixtures / name
    convert_sidecar(fixture / "bf16", tmp_path / "sidecar")
    runner = turbospark_core.open(turbospark_install(name, "bf16"), vision=tmp_path / "sidecar")
    logits = runner.logits(runner.chat_input(_messages(fixture, "one")))
    want = np.load(fixture / "references_vision.npz")["one_logits_bf16_weights"]
    assert np.abs(logits - want).max() <= 1e-2  # loosely, as the README says (observed 2e-6 with float32 math)


def test_sidecar_records_the_tower_and_placeholders(turbospark_fixtures: Path, sidecars: dict[str, Path]) -> None:
    manifest = json.loads((sidecars["gemma4_e"] / "manifest.json").read_text())
    assert manifest["tokens"] == {"image": 11, "boi": 9, "eoi": 10}
    assert manifest["vision"]["model_type"] == "gemma4" and manifest["vision"]["text_hidden_size"] == 64
    assert vision_target("model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight").name == (
        "vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"
    )
    projection = "embed_vision.embedding_projection.weight"
    assert vision_target(f"model.{projection}").name == projection
    assert vision_target("model.language_model.embed_tokens.weight").name is None
    assert vision_target("model.audio_tower.layers.0.weight").name is None


def test_text_only_config_has_no_tower() -> None:
    assert vision_spec({"model_type": "gemma4_text", "hidden_size": 64}) is None
    assert vision_spec({"model_type": "gemma4", "text_config": {"hidden_size": 64}}) is None


def test_bidirectional_image_attention_refused(turbospark_fixtures: Path) -> None:
    config = json.loads((turbospark_fixtures / "gemma4_e" / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = "vision"
    with pytest.raises(ArchConfigError, match="use_bidirectional_attention"):
        vision_spec(config)
    del config["text_config"]["use_bidirectional_attention"], config["boi_token_id"]
    with pytest.raises(ArchConfigError, match="boi_token_id"):
        vision_spec(config)


def test_processor_config_that_does_not_fit_the_tower_refused(
    turbospark_install: Any, sidecars: dict[str, Path], tmp_path: Path
) -> None:
    copy = tmp_path / "sidecar"
    shutil.copytree(sidecars["gemma4_e"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["processor"]["patch_size"] = 8
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArchConfigError, match="patch_size 8"):
        turbospark_core.open(turbospark_install("gemma4_e"), vision=copy)


def test_image_the_tower_cannot_take_is_a_bad_request(
    turbospark_install: Any, sidecars: dict[str, Path]
) -> None:
    runner = turbospark_core.open(turbospark_install("gemma4_e"), vision=sidecars["gemma4_e"])
    for size, named in (((13, 24), "multiples of"), ((72, 24), "position_embedding_size")):
        image = np.zeros((*size, 3), dtype=np.uint8)
        with pytest.raises(ImageError, match=named):
            runner.chat_input([{"role": "user", "content": [{"type": "image", "image": image}]}])


@pytest.mark.parametrize("name", FIXTURES)
def test_session_reuse_with_images_equals_a_fresh_run(
    turbospark_install: Any, turbospark_fixtures: Path, sidecars: dict[str, Path], name: str
) -> None:
    """A follow-up turn reuses the cached image prefix; a different image at the same place is not reused."""
    fixture = turbospark_fixtures / name
    runner = turbospark_core.open(turbospark_install(name), vision=sidecars[name])
    first = _messages(fixture, "one")
    session = runner.session("s")
    reply = session.chat(first, max_tokens=4, temperature=0.0)
    follow_up = [*first, {"role": "assistant", "content": reply.text}, {"role": "user", "content": "And the colours?"}]
    assert session.chat(follow_up, max_tokens=6, temperature=0.0).tokens == runner.chat(
        follow_up, max_tokens=6, temperature=0.0
    ).tokens
    other = [{"role": "user", "content": [{**first[0]["content"][0], "image": str(fixture / "image_1.png")},
                                          *first[0]["content"][1:]]}]  # fmt: skip
    assert session.chat(other, max_tokens=6, temperature=0.0).tokens == runner.chat(
        other, max_tokens=6, temperature=0.0
    ).tokens
