"""The vision sidecar: an install of its own kind holding one family's vision tower.

::

    <sidecar>/manifest.json               format "turbospark-vision-sidecar", "sidecar": "vision",
                                          the trunk it fits, the vision arch, placeholder ids
                                          (and their token texts), the processor config,
                                          the file table
    <sidecar>/vision_weights.safetensors  the tower's tensors
    <sidecar>/chat_template.jinja         optional: a chat template that renders image parts

Opening a sidecar as a model is refused (open step 1 sees ``"sidecar": "vision"``).
Reads are bounded like an install's: the manifest by ``MAX_MANIFEST_BYTES``,
every file by its table size, file names from a fixed set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from turbospark_core.errors import FileTableError, InstallError, NotAnInstallError
from turbospark_core.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    FileEntry,
    check_file_sizes,
    parse_json,
    sha256_file,
)

SIDECAR_FORMAT = "turbospark-vision-sidecar"
SIDECAR_FORMAT_VERSION = 1
VISION_WEIGHTS = "vision_weights.safetensors"
CHAT_TEMPLATE = "chat_template.jinja"
SIDECAR_FILES = frozenset({VISION_WEIGHTS, CHAT_TEMPLATE})
MAX_TEMPLATE_BYTES = 1 << 20


class SidecarError(InstallError):
    """A vision sidecar that is malformed, or does not fit the trunk it is attached to."""


@attrs.frozen(kw_only=True)
class Sidecar:
    """A parsed, validated sidecar manifest.

    Attributes:
        root: The sidecar directory.
        family: The family whose plugin wrote (and serves) the tower.
        distribution: That plugin's distribution.
        trunk: What the trunk must be: ``model_type``, ``hidden_size``, ``vocab_size``.
        vision: The family's vision arch (``VisionSpec.vision``).
        tokens: Placeholder ids by name (``"image"`` always present).
        token_texts: The token text of each placeholder id in the source tokenizer.
        processor: The preprocessing config.
        files: The file table.
        quantization: Matrix base name -> quantization (as an install's).
        provenance: Source, converter, options.
    """

    root: Path
    family: str
    distribution: str
    trunk: dict[str, Any]
    vision: dict[str, Any]
    tokens: dict[str, int]
    token_texts: dict[str, str]
    processor: dict[str, Any]
    files: dict[str, FileEntry]
    quantization: dict[str, Any] = attrs.field(factory=dict)
    provenance: dict[str, Any] = attrs.field(factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The manifest as written to disk."""
        return {
            "format": SIDECAR_FORMAT,
            "format_version": SIDECAR_FORMAT_VERSION,
            "sidecar": "vision",
            "family": self.family,
            "distribution": self.distribution,
            "trunk": self.trunk,
            "vision": self.vision,
            "tokens": self.tokens,
            "token_texts": self.token_texts,
            "processor": self.processor,
            "files": {n: attrs.asdict(e) for n, e in sorted(self.files.items())},
            "quantization": self.quantization,
            "provenance": self.provenance,
        }

    def path(self, name: str) -> Path:
        """Path of a file in the table (checked)."""
        if name not in self.files:
            raise FileTableError(f"{self.root}: the sidecar's file table has no {name!r}; re-run the conversion")
        return self.root / name

    def chat_template(self) -> str | None:
        """The sidecar's chat template (bounded read), or ``None``."""
        if CHAT_TEMPLATE not in self.files:
            return None
        size = self.files[CHAT_TEMPLATE].size
        with self.path(CHAT_TEMPLATE).open("rb") as f:
            data = f.read(min(size, MAX_TEMPLATE_BYTES) + 1)
        if len(data) > MAX_TEMPLATE_BYTES:
            raise SidecarError(f"{self.root / CHAT_TEMPLATE} is over the {MAX_TEMPLATE_BYTES}-byte bound")
        try:
            return data.decode()
        except UnicodeDecodeError:
            raise SidecarError(f"{self.root / CHAT_TEMPLATE} is not UTF-8; re-run the conversion") from None


def is_sidecar(path: Path) -> bool:
    """Whether ``path`` holds a sidecar manifest (a cheap look; :func:`load_sidecar` validates)."""
    manifest = path / MANIFEST
    if not manifest.is_file() or manifest.stat().st_size > MAX_MANIFEST_BYTES:
        return False
    try:
        raw = json.loads(manifest.read_bytes())
    except (ValueError, RecursionError):
        return False
    return isinstance(raw, dict) and raw.get("sidecar") == "vision"


def load_sidecar(path: str | Path) -> Sidecar:
    """Read and validate a sidecar (bounded manifest read, strict keys, files present with their sizes).

    Raises:
        NotAnInstallError: ``path`` is a language-model install or no sidecar at all.
        SidecarError: A malformed manifest or file table, naming the key and the fix.
    """
    root = Path(path)
    where = root / MANIFEST
    if not where.is_file():
        msg = f"{root} is not a vision sidecar (no {MANIFEST}); make one: `turbospark convert SRC DST --vision SIDECAR`"
        raise NotAnInstallError(msg)
    size = where.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise SidecarError(f"{where} is {size} bytes, over the {MAX_MANIFEST_BYTES}-byte bound; the sidecar is corrupt")
    with where.open("rb") as f:
        raw = parse_json(f.read(MAX_MANIFEST_BYTES + 1), where, SidecarError)
    if not isinstance(raw, dict) or raw.get("sidecar") != "vision":
        msg = (
            f"{root} is not a vision sidecar (its manifest has no \"sidecar\": \"vision\"); pass the directory "
            f"`turbospark convert SRC DST --vision SIDECAR` wrote as SIDECAR"
        )
        raise NotAnInstallError(msg)
    if raw.get("format") != SIDECAR_FORMAT or raw.get("format_version") != SIDECAR_FORMAT_VERSION:
        msg = (
            f"{where}: format {raw.get('format')!r} version {raw.get('format_version')!r} is not "
            f"{SIDECAR_FORMAT!r} version {SIDECAR_FORMAT_VERSION}; re-convert with this turbospark version"
        )
        raise SidecarError(msg)
    sidecar = Sidecar(
        root=root,
        family=_get(raw, "family", str, where),
        distribution=_get(raw, "distribution", str, where),
        trunk=_trunk(_get(raw, "trunk", dict, where), where),
        vision=_get(raw, "vision", dict, where),
        tokens=_tokens(_get(raw, "tokens", dict, where), where),
        token_texts=_texts(raw.get("token_texts") or {}, where),
        processor=_get(raw, "processor", dict, where),
        files=_file_table(_get(raw, "files", dict, where), where),
        quantization=_optional(raw, "quantization", where),
        provenance=_optional(raw, "provenance", where),
    )
    check_file_sizes(root, sidecar.files)
    return sidecar


def _get(raw: dict[str, Any], key: str, kind: type, where: Path) -> Any:
    value = raw.get(key)
    if not isinstance(value, kind):
        msg = f"{where}: {key!r} must be a {kind.__name__}, got {value!r:.80}; re-run the sidecar conversion"
        raise SidecarError(msg)
    return value


def _optional(raw: dict[str, Any], key: str, where: Path) -> dict[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise SidecarError(f"{where}: {key!r} must be an object or null, got {value!r:.80}; re-convert the sidecar")
    return value


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _trunk(trunk: dict[str, Any], where: Path) -> dict[str, Any]:
    if not isinstance(trunk.get("model_type"), str):
        raise SidecarError(f"{where}: trunk.model_type must be a string; re-run the sidecar conversion")
    for key in ("hidden_size", "vocab_size"):
        if not _is_count(trunk.get(key)):
            raise SidecarError(f"{where}: trunk.{key} must be a non-negative integer, got {trunk.get(key)!r:.40}")
    return trunk


def _tokens(tokens: dict[str, Any], where: Path) -> dict[str, int]:
    bad = [name for name, value in tokens.items() if not _is_count(value)]
    if bad:
        raise SidecarError(f"{where}: placeholder id tokens.{bad[0]} must be a non-negative integer")
    if "image" not in tokens:
        raise SidecarError(f"{where}: tokens has no 'image' placeholder id; re-run the sidecar conversion")
    return dict(tokens)


def _texts(texts: Any, where: Path) -> dict[str, str]:
    if not isinstance(texts, dict) or not all(isinstance(v, str) for v in texts.values()):
        raise SidecarError(f"{where}: token_texts must map names to token strings")
    return dict(texts)


def _file_table(table: dict[str, Any], where: Path) -> dict[str, FileEntry]:
    files: dict[str, FileEntry] = {}
    for name, entry in table.items():
        if name not in SIDECAR_FILES:
            msg = (
                f"{where}: file table names {name!r}, which is not a sidecar file "
                f"(allowed: {', '.join(sorted(SIDECAR_FILES))}); refusing to read outside the sidecar"
            )
            raise FileTableError(msg)
        if not isinstance(entry, dict) or not _is_count(entry.get("size")) or not isinstance(entry.get("sha256"), str):
            raise FileTableError(f"{where}: file table entry {name!r} has no valid 'size'/'sha256': {entry!r:.120}")
        files[name] = FileEntry(size=entry["size"], sha256=entry["sha256"])
    if VISION_WEIGHTS not in files:
        raise FileTableError(f"{where}: file table lacks {VISION_WEIGHTS!r}; re-run the sidecar conversion")
    return files


def write_sidecar_manifest(staging: Path, sidecar: Sidecar) -> Sidecar:
    """Fill the file table from ``staging``'s files and write the manifest (returns the final record)."""
    files = {}
    for name in sorted(SIDECAR_FILES):
        if (staging / name).is_file():
            size = (staging / name).stat().st_size
            files[name] = FileEntry(size=size, sha256=sha256_file(staging / name, size))
    out = attrs.evolve(sidecar, root=staging, files=files)
    (staging / MANIFEST).write_text(json.dumps(out.to_json(), indent=1, sort_keys=True))
    return out
