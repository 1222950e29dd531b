"""The Gemma 4 vision tower against transformers' references, from the stored ``pixel_values``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core.family import ArchConfigError, InstallError

from turbospark_gemma4.errors import ImageInputError
from turbospark_gemma4.image_processing import ImagePatches, from_processor_output
from turbospark_gemma4.vision import Encoder
from turbospark_gemma4.vision_config import VisionArgs, vision_arch_from_hf

FIXTURES = ("gemma4_e", "gemma4_moe")


def _tower(fixture: Path, weights: dict[str, mx.array] | None = None, **change: Any) -> Encoder:
    arch = {**vision_arch_from_hf(json.loads((fixture / "config.json").read_text())), **change}
    tensors = weights if weights is not None else cast(dict[str, mx.array], mx.load(str(fixture / "model.safetensors")))
    return Encoder(VisionArgs.from_arch(arch), tensors.__getitem__, prefix="model.")


def _images(ref: Any, case: str) -> list[ImagePatches]:
    pv, pos = ref[f"{case}_pixel_values"], ref[f"{case}_image_position_ids"]
    return [from_processor_output(pv[i], pos[i], 3) for i in range(pv.shape[0])]


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("case", ["one", "two"])
def test_image_embeds_match_transformers(turbospark_fixtures: Path, name: str, case: str) -> None:
    fixture = turbospark_fixtures / name
    ref = np.load(fixture / "references_vision.npz")
    tower = _tower(fixture)
    images = _images(ref, case)
    hidden = mx.concatenate([tower.hidden(mx.array(im.patches), im.rows, im.cols) for im in images], axis=0)
    assert np.abs(np.array(hidden) - ref[f"{case}_vision_hidden"]).max() <= 1e-5
    embeds = np.array(tower.embed_images(images))
    assert embeds.shape == ref[f"{case}_image_embeds"].shape
    assert np.abs(embeds - ref[f"{case}_image_embeds"]).max() <= 1e-5


def test_arch_from_the_fixture_config(turbospark_fixtures: Path) -> None:
    arch = vision_arch_from_hf(json.loads((turbospark_fixtures / "gemma4_e" / "config.json").read_text()))
    args = VisionArgs.from_arch(arch)
    assert (args.hidden_size, args.head_dim, args.patch_size, args.pooling_kernel_size) == (32, 16, 4, 3)
    assert (args.rope_theta, args.text_hidden_size, args.position_embedding_size) == (100.0, 64, 16)
    assert not args.standardize and not args.use_clipped_linears


def test_checkpoint_without_a_tower_refused() -> None:
    with pytest.raises(ArchConfigError, match="vision_config"):
        vision_arch_from_hf({"model_type": "gemma4", "text_config": {"hidden_size": 64}})


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"head_dim": 18}, "head_dim"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"rope_theta": None}, "rope_theta"),
        ({"standardize": "yes"}, "standardize"),
        ({"patch_size": 0}, "patch_size"),
    ],
)
def test_unsupported_tower_config_refused_by_key(turbospark_fixtures: Path, change: dict[str, Any], named: str) -> None:
    arch = {**vision_arch_from_hf(json.loads((turbospark_fixtures / "gemma4_e" / "config.json").read_text())), **change}
    assert any(named in p for p in VisionArgs.problems(arch))
    with pytest.raises(ArchConfigError, match=named):
        VisionArgs.from_arch(arch)
    arch.pop(named)
    with pytest.raises(ArchConfigError, match=f"'{named}' is missing"):
        VisionArgs.from_arch(arch)


@pytest.mark.parametrize(
    ("rows", "cols", "named"),
    [(18, 3, "position_embedding_size"), (3, 18, "position_embedding_size"), (4, 3, "pooling_kernel_size")],
)
def test_grid_the_tower_cannot_cover_refused(turbospark_fixtures: Path, rows: int, cols: int, named: str) -> None:
    tower = _tower(turbospark_fixtures / "gemma4_e")
    with pytest.raises(ImageInputError, match=named):
        tower.hidden(mx.zeros((rows * cols, 48)), rows, cols)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"position_embedding_size": 32}, "position_embedding_table"),
        ({"patch_size": 8}, "input_proj"),
        ({"text_hidden_size": 128}, "embedding_projection"),
    ],
)
def test_tensors_of_another_shape_refused(turbospark_fixtures: Path, change: dict[str, Any], named: str) -> None:
    with pytest.raises(InstallError, match=f"{named}.* has shape"):
        _tower(turbospark_fixtures / "gemma4_e", **change)


def _weights(fixture: Path) -> dict[str, mx.array]:
    return dict(cast(dict[str, mx.array], mx.load(str(fixture / "model.safetensors"))))


def test_clipped_linears_clamp_inputs_and_outputs(turbospark_fixtures: Path) -> None:
    fixture = turbospark_fixtures / "gemma4_e"
    ref = np.load(fixture / "references_vision.npz")
    image = _images(ref, "one")[0]
    weights = _weights(fixture)
    linears = [k[: -len(".linear.weight")] for k in weights if k.endswith(".linear.weight")]
    wide = dict(weights)
    for base in linears:  # unbounded clips change nothing
        wide |= {f"{base}.input_min": mx.array(-np.inf), f"{base}.input_max": mx.array(np.inf),
                 f"{base}.output_min": mx.array(-np.inf), f"{base}.output_max": mx.array(np.inf)}  # fmt: skip
    got = np.array(_tower(fixture, wide, use_clipped_linears=True)(image))
    assert np.abs(got - ref["one_image_embeds"]).max() <= 1e-5
    tight = dict(wide)
    down = "model.vision_tower.encoder.layers.0.mlp.down_proj"
    tight |= {f"{down}.output_min": mx.array(-0.01), f"{down}.output_max": mx.array(0.01)}
    clipped = _tower(fixture, tight, use_clipped_linears=True)
    assert not np.allclose(np.array(clipped(image)), got, atol=1e-3)
    layer = clipped.layers[0]
    y = np.array(layer.down_proj(mx.array(np.linspace(-3, 3, 64 * 5, dtype=np.float32).reshape(5, 64))))
    assert y.min() >= -0.01 and y.max() <= 0.01


def test_standardize_shifts_and_scales_the_pooled_output(turbospark_fixtures: Path) -> None:
    fixture = turbospark_fixtures / "gemma4_e"
    ref = np.load(fixture / "references_vision.npz")
    image = _images(ref, "one")[0]
    weights = _weights(fixture)
    bias = np.linspace(-1, 1, 32, dtype=np.float32)
    scale = np.linspace(0.5, 2, 32, dtype=np.float32)
    weights |= {"model.vision_tower.std_bias": mx.array(bias), "model.vision_tower.std_scale": mx.array(scale)}
    tower = _tower(fixture, weights, standardize=True)
    hidden = np.array(tower.hidden(mx.array(image.patches), image.rows, image.cols))
    assert np.abs(hidden - (ref["one_vision_hidden"] - bias) * scale).max() <= 1e-4
