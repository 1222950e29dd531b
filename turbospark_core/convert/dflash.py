"""Convert a DFlash drafter checkpoint (z-lab layout) into a drafter install (manifest kind ``"dflash"``).

The checkpoint is a directory with a decoder ``config.json`` whose
``architectures`` is ``["DFlashDraftModel"]`` and safetensors tensors with
the released names (``fc``, ``hidden_norm``, ``norm``, ``layers.<i>.*``, no
``model.`` prefix, no embeddings, no LM head). The install holds those
tensors under the same names in ``model_weights.safetensors`` and the
checked flat arch of :mod:`turbospark_core.speculative.dflash_config`.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx

from turbospark_core import __version__
from turbospark_core.convert import hf
from turbospark_core.convert.assemble import Assembler, ConvertOptions
from turbospark_core.convert.records import AffineQuantized, TensorTarget
from turbospark_core.convert.writer import destination_lock, finish, prepare_destination
from turbospark_core.errors import ConversionError
from turbospark_core.manifest import DFLASH_KIND, MANIFEST, WEIGHTS, FileEntry, Manifest, load_manifest, sha256_file
from turbospark_core.speculative.dflash_config import DFlashConfig, arch_from_hf


def convert_dflash(src: Path, dst: Path, config: dict[str, Any], options: ConvertOptions, *, force: bool) -> Manifest:
    """Make a drafter install at ``dst`` from the DFlash checkpoint ``src`` (``config`` its config.json).

    ``--dtype`` and ``--quantize`` apply as to a model.

    Raises:
        ConversionError: An unsupported variant or config value, a hadamard rotation (drafters read
            the target's unrotated states), or tensors that are missing, unknown or of the wrong shape,
            each named.
    """
    arch, problems = arch_from_hf(config)
    if problems:
        msg = f"{src}: cannot convert this DFlash drafter: " + "; ".join(problems)
        raise ConversionError(msg)
    if options.rotate:
        msg = f"{src} is a DFlash drafter; --rotate (hadamard folding) applies to models only, convert without it"
        raise ConversionError(msg)
    cfg = DFlashConfig.from_arch(arch)
    assembler = Assembler(options)
    for name, data, quant in _checked_tensors(src, config, cfg):
        assembler.add(TensorTarget.to(name), data, quant)
    tensors, quantization = assembler.finish()
    mx.eval(list(tensors.values()))
    with destination_lock(dst):
        staging = prepare_destination(dst, force=force)
        try:
            _write(staging, arch, tensors, quantization, _provenance(src, options))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finish(staging, dst)
    return load_manifest(dst)


def _checked_tensors(src: Path, config: dict[str, Any], cfg: DFlashConfig) -> Any:
    """Every checkpoint tensor, refusing unknown names and wrong shapes; then refusing missing ones."""
    want = cfg.tensor_shapes()
    seen: set[str] = set()
    for tensor, quant in hf.tensors(src, config):
        name = tensor.name
        leaf = name.rpartition(".")[2]
        logical = f"{name.rpartition('.')[0]}.weight" if quant is not None and leaf in ("scales", "biases") else name
        if logical not in want:
            hint = (
                " (drafters with their own embeddings or LM head are not supported)"
                if "embed" in name or "lm_head" in name
                else ""
            )
            msg = (
                f"{src}: DFlash drafter tensor {name!r} is not one the drafter uses{hint}; only the released names are"
            )
            raise ConversionError(msg)
        data = tensor.data
        shape = tuple(data.shape) if not isinstance(data, AffineQuantized) else data.shape
        if quant is None and leaf == "weight" and shape != want[name]:
            msg = f"{src}: DFlash drafter tensor {name!r} has shape {list(shape)}, its config needs {list(want[name])}"
            raise ConversionError(msg)
        seen.add(logical)
        yield name, tensor, quant
    missing = sorted(set(want) - seen)
    if missing:
        msg = f"{src}: the DFlash drafter checkpoint lacks tensor {missing[0]!r} ({len(missing)} missing)"
        raise ConversionError(msg)


def _write(
    staging: Path,
    arch: dict[str, Any],
    tensors: dict[str, mx.array],
    quantization: dict[str, Any],
    provenance: dict[str, Any],
) -> None:
    mx.save_safetensors(str(staging / WEIGHTS), tensors, metadata={"format": "mlx"})
    size = (staging / WEIGHTS).stat().st_size
    manifest = Manifest(
        root=staging,
        arch=arch,
        files={WEIGHTS: FileEntry(size=size, sha256=sha256_file(staging / WEIGHTS, size))},
        quantization=quantization,
        kind=DFLASH_KIND,
        provenance=provenance,
    )
    (staging / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1, sort_keys=True))


def _provenance(src: Path, options: ConvertOptions) -> dict[str, Any]:
    return {
        "source": str(src.resolve()),
        "source_kind": "dflash checkpoint",
        "converter": f"turbospark {__version__}",
        "options": attrs.asdict(options),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
