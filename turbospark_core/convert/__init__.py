"""``turbospark convert``: make an install from a Hugging Face, mlx-lm or GGUF source."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx

from turbospark_core import __version__, plugins
from turbospark_core.arch_check import generic_problems
from turbospark_core.convert import hf
from turbospark_core.convert.assemble import Assembler, ConvertOptions, map_all
from turbospark_core.convert.calibration import CALIBRATION_DIR, calibrate, read_text
from turbospark_core.convert.experts import split_experts, top_k_from_config
from turbospark_core.convert.records import SourceTensor, TensorTarget
from turbospark_core.convert.rotate import RotationStep, refuse_unrotatable
from turbospark_core.convert.writer import destination_lock, finish, prepare_destination, write_install
from turbospark_core.errors import ConversionError, UnknownFamilyError
from turbospark_core.manifest import MTP_PREFIX, Manifest, load_manifest
from turbospark_core.progress import progress
from turbospark_core.speculative.dflash_config import is_dflash_config

__all__ = ["ConvertOptions", "convert"]


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    dtype: str | None = None,
    quantize: str | None = None,
    group_size: int = 64,
    strict: bool = False,
    force: bool = False,
    show_progress: bool = False,
    experts_file: bool = True,
    rotate: bool = False,
    rotate_seed: int = 0,
    calibrate: str | Path | None = None,
    calibrate_tokens: int | None = None,
    calibrate_sequential: bool = False,
) -> Manifest:
    """Make an install at ``dst`` from ``src``.

    Args:
        src: A Hugging Face / mlx-lm checkpoint directory, or a ``.gguf`` file.
        dst: The install directory to create.
        dtype: Cast float tensors to ``bfloat16``/``float16``/``float32``.
        quantize: ``q3``, ``q4`` or ``q8``: quantize float matrices (MLX affine).
        group_size: Quantization group size (32, 64, 128).
        strict: GGUF only: refuse block types with no exact affine mapping (e.g.
            IQ4_NL) instead of dequantizing them to float; dequantized tensors
            are listed in the manifest's provenance (``dequantized``).
        force: Replace a non-empty ``dst``.
        show_progress: Draw a progress bar on stderr.
        experts_file: MoE only: pack the routed experts into ``experts.bin``
            (one aligned record per layer and expert, for streaming) instead of
            ``model_weights.safetensors``.
        rotate: Fold a randomized Hadamard rotation of the residual stream
            into the weights before any ``quantize`` (families whose
            ``accepts_hadamard`` says yes; others are refused by name).
        rotate_seed: Seed of the rotation's random signs.
        calibrate: A UTF-8 text file (:data:`~turbospark_core.convert.calibration.BUILTIN`
            is bundled English prose): with ``quantize``, every matrix the
            family multiplies is rounded by GPTQ from its inputs when the float
            model (rotated, with ``rotate``) reads the text, instead of to
            nearest (see :mod:`turbospark_core.convert.calibration`).
        calibrate_tokens: How many tokens of that text are used (default
            :data:`~turbospark_core.convert.calibration.DEFAULT_TOKENS`; at least 128).
        calibrate_sequential: Solve layer by layer, each from inputs through
            the layers already quantized (as GPTQ's reference does; one pass
            over the text per layer) instead of from the float model's inputs
            (one pass).

    Raises:
        ConversionError: The source is unreadable or has something unsupported.
        UnknownFamilyError: No installed plugin serves the source's model type.
    """
    options = ConvertOptions(
        dtype=dtype,
        quantize=quantize,
        group_size=group_size,
        strict=strict,
        experts_file=experts_file,
        rotate=rotate,
        rotate_seed=rotate_seed,
        calibrate=None if calibrate is None else str(calibrate),
        calibrate_tokens=calibrate_tokens,
        calibrate_sequential=calibrate_sequential,
    )
    text = None if options.calibrate is None else read_text(options.calibrate)  # refused before any tensor is read
    src, dst = Path(src), Path(dst)
    if src.is_file() and src.suffix == ".gguf":
        from turbospark_core.convert.gguf import gguf_source

        arch, items, texts, total, dequantized = gguf_source(src, options)
        top_k = None  # GGUF: the first routed call checks the slot count against the router's k
    elif src.is_dir() and is_dflash_config(hf.read_config(src)):  # a drafter: an install of its own kind
        from turbospark_core.convert.dflash import convert_dflash

        if text is not None:
            msg = f"{src} is a DFlash drafter, which runs only beside its target; convert it without --calibrate"
            raise ConversionError(msg)

        return convert_dflash(src, dst, hf.read_config(src), options, force=force)
    elif src.is_dir():
        arch, items, texts, total = _hf_source(src)
        dequantized = {}
        top_k = top_k_from_config(hf.read_config(src))
    else:
        msg = f"{src} is neither a checkpoint directory nor a .gguf file"
        raise ConversionError(msg)
    hooks = plugins.family_hooks(arch["model_type"])
    _check_arch(src, arch, hooks)
    rotation = None  # --- hadamard rotation (issue 18)
    if options.rotate:
        refuse_unrotatable(hooks, arch)
        rotation = RotationStep(hooks, arch, options.rotate_seed)
    with destination_lock(dst):
        staging = prepare_destination(dst, force=force)
        try:
            _write(
                staging,
                src,
                options,
                items,
                total,
                top_k,
                arch,
                texts,
                hooks,
                dequantized,
                show_progress,
                rotation,
                text,
            )
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finish(staging, dst)
    return load_manifest(dst)


def _write(
    staging: Path,
    src: Path,
    options: ConvertOptions,
    items: Any,
    total: int,
    top_k: int | None,
    arch: dict[str, Any],
    texts: dict[str, str],
    hooks: plugins.FamilyHooks,
    dequantized: dict[str, list[str]],
    show_progress: bool,
    rotation: RotationStep | None = None,
    calibration_text: str | None = None,
) -> None:
    """Map, evaluate and write every file of the install into ``staging`` (rotated when ``rotation``,
    quantized by GPTQ from the model's inputs on ``calibration_text`` when given)."""
    assembler = Assembler(options, before_cast=rotation)
    if rotation is not None:  # the head reads the residual stream, which the rotation does not cover: dropped
        items = (item for item in items if not _is_head(item[0]))
    map_all(assembler, progress(items, total, "mapping", enabled=show_progress))
    tensors, quantization = assembler.finish(quantize=calibration_text is None)
    record = None
    if calibration_text is not None:
        _evaluate(tensors, show_progress)
        calibration = calibrate(
            staging / CALIBRATION_DIR,
            tensors,
            quantization,
            assembler.quantizable(),
            text=calibration_text,
            options=options,
            arch=arch,
            texts=texts,
            hooks=hooks,
            hadamard=None if rotation is None else rotation.result,
            show_progress=show_progress,
        )
        assembler.quantize(calibration.solved)
        record = calibration.record
    _evaluate(tensors, show_progress)
    tensors, quantization, head = _split_head(tensors, quantization)
    pack = None
    if options.experts_file:
        tensors, quantization, pack = split_experts(tensors, quantization, top_k=top_k)
    write_install(
        staging,
        arch=arch,
        tensors=tensors,
        quantization=quantization,
        experts=pack,
        text_files=texts,
        family=hooks.spec.name,
        distribution=hooks.spec.distribution,
        provenance=_provenance(src, options, dequantized, record),
        hadamard=None if rotation is None else rotation.result,
        mtp=head,
    )


def _is_head(target: TensorTarget | None) -> bool:
    return target is not None and target.name is not None and target.name.startswith(MTP_PREFIX)


def _split_head(
    tensors: dict[str, mx.array], quantization: dict[str, Any]
) -> tuple[dict[str, mx.array], dict[str, Any], tuple[dict[str, mx.array], dict[str, Any]] | None]:
    """Move the multi-token-prediction head (install names ``mtp.*``) out, for ``mtp.safetensors``.

    What is left is exactly the install the checkpoint would make without a head.
    """
    head = {n: a for n, a in tensors.items() if n.startswith(MTP_PREFIX)}
    if not head:
        return tensors, quantization, None
    rest = {n: a for n, a in tensors.items() if not n.startswith(MTP_PREFIX)}
    head_quant = {b: q for b, q in quantization.items() if b.startswith(MTP_PREFIX)}
    rest_quant = {b: q for b, q in quantization.items() if not b.startswith(MTP_PREFIX)}
    return rest, rest_quant, (head, head_quant)


def _check_arch(src: Path, arch: dict[str, Any], hooks: plugins.FamilyHooks) -> None:
    """The checks an open makes (the core's, then the family's): never write an install that cannot open."""
    problems = generic_problems(arch) or hooks.arch_problems(arch)
    if problems:
        msg = f"{src}: the arch config it gives (model type {arch['model_type']!r}) is invalid: " + "; ".join(problems)
        raise ConversionError(msg)


def _hf_source(src: Path) -> tuple[dict[str, Any], Any, dict[str, str], int]:
    config = hf.read_config(src)
    arch = plugins.arch_from_hf_config(config)
    if arch is None:
        reg = plugins.registry()
        raise UnknownFamilyError(reg.refusal(config["model_type"]))
    hooks = plugins.family_hooks(arch["model_type"])
    texts = hf.text_files(src)
    total = sum(len(mx.load(str(p))) for p in hf.weight_files(src))

    def items() -> Any:
        for tensor, quant in hf.tensors(src, config):
            rewritten = hooks.hf_tensor_transform(arch, tensor.name, tensor.data)
            if rewritten is None:
                yield hooks.hf_tensor_target(arch, tensor.name), tensor, quant
                continue
            for name, data in rewritten.items():
                yield TensorTarget.to(name), SourceTensor(name=tensor.name, data=data), quant

    return arch, items(), texts, total


def _evaluate(tensors: dict[str, mx.array], show: bool) -> None:
    for name in progress(sorted(tensors), len(tensors), "converting", enabled=show):
        mx.eval(tensors[name])


def _provenance(
    src: Path, options: ConvertOptions, dequantized: dict[str, list[str]], calibration: dict[str, Any] | None = None
) -> dict[str, Any]:
    extra: dict[str, Any] = {"dequantized": dequantized} if dequantized else {}
    if calibration is not None:
        extra["calibration"] = calibration
    return {
        **extra,
        "source": str(src.resolve()),
        "source_kind": "gguf" if src.suffix == ".gguf" else "checkpoint",
        "converter": f"turbospark {__version__}",
        "options": attrs.asdict(options),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
