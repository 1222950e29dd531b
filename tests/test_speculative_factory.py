"""Open step 12 (turbospark_core.speculative.factory and the drafter options): each refusal, by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import turbospark_core
from turbospark_core.convert import convert
from turbospark_core.errors import DrafterError, InstallError, OptionError
from turbospark_core.options import OpenOptions
from turbospark_core.testing import llama_tensor_shapes

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def rotated(llama_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("rotated") / "install"
    convert(llama_src, dst, rotate=True, rotate_seed=1)
    return dst


def _tiny(make: Any, vocab: int) -> Path:
    config = {**TINY, "vocab_size": vocab}
    path: Path = make(f"tiny_llama_{vocab}", config, llama_tensor_shapes(config))
    return path


def test_two_drafters_named_are_a_caller_error_naming_both(f32_install: Path) -> None:
    with pytest.raises(OptionError, match=r"draft_model=.* and ngram=3 name two speculative drafters"):
        turbospark_core.open(f32_install, draft_model=f32_install, ngram=3)


def test_num_draft_tokens_without_a_drafter_is_refused(f32_install: Path) -> None:
    names = "dflash, draft_model, ngram, mtp"
    with pytest.raises(OptionError, match=f"num_draft_tokens=4 names no drafter; also pass one of {names}"):
        turbospark_core.open(f32_install, num_draft_tokens=4)


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("ngram", 0, "ngram=0 is invalid"),
        ("ngram", True, "ngram=True is invalid"),
        ("ngram", 33, "ngram=33 is too large"),
        ("ngram", "4", "ngram='4' is invalid"),
        ("num_draft_tokens", -1, "num_draft_tokens=-1 is invalid"),
        ("num_draft_tokens", 64, "num_draft_tokens=64 is too large"),
        ("draft_model", "", "draft_model='' is invalid"),
        ("draft_model", 7, "draft_model=7 is invalid"),
    ],
)
def test_bad_drafter_values_are_refused_by_name(name: str, value: Any, match: str) -> None:
    extra = {"ngram": 2} if name == "num_draft_tokens" else {}
    with pytest.raises(OptionError, match=match):
        OpenOptions.from_kwargs({name: value, **extra})


@pytest.mark.parametrize("option", [{"ngram": 3}, {"draft_model": "DRAFT"}])
def test_a_hadamard_folded_install_refuses_every_drafter(rotated: Path, f32_install: Path, option: Any) -> None:
    option = {k: f32_install if v == "DRAFT" else v for k, v in option.items()}
    name = next(iter(option))
    with pytest.raises(DrafterError, match=rf"hadamard-folded and cannot serve a speculative drafter \({name}="):
        turbospark_core.open(rotated, **option)


def test_a_hadamard_folded_draft_model_is_refused(rotated: Path, f32_install: Path) -> None:
    with pytest.raises(DrafterError, match=r"draft_model .* is hadamard-folded"):
        turbospark_core.open(f32_install, draft_model=rotated)


def test_a_draft_model_with_another_vocab_size_is_refused(f32_install: Path, turbospark_tiny_install: Any) -> None:
    draft = _tiny(turbospark_tiny_install, 256)
    with pytest.raises(DrafterError, match=r"draft_model .* has vocab_size 256 but .* has 512"):
        turbospark_core.open(f32_install, draft_model=draft)


def test_a_draft_model_with_another_tokenizer_is_refused(f32_install: Path, turbospark_tiny_install: Any) -> None:
    draft = _tiny(turbospark_tiny_install, 512)  # same size, a word-level tokenizer
    want = r"different tokenizer vocabulary .* \(token id 0 is .<\|pad\|>. in the target, .<unk>. in the draft\)"
    with pytest.raises(DrafterError, match=want):
        turbospark_core.open(f32_install, draft_model=draft)


def test_a_draft_model_that_is_not_an_install_is_refused(f32_install: Path, tmp_path: Path) -> None:
    with pytest.raises(InstallError, match=r"draft_model='.*missing' cannot be opened: .* does not exist"):
        turbospark_core.open(f32_install, draft_model=tmp_path / "missing")
    with pytest.raises(InstallError, match=r"draft_model=.* is not a turbospark install"):
        turbospark_core.open(f32_install, draft_model=tmp_path)


def test_the_opened_drafter_is_described_and_timed(f32_install: Path) -> None:
    runner = turbospark_core.open(f32_install, draft_model=f32_install)
    setup = runner.opened.drafter
    assert setup is not None and setup.name == "draft_model"
    assert setup.num_draft_tokens == 4 and setup.adaptive
    assert setup.draft_cost == pytest.approx(1.0)
    assert "draft_model" in setup.description and "llama" in setup.description
    assert runner.startup_stats.drafter > 0
    lookup = turbospark_core.open(f32_install, ngram=5).opened.drafter
    assert lookup is not None and lookup.name == "ngram" and lookup.num_draft_tokens == 5
    assert turbospark_core.open(f32_install).opened.drafter is None
