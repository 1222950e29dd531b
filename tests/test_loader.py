"""Tests of the open sequence: non-installs, families, hadamard, arch, tensors, context."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core import loader
from turbospark_core import runner as runner_mod
from turbospark_core.errors import (
    ArchConfigError,
    ContextOverflowError,
    FamilyRefusalError,
    FileTableError,
    InstallError,
    NotAnInstallError,
    OptionError,
    TokenizerError,
    UnknownFamilyError,
)
from turbospark_core.manifest import HADAMARD
from turbospark_core.options import OpenOptions
from turbospark_core.sessions import SessionPool
from turbospark_core.stats import PHASES


# ------------------------------------------------------------------ a good open
def test_open_matches_the_reference_logits(f32_install: Path, references) -> None:
    runner = turbospark_core.open(f32_install)
    logits = runner.logits(references["prompt_ids"].tolist())
    ref = references["logits"]
    assert logits.shape == ref.shape and logits.dtype == np.float32
    assert np.abs(logits - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())
    out = runner.generate(references["prompt_ids"].tolist(), max_tokens=len(references["greedy_tokens"]))
    assert out.tokens == references["greedy_tokens"].tolist()


def test_open_records_startup_stats_and_capabilities(f32_install: Path) -> None:
    runner = turbospark_core.open(f32_install, warmup=True)
    stats = runner.startup_stats.as_dict()
    assert set(stats) == {*PHASES, "total_open"}
    # each timed real work
    assert all(stats[phase] > 0 for phase in PHASES if phase not in ("session_state", "steering", "drafter"))
    assert stats["total_open"] >= sum(stats[phase] for phase in PHASES)
    caps = runner.opened.capabilities
    assert (caps.family, caps.distribution, caps.accepts_hadamard) == ("llama", "turbospark-llama", True)
    assert runner.max_context == 256  # min(max_position_embeddings, default)
    assert turbospark_core.open(f32_install, max_context=600).max_context == 600


def test_warmup_is_its_own_phase(f32_install: Path) -> None:
    assert turbospark_core.open(f32_install).startup_stats.warmup == 0.0
    assert turbospark_core.open(f32_install, warmup=True).startup_stats.warmup > 0.0


def test_the_open_sequence_builds_and_times_the_session_pool(f32_install: Path, monkeypatch) -> None:
    built: list[SessionPool] = []

    def slow_pool(*args: Any) -> SessionPool:
        time.sleep(0.02)
        built.append(SessionPool(*args))
        return built[-1]

    monkeypatch.setattr(loader, "SessionPool", slow_pool)
    runner = turbospark_core.open(f32_install, session_slots=3)
    assert runner.sessions is runner.opened.sessions is built[0]
    assert runner.startup_stats.session_state >= 20.0
    assert runner.sessions.slots == 3 and len(runner.sessions) == 0
    assert len(runner.sessions.acquire("a").caches) == len(runner.opened.cache_layout)


def test_the_tokenizer_is_read_before_the_weights_are_held(f32_install: Path, monkeypatch) -> None:
    # the open's peak is then the larger of the two, not their sum (a tokenizer's parse peaks high)
    order: list[str] = []
    read = loader.Tokenizer.from_install

    def reading(*args: Any, **kwargs: Any) -> Any:
        order.append("tokenizer")
        return read(*args, **kwargs)

    class Store(loader.WeightStore):
        def __init__(self, *args: Any) -> None:
            order.append("weights")
            super().__init__(*args)

    monkeypatch.setattr(loader.Tokenizer, "from_install", reading)
    monkeypatch.setattr(loader, "WeightStore", Store)
    runner = turbospark_core.open(f32_install)
    assert order == ["tokenizer", "weights"]
    assert runner.tokenizer is runner.opened.tokenizer
    assert runner.startup_stats.tokenizer > 0


def test_open_install_reads_no_tokenizer_unless_asked(f32_install: Path) -> None:
    # a draft model's open (the drafter factory) needs none
    assert loader.open_install(f32_install, OpenOptions()).tokenizer is None


def test_a_broken_tokenizer_is_refused_before_the_weights_are_read(f32_install: Path, tmp_path: Path,
                                                                      monkeypatch) -> None:
    install = tmp_path / "broken-tokenizer.turbospark"
    shutil.copytree(f32_install, install)
    tokenizer = install / "tokenizer.json"
    tokenizer.write_bytes(b"{" * tokenizer.stat().st_size)  # the size the manifest records: unreadable, not short
    monkeypatch.setattr(loader, "WeightStore", lambda *a: pytest.fail("the weights were read"))
    with pytest.raises(TokenizerError) as e:
        turbospark_core.open(install)
    assert "tokenizer.json" in str(e.value) and "turbospark convert" in str(e.value)


# ------------------------------------------------------------------ step 1: not an install
def test_nonexistent_path(tmp_path: Path, names) -> None:
    with pytest.raises(InstallError) as e:
        turbospark_core.open(tmp_path / "nowhere")
    names(e, "nowhere", "does not exist", "turbospark convert")


def test_hugging_face_checkpoint_passed_to_open(llama_src: Path, names) -> None:
    with pytest.raises(NotAnInstallError) as e:
        turbospark_core.open(llama_src)
    names(e, str(llama_src), "checkpoint", f"turbospark convert {llama_src} DST")


def test_gguf_file_passed_to_open(tmp_path: Path, names) -> None:
    path = tmp_path / "model-Q4_0.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\0" * 64)
    with pytest.raises(NotAnInstallError) as e:
        turbospark_core.open(path)
    names(e, str(path), "GGUF file", "not a turbospark install", "turbospark convert")


def test_other_file_passed_to_open(f32_install: Path, names) -> None:
    path = f32_install / "model_weights.safetensors"
    with pytest.raises(NotAnInstallError) as e:
        turbospark_core.open(path)
    names(e, str(path), "not a turbospark install", "turbospark convert")


@pytest.mark.parametrize("name", ["mmproj-model-f16.gguf", "Qwen3-VL-MMPROJ-Q8_0.gguf"])
def test_mmproj_gguf_passed_to_open(tmp_path: Path, name: str, names) -> None:
    path = tmp_path / name
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\0" * 64)
    with pytest.raises(NotAnInstallError) as e:
        turbospark_core.open(path)
    names(e, name, "vision sidecar", "text model")


@pytest.mark.parametrize("model_type", ["siglip_vision_model", "clip_vision_model", "qwen3_vl_vision"])
def test_vision_sidecar_directory_passed_to_open(tmp_path: Path, model_type: str, names) -> None:
    sidecar = tmp_path / "vision"
    sidecar.mkdir()
    (sidecar / "config.json").write_text(json.dumps({"model_type": model_type, "image_size": 224}))
    (sidecar / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.5] * 3}))
    with pytest.raises(NotAnInstallError) as e:
        turbospark_core.open(sidecar, expert_slots=0)  # step 1 comes before the option check
    names(e, str(sidecar), "vision sidecar", repr(model_type), "text model")


def test_install_marked_as_a_vision_sidecar(install: Path, tamper, names) -> None:
    tamper.edit(install, lambda raw: raw.__setitem__("sidecar", "vision"))
    with pytest.raises(NotAnInstallError) as e:
        turbospark_core.open(install)
    names(e, str(install), "vision sidecar", "text model")


# ------------------------------------------------------------------ families
def test_unknown_family_names_installed_families_and_distribution(install: Path, tamper, names) -> None:
    def edit(raw: dict) -> None:
        raw["arch"]["model_type"] = "mamba9"
        raw["family"] = "mamba"
        raw["distribution"] = "turbospark-mamba"

    tamper.edit(install, edit)
    with pytest.raises(UnknownFamilyError) as e:
        turbospark_core.open(install)
    assert isinstance(e.value, LookupError) and not isinstance(e.value, ImportError)
    message = str(e.value)
    assert message.startswith("no installed plugin serves")  # no stray LookupError quotes
    names(message, "'mamba9'", "installed families: ", "llama (llama, qwen2", "install turbospark-mamba")


def test_unknown_family_without_a_recorded_distribution(install: Path, tamper, names) -> None:
    def edit(raw: dict) -> None:
        raw["arch"]["model_type"] = "mamba9"
        raw.pop("distribution")

    tamper.edit(install, edit)
    with pytest.raises(UnknownFamilyError) as e:
        turbospark_core.open(install)
    names(e, "'mamba9'", "llama (", "install the turbospark plugin distribution")


def test_serving_plugin_not_installed(f32_install: Path, no_plugins, names) -> None:
    with pytest.raises(UnknownFamilyError) as e:
        turbospark_core.open(f32_install)
    assert not isinstance(e.value, ImportError)
    names(e, "model type 'llama'", "installed families: none", "install turbospark-llama")


def test_plugins_come_back_after_the_allow_list_is_lifted(f32_install: Path) -> None:
    """The no_plugins fixture restores state: the family serves again."""
    assert turbospark_core.open(f32_install).opened.capabilities.family == "llama"


# ------------------------------------------------------------------ arch, hadamard, tensors
@pytest.mark.parametrize(("key", "value"), [("hidden_size", 0), ("num_hidden_layers", "2"), ("vocab_size", None)])
def test_invalid_arch_config(install: Path, tamper, key: str, value, names) -> None:
    tamper.edit(install, lambda raw: raw["arch"].__setitem__(key, value))
    with pytest.raises(ArchConfigError) as e:
        turbospark_core.open(install)
    names(e, "model type 'llama'", repr(key), repr(value))


def test_family_arch_check(install: Path, tamper, names) -> None:
    tamper.edit(install, lambda raw: raw["arch"].__setitem__("num_key_value_heads", 3))
    with pytest.raises(ArchConfigError) as e:
        turbospark_core.open(install)
    names(e, "model type 'llama'", "num_key_value_heads=3")


def _add_hadamard(root: Path, tamper, *, size: int = 64, declared: int | None = 64) -> None:
    """A well-formed hadamard section (the llama fixture's hidden size is 64) over ``size`` bytes of signs."""
    tamper.put_file(root, HADAMARD, np.ones(size, np.int8).tobytes())
    section = {
        "scheme": "randomized-hadamard", "seed": 0, "hidden_size": 64, "block": 64, "size": declared,
        "signs": {"offset": 0, "length": 64, "dtype": "int8"}, "folded": [], "online": [],
    }
    tamper.edit(root, lambda raw: raw.__setitem__("hadamard", section))


def test_hadamard_on_a_family_that_does_not_accept_it(install: Path, tamper, names, monkeypatch) -> None:
    from turbospark_core import plugins

    monkeypatch.setattr(plugins.FamilyHooks, "accepts_hadamard", lambda self, arch: False)
    _add_hadamard(install, tamper)
    with pytest.raises(FamilyRefusalError) as e:
        turbospark_core.open(install)
    names(e, "hadamard-folded", "family 'llama'", "model type 'llama'", "re-convert without hadamard")


def test_hadamard_section_size_disagrees_with_the_table(install: Path, tamper, names) -> None:
    _add_hadamard(install, tamper, size=64, declared=128)
    with pytest.raises(InstallError) as e:
        turbospark_core.open(install)
    names(e, HADAMARD, "128 bytes", "64")


def test_hadamard_section_without_its_file(install: Path, tamper, names) -> None:
    tamper.edit(install, lambda raw: raw.__setitem__("hadamard", {"block": 4}))
    with pytest.raises(FileTableError) as e:
        turbospark_core.open(install)
    names(e, repr(HADAMARD), "turbospark convert")


def test_tensor_the_family_does_not_use(install: Path, tamper, names) -> None:
    tensors = tamper.load_weights(install)
    tensors["model.layers.9.extra.weight"] = np.zeros((4, 4), np.float32)
    tamper.put_weights(install, tensors)
    with pytest.raises(InstallError) as e:
        turbospark_core.open(install)
    names(e, "'model.layers.9.extra.weight'", "family 'llama'", "turbospark convert")


def test_tensor_the_family_needs_is_missing(install: Path, tamper, names) -> None:
    tensors = tamper.load_weights(install)
    del tensors["model.norm.weight"]
    tamper.put_weights(install, tensors)
    with pytest.raises(InstallError) as e:
        turbospark_core.open(install)
    names(e, "'model.norm.weight'", "turbospark convert")


# ------------------------------------------------------------------ context
@pytest.fixture(scope="module")
def runner(f32_install: Path) -> turbospark_core.Runner:
    return turbospark_core.open(f32_install, max_context=64)


def test_generate_past_max_context(runner, references, names) -> None:
    prompt = references["prompt_ids"].tolist()  # 48 tokens
    with pytest.raises(ContextOverflowError) as e:
        runner.generate(prompt, max_tokens=17)
    names(e, "48 tokens", "max_tokens (17)", "max_context=64", "lower max_tokens", "larger max_context")
    assert len(runner.generate(prompt, max_tokens=16).tokens) <= 16  # exactly at the limit is fine


def test_logits_past_max_context(runner, names) -> None:
    with pytest.raises(ContextOverflowError) as e:
        runner.logits(list(range(65)))
    names(e, "65 tokens", "max_context=64", "larger max_context")
    assert runner.logits(list(range(64))).shape == (64, 512)


def test_model_level_cache_refuses_to_overflow(runner, names) -> None:
    cache = runner.opened.new_cache()
    runner.model(mx.array([list(range(60))]), cache)
    with pytest.raises(ContextOverflowError) as e:
        runner.model(mx.array([list(range(5))]), cache)
    names(e, "65 tokens", "max_context=64")


@pytest.mark.parametrize(("ids", "expected"), [([], "empty"), ([1, 512], "token id 512"), ([-1], "token id -1")])
def test_logits_bad_token_ids(runner, ids, expected: str, names) -> None:
    with pytest.raises(OptionError) as e:
        runner.logits(ids)
    names(e, expected)


def _incremental(model, cache, ids: list[int], cuts: list[int]) -> np.ndarray:
    outs = []
    for start, end in zip([0, *cuts], [*cuts, len(ids)], strict=True):
        out = model(mx.array([ids[start:end]]), cache)
        mx.eval(out)
        outs.append(np.array(out[0].astype(mx.float32)))
    return np.concatenate(outs)


def test_incremental_decode_equals_full_forward(runner, references) -> None:
    ids = references["prompt_ids"].tolist()
    opened = runner.opened
    full = np.array(opened.model(mx.array([ids]), opened.new_cache())[0].astype(mx.float32))
    # prefix chunks of 10 and 20, then one token at a time
    cuts = [10, 30, *range(31, len(ids))]
    inc = _incremental(opened.model, opened.new_cache(), ids, cuts)
    assert inc.shape == full.shape
    assert np.abs(inc - full).max() <= 1e-5
    assert np.abs(full - references["logits"]).max() <= 1e-4


def test_chunked_prefill_across_the_kv_growth_step(f32_install: Path) -> None:
    """Caches grow 256 tokens at a time: chunks and single steps crossing 256 change nothing."""
    opened = turbospark_core.open(f32_install, max_context=600).opened
    ids = np.random.default_rng(0).integers(0, 512, 300).tolist()
    full = np.array(opened.model(mx.array([ids]), opened.new_cache())[0].astype(mx.float32))
    cuts = [200, 250, *range(251, 262), 290]  # single tokens at 250..261 cross the step
    cache = opened.new_cache()
    inc = _incremental(opened.model, cache, ids, cuts)
    assert cache[0].offset == 300 and cache[0].keys.shape[2] == 512
    assert np.abs(inc - full).max() <= 1e-5


def test_runner_prefill_in_small_chunks_keeps_greedy_output(
    f32_install: Path, references, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = turbospark_core.open(f32_install)
    monkeypatch.setattr(runner_mod, "PREFILL_CHUNK", 7)
    out = runner.generate(references["prompt_ids"].tolist(), max_tokens=len(references["greedy_tokens"]))
    assert out.tokens == references["greedy_tokens"].tolist()

