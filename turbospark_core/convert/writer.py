"""Write an install: the weights container, tokenizer files and the manifest with its file table."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from turbospark_core.errors import ConversionError
from turbospark_core.manifest import (
    EXPERTS,
    HADAMARD,
    MANIFEST,
    WEIGHTS,
    FileEntry,
    Manifest,
    sha256_file,
)

if TYPE_CHECKING:
    from turbospark_core.convert.experts import ExpertPack


def prepare_destination(dst: Path, *, force: bool) -> Path:
    """A fresh staging directory beside ``dst`` (renamed into place by :func:`finish`)."""
    if dst.exists() and any(dst.iterdir()) and not force:
        msg = f"{dst} exists and is not empty; choose another destination or pass --force"
        raise ConversionError(msg)
    staging = dst.with_name(dst.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def write_install(
    staging: Path,
    *,
    arch: dict[str, Any],
    tensors: dict[str, mx.array],
    quantization: dict[str, Any],
    text_files: dict[str, str],
    family: str,
    distribution: str,
    provenance: dict[str, Any],
    experts: ExpertPack | None = None,
    hadamard: tuple[dict[str, Any], bytes] | None = None,
) -> Manifest:
    """Write every file into ``staging`` and the manifest naming each with size and sha256.

    ``experts`` (MoE installs) is written to ``experts.bin`` with its layout as the
    manifest's ``experts`` section. ``hadamard`` (rotated installs) is the
    ``hadamard`` section and the bytes of ``hadamard.bin``.
    """
    mx.save_safetensors(str(staging / WEIGHTS), tensors, metadata={"format": "mlx"})
    section = None if experts is None else experts.write(staging / EXPERTS)
    for name, text in text_files.items():
        (staging / name).write_text(text)
    files = {}
    if hadamard is not None:
        (staging / HADAMARD).write_bytes(hadamard[1])
    for name in [WEIGHTS, *([EXPERTS] if section else []), *([HADAMARD] if hadamard else []), *sorted(text_files)]:
        size = (staging / name).stat().st_size
        files[name] = FileEntry(size=size, sha256=sha256_file(staging / name, size))
    manifest = Manifest(
        root=staging,
        arch=arch,
        files=files,
        quantization=quantization,
        family=family,
        distribution=distribution,
        experts=section,
        hadamard=None if hadamard is None else hadamard[0],
        provenance=provenance,
    )
    (staging / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1, sort_keys=True))
    return manifest


def finish(staging: Path, dst: Path) -> None:
    """Move the finished install into place."""
    if dst.exists():
        shutil.rmtree(dst)
    staging.rename(dst)
