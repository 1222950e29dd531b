"""Steering: direction files (safetensors, GGUF control vectors), open step 14.

Also per-request and per-row edits, and refusals.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import save_file

import turbospark_core
from turbospark_core.convert import convert
from turbospark_core.errors import FamilyRefusalError, OptionError
from turbospark_core.steering import (
    DirectionFileError,
    DirectionMismatchError,
    DirectionSet,
    DirectionValueError,
    Edit,
    SteeringError,
    applying,
    fingerprint,
    parse_layers,
    steer,
)
from turbospark_core.testing import write_word_tokenizer

HIDDEN, LAYERS = 64, 2  # the llama fixture


@pytest.fixture(scope="module")
def runner(f32_install: Path) -> turbospark_core.Runner:
    return turbospark_core.open(f32_install)


@pytest.fixture
def prompt(references: dict[str, np.ndarray]) -> list[int]:
    return references["prompt_ids"].tolist()


def _unit(seed: int = 0, size: int = HIDDEN) -> np.ndarray:
    d = np.random.default_rng(seed).standard_normal(size).astype(np.float32)
    return d / np.linalg.norm(d)


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None) -> Path:
    save_file(tensors, str(path), metadata=metadata)
    return path


def _write_control_vector(path: Path, tensors: dict[str, np.ndarray], arch: str = "controlvector") -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string(f"{arch}.model_hint", "llama")
    writer.add_uint32(f"{arch}.layer_count", len(tensors))
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ------------------------------------------------------------------ the file format
def test_safetensors_round_trip(tmp_path: Path) -> None:
    made = DirectionSet.from_arrays({1: _unit(1), 0: _unit(0)}, mode="add", scale=2.5, model_type="llama")
    path = made.save(tmp_path / "set.safetensors")
    back = DirectionSet.load(path)
    assert (back.mode, back.scale, back.model_type, back.layers, back.hidden_size) == ("add", 2.5, "llama", (0, 1), 64)
    assert all(np.array_equal(back.directions[i], made.directions[i]) for i in (0, 1))
    assert back.source == str(path)


def test_from_arrays_takes_a_layers_by_hidden_array() -> None:
    arr = np.stack([_unit(0), _unit(1)])
    made = DirectionSet.from_arrays(arr, mode="ablate")
    assert made.layers == (0, 1) and made.scale == 1.0 and np.array_equal(made.directions[1], arr[1])
    with pytest.raises(DirectionValueError, match="num_layers, hidden_size"):
        DirectionSet.from_arrays(_unit(0), mode="ablate")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "subtract"}, "mode 'subtract' is invalid"),
        ({"scale": float("nan")}, "scale=nan is invalid"),
        ({"directions": {0: np.full(HIDDEN, np.nan, np.float32)}}, "layer 0 holds NaN"),
        ({"directions": {0: np.full(HIDDEN, np.inf, np.float32)}}, "layer 0 holds NaN or infinite"),
        ({"directions": {}}, "at least one layer"),
        ({"directions": {-1: _unit()}}, "layer -1 is invalid"),
        ({"directions": {0: _unit(), 1: _unit(size=32)}}, "different sizes"),
        ({"directions": {0: np.zeros((2, 2), np.float32)}}, r"shape \(2, 2\)"),
    ],
)
def test_bad_values_are_refused_by_name(kwargs: dict, match: str) -> None:
    args = {"mode": "add", "scale": 1.0, "directions": {0: _unit()}} | kwargs
    with pytest.raises(DirectionValueError, match=match):
        DirectionSet(**args)


def test_bad_files_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(DirectionFileError, match="does not exist"):
        DirectionSet.load(tmp_path / "missing.safetensors")
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"abc")
    with pytest.raises(DirectionFileError, match="too short"):
        DirectionSet.load(short)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(DirectionFileError, match="declares a 1099511627776-byte header"):
        DirectionSet.load(huge)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(DirectionFileError, match="unreadable safetensors header"):
        DirectionSet.load(garbage)
    meta = {"mode": "add", "scale": "1"}
    f16 = _write_safetensors(tmp_path / "f16.safetensors", {"direction.0": _unit().astype(np.float16)}, meta)
    with pytest.raises(DirectionFileError, match="must be float32 of shape"):
        DirectionSet.load(f16)
    other = _write_safetensors(tmp_path / "other.safetensors", {"lm_head.weight": _unit()}, meta)
    with pytest.raises(DirectionFileError, match=r"holds tensor 'lm_head\.weight'"):
        DirectionSet.load(other)
    no_mode = _write_safetensors(tmp_path / "nomode.safetensors", {"direction.0": _unit()}, {"scale": "1"})
    with pytest.raises(DirectionFileError, match="no 'mode' metadata"):
        DirectionSet.load(no_mode)
    bad_mode = _write_safetensors(tmp_path / "badmode.safetensors", {"direction.0": _unit()}, {"mode": "steer"})
    with pytest.raises(DirectionValueError, match="mode 'steer'"):
        DirectionSet.load(bad_mode)
    nan = _write_safetensors(tmp_path / "nan.safetensors", {"direction.3": np.full(8, np.nan, np.float32)}, meta)
    with pytest.raises(DirectionValueError, match="layer 3 holds NaN"):
        DirectionSet.load(nan)
    lying = _write_safetensors(tmp_path / "lying.safetensors", {"direction.0": _unit()}, meta | {"hidden_size": "32"})
    with pytest.raises(DirectionFileError, match="says hidden_size 32"):
        DirectionSet.load(lying)


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    path = DirectionSet.from_arrays({0: _unit()}, mode="add").save(tmp_path / "set.safetensors")
    path.write_bytes(path.read_bytes()[:-16])
    with pytest.raises(DirectionFileError, match=r"offsets .* outside the data"):
        DirectionSet.load(path)


def test_layer_ranges() -> None:
    assert parse_layers("4:12") == (4, 12) and parse_layers(":3") == (0, 3) and parse_layers("2:")[0] == 2
    for bad in ("4", "a:b", "5:5", "6:2"):
        with pytest.raises(DirectionValueError, match="steering layers"):
            parse_layers(bad)
    made = DirectionSet.from_arrays({0: _unit(0), 1: _unit(1), 5: _unit(5)}, mode="add")
    assert made.with_layers(1, 6).layers == (1, 5)
    with pytest.raises(DirectionMismatchError, match="keep none"):
        made.with_layers(2, 5)


# ------------------------------------------------------------------ GGUF control vectors
def test_gguf_control_vector_maps_direction_k_to_the_output_of_layer_k(tmp_path: Path, runner, prompt) -> None:
    d1 = _unit(1)
    path = _write_control_vector(tmp_path / "cv.gguf", {"direction.1": d1})
    cv = DirectionSet.load(path)
    assert (cv.mode, cv.scale, cv.layers, cv.model_type) == ("add", 1.0, (1,), None)
    # llama.cpp: direction.k is added to l_out of block k (0-based), at every position
    plain = runner.capture([prompt], position="all", steering=False)[0]
    steered = runner.capture([prompt], position="all", steering=cv.with_scale(3.0))[0]
    assert np.array_equal(steered[:, 0], plain[:, 0])
    np.testing.assert_allclose(steered[:, 1] - plain[:, 1], np.broadcast_to(3.0 * d1, plain[:, 1].shape), atol=2e-5)


def test_gguf_control_vector_refusals(tmp_path: Path) -> None:
    zero = _write_control_vector(tmp_path / "zero.gguf", {"direction.0": _unit()})
    with pytest.raises(DirectionFileError, match=r"direction\.0"):
        DirectionSet.load(zero)
    model = _write_control_vector(tmp_path / "model.gguf", {"direction.1": _unit()}, arch="llama")
    with pytest.raises(DirectionFileError, match="architecture 'llama', not a control vector"):
        DirectionSet.load(model)
    odd = _write_control_vector(tmp_path / "odd.gguf", {"token_embd.weight": _unit()})
    with pytest.raises(DirectionFileError, match=r"holds tensor 'token_embd\.weight'"):
        DirectionSet.load(odd)
    f16 = _write_control_vector(tmp_path / "f16.gguf", {"direction.2": _unit().astype(np.float16)})
    with pytest.raises(DirectionFileError, match="F16; control vector tensors are F32"):
        DirectionSet.load(f16)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 7)
    with pytest.raises(DirectionFileError, match=r"broken\.gguf"):
        DirectionSet.load(broken)


# ------------------------------------------------------------------ open step 14
def test_open_reads_checks_and_times_the_set(f32_install: Path, tmp_path: Path, prompt) -> None:
    dset = DirectionSet.from_arrays({1: _unit()}, mode="add", scale=4.0, model_type="llama")
    path = dset.save(tmp_path / "s.safetensors")
    steered = turbospark_core.open(f32_install, steering=str(path))
    assert steered.steering is not None and steered.steering.layers == (1,) and steered.startup_stats.steering > 0
    plain = turbospark_core.open(f32_install)
    assert plain.steering is None and plain.startup_stats.steering == 0.0
    # the open's set applies to every request that names none; False turns it off for one request
    want = plain.logits(prompt, steering=steered.steering)
    assert np.array_equal(steered.logits(prompt), want)
    assert np.array_equal(steered.logits(prompt, steering=False), plain.logits(prompt))
    assert steered.generate(prompt, max_tokens=3, temperature=0.0).tokens == plain.generate(
        prompt, max_tokens=3, temperature=0.0, steering=steered.steering
    ).tokens


@pytest.mark.parametrize(
    ("directions", "extra", "match"),
    [
        ({0: _unit(size=32)}, {}, "32-dim directions but model type 'llama' has hidden_size 64"),
        ({2: _unit()}, {}, "steers layer 2 but the model has 2 decoder layers"),
        ({0: _unit()}, {"model_type": "qwen3"}, "computed on model type 'qwen3', not 'llama'"),
    ],
)
def test_open_refuses_a_set_that_does_not_fit(f32_install: Path, directions, extra, match) -> None:
    with pytest.raises(DirectionMismatchError, match=match):
        turbospark_core.open(f32_install, steering=DirectionSet.from_arrays(directions, mode="add", **extra))


def test_open_refuses_bad_steering_options(f32_install: Path, tmp_path: Path) -> None:
    with pytest.raises(OptionError, match="steering=42 is invalid"):
        turbospark_core.open(f32_install, steering=42)  # type: ignore[arg-type]
    with pytest.raises(DirectionFileError, match="does not exist"):
        turbospark_core.open(f32_install, steering=tmp_path / "nope.safetensors")


def test_per_request_sets_are_checked(runner, prompt) -> None:
    with pytest.raises(DirectionMismatchError, match="steers layer 7"):
        runner.generate(prompt, max_tokens=1, steering=DirectionSet.from_arrays({7: _unit()}, mode="add"))
    with pytest.raises(OptionError, match="steering='x' is invalid"):
        runner.logits(prompt, steering="x")  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="capture layer 5 is invalid"):
        runner.capture([prompt], layers=[5])
    with pytest.raises(OptionError, match="position='first'"):
        runner.capture([prompt], position="first")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def dummy_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An install of the test plugin's family, whose steering_supported refuses."""
    src = tmp_path_factory.mktemp("dummy") / "hf"
    src.mkdir()
    rng = np.random.default_rng(0)
    names = ("model.embed_tokens.weight", "lm_head.weight")
    tensors = {name: rng.standard_normal((32, 16)).astype(np.float32) for name in names}
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps({"model_type": "dummy_lm", "hidden_size": 16, "vocab_size": 32}))
    write_word_tokenizer(src, 32)
    dst = src.parent / "install"
    convert(src, dst)
    return dst


def test_a_family_that_cannot_steer_refuses_by_name(dummy_install: Path) -> None:
    steering = DirectionSet.from_arrays({0: _unit(size=16)}, mode="add")
    with pytest.raises(FamilyRefusalError, match=r"steering refused by family 'dummy'.*no decoder layers to steer"):
        turbospark_core.open(dummy_install, steering=steering)
    runner = turbospark_core.open(dummy_install)
    assert runner.opened.capabilities.steering_refusal == "the bigram flow has no decoder layers to steer"
    assert not runner.opened.capabilities.steering
    with pytest.raises(FamilyRefusalError, match="family 'dummy'"):
        runner.generate([3, 4], max_tokens=1, steering=steering)
    with pytest.raises(FamilyRefusalError, match="family 'dummy'"):
        runner.capture([[3, 4]])
    assert len(runner.generate([3, 4], max_tokens=2, temperature=0.0).tokens) <= 2  # unsteered still works


# ------------------------------------------------------------------ the edit
def test_steer_is_the_identity_with_nothing_active() -> None:
    h = mx.ones((1, 2, 4))
    assert steer(h, 0) is h
    with applying(Edit({})):
        assert steer(h, 0) is h


def test_a_flow_that_skips_steer_is_caught() -> None:
    edit = DirectionSet.from_arrays({1: np.ones(4, np.float32)}, mode="add").edit()
    with (
        pytest.raises(SteeringError, match="family 'toy' never passed decoder layer 1's output"),
        applying(edit, family="toy"),
    ):
        steer(mx.ones((1, 1, 4)), 0)


def test_rows_of_one_batch_get_their_own_edits(runner, prompt) -> None:
    """Per-row steering inside one batched forward: each row equals its own single-row run."""
    add = DirectionSet.from_arrays({0: _unit(3)}, mode="add", scale=5.0)
    ablate = DirectionSet.from_arrays({0: _unit(4), 1: _unit(4)}, mode="ablate")
    rows = [add, None, ablate]
    ids = mx.array([prompt] * 3)
    with applying(Edit.of_rows(rows)):
        batch = np.array(runner.model(ids, runner.opened.new_cache()))
    for r, s in enumerate(rows):
        alone = runner.logits(prompt, steering=s if s is not None else False)
        assert np.abs(batch[r] - alone).max() <= 1e-4 * np.abs(alone).max(), r
    plain = np.array(runner.model(mx.array([prompt]), runner.opened.new_cache()))[0]
    assert np.array_equal(batch[1], runner.logits(prompt)) or np.abs(batch[1] - plain).max() <= 1e-5


def test_partial_ablation_scale(runner, prompt) -> None:
    d = _unit(5)
    full = runner.capture([prompt], layers=[0], steering=DirectionSet.from_arrays({0: d}, mode="ablate"))[0, 0]
    plain = runner.capture([prompt], layers=[0], steering=False)[0, 0]
    half = runner.capture([prompt], layers=[0], steering=DirectionSet.from_arrays({0: d}, mode="ablate", scale=0.5))
    assert abs(float(full @ d)) <= 1e-5 * np.linalg.norm(full)
    np.testing.assert_allclose(half[0, 0] @ d, 0.5 * (plain @ d), rtol=1e-4)


def test_capture_positions(runner, prompt) -> None:
    every = runner.capture([prompt, prompt[:10]], position="all", steering=False)
    assert [a.shape for a in every] == [(len(prompt), 2, HIDDEN), (10, 2, HIDDEN)]
    last = runner.capture([prompt, prompt[:10]], steering=False)
    mean = runner.capture([prompt, prompt[:10]], layers=[1], position="mean", steering=False)
    assert last.shape == (2, 2, HIDDEN) and mean.shape == (2, 1, HIDDEN)
    assert np.array_equal(last[1], every[1][-1])
    np.testing.assert_allclose(mean[0, 0], every[0][:, 1].mean(axis=0), rtol=1e-5, atol=1e-6)


def test_a_parked_session_is_not_reused_under_other_steering(runner, prompt) -> None:
    add = DirectionSet.from_arrays({0: _unit(6)}, mode="add", scale=2.0)
    session = runner.session("steer")
    session.reset()
    steered = session.generate(prompt, max_tokens=4, temperature=0.0, steering=add)
    assert steered.tokens == runner.generate(prompt, max_tokens=4, temperature=0.0, steering=add).tokens
    state = runner.sessions.acquire("steer")
    assert runner.cached_steering(state) == fingerprint(add) is not None  # what its caches were filled under
    plain = session.generate(prompt, max_tokens=4, temperature=0.0)
    assert runner.cached_steering(state) is None
    assert plain.stats.reused_tokens == 0  # the parked caches hold steered residuals
    assert plain.tokens == runner.generate(prompt, max_tokens=4, temperature=0.0).tokens
    assert session.generate(prompt, max_tokens=4, temperature=0.0).stats.reused_tokens > 0
    again = session.generate(prompt, max_tokens=4, temperature=0.0, steering=add.with_scale(2.0))
    assert again.stats.reused_tokens == 0 and again.tokens == steered.tokens
    session.reset()
