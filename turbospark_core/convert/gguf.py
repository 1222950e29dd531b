"""Source: a GGUF file, mapped through the family plugin that serves its architecture."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from turbospark_core import plugins
from turbospark_core.arch_check import generic_problems
from turbospark_core.convert.assemble import ConvertOptions
from turbospark_core.convert.gguf_reader import GGUFSource, open_gguf, unpermute_rotary_rows
from turbospark_core.convert.gguf_tokenizer import tokenizer_files_from_gguf
from turbospark_core.convert.records import SourceTensor, TensorTarget
from turbospark_core.errors import ConversionError, UnknownFamilyError

Item = tuple[TensorTarget | None, SourceTensor, None]
_EMPTY = np.zeros((0,), np.float32)


def _generation_config(src: GGUFSource) -> str:
    config = {
        key: src.metadata[f"tokenizer.ggml.{key}"]
        for key in ("bos_token_id", "eos_token_id")
        if f"tokenizer.ggml.{key}" in src.metadata
    }
    return json.dumps(config, indent=1)


def gguf_source(
    path: Path, options: ConvertOptions
) -> tuple[dict[str, Any], Iterator[Item], dict[str, str], int, dict[str, list[str]]]:
    """Arch config, mapped tensors, tokenizer files, tensor count and dequantized tensors of a GGUF file.

    Block types with an exact affine form (see ``gguf_reader.EXACT_TYPES``) stay
    quantized. The others are dequantized to float (the default), or, under
    ``options.strict``, refused, naming every such tensor, before any is read.

    Returns:
        ``(arch, items, texts, total, dequantized)``, where ``dequantized`` maps a
        GGML type name to the tensors that will be stored as float.
    """
    src = open_gguf(path)
    try:
        arch = plugins.arch_from_gguf(src.architecture, src.metadata, src.tensor_names())
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as exc:
        msg = (
            f"{path}: the metadata of GGUF architecture {src.architecture!r} is malformed "
            f"({type(exc).__name__}: {str(exc)[:200]}); the file is corrupt or was exported by an unknown converter"
        )
        raise ConversionError(msg) from None
    if arch is None:
        reg = plugins.registry()
        served = ", ".join(a for s in reg.families() for a in s.gguf_architectures) or "none"
        msg = (
            f"{path}: no installed plugin serves GGUF architecture {src.architecture!r} "
            f"(served: {served}); install the turbospark plugin distribution for it"
        )
        raise UnknownFamilyError(msg)
    hooks = plugins.family_hooks(arch["model_type"])
    problems = generic_problems(arch) or hooks.arch_problems(arch)  # before the plugin maps names with it
    if problems:
        msg = f"{path}: its metadata gives an invalid arch config (model type {arch['model_type']!r}): "
        msg += "; ".join(problems)
        raise ConversionError(msg)
    targets = {name: hooks.gguf_tensor_target(arch, name) for name in src.tensor_names()}
    dequantized = _inexact(src, targets)
    if dequantized and options.strict:
        raise ConversionError(_strict_refusal(path, dequantized))
    texts = tokenizer_files_from_gguf(src)
    texts["generation_config.json"] = _generation_config(src)

    def items() -> Iterator[Item]:
        for name, target in targets.items():
            if target is None or target.name is None:
                yield target, SourceTensor(name=name, data=_EMPTY), None
                continue
            tensor = src.read_tensor(name, dequantize=not options.strict)
            if target.unpermute_heads:
                tensor = SourceTensor(name=name, data=unpermute_rotary_rows(tensor.data, target.unpermute_heads))
            yield target, tensor, None

    return arch, items(), texts, len(targets), dequantized


def _inexact(src: GGUFSource, targets: dict[str, TensorTarget | None]) -> dict[str, list[str]]:
    """GGML type -> kept tensors whose type has no exact affine form."""
    out: dict[str, list[str]] = {}
    kinds = src.tensor_types()
    for name, target in targets.items():
        if target is not None and target.name is not None and src.needs_dequantize(name):
            out.setdefault(kinds[name], []).append(name)
    return out


def _strict_refusal(path: Path, dequantized: dict[str, list[str]]) -> str:
    listed = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in sorted(dequantized.items()))
    return (
        f"--strict: {path} holds tensors with no exact affine form ({listed}); these would have to "
        f"be dequantized to float; convert without --strict to accept that"
    )
