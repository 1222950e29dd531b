"""``open(..., verify=True)``: every file's sha256 is checked against the file table before use."""

from __future__ import annotations

from pathlib import Path

import pytest

import turbospark_core
from turbospark_core.errors import FileTableError, OptionError
from turbospark_core.manifest import WEIGHTS


def _flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_clean_install_opens_with_verify(install: Path) -> None:
    runner = turbospark_core.open(install, verify=True)
    assert runner is not None


def test_a_bit_flip_in_the_weights_is_caught_by_verify(install: Path, names) -> None:
    _flip_bit(install / WEIGHTS, (install / WEIGHTS).stat().st_size - 3)  # in a tensor's data, same size
    turbospark_core.open(install)  # without verify, the size check cannot see it
    with pytest.raises(FileTableError) as err:
        turbospark_core.open(install, verify=True)
    names(err, WEIGHTS, "sha256", "turbospark convert")


def test_a_bit_flip_in_a_tokenizer_file_is_caught(install: Path, names) -> None:
    _flip_bit(install / "tokenizer.json", 10)
    with pytest.raises(FileTableError) as err:
        turbospark_core.open(install, verify=True)
    names(err, "tokenizer.json", "sha256")


def test_a_file_without_a_recorded_sha256_is_refused_by_verify(install: Path, tamper, names) -> None:
    tamper.edit(install, lambda raw: raw["files"][WEIGHTS].__setitem__("sha256", ""))
    with pytest.raises(FileTableError) as err:
        turbospark_core.open(install, verify=True)
    names(err, WEIGHTS, "no sha256", "without verify")


def test_verify_must_be_a_bool(install: Path, names) -> None:
    with pytest.raises(OptionError) as err:
        turbospark_core.open(install, verify="yes")  # type: ignore[arg-type]
    names(err, "verify='yes'", "True or False")
