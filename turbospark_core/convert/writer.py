"""Write an install: the weights container, tokenizer files and the manifest with its file table."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from turbospark_core.errors import ConversionError
from turbospark_core.manifest import (
    EXPERTS,
    HADAMARD,
    MANIFEST,
    MTP_HEAD,
    WEIGHTS,
    FileEntry,
    Manifest,
    sha256_file,
)

if TYPE_CHECKING:
    from turbospark_core.convert.experts import ExpertPack


STAGING_INFIX = ".partial-"  # staging directories: .<dst name>.partial-<random>, beside dst
LOCK_SUFFIX = ".lock"


@contextlib.contextmanager
def destination_lock(dst: Path) -> Iterator[Path]:
    """Hold ``.<dst name>.lock`` beside ``dst`` for one convert; a second convert to ``dst`` is refused.

    The lock is an ``flock`` on that file: a convert killed at any point releases
    it with its process, so a re-run is never refused by a stale lock.

    Raises:
        ConversionError: Another convert holds the lock (naming its pid and the lock file).
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    path = dst.with_name(f".{dst.name}{LOCK_SUFFIX}")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            msg = (
                f"another `turbospark convert` (pid {holder}) is writing {dst} (lock {path}); "
                f"wait for it to finish or choose another destination"
            )
            raise ConversionError(msg) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:  # not a lock file its last holder unlinked between our open and flock
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield path
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def prepare_destination(dst: Path, *, force: bool) -> Path:
    """A fresh staging directory beside ``dst`` (renamed into place by :func:`finish`).

    Call it holding :func:`destination_lock`: it removes what killed converts to
    ``dst`` left behind (staging directories, a replaced install not yet deleted).
    """
    if dst.exists() and not dst.is_dir():
        msg = f"{dst} exists and is not a directory; choose another destination"
        raise ConversionError(msg)
    if dst.exists() and any(dst.iterdir()) and not force:
        msg = f"{dst} exists and is not empty; choose another destination or pass --force"
        raise ConversionError(msg)
    for stale in dst.parent.glob(f".{glob.escape(dst.name)}{STAGING_INFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f".{dst.name}{STAGING_INFIX}", dir=dst.parent))


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
    mtp: tuple[dict[str, mx.array], dict[str, Any]] | None = None,
) -> Manifest:
    """Write every file into ``staging`` and the manifest naming each with size and sha256.

    ``experts`` (MoE installs) is written to ``experts.bin`` with its layout as the
    manifest's ``experts`` section. ``hadamard`` (rotated installs) is the
    ``hadamard`` section and the bytes of ``hadamard.bin``. ``mtp`` (installs with a
    multi-token-prediction head) is the head's tensors and quantization table, written to
    ``mtp.safetensors`` with the table as the manifest's ``mtp`` section: the other files
    are then exactly those of the same install without a head.
    """
    mx.save_safetensors(str(staging / WEIGHTS), tensors, metadata={"format": "mlx"})
    section = None if experts is None else experts.write(staging / EXPERTS)
    for name, text in text_files.items():
        (staging / name).write_text(text)
    files = {}
    if hadamard is not None:
        (staging / HADAMARD).write_bytes(hadamard[1])
    if mtp is not None:
        mx.save_safetensors(str(staging / MTP_HEAD), mtp[0], metadata={"format": "mlx"})
    extra = [*([EXPERTS] if section else []), *([HADAMARD] if hadamard else []), *([MTP_HEAD] if mtp else [])]
    for name in [WEIGHTS, *extra, *sorted(text_files)]:
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
        mtp=None if mtp is None else {"quantization": mtp[1]},
    )
    (staging / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1, sort_keys=True))
    return manifest


def finish(staging: Path, dst: Path) -> None:
    """Make the finished install durable, then move it into place with renames.

    Until the last rename ``dst`` is either absent, empty, or the install it held
    before: a convert killed at any point leaves nothing that opens as a new,
    partial install.
    """
    _sync_tree(staging)
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}{STAGING_INFIX}old-{os.getpid()}")
        dst.rename(old)
    staging.rename(dst)
    _sync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _sync_tree(root: Path) -> None:
    for path in root.iterdir():
        with path.open("rb") as f:
            os.fsync(f.fileno())
    _sync_dir(root)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
