"""Tests of the manifest: bounded read, strict format, the file table and its checks."""

from __future__ import annotations

import json
import os
import pathlib
from pathlib import Path

import pytest

import turbospark_core
from turbospark_core import manifest as manifest_mod
from turbospark_core.errors import FileTableError, ManifestError
from turbospark_core.manifest import (
    MANIFEST,
    WEIGHTS,
    check_files,
    load_manifest,
    sha256_file,
    verify_checksums,
)
from turbospark_core.names import INSTALL_FORMAT, INSTALL_FORMAT_VERSION


# ------------------------------------------------------------------ a good manifest
def test_load_manifest_reads_what_convert_wrote(f32_install: Path) -> None:
    m = load_manifest(f32_install)
    raw = json.loads((f32_install / MANIFEST).read_text())
    assert m.model_type == "llama"
    assert (m.family, m.distribution) == ("llama", "turbospark-llama")
    assert m.to_json() == raw
    assert set(m.files) == {WEIGHTS, "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    for name, entry in m.files.items():
        assert entry.size == (f32_install / name).stat().st_size
    check_files(m)  # sizes agree: no exception
    assert verify_checksums(m) == []


def test_path_of_a_name_not_in_the_table_is_refused(f32_install: Path, names) -> None:
    m = load_manifest(f32_install)
    assert m.path(WEIGHTS) == f32_install / WEIGHTS
    with pytest.raises(FileTableError) as e:
        m.path("experts.bin")
    names(e, "'experts.bin'", "turbospark convert")


# ------------------------------------------------------------------ unreadable manifests
def test_missing_manifest(tmp_path: Path, names) -> None:
    with pytest.raises(ManifestError) as e:
        load_manifest(tmp_path)
    names(e, str(tmp_path), MANIFEST, "turbospark convert")


def test_missing_manifest_through_open(tmp_path: Path, names) -> None:
    with pytest.raises(ManifestError) as e:
        turbospark_core.open(tmp_path)
    names(e, MANIFEST, "turbospark convert")


@pytest.mark.parametrize("blob", [b"{not json", b"", b"\xff\xfe\xfa garbage", b'{"format": '])
def test_manifest_not_json(install: Path, blob: bytes, names) -> None:
    (install / MANIFEST).write_bytes(blob)
    with pytest.raises(ManifestError) as e:
        turbospark_core.open(install)
    names(e, MANIFEST, "not valid JSON", "turbospark convert")


def test_manifest_not_an_object(install: Path, names) -> None:
    (install / MANIFEST).write_text("[1, 2, 3]")
    with pytest.raises(ManifestError) as e:
        load_manifest(install)
    names(e, "'list'", repr(INSTALL_FORMAT), "turbospark convert")


@pytest.mark.parametrize("fmt", ["gguf", None, 1])
def test_wrong_format(install: Path, tamper, fmt, names) -> None:
    tamper.edit(install, lambda raw: raw.__setitem__("format", fmt))
    with pytest.raises(ManifestError) as e:
        turbospark_core.open(install)
    names(e, repr(fmt), repr(INSTALL_FORMAT), "turbospark convert")


@pytest.mark.parametrize("version", [2, 0, "1", None])
def test_wrong_format_version(install: Path, tamper, version, names) -> None:
    tamper.edit(install, lambda raw: raw.__setitem__("format_version", version))
    with pytest.raises(ManifestError) as e:
        turbospark_core.open(install)
    names(e, "format_version", repr(version), str(INSTALL_FORMAT_VERSION), "re-convert")


def test_manifest_over_the_size_bound(install: Path, monkeypatch: pytest.MonkeyPatch, names) -> None:
    size = (install / MANIFEST).stat().st_size
    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", 256)
    with pytest.raises(ManifestError) as e:
        turbospark_core.open(install)
    names(e, MANIFEST, f"{size} bytes", "256-byte bound", "corrupt")


def test_manifest_read_is_bounded(install: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even a file that grows after stat() is read at most bound + 1 bytes."""
    bound = (install / MANIFEST).stat().st_size
    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", bound)
    requested: list[int] = []
    real_open = pathlib.Path.open

    def spy_open(self, *args, **kwargs):
        f = real_open(self, *args, **kwargs)
        if self.name == MANIFEST:
            real_read = f.read

            class Reader:
                def __enter__(self):
                    return self

                def __exit__(self, *exc):
                    f.close()

                def read(self, n=-1):
                    requested.append(n)
                    return real_read(n)

            return Reader()
        return f

    monkeypatch.setattr(pathlib.Path, "open", spy_open)
    load_manifest(install)
    assert requested and all(0 <= n <= bound + 1 for n in requested)


@pytest.mark.parametrize(
    ("arch", "expected"),
    [
        ({"hidden_size": 64}, "'model_type'"),
        ({"model_type": 5}, "'model_type'"),
        ("llama", "'arch' must be a dict"),
        (None, "'arch' must be a dict"),
    ],
)
def test_arch_without_model_type(install: Path, tamper, arch, expected, names) -> None:
    tamper.edit(install, lambda raw: raw.__setitem__("arch", arch))
    with pytest.raises(ManifestError) as e:
        turbospark_core.open(install)
    names(e, MANIFEST, expected, "turbospark convert")


@pytest.mark.parametrize("section", ["quantization", "experts", "hadamard", "provenance"])
def test_optional_section_not_an_object(install: Path, tamper, section: str, names) -> None:
    tamper.edit(install, lambda raw: raw.__setitem__(section, [1, 2]))
    with pytest.raises(ManifestError) as e:
        load_manifest(install)
    names(e, repr(section), "turbospark convert")


# ------------------------------------------------------------------ the file table itself
def test_file_table_not_an_object(install: Path, tamper, names) -> None:
    tamper.edit(install, lambda raw: raw.__setitem__("files", ["model_weights.safetensors"]))
    with pytest.raises(ManifestError) as e:
        load_manifest(install)
    names(e, "'files' must be a dict", "turbospark convert")


@pytest.mark.parametrize("entry", [{"size": -1}, {"size": "10"}, {"size": True}, {"sha256": "x"}, 10, None])
def test_file_table_entry_without_valid_size(install: Path, tamper, entry, names) -> None:
    tamper.edit(install, lambda raw: raw["files"].__setitem__("tokenizer.json", entry))
    with pytest.raises(FileTableError) as e:
        load_manifest(install)
    names(e, "'tokenizer.json'", "valid 'size'")


def test_file_table_without_weights(install: Path, tamper, names) -> None:
    tamper.edit(install, lambda raw: raw["files"].pop(WEIGHTS))
    with pytest.raises(FileTableError) as e:
        turbospark_core.open(install)
    names(e, repr(WEIGHTS), "turbospark convert")


OUTSIDE_NAMES = ["../x", "/etc/passwd", "sub/dir.bin", "..", MANIFEST, "model_weights.safetensors/../x"]


@pytest.mark.parametrize("name", OUTSIDE_NAMES)
def test_file_table_name_outside_the_install_is_refused_unread(
    install: Path, tamper, monkeypatch: pytest.MonkeyPatch, name: str, names
) -> None:
    # Make the target real and exactly as large as the table says, so only the name can give it away.
    target = install / "sub" / "dir.bin" if name.startswith("sub/") else (install / name)
    if not name.startswith("/") and name not in ("..", MANIFEST) and "/../" not in name:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"secret")
    tamper.edit(install, lambda raw: raw["files"].__setitem__(name, {"size": 6, "sha256": ""}))

    touched: list[str] = []
    root = os.path.realpath(install)
    for method in ("open", "stat", "read_bytes", "read_text", "is_file", "exists", "is_symlink"):
        real = getattr(pathlib.Path, method)

        def spy(self, *a, _real=real, **k):
            touched.append(str(self))
            return _real(self, *a, **k)

        monkeypatch.setattr(pathlib.Path, method, spy)
    with pytest.raises(FileTableError) as e:
        turbospark_core.open(install)
    monkeypatch.undo()
    names(e, repr(name), "not an install file", "refusing to read outside the install")
    outside = [p for p in touched if not os.path.realpath(p).startswith(root)]
    assert outside == []
    forbidden = {str(install / "sub" / "dir.bin"), "/etc/passwd", str(install / "../x")}
    assert forbidden.isdisjoint(touched)


# ------------------------------------------------------------------ files against the table
def _resize(path: Path, delta: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:delta] if delta < 0 else data + b"\0" * delta)


@pytest.mark.parametrize(("name", "delta", "how"), [
    (WEIGHTS, -1, "shorter"),
    (WEIGHTS, 7, "longer"),
    ("tokenizer.json", -100, "shorter"),
    ("generation_config.json", 1, "longer"),
])
def test_file_size_disagrees_with_the_table(install: Path, name: str, delta: int, how: str, names) -> None:
    entry = load_manifest(install).files[name]
    _resize(install / name, delta)
    with pytest.raises(FileTableError) as e:
        turbospark_core.open(install)
    names(e, repr(name), f"{entry.size + delta} bytes", how, f"{entry.size} bytes", "turbospark convert")


@pytest.mark.parametrize("name", [WEIGHTS, "tokenizer_config.json"])
def test_file_in_the_table_is_missing(install: Path, name: str, names) -> None:
    (install / name).unlink()
    with pytest.raises(FileTableError) as e:
        turbospark_core.open(install)
    names(e, repr(name), "missing", "turbospark convert")


def test_file_in_the_table_is_a_symlink(install: Path, tmp_path: Path, names) -> None:
    """A link could point anywhere: only regular files inside the install are read."""
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes((install / "tokenizer.json").read_bytes())
    (install / "tokenizer.json").unlink()
    (install / "tokenizer.json").symlink_to(outside)
    with pytest.raises(FileTableError) as e:
        turbospark_core.open(install)
    names(e, "'tokenizer.json'", "not a regular file")


def test_file_in_the_table_is_a_directory(install: Path, names) -> None:
    (install / "generation_config.json").unlink()
    (install / "generation_config.json").mkdir()
    with pytest.raises(FileTableError) as e:
        check_files(load_manifest(install))
    names(e, "'generation_config.json'", "missing")


# ------------------------------------------------------------------ checksums
def test_verify_checksums_names_the_altered_file(install: Path) -> None:
    path = install / WEIGHTS
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size: only the sha256 can tell
    path.write_bytes(bytes(data))
    m = load_manifest(install)
    check_files(m)
    assert verify_checksums(m) == [WEIGHTS]


def test_sha256_is_bounded_by_the_table_size(install: Path) -> None:
    m = load_manifest(install)
    entry = m.files["tokenizer.json"]
    with (install / "tokenizer.json").open("ab") as f:
        f.write(b"trailing junk")
    assert sha256_file(install / "tokenizer.json", entry.size) == entry.sha256
