"""Hostile install files found by the fuzzing: each was an escape (not a TurbosparkError), now a named refusal."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

import turbospark_core
from turbospark_core.errors import FileTableError, InstallError, ManifestError, TensorStorageError, TokenizerError
from turbospark_core.manifest import MANIFEST, WEIGHTS

BOMB = b"[" * 100000 + b"]" * 100000  # was RecursionError
HUGE_INT = b"1" * 5000  # was ValueError: Exceeds the limit (4300 digits) for integer string conversion


@pytest.mark.parametrize("text", [BOMB, b'{"format": ' + HUGE_INT + b"}"])
def test_a_manifest_nesting_bomb_or_huge_integer_is_a_manifest_error(install: Path, names, text: bytes) -> None:
    (install / MANIFEST).write_bytes(text)
    with pytest.raises(ManifestError) as err:
        turbospark_core.open(install)
    names(err, MANIFEST, "not valid JSON", "turbospark convert")


@pytest.mark.parametrize("body", [BOMB, b'{"a": ' + HUGE_INT + b"}"])
def test_a_safetensors_header_nesting_bomb_or_huge_integer_is_refused(
    install: Path, tamper, names, body: bytes
) -> None:
    tamper.put_weights_raw(install, None, b"", header_bytes=body)
    with pytest.raises(InstallError) as err:
        turbospark_core.open(install)
    names(err, WEIGHTS, "unreadable safetensors header")


@pytest.mark.parametrize(
    ("name", "error"), [("tokenizer_config.json", TokenizerError), ("generation_config.json", InstallError)]
)
@pytest.mark.parametrize("text", [BOMB, b"{" + b'"a": ' + HUGE_INT + b"}"])
def test_tokenizer_and_generation_configs_refuse_bombs(
    install: Path, tamper, names, name: str, error: type[Exception], text: bytes
) -> None:
    tamper.put_file(install, name, text)
    with pytest.raises(error) as err:
        turbospark_core.open(install)
    names(err, name, "not valid JSON")


@pytest.mark.parametrize(
    "config",
    [b"[1, 2]", b'"text"', b'{"chat_template": 7}', b'{"chat_template": [{"name": "default", "template": 7}]}'],
)
def test_a_malformed_tokenizer_config_is_a_tokenizer_error(install: Path, tamper, names, config: bytes) -> None:
    tamper.put_file(install, "tokenizer_config.json", config)
    with pytest.raises(TokenizerError) as err:  # was AttributeError, or a TypeError at the first chat
        turbospark_core.open(install)
    names(err, "tokenizer_config.json")


def test_named_chat_templates_use_the_default(install: Path, tamper) -> None:
    config = json.loads((install / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ 1 }}"}]
    tamper.put_file(install, "tokenizer_config.json", json.dumps(config).encode())
    runner = turbospark_core.open(install)
    assert runner.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "D1"


def test_a_token_text_that_is_not_a_string_is_ignored(install: Path, tamper) -> None:
    config = json.loads((install / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": ["</s>"]}  # was TypeError inside tokenizers
    tamper.put_file(install, "tokenizer_config.json", json.dumps(config).encode())
    assert turbospark_core.open(install).tokenizer.eos_token is None


@pytest.mark.parametrize(
    "entry", [{"bits": [4], "group_size": 64}, {"bits": 4, "group_size": {}}, {"mode": ["affine"]}]
)
def test_a_quantization_entry_of_unhashable_values_is_refused(q4_copy: Path, tamper, names, entry: dict) -> None:
    def edit(raw: dict) -> None:
        name = sorted(raw["quantization"])[0]
        raw["quantization"][name] = entry

    tamper.edit(q4_copy, edit)
    with pytest.raises(TensorStorageError) as err:  # was TypeError: unhashable type
        turbospark_core.open(q4_copy)
    names(err, "no kernel here")


def test_a_packed_matrix_without_two_dimensions_is_refused(q4_copy: Path, tamper, names) -> None:
    header, data = tamper.weights_header(q4_copy)
    name = next(n for n in sorted(header) if n.endswith(".weight") and header[n]["dtype"] == "U32")
    start = header[name]["data_offsets"][0]
    header[name] = {"dtype": "U32", "shape": [], "data_offsets": [start, start + 4]}  # was IndexError in float_bytes
    tamper.put_weights_raw(q4_copy, header, data)
    with pytest.raises(TensorStorageError) as err:
        turbospark_core.open(q4_copy)
    names(err, name, "at least two dimensions")


def test_a_tensor_with_too_many_dimensions_is_refused(install: Path, tamper, names) -> None:
    header, data = tamper.weights_header(install)
    name = sorted(n for n in header if n != "__metadata__")[0]
    header[name]["shape"] = [2**62] * 10000  # the shape arithmetic alone would take seconds
    tamper.put_weights_raw(install, header, data)
    with pytest.raises(InstallError) as err:
        turbospark_core.open(install)
    names(err, name, "at most 8")


@pytest.mark.parametrize(("key", "value"), [("family", ["llama"]), ("distribution", {"a": 1})])
def test_family_and_distribution_must_be_strings(install: Path, tamper, names, key: str, value: object) -> None:
    tamper.edit(install, lambda raw: raw.__setitem__(key, value))
    with pytest.raises(ManifestError) as err:
        turbospark_core.open(install)
    names(err, repr(key), "string or null")


@pytest.mark.parametrize("digest", [{"x": 1}, 7, "abc"])
def test_a_sha256_that_is_not_64_hex_digits_is_refused(install: Path, tamper, names, digest: object) -> None:
    tamper.edit(install, lambda raw: raw["files"][WEIGHTS].__setitem__("sha256", digest))
    with pytest.raises(FileTableError) as err:
        turbospark_core.open(install)
    names(err, WEIGHTS, "64 hex digits")


def test_an_experts_dtype_that_is_not_a_string_is_refused(names) -> None:
    from turbospark_core.experts.layout import ExpertTensor

    with pytest.raises(TensorStorageError) as err:  # was TypeError: unhashable type: 'list'
        ExpertTensor.from_json({"dtype": ["F32"], "shape": [2, 2], "offset": 0}, "experts.bin layer 0")
    names(err, "experts.bin layer 0", "no kernel here")


def test_the_length_prefix_is_the_only_trusted_size(install: Path, tamper, names) -> None:
    blob = (install / WEIGHTS).read_bytes()
    tamper.put_file(install, WEIGHTS, struct.pack("<Q", 2**64 - 1) + blob[8:])
    with pytest.raises(InstallError) as err:
        turbospark_core.open(install)
    names(err, WEIGHTS, "header")


def test_a_token_text_with_a_lone_surrogate_is_ignored(install: Path, tamper) -> None:
    config = json.loads((install / "tokenizer_config.json").read_text())
    config["bos_token"] = "\ud800"  # was UnicodeEncodeError inside tokenizers (found by the long fuzz run)
    tamper.put_file(install, "tokenizer_config.json", json.dumps(config).encode())
    assert turbospark_core.open(install).tokenizer.bos_token is None


class _Panic(BaseException):
    """Stands for pyo3's PanicException, which the tokenizers library raises when a Rust panic crosses into Python."""


def test_a_tokenizer_panic_is_a_tokenizer_error(install: Path, names) -> None:
    tok = turbospark_core.open(install).tokenizer

    class Panicking:
        def encode(self, *args: object, **kwargs: object) -> None:
            raise _Panic("slice index starts at 1 but ends at 0")  # seen in the long fuzz run

        decode = token_to_id = encode

    tok._tok = Panicking()  # type: ignore[assignment]
    for call in (lambda: tok.encode("hi"), lambda: tok.decode([1]), lambda: tok.token_to_id("a")):
        with pytest.raises(TokenizerError) as err:
            call()
        names(err, "the install's tokenizer failed", "slice index")
