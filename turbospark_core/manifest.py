"""The install manifest: format, arch config, file table, sections; read with a byte bound."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import attrs

from turbospark_core.errors import FileTableError, ManifestError, TurbosparkError
from turbospark_core.names import INSTALL_FORMAT, INSTALL_FORMAT_VERSION

MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
WEIGHTS = "model_weights.safetensors"
EXPERTS = "experts.bin"
HADAMARD = "hadamard.bin"
#: The multi-token-prediction head's tensors (install names ``mtp.*``), read only when a drafter asks for it
MTP_HEAD = "mtp.safetensors"
MTP_PREFIX = "mtp."
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# The only file names an install may have: no manifest path can point elsewhere.
ALLOWED_FILES = frozenset({WEIGHTS, EXPERTS, HADAMARD, MTP_HEAD, *TOKENIZER_FILES})
# What an install holds: a model (the default), or a drafter that is opened only beside its target.
MODEL_KIND = "model"
DFLASH_KIND = "dflash"
KINDS = (MODEL_KIND, DFLASH_KIND)


@attrs.frozen(kw_only=True)
class FileEntry:
    """One row of the file table."""

    size: int
    sha256: str


@attrs.frozen(kw_only=True)
class Manifest:
    """A parsed, validated ``manifest.json``.

    Attributes:
        root: The install directory.
        arch: Arch config (``model_type`` and the family's keys).
        files: File name -> size and sha256.
        quantization: Matrix base name -> ``{bits, group_size, mode}``.
        family: Family name recorded at conversion.
        distribution: Plugin distribution that made the install.
        kind: ``"model"``, or a drafter kind (``"dflash"``) that opens only beside its target.
        hadamard: The ``hadamard`` section, or ``None``.
        experts: The ``experts`` section, or ``None``.
        mtp: The ``mtp`` section (the head in ``mtp.safetensors``: its ``quantization``), or ``None``.
        provenance: Source, converter version, options.
    """

    root: Path
    arch: dict[str, Any]
    files: dict[str, FileEntry]
    quantization: dict[str, Any]
    family: str | None = None
    distribution: str | None = None
    kind: str = MODEL_KIND
    hadamard: dict[str, Any] | None = None
    experts: dict[str, Any] | None = None
    provenance: dict[str, Any] = attrs.field(factory=dict)
    mtp: dict[str, Any] | None = None

    @property
    def model_type(self) -> str:
        """The arch's Hugging Face model type."""
        return str(self.arch["model_type"])

    def path(self, name: str) -> Path:
        """Path of a file that is in the table (checked)."""
        if name not in self.files:
            msg = f"{self.root}: the manifest's file table has no {name!r}; re-run `turbospark convert`"
            raise FileTableError(msg)
        return self.root / name

    def to_json(self) -> dict[str, Any]:
        """The manifest as written to disk."""
        return {
            "format": INSTALL_FORMAT,
            "format_version": INSTALL_FORMAT_VERSION,
            "family": self.family,
            "distribution": self.distribution,
            "kind": self.kind,
            "arch": self.arch,
            "files": {n: attrs.asdict(e) for n, e in sorted(self.files.items())},
            "quantization": self.quantization,
            "hadamard": self.hadamard,
            "experts": self.experts,
            "provenance": self.provenance,
            **({"mtp": self.mtp} if self.mtp is not None else {}),
        }


def parse_json(data: bytes, where: Path | str, error: type[TurbosparkError]) -> Any:
    """``json.loads`` of untrusted bytes: every way it can fail becomes ``error`` naming ``where``.

    Besides malformed JSON and UTF-8 (``ValueError``), Python refuses integers
    of more than 4300 digits (``ValueError``) and deep nesting (``RecursionError``).
    """
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        msg = f"{where} is not valid JSON ({str(e)[:200]}); the install is corrupt, re-run `turbospark convert`"
        raise error(msg) from None


def _read_bounded(path: Path) -> bytes:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        msg = (
            f"{path.parent} has no {MANIFEST}; it is not a turbospark install"
            " (make one with `turbospark convert SRC DST`)"
        )
        raise ManifestError(msg) from None
    if size > MAX_MANIFEST_BYTES:
        msg = f"{path} is {size} bytes, over the {MAX_MANIFEST_BYTES}-byte bound for a manifest; the install is corrupt"
        raise ManifestError(msg)
    with path.open("rb") as f:
        return f.read(MAX_MANIFEST_BYTES + 1)


def _require(raw: dict[str, Any], key: str, kind: type, where: Path) -> Any:
    value = raw.get(key)
    if not isinstance(value, kind):
        msg = f"{where}: {key!r} must be a {kind.__name__}, got {value!r:.80}; re-run `turbospark convert`"
        raise ManifestError(msg)
    return value


def _file_table(raw: dict[str, Any], where: Path) -> dict[str, FileEntry]:
    table = _require(raw, "files", dict, where)
    files: dict[str, FileEntry] = {}
    for name, entry in table.items():
        if name not in ALLOWED_FILES:
            msg = (
                f"{where}: file table names {name!r}, which is not an install file "
                f"(allowed: {', '.join(sorted(ALLOWED_FILES))}); refusing to read outside the install"
            )
            raise FileTableError(msg)
        size = entry.get("size") if isinstance(entry, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            msg = f"{where}: file table entry {name!r} has no valid 'size': {entry!r:.120}"
            raise FileTableError(msg)
        digest = entry.get("sha256", "")
        if not isinstance(digest, str) or (digest and not _is_sha256(digest)):
            msg = f"{where}: file table entry {name!r} has a 'sha256' that is not 64 hex digits: {digest!r:.80}"
            raise FileTableError(msg)
        files[name] = FileEntry(size=size, sha256=digest)
    if WEIGHTS not in files:
        msg = f"{where}: file table lacks {WEIGHTS!r}; re-run `turbospark convert`"
        raise FileTableError(msg)
    return files


def _is_sha256(digest: str) -> bool:
    return len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)


def load_manifest(root: Path) -> Manifest:
    """Read and validate ``root/manifest.json`` (bounded read, strict keys).

    Raises:
        ManifestError: Missing, too large, not JSON, wrong format or version.
        FileTableError: A bad file table entry or a name outside the fixed set.
    """
    where = root / MANIFEST
    raw = parse_json(_read_bounded(where), where, ManifestError)
    if not isinstance(raw, dict) or raw.get("format") != INSTALL_FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        msg = f"{where}: format is {got!r}, expected {INSTALL_FORMAT!r}; make an install with `turbospark convert`"
        raise ManifestError(msg)
    if raw.get("format_version") != INSTALL_FORMAT_VERSION:
        msg = (
            f"{where}: format_version {raw.get('format_version')!r} is not "
            f"{INSTALL_FORMAT_VERSION}; re-convert with this turbospark version"
        )
        raise ManifestError(msg)
    arch = _require(raw, "arch", dict, where)
    if not isinstance(arch.get("model_type"), str):
        msg = f"{where}: arch has no 'model_type' string; re-run `turbospark convert`"
        raise ManifestError(msg)
    for key in ("family", "distribution"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            msg = f"{where}: {key!r} must be a string or null, got {raw[key]!r:.80}; re-run `turbospark convert`"
            raise ManifestError(msg)
    kind = raw.get("kind", MODEL_KIND)
    if kind not in KINDS:
        msg = f"{where}: kind {kind!r:.60} is not one of {', '.join(map(repr, KINDS))}; re-run `turbospark convert`"
        raise ManifestError(msg)
    sections = {key: _optional_object(raw, key, where) for key in _SECTIONS}
    files = _file_table(raw, where)
    _check_paired(sections, files, where)
    return Manifest(
        root=root,
        arch=arch,
        files=files,
        quantization=sections["quantization"] or {},
        family=raw.get("family"),
        distribution=raw.get("distribution"),
        kind=kind,
        hadamard=sections["hadamard"],
        experts=sections["experts"],
        provenance=sections["provenance"] or {},
        mtp=sections["mtp"],
    )


_SECTIONS = ("quantization", "hadamard", "experts", "provenance", "mtp")
_SECTION_FILES = {"experts": EXPERTS, "mtp": MTP_HEAD}  # a section that describes a file comes with it, and back


def _check_paired(sections: dict[str, Any], files: dict[str, FileEntry], where: Path) -> None:
    for key, name in _SECTION_FILES.items():
        if (sections[key] is None) != (name not in files):
            has, lacks = (f"an {key!r} section", f"{name!r} in its file table") if sections[key] is not None else (
                f"{name!r} in its file table", f"an {key!r} section"
            )
            msg = f"{where} has {has} but no {lacks}; the install is incomplete, re-run `turbospark convert`"
            raise ManifestError(msg)


def _optional_object(raw: dict[str, Any], key: str, where: Path) -> dict[str, Any] | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, dict):
        msg = f"{where}: {key!r} must be an object or null, got {value!r:.80}; re-run `turbospark convert`"
        raise ManifestError(msg)
    return value


def check_files(manifest: Manifest) -> None:
    """Every file in the table exists with exactly its recorded size.

    Raises:
        FileTableError: Naming the missing, short or long file.
    """
    check_file_sizes(manifest.root, manifest.files)


def check_file_sizes(root: Path, files: dict[str, FileEntry]) -> None:
    """Every file of a file table (an install's, a sidecar's) is a regular file under ``root`` of its recorded size.

    Raises:
        FileTableError: Naming the missing, short or long file.
    """
    for name, entry in files.items():
        path = root / name
        if path.is_symlink() or not path.is_file():
            msg = (
                f"{root}: {name!r} is in the file table but missing (or not a regular file);"
                " re-run `turbospark convert`"
            )
            raise FileTableError(msg)
        size = path.stat().st_size
        if size != entry.size:
            how = "shorter" if size < entry.size else "longer"
            msg = (
                f"{root}: {name!r} is {size} bytes, {how} than the "
                f"{entry.size} bytes its file table entry says; the install is "
                f"truncated or altered, re-run `turbospark convert`"
            )
            raise FileTableError(msg)


def sha256_file(path: Path, size: int) -> str:
    """sha256 of the first ``size`` bytes of ``path`` (bounded by the table)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        left = size
        while left > 0:
            chunk = f.read(min(left, 1 << 22))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def verify_checksums(manifest: Manifest) -> list[str]:
    """Names of files whose sha256 differs from the table (empty when all match)."""
    return [
        name
        for name, entry in sorted(manifest.files.items())
        if entry.sha256 and sha256_file(manifest.root / name, entry.size) != entry.sha256
    ]
