"""A randomized Hadamard rotation of the residual stream, folded into an install's weights (QuaRot).

The rotation is ``Q = diag(s) . blockdiag(H_b, ..., H_b)``: random signs ``s``
(+-1, from a seed) times a normalized Walsh-Hadamard matrix of block ``b`` (the
largest power of two dividing the hidden size, as ``mx.hadamard_transform``
computes it). ``Q`` is orthogonal, so with the residual stream carried as
``h Q`` instead of ``h`` every RMSNorm sees the same root-mean-square, and the
model's outputs are unchanged in exact math once:

- each RMSNorm's scale ``g`` is folded into the linears that read its output
  (``W <- W diag(g) Q``; the norm's scale becomes one);
- the embedding rows are rotated (``E <- E Q``) and the LM head is folded
  with the final norm (``W <- W diag(g) Q``; a tied head is written untied);
- every linear that writes the residual is rotated on its output side
  (``W <- Q^T W``, ``b <- b Q``).

Rotated, the weights have far fewer outlier channels, so they quantize with
less error. The family says which tensors are which with its
``hadamard_residual_map`` hook (a :class:`ResidualMap`); this module knows no
family. ``hadamard.bin`` holds the signs (one int8 per channel); the manifest's
``hadamard`` section records the seed, sizes, what was folded and which runtime
transforms the flow must apply (none: every rotation here is folded).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core.errors import ConversionError, InstallError

SCHEME = "randomized-hadamard"
FOLDED = ("norms", "embedding", "head", "readers", "writers")
ONLINE_TRANSFORMS: tuple[str, ...] = ()  # runtime transforms a flow may be asked to apply (none yet)
MAX_HIDDEN = 1 << 20


def _names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _norm_readers(value: Iterable[NormReaders]) -> tuple[NormReaders, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class NormReaders:
    """One RMSNorm and the linears (weight names, ``[..., out, hidden]``) that read its output."""

    norm: str
    readers: tuple[str, ...] = attrs.field(converter=_names)


@attrs.frozen(kw_only=True)
class ResidualMap:
    """Which install tensors read and write a family's residual stream (its ``hadamard_residual_map`` answer).

    Attributes:
        hidden_size: Width of the residual stream.
        embedding: The embedding weight (``[vocab, hidden]``, rows rotated).
        head: The LM head weight; when absent from the install (tied), it is
            written from the embedding, folded and rotated.
        final_norm: The norm before the head (folded into it).
        norms: Every other RMSNorm with the linears reading it.
        writers: Linear weights writing the residual (``[..., hidden, in]``);
            a ``<base>.bias`` beside one is rotated too.
        norm_offset: The flow scales by ``norm_offset + w`` (1.0 for
            ``(1 + w)`` norms); a folded norm's stored weight becomes
            ``1 - norm_offset``.
    """

    hidden_size: int
    embedding: str
    head: str
    final_norm: str
    norms: tuple[NormReaders, ...] = attrs.field(converter=_norm_readers)
    writers: tuple[str, ...] = attrs.field(converter=_names)
    norm_offset: float = 0.0


def names_under(names: Iterable[str], prefix: str, suffixes: tuple[str, ...]) -> tuple[str, ...]:
    """The ``names`` that start with ``prefix`` and end with one of ``suffixes`` (for a family's residual map)."""
    return tuple(n for n in names if n.startswith(prefix) and n.endswith(suffixes))


def block_size(n: int) -> int:
    """The Hadamard block for a residual of width ``n``: its largest power-of-two divisor."""
    return n & -n


def make_signs(n: int, seed: int) -> np.ndarray:
    """``n`` random +-1 signs (int8) from ``seed``."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 2, size=n, dtype=np.int8) * 2 - 1).astype(np.int8)


def rotate_last(x: mx.array, signs: mx.array) -> mx.array:
    """``x Q`` along the last axis (float32): signs, then a normalized block Hadamard transform."""
    n = x.shape[-1]
    b = block_size(n)
    y = (x.astype(mx.float32) * signs).reshape(*x.shape[:-1], n // b, b)
    return mx.hadamard_transform(y).reshape(x.shape)


def _rotate_rows_out(w: mx.array, signs: mx.array) -> mx.array:
    """``Q^T W`` for ``W`` of shape ``[..., hidden, in]``."""
    return rotate_last(w.swapaxes(-1, -2), signs).swapaxes(-1, -2)


def _require(tensors: dict[str, mx.array], name: str, family: str) -> mx.array:
    if name not in tensors:
        msg = (
            f"family {family!r} names {name!r} in its hadamard residual map, "
            f"but the install has no such tensor; the plugin's map is out of date"
        )
        raise ConversionError(msg)
    return tensors[name]


def fold_rotation(tensors: dict[str, mx.array], rmap: ResidualMap, seed: int, family: str) -> np.ndarray:
    """Fold the rotation into float ``tensors`` in place; returns the signs (for ``hadamard.bin``).

    Every tensor touched is computed in float32 and cast back to its dtype.
    """
    signs_np = make_signs(rmap.hidden_size, seed)
    signs = mx.array(signs_np.astype(np.float32))

    def put(name: str, value: mx.array, like: mx.array) -> None:
        tensors[name] = value.astype(like.dtype)

    def fold_norm(norm_name: str) -> mx.array:
        norm = _require(tensors, norm_name, family)
        put(norm_name, mx.full(norm.shape, 1.0 - rmap.norm_offset), norm)
        return rmap.norm_offset + norm.astype(mx.float32)

    emb = _require(tensors, rmap.embedding, family)
    head = tensors.get(rmap.head, emb)
    put(rmap.head, rotate_last(head.astype(mx.float32) * fold_norm(rmap.final_norm), signs), head)
    put(rmap.embedding, rotate_last(emb, signs), emb)
    for group in rmap.norms:
        g = fold_norm(group.norm)
        for name in group.readers:
            w = _require(tensors, name, family)
            put(name, rotate_last(w.astype(mx.float32) * g, signs), w)
    for name in rmap.writers:
        w = _require(tensors, name, family)
        put(name, _rotate_rows_out(w, signs), w)
        bias = name.rpartition(".")[0] + ".bias"
        if bias in tensors:
            put(bias, rotate_last(tensors[bias], signs), tensors[bias])
    return signs_np


def section_for(rmap: ResidualMap, seed: int) -> dict[str, Any]:
    """The manifest's ``hadamard`` section for a rotation folded with ``rmap`` and ``seed``."""
    n = rmap.hidden_size
    return {
        "scheme": SCHEME,
        "seed": seed,
        "hidden_size": n,
        "block": block_size(n),
        "size": n,
        "signs": {"offset": 0, "length": n, "dtype": "int8"},
        "folded": list(FOLDED),
        "online": [],
    }


# ------------------------------------------------------------------ open: validation


@attrs.frozen(kw_only=True)
class HadamardSection:
    """A validated ``hadamard`` section."""

    seed: int
    hidden_size: int
    block: int
    size: int
    signs_offset: int
    online: tuple[str, ...]


def _int(section: dict[str, Any], key: str, where: str, low: int, high: int) -> int:
    value = section.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        msg = f"{where}: hadamard section {key!r} must be an integer in [{low}, {high}], got {value!r}"
        raise InstallError(msg)
    return value


def parse_section(section: dict[str, Any], arch: dict[str, Any], where: str) -> HadamardSection:
    """Validate the section against the arch (sizes and offsets bounded, transforms known).

    Raises:
        InstallError: Naming the bad key and its value.
    """
    if section.get("scheme") != SCHEME:
        msg = f"{where}: hadamard scheme {section.get('scheme')!r} is not {SCHEME!r}; re-convert with --rotate"
        raise InstallError(msg)
    hidden = _int(section, "hidden_size", where, 2, MAX_HIDDEN)
    if hidden != arch.get("hidden_size"):
        msg = f"{where}: hadamard hidden_size {hidden} is not the arch's hidden_size {arch.get('hidden_size')!r}"
        raise InstallError(msg)
    block = _int(section, "block", where, 1, hidden)
    if block != block_size(hidden):
        msg = f"{where}: hadamard block {block} is not {block_size(hidden)}, the largest power of two dividing {hidden}"
        raise InstallError(msg)
    size = _int(section, "size", where, hidden, 2 * MAX_HIDDEN)
    signs = section.get("signs")
    if not isinstance(signs, dict) or signs.get("dtype") != "int8" or signs.get("length") != hidden:
        msg = f"{where}: hadamard 'signs' must be {{offset, length: {hidden}, dtype: 'int8'}}, got {signs!r}"
        raise InstallError(msg)
    offset = _int(signs, "offset", where, 0, size - hidden)
    online = section.get("online")
    if not isinstance(online, list) or any(t not in ONLINE_TRANSFORMS for t in online):
        msg = (
            f"{where}: hadamard 'online' lists runtime transforms {online!r}; this turbospark applies "
            f"{list(ONLINE_TRANSFORMS) or 'none'}; re-convert with this version"
        )
        raise InstallError(msg)
    seed = _int(section, "seed", where, 0, 2**63 - 1)
    return HadamardSection(
        seed=seed, hidden_size=hidden, block=block, size=size, signs_offset=offset, online=tuple(online)
    )


def read_signs(path: Path, section: HadamardSection) -> np.ndarray:
    """The signs from ``hadamard.bin`` (bounded read; each must be +-1).

    Raises:
        InstallError: A file of the wrong size, or a value that is not a sign.
    """
    actual = path.stat().st_size
    if actual != section.size:
        how = "truncated" if actual < section.size else "oversized"
        msg = f"{path} is {actual} bytes, {how}: its hadamard section says {section.size}; re-run `turbospark convert`"
        raise InstallError(msg)
    with path.open("rb") as f:
        f.seek(section.signs_offset)
        raw = np.frombuffer(f.read(section.hidden_size), dtype=np.int8)
    if raw.size != section.hidden_size or not np.isin(raw, (-1, 1)).all():
        msg = f"{path}: the hadamard signs are not all +-1; the install is corrupt, re-run `turbospark convert`"
        raise InstallError(msg)
    return raw
