"""Qwen3-VL images against transformers' references (fixtures README, section "Images")."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core import runner as runner_module
from turbospark_core.errors import ArchConfigError
from turbospark_core.runner import Runner
from turbospark_core.testing import vision_messages
from turbospark_core.vision.images import load_image
from turbospark_core.vision.prompt import VisionPrompt, expand

from turbospark_llama.vision import ImageSizeError, Processor

MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"
CASES = ("one", "two")


@pytest.fixture(scope="module")
def src(turbospark_fixtures: Path) -> Path:
    return turbospark_fixtures / "qwen3_vl"


@pytest.fixture(scope="module")
def ref(src: Path) -> Iterator[dict[str, np.ndarray]]:
    with np.load(src / "references_vision.npz") as npz:
        yield {k: npz[k] for k in npz.files}


@pytest.fixture(scope="module")
def runner(turbospark_vision_install: Callable[[str], tuple[Path, Path]]) -> Runner:
    trunk, sidecar = turbospark_vision_install("qwen3_vl")
    return turbospark_core.open(trunk, vision=sidecar)


def _images(src: Path, ref: dict[str, np.ndarray], case: str) -> list[Path]:
    return [src / f"image_{i}.png" for i in ref[f"{case}_image_indices"]]


def _messages(src: Path, ref: dict[str, np.ndarray], case: str) -> list[dict[str, Any]]:
    return vision_messages(str(ref[f"{case}_prompt"]), MARKUP, _images(src, ref, case))


def _prompt(runner: Runner, src: Path, ref: dict[str, np.ndarray], case: str) -> VisionPrompt:
    prompt = runner.chat_input(_messages(src, ref, case))
    assert isinstance(prompt, VisionPrompt)
    return prompt


@pytest.mark.parametrize("case", CASES)
def test_tower_matches_image_embeds_and_deepstack_from_pixel_values(
    runner: Runner, ref: dict[str, np.ndarray], case: str
) -> None:
    assert runner.vision is not None
    tower: Any = runner.vision.tower
    grids = [tuple(int(x) for x in g) for g in ref[f"{case}_image_grid_thw"]]
    embeds, deepstack = tower.forward(mx.array(ref[f"{case}_pixel_values"]), grids)
    assert np.abs(np.array(embeds) - ref[f"{case}_image_embeds"]).max() <= 1e-5
    assert len(deepstack) == ref[f"{case}_deepstack_features"].shape[0]
    for got, want in zip(deepstack, ref[f"{case}_deepstack_features"], strict=True):
        assert np.abs(np.array(got) - want).max() <= 1e-5


@pytest.mark.parametrize("case", CASES)
def test_preprocessing_from_png_matches_pixel_values_and_grid(
    runner: Runner, src: Path, ref: dict[str, np.ndarray], case: str
) -> None:
    prompt = _prompt(runner, src, ref, case)
    pixels = np.concatenate([im.pixel_values for im in prompt.images])
    assert pixels.shape == ref[f"{case}_pixel_values"].shape
    # image_1 is resized: PIL bicubic, as the reference
    assert np.abs(pixels - ref[f"{case}_pixel_values"]).max() <= 1e-6
    assert [im.grid for im in prompt.images] == [tuple(g) for g in ref[f"{case}_image_grid_thw"].tolist()]


@pytest.mark.parametrize("case", CASES)
def test_expanded_ids_mask_and_mrope_positions_are_exact(
    runner: Runner, src: Path, ref: dict[str, np.ndarray], case: str
) -> None:
    prompt = _prompt(runner, src, ref, case)
    assert prompt.ids == ref[f"{case}_input_ids"].tolist()
    assert prompt.soft.astype(np.int32).tolist() == ref[f"{case}_mm_token_type_ids"].tolist()
    assert prompt.positions is not None
    assert np.array_equal(prompt.positions, ref[f"{case}_position_ids"])
    assert prompt.shift == int(ref[f"{case}_rope_delta"])


@pytest.mark.parametrize("case", CASES)
def test_logits_end_to_end_from_the_png_files(runner: Runner, src: Path, ref: dict[str, np.ndarray], case: str) -> None:
    got = runner.logits(_prompt(runner, src, ref, case))
    assert np.abs(got - ref[f"{case}_logits"]).max() <= 1e-4


@pytest.mark.parametrize("case", CASES)
def test_greedy_decode_with_the_cache_matches_tokens_and_step_logits(
    runner: Runner, src: Path, ref: dict[str, np.ndarray], case: str
) -> None:
    want = ref[f"{case}_greedy_tokens"].tolist()
    gen = runner.chat(_messages(src, ref, case), max_tokens=len(want))
    assert gen.tokens == want  # decode steps run at position j + rope_delta
    # full recomputation over prompt + continuation: the step logits
    assert runner.vision is not None
    prompt = _prompt(runner, src, ref, case)
    rgbs = [load_image(p) for p in _images(src, ref, case)]
    ids = runner.tokenizer.encode(str(ref[f"{case}_prompt"]), add_special_tokens=False)
    longer = expand(ids + want[:-1], rgbs, runner.vision.tower, runner.max_context)
    steps = runner.logits(longer)[len(prompt.ids) - 1 :]
    assert np.abs(steps - ref[f"{case}_greedy_step_logits"]).max() <= 1e-4


def test_chunked_prefill_equals_one_pass(
    runner: Runner, src: Path, ref: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    want = ref["two_greedy_tokens"].tolist()[:4]
    monkeypatch.setattr(runner_module, "PREFILL_CHUNK", 7)  # chunks cut through both images
    assert runner.chat(_messages(src, ref, "two"), max_tokens=4).tokens == want


def test_session_reuses_a_prefix_only_with_the_same_images(
    runner: Runner, src: Path, ref: dict[str, np.ndarray]
) -> None:
    messages = _messages(src, ref, "one")
    session = runner.session("pictures")
    first = session.chat(messages, max_tokens=3)
    follow = [*messages, {"role": "assistant", "content": first.text}, {"role": "user", "content": "and?"}]
    again = session.chat(follow, max_tokens=3)
    assert again.stats.reused_tokens > len(ref["one_input_ids"]) - 1  # the image rows were reused
    assert again.tokens == runner.chat(follow, max_tokens=3).tokens
    # the same conversation with another image of the same size: nothing from the image on is reused
    flipped = np.array(load_image(src / "image_0.png")[::-1])
    parts = [{**p, "image": flipped} if p["type"] == "image" else p for p in follow[0]["content"]]
    other = [{**follow[0], "content": parts}]
    swapped = session.chat([*other, *follow[1:]], max_tokens=3)
    first_image = ref["one_input_ids"].tolist().index(7)
    assert swapped.stats.reused_tokens <= first_image
    assert swapped.tokens == runner.chat([*other, *follow[1:]], max_tokens=3).tokens


def test_text_only_chat_is_unchanged_by_an_attached_tower(
    runner: Runner, turbospark_vision_install: Callable[[str], tuple[Path, Path]]
) -> None:
    plain = turbospark_core.open(turbospark_vision_install("qwen3_vl")[0])
    messages = [{"role": "user", "content": "hello there"}]
    assert runner.chat_input(messages) == plain.chat_prompt(messages)
    assert runner.chat(messages, max_tokens=6).tokens == plain.chat(messages, max_tokens=6).tokens


def test_smart_resize_rounds_half_to_even_and_bounds_pixels() -> None:
    size = {"shortest_edge": 256, "longest_edge": 2048}
    config = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, "size": size}
    processor = Processor.from_config(config)
    assert processor.target_size(32, 40) == (32, 40)
    assert processor.target_size(36, 52) == (32, 48)  # 4.5 and 6.5 round down to even
    h, w = processor.target_size(400, 400)
    assert h * w <= 2048 and h % 8 == 0 and w % 8 == 0
    h, w = processor.target_size(4, 4)
    assert h * w >= 256 and h % 8 == 0
    with pytest.raises(ImageSizeError, match="aspect ratio"):
        processor.target_size(1, 300)


@pytest.mark.parametrize(
    ("change", "words"),
    [  # each was an escape (ZeroDivisionError, TypeError, ValueError, AttributeError) found by tests/fuzz
        ({"patch_size": 0}, "'processor.patch_size' must be an integer"),
        ({"merge_size": [2]}, "'processor.merge_size' must be an integer"),
        ({"size": [1]}, "processor.size must be an object"),
        ({"rescale_factor": ""}, "'processor.rescale_factor' must be a finite number"),
        ({"image_mean": [0.5, 0.5, 0.5, 0.5]}, "'processor.image_mean' must list 3"),
        ({"image_std": [0.5, 0.0, 0.5]}, "'processor.image_std' must list 3"),
        ({"do_resize": "yes"}, "'processor.do_resize' must be true or false"),
        ({"size": {"shortest_edge": 4096, "longest_edge": 256}}, "must not exceed max_pixels"),
    ],
)
def test_a_bad_processor_config_is_refused_by_name(change: dict[str, Any], words: str) -> None:
    config = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, **change}
    with pytest.raises(ArchConfigError, match=words):
        Processor.from_config(config)


# ------------------------------------------------------------------ the vision hooks, via llama


def test_hook_vision_arch_from_hf_config(src: Path, turbospark_fixtures: Path) -> None:
    import json

    from turbospark_core import plugins

    hooks = plugins.family_hooks("qwen3_vl")
    spec = hooks.vision_arch_from_hf_config(json.loads((src / "config.json").read_text()))
    assert spec is not None and spec.hidden_size == 64
    assert spec.tokens == {"image": 7, "vision_start": 5, "vision_end": 6}
    assert spec.vision["deepstack_visual_indexes"] == [0] and spec.vision["rope_theta"] == 10000.0
    json.dumps(spec.vision)  # it goes into the sidecar manifest
    text_only = json.loads((turbospark_fixtures / "qwen3" / "config.json").read_text())
    assert hooks.vision_arch_from_hf_config(text_only) is None  # no tower: the sidecar is refused


def test_hook_vision_tensor_target() -> None:
    from turbospark_core import plugins
    from turbospark_core.family import TensorTarget

    hooks = plugins.family_hooks("qwen3_vl")
    got = hooks.vision_tensor_target({}, "model.visual.blocks.0.attn.qkv.weight")
    assert got == TensorTarget.to("visual.blocks.0.attn.qkv.weight")
    assert hooks.vision_tensor_target({}, "model.language_model.layers.0.mlp.up_proj.weight") == TensorTarget.drop()
    with pytest.raises(turbospark_core.TurbosparkError, match="mlx-vlm vision tower"):
        hooks.vision_tensor_target({}, "vision_tower.patch_embed.proj.weight")


def test_hook_build_vision(runner: Runner) -> None:
    from turbospark_core.vision.tower import VisionContext

    assert runner.vision is not None
    tower = runner.vision.tower
    assert (tower.placeholder_id, tower.soft_token_id) == (7, 7)
    opened = runner.opened
    sidecar = runner.vision.sidecar
    from turbospark_core.tensor_index import build_index
    from turbospark_core.vision.sidecar import VISION_WEIGHTS
    from turbospark_core.weights import WeightStore

    index = build_index(sidecar.path(VISION_WEIGHTS), sidecar.files[VISION_WEIGHTS].size, {})
    context = VisionContext(
        arch={**opened.manifest.arch, "model_type": "qwen3"},
        vision=sidecar.vision,
        processor=sidecar.processor,
        tokens=sidecar.tokens,
        weights=WeightStore(sidecar.path(VISION_WEIGHTS), index, opened.policy),
        compute_dtype=opened.policy.compute_dtype,
    )
    assert opened.hooks.build_vision(context) is None  # a text-only model type: no vision flow
    no_mrope = {k: v for k, v in opened.manifest.arch.items() if k != "mrope"}
    with pytest.raises(turbospark_core.TurbosparkError, match="no 'mrope' section"):
        opened.hooks.build_vision(attrs.evolve(context, arch=no_mrope))


def test_batched_rows_with_images_equal_single_sequence_runs(
    runner: Runner, src: Path, ref: dict[str, np.ndarray]
) -> None:
    one, two = _prompt(runner, src, ref, "one"), _prompt(runner, src, ref, "two")
    text = runner.chat_prompt([{"role": "user", "content": "hello there"}])
    got = runner.generate_many([one, text, two], max_tokens=6)  # type: ignore[list-item]
    assert got[0].tokens == ref["one_greedy_tokens"].tolist()[:6]
    assert got[2].tokens == ref["two_greedy_tokens"].tolist()[:6]  # each row decodes at its own rope_delta
    assert got[1].tokens == runner.generate(text, max_tokens=6).tokens


@pytest.mark.parametrize("case", CASES)
def test_bf16_checkpoint_matches_logits_bf16_weights(
    turbospark_vision_install: Callable[..., tuple[Path, Path]], src: Path, ref: dict[str, np.ndarray], case: str
) -> None:
    trunk, sidecar = turbospark_vision_install("qwen3_vl", "bf16")
    runner = turbospark_core.open(trunk, vision=sidecar)  # bf16 weights, float32 math on the CPU
    got = runner.logits(_prompt(runner, src, ref, case))
    loose = 1e-3 if runner.opened.policy.compute_dtype == mx.float32 else 0.1  # bf16 activations off the CPU
    assert np.abs(got - ref[f"{case}_logits_bf16_weights"]).max() <= loose


def test_image_prompts_speculate_losslessly_alone_and_batched(
    turbospark_vision_install: Callable[[str], tuple[Path, Path]], src: Path, ref: dict[str, np.ndarray]
) -> None:
    """A drafter open: image prompts are drafted for and verified (at their own rope_delta), alone or together."""
    trunk, sidecar = turbospark_vision_install("qwen3_vl")
    runner = turbospark_core.open(trunk, vision=sidecar, draft_model=trunk, num_draft_tokens=3)
    one, two = _prompt(runner, src, ref, "one"), _prompt(runner, src, ref, "two")
    n = len(ref["one_greedy_tokens"])
    alone = runner.generate(one, max_tokens=n)
    assert alone.tokens == ref["one_greedy_tokens"].tolist()
    assert alone.stats.draft_tokens > 0
    got = runner.generate_many([one, two], max_tokens=[n, 6])  # type: ignore[list-item]
    assert got[0].tokens == ref["one_greedy_tokens"].tolist()
    assert got[1].tokens == ref["two_greedy_tokens"].tolist()[:6]
    assert got[1].stats.draft_tokens > 0  # verified in the batch, beside the other row
