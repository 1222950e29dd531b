"""Fixtures of the DFlash drafter tests: the qwen3_dflash / llama_dflash targets and drafters, converted once."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np
import pytest

import turbospark_core
from turbospark_core.convert import convert
from turbospark_core.runner import Runner
from turbospark_core.speculative.dflash import DFlashFactory, open_dflash

FIXTURES = ("qwen3_dflash", "llama_dflash")
ABS_TOL = 1e-4  # max |logit - reference| (the fixtures README's suggestion)


@attrs.frozen
class DFlashFixture:
    """One fixture: where its target and drafter installs are, and its references."""

    name: str
    source: Path
    target: Path
    drafter: Path
    refs: dict[str, np.ndarray] = attrs.field(eq=False, repr=False)
    greedy: np.ndarray = attrs.field(eq=False, repr=False)

    def open(self, **options: object) -> Runner:
        """The target opened with ``options``."""
        return turbospark_core.open(self.target, **options)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def dflash_fixture(
    turbospark_fixtures: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], DFlashFixture]:
    """``dflash_fixture(name)`` -> its installs (converted once per session) and references."""
    made: dict[str, DFlashFixture] = {}

    def make(name: str) -> DFlashFixture:
        if name not in made:
            src = turbospark_fixtures / name
            if not (src / "dflash" / "config.json").is_file():
                pytest.skip(f"reference fixture {src} is not available")
            root = tmp_path_factory.mktemp(name)
            convert(src, root / "target")
            convert(src / "dflash", root / "drafter")
            with np.load(src / "references_dflash.npz") as npz:
                refs = {k: npz[k] for k in npz.files}
            with np.load(src / "references.npz") as npz:
                greedy = npz["greedy_tokens"]
            made[name] = DFlashFixture(name, src, root / "target", root / "drafter", refs, greedy)
        return made[name]

    return make


@pytest.fixture(params=FIXTURES)
def fx(request: pytest.FixtureRequest, dflash_fixture: Callable[[str], DFlashFixture]) -> DFlashFixture:
    """Each DFlash fixture in turn."""
    return dflash_fixture(request.param)


@pytest.fixture(scope="session")
def factory_for() -> Callable[[Runner, Path], DFlashFactory]:
    """``factory_for(runner, path)``: the drafter install at ``path`` bound to ``runner``'s target (open step 12)."""

    def make(runner: Runner, path: Path) -> DFlashFactory:
        opened = runner.opened
        return open_dflash(
            path,
            target_arch=opened.manifest.arch,
            target_model=opened.model,
            capabilities=opened.capabilities,
            policy=opened.policy,
            max_context=opened.max_context,
        )

    return make


def write_random_drafter(
    dst: Path, *, hidden: int, vocab: int, target_layers: list[int], num_target_layers: int, seed: int = 0
) -> Path:
    """A z-lab-layout DFlash checkpoint with random weights for a target of ``hidden`` / ``vocab``."""
    import json

    import mlx.core as mx

    from turbospark_core.speculative.dflash_config import DFlashConfig, arch_from_hf

    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": 8,
        "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": target_layers},
        "num_target_layers": num_target_layers,
        "hidden_size": hidden,
        "vocab_size": vocab,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 2 * hidden,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
    }
    arch, problems = arch_from_hf(config)
    assert not problems, problems
    rng = np.random.default_rng(seed)
    tensors = {
        name: mx.array(
            (1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else 0.08 * rng.standard_normal(shape)).astype(
                np.float32
            )
        )
        for name, shape in DFlashConfig.from_arch(arch).tensor_shapes().items()
    }
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(dst / "model.safetensors"), tensors)
    return dst


@pytest.fixture(scope="session")
def random_drafter() -> Callable[..., Path]:
    """:func:`write_random_drafter`, for test modules (which cannot import this conftest)."""
    return write_random_drafter


@pytest.fixture
def drafter_copy(fx: DFlashFixture, tmp_path: Path) -> Path:
    """A private copy of the fixture's drafter install that the test may corrupt."""
    dst = tmp_path / "drafter"
    shutil.copytree(fx.drafter, dst)
    return dst
