"""``convert --calibrate``: GPTQ from the model's own inputs, on the tiny fixtures (inputs recorded through
the core's Linear, full-precision and sequential, every family's install opening, refusals)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import save_file

import turbospark_core
from turbospark_core.cli import main
from turbospark_core.convert import calibration, convert
from turbospark_core.convert.calibration import BUILTIN, CalibrationStore, Recorder, stage_of
from turbospark_core.errors import ConversionError, InstallError
from turbospark_core.loader import open_install
from turbospark_core.manifest import EXPERTS, WEIGHTS, load_manifest
from turbospark_core.options import OpenOptions
from turbospark_core.tensor_index import QuantSpec, read_header
from turbospark_core.tokenizer import Tokenizer

FIXTURES = Path(os.environ.get("TURBOSPARK_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures"))
TOKENS = 512  # calibration tokens in these tests (the fixtures' context is 256: two sequences)


def _src(name: str) -> Path:
    path = FIXTURES / name
    if not (path / "config.json").is_file():
        pytest.skip(f"reference fixture {path} is not available")
    return path


def _weights(root: Path) -> dict[str, mx.array]:
    return dict(mx.load(str(root / WEIGHTS)))  # type: ignore[arg-type]


def _header(root: Path) -> dict[str, Any]:
    header, _ = read_header(root / WEIGHTS, (root / WEIGHTS).stat().st_size)
    return {n: (e["dtype"], e["shape"]) for n, e in header.items() if n != "__metadata__"}


def _matrix(weights: dict[str, mx.array], base: str, quant: dict[str, Any]) -> np.ndarray:
    spec = QuantSpec(bits=quant["bits"], group_size=quant["group_size"])
    w = mx.dequantize(
        weights[f"{base}.weight"], weights[f"{base}.scales"], weights[f"{base}.biases"], spec.group_size, spec.bits
    )
    return np.array(w.astype(mx.float32), dtype=np.float64)


def _recorded(float_install: Path, bases: list[str], tokens: int) -> dict[str, np.ndarray]:
    """``X^T X`` of each base's inputs when the float install reads the bundled text (as convert segments it)."""
    recorder = Recorder()

    def store(path: Path, index: Any, policy: Any) -> CalibrationStore:
        return CalibrationStore(path, index, policy, recorder=recorder, targets=frozenset(bases))

    opened = open_install(float_install, OpenOptions(max_context=256), store=store)
    tokenizer = Tokenizer.from_install(float_install, opened.generation_config, lambda: None)
    ids = tokenizer.encode(BUILTIN.read_text())[:tokens]
    recorder.start(frozenset(bases))
    float_model = calibration._FloatModel(
        model=opened.model, new_cache=opened.new_cache, tokenizer=tokenizer, segment=256
    )
    float_model.run([ids[i : i + 256] for i in range(0, len(ids), 256)], recorder)
    return {b: np.array(recorder.sums[b], dtype=np.float64) for b in bases}


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The llama fixture at q4 group 32: round-to-nearest and --calibrate (full-precision inputs)."""
    root = tmp_path_factory.mktemp("calibration")
    rtn = root / "rtn"
    gptq = root / "gptq"
    convert(_src("llama"), rtn, quantize="q4", group_size=32)
    convert(_src("llama"), gptq, quantize="q4", group_size=32, calibrate=BUILTIN, calibrate_tokens=TOKENS)
    return rtn, gptq


# ------------------------------------------------------------------ the result


def test_calibrated_install_has_the_plain_quantized_layout(llama_pair: tuple[Path, Path]) -> None:
    """Same tensors, dtypes, shapes and quantization table as round-to-nearest's: an ordinary install."""
    rtn, gptq = llama_pair
    assert _header(gptq) == _header(rtn)
    plain, calibrated = load_manifest(rtn), load_manifest(gptq)
    assert calibrated.quantization == plain.quantization
    record = calibrated.provenance["calibration"]
    assert record["method"] == "gptq" and record["inputs"] == "full-precision"
    assert record["tokens"] == TOKENS and record["segment"] == 256 and record["text"] == str(BUILTIN)
    assert record["gptq"] == 15  # 2 layers x 7 matrices and the (untied) head
    assert record["round_to_nearest"] == ["model.embed_tokens"]  # gathered rows: not inputs times the matrix
    options = calibrated.provenance["options"]
    assert options["calibrate"] == str(BUILTIN) and options["calibrate_tokens"] == TOKENS
    logits = turbospark_core.open(gptq).logits(list(range(1, 40)))
    assert np.isfinite(logits).all()


def test_every_solved_matrix_beats_round_to_nearest_on_its_inputs(
    llama_pair: tuple[Path, Path], f32_install: Path
) -> None:
    """The layer error tr((W - Q) X^T X (W - Q)^T) on the calibration inputs (recorded independently here,
    through a float install) is strictly below round-to-nearest's for every matrix GPTQ solved; the embedding,
    left to rounding, is round-to-nearest's bit for bit."""
    rtn, gptq = llama_pair
    manifest = load_manifest(gptq)
    solved = sorted(set(manifest.quantization) - set(manifest.provenance["calibration"]["round_to_nearest"]))
    h = _recorded(f32_install, solved, TOKENS)
    floats, plain, calibrated = _weights(f32_install), _weights(rtn), _weights(gptq)
    for base in solved:
        w = np.array(floats[f"{base}.weight"], dtype=np.float64)
        quant = manifest.quantization[base]
        errors = [np.trace(d @ h[base] @ d.T) for d in (w - _matrix(q, base, quant) for q in (calibrated, plain))]
        assert errors[0] < 0.9 * errors[1], base
    for leaf in ("weight", "scales", "biases"):
        name = f"model.embed_tokens.{leaf}"
        assert mx.array_equal(calibrated[name], plain[name]).item()


def test_deterministic(llama_pair: tuple[Path, Path], tmp_path: Path) -> None:
    _, gptq = llama_pair
    again = convert(
        _src("llama"), tmp_path / "again", quantize="q4", group_size=32, calibrate=BUILTIN, calibrate_tokens=TOKENS
    )
    assert (again.root / WEIGHTS).read_bytes() == (gptq / WEIGHTS).read_bytes()


def test_sequential_inputs_go_through_the_quantized_layers(llama_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """Layer 0 reads the same inputs either way (nothing before it is quantized): bit-identical matrices.
    Layer 1 and the head read layer 0's quantized outputs when sequential: different matrices."""
    _, full = llama_pair
    seq = convert(
        _src("llama"),
        tmp_path / "seq",
        quantize="q4",
        group_size=32,
        calibrate=BUILTIN,
        calibrate_tokens=TOKENS,
        calibrate_sequential=True,
    )
    assert seq.provenance["calibration"]["inputs"] == "sequential"
    a, b = _weights(full), _weights(seq.root)
    for base in seq.quantization:
        same = mx.array_equal(a[f"{base}.weight"], b[f"{base}.weight"]).item()
        if base == "model.embed_tokens" or stage_of(base) == 0:
            assert same, base
        elif base != "model.layers.1.mlp.down_proj":  # a matrix may come out equal by chance; most must not
            assert not same, base


def test_rotated_and_calibrated(tmp_path: Path, f32_install: Path) -> None:
    """--rotate composes: the float model GPTQ reads is the rotated one (the install carries the section),
    and its logits stay near the float model's."""
    m = convert(
        _src("llama"),
        tmp_path / "rot",
        quantize="q8",
        group_size=32,
        rotate=True,
        calibrate=BUILTIN,
        calibrate_tokens=256,
    )
    assert m.hadamard is not None and m.provenance["calibration"]["gptq"] == 15
    ids = list(range(1, 40))
    got = turbospark_core.open(m.root).logits(ids)
    want = turbospark_core.open(f32_install).logits(ids)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


@pytest.mark.parametrize(
    ("fixture", "rounded"),
    [
        ("qwen3", {"model.embed_tokens"}),  # tied head: the embedding is gathered
        ("qwen3_moe", {"model.embed_tokens"}),  # routed experts: stacks, rounded (see below)
        ("qwen3_5_moe_mtp", {"model.embed_tokens"}),  # hybrid attention; the MTP head rounded in mtp.safetensors
        ("gemma4_e", None),
    ],
)
def test_families_open_calibrated(fixture: str, rounded: set[str] | None, tmp_path: Path) -> None:
    """Any family's install: the flow's matrices are solved through the core's Linear, whatever the family;
    expert stacks stay round-to-nearest's (bit for bit), and the install opens as the plain one does."""
    src = _src(fixture)
    plain = convert(src, tmp_path / "rtn", quantize="q8", group_size=32)
    m = convert(src, tmp_path / "gptq", quantize="q8", group_size=32, calibrate=BUILTIN, calibrate_tokens=256)
    assert _header(m.root) == _header(plain.root) and m.quantization == plain.quantization
    record = m.provenance["calibration"]
    assert record["gptq"] > 0
    if rounded is not None:
        assert rounded <= set(record["round_to_nearest"])
    moe = m.experts is not None
    if moe:  # routed experts: experts.bin, rounded to nearest
        assert (m.root / EXPERTS).read_bytes() == (plain.root / EXPERTS).read_bytes()
    ids = list(range(1, 30))
    got = turbospark_core.open(m.root).logits(ids)
    assert np.isfinite(got).all()
    if not moe:  # (the MoE fixtures' routing choices lead by 2e-4: any rounding may reroute a token)
        want = turbospark_core.open(plain.root).logits(ids)
        assert np.abs(got - want).max() < 0.1 * np.abs(want).max()


def test_cli_calibrate_alone_uses_the_bundled_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "inst"
    args = ["convert", str(_src("llama")), str(dst), "--quantize", "q4", "--group-size", "32"]
    assert main([*args, "--calibrate", "--calibrate-tokens", "256", "-q"]) == 0
    assert "16 quantized matrices" in capsys.readouterr().out
    assert load_manifest(dst).provenance["calibration"]["text"] == str(BUILTIN)


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("options", "parts"),
    [
        ({"calibrate": BUILTIN}, ("--calibrate", "add --quantize")),
        ({"calibrate_tokens": 512, "quantize": "q4"}, ("--calibrate-tokens", "add --calibrate")),
        ({"calibrate_sequential": True, "quantize": "q4"}, ("--calibrate-sequential", "add --calibrate")),
        ({"calibrate": BUILTIN, "calibrate_tokens": 100, "quantize": "q4"}, ("--calibrate-tokens 100", "128")),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], parts: tuple[str, ...], tmp_path: Path, names) -> None:
    with pytest.raises(ConversionError) as e:
        convert(_src("llama"), tmp_path / "dst", **options)
    names(e, *parts)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize(
    ("content", "parts"),
    [
        (None, ("no file", "UTF-8 text file")),
        (b"  \n\n", ("is empty", "at least 128 tokens")),
        (b"\xff\xfe\x00bad", ("cannot read", "as UTF-8")),
        (b"Too short to calibrate anything.", ("is ", " tokens", "at least 128", "longer text")),
    ],
)
def test_bad_texts_are_refused(content: bytes | None, parts: tuple[str, ...], tmp_path: Path, names) -> None:
    text = tmp_path / "calib.txt"
    if content is not None:
        text.write_bytes(content)
    with pytest.raises(ConversionError) as e:
        convert(_src("llama"), tmp_path / "dst", quantize="q4", group_size=32, calibrate=text)
    names(e, str(text), *parts)
    assert not (tmp_path / "dst").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["calib.txt"] or not content  # no staging left behind


def test_drafter_source_is_refused(tmp_path: Path, names) -> None:
    with pytest.raises(ConversionError) as e:
        convert(_src("llama_dflash") / "dflash", tmp_path / "dst", quantize="q4", calibrate=BUILTIN)
    names(e, "DFlash drafter", "without --calibrate")


def test_already_quantized_source_is_refused(mlx_q4_dir: Path, tmp_path: Path, names) -> None:
    with pytest.raises(ConversionError) as e:
        convert(mlx_q4_dir, tmp_path / "dst", quantize="q4", group_size=32, calibrate=BUILTIN)
    names(e, "no float matrix", "quantized already", "without --calibrate")
    assert not (tmp_path / "dst").exists()


def test_family_that_calls_no_linear_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, names) -> None:
    """A flow that multiplies by matrices it reads as plain tensors gives GPTQ no inputs: refused by name."""
    plugin = pytest.importorskip("turbospark_dummy.plugin")

    class OwnMatmul:
        def __init__(self, context: Any) -> None:
            self.embed_tokens = context.weights.embedding("model.embed_tokens")
            self.head = context.weights.tensor("lm_head.weight")

        def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
            return self.embed_tokens(inputs) @ self.head.T

        @property
        def layers(self) -> list[Any]:
            return []

    monkeypatch.setattr(plugin, "BigramModel", OwnMatmul)
    src = tmp_path / "bigram"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "dummy_lm", "hidden_size": 64, "vocab_size": 512}))
    rng = np.random.default_rng(0)
    tables = {
        n: rng.standard_normal((512, 64)).astype(np.float32) for n in ("model.embed_tokens.weight", "lm_head.weight")
    }
    save_file(tables, str(src / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(_src("llama") / name, src / name)
    with pytest.raises(ConversionError) as e:
        convert(src, tmp_path / "dst", quantize="q4", group_size=32, calibrate=BUILTIN, calibrate_tokens=256)
    names(e, "family 'dummy'", "'dummy_lm'", "calls none of the", "without --calibrate")
    assert not (tmp_path / "dst").exists()


def test_float_model_the_runtime_cannot_open_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, names) -> None:
    """The runtime's own refusal of the temporary float install is passed on, naming the cause and the way out;
    neither the destination nor the staging directory (with that temporary install) is left behind."""
    from turbospark_core import loader

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise InstallError("the arch config has no 'num_attention_heads'")

    monkeypatch.setattr(loader, "open_install", refuse)
    with pytest.raises(ConversionError) as e:
        convert(_src("llama"), tmp_path / "dst", quantize="q4", group_size=32, calibrate=BUILTIN)
    names(e, "does not open for calibration", "num_attention_heads", "convert without --calibrate")
    assert list(tmp_path.iterdir()) == []
