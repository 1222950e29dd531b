"""Attaching a sidecar: it must fit the trunk, the family must serve vision, the tower counts in the budget."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import turbospark_core
from turbospark_core.errors import FamilyRefusalError, MemoryBudgetError, OptionError
from turbospark_core.manifest import MANIFEST
from turbospark_core.vision.sidecar import SidecarError

Made = Callable[[str], tuple[Path, Path]]


@pytest.fixture
def pair(turbospark_vision_install: Made) -> tuple[Path, Path]:
    return turbospark_vision_install("qwen3_vl")


@pytest.fixture
def sidecar(pair: tuple[Path, Path], tmp_path: Path) -> Path:
    dst = tmp_path / "sidecar"
    shutil.copytree(pair[1], dst)
    return dst


def _edit(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    raw = json.loads((path / MANIFEST).read_text())
    change(raw)
    (path / MANIFEST).write_text(json.dumps(raw))


def test_open_with_vision_attaches_the_tower(pair: tuple[Path, Path]) -> None:
    runner = turbospark_core.open(pair[0], vision=pair[1])
    assert runner.vision is not None and runner.vision.weight_bytes > 0
    assert runner.vision.tower.placeholder_id == 7 and runner.vision.sidecar.root == pair[1]
    plain = turbospark_core.open(pair[0])
    assert plain.vision is None
    assert plain.attach_vision(str(pair[1])).tower.soft_token_id == 7  # or later, on a runner


def test_a_sidecar_of_another_model_type_is_refused(
    turbospark_install: Callable[[str], Path], pair: tuple[Path, Path]
) -> None:
    with pytest.raises(SidecarError, match=r"model type 'qwen3_vl'.*model type 'qwen3'\); attach the sidecar"):
        turbospark_core.open(turbospark_install("qwen3"), vision=pair[1])


def test_a_sidecar_of_another_hidden_size_is_refused(pair: tuple[Path, Path], sidecar: Path) -> None:
    _edit(sidecar, lambda raw: raw["trunk"].update(hidden_size=128))
    with pytest.raises(SidecarError, match=r"is for hidden_size 128, .* has hidden_size 64"):
        turbospark_core.open(pair[0], vision=sidecar)


def test_wrong_placeholder_ids_are_refused(pair: tuple[Path, Path], sidecar: Path) -> None:
    _edit(sidecar, lambda raw: raw["tokens"].update(image=3))
    with pytest.raises(SidecarError, match=r"placeholder 'image' is token '<\|image_pad\|>' = id 3, .* at id 7"):
        turbospark_core.open(pair[0], vision=sidecar)
    _edit(sidecar, lambda raw: raw["tokens"].update(image=4096))
    with pytest.raises(SidecarError, match=r"id 4096 is outside the vocabulary \[0, 512\)"):
        turbospark_core.open(pair[0], vision=sidecar)


def test_a_family_without_a_vision_flow_refuses(turbospark_install: Callable[[str], Path], sidecar: Path) -> None:
    _edit(sidecar, lambda raw: (raw["trunk"].update(model_type="qwen3"), raw.update(token_texts={})))
    with pytest.raises(FamilyRefusalError, match="has no vision flow for model type 'qwen3'"):
        turbospark_core.open(turbospark_install("qwen3"), vision=sidecar)


def test_the_memory_guard_counts_the_tower(pair: tuple[Path, Path]) -> None:
    plain = turbospark_core.open(pair[0], max_context=256)
    budget = plain.opened.estimate.total + 1  # the trunk fits, the tower does not
    with pytest.raises(MemoryBudgetError, match=r"attaching vision sidecar .* raise memory_budget"):
        turbospark_core.open(pair[0], max_context=256, memory_budget=budget, vision=pair[1])


def test_a_bad_vision_option_is_refused(pair: tuple[Path, Path]) -> None:
    with pytest.raises(OptionError, match="vision=3 is invalid"):
        turbospark_core.open(pair[0], vision=3)  # type: ignore[arg-type]
