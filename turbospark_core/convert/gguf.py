"""Source: a GGUF file, mapped through the family plugin that serves its architecture."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from turbospark_core import plugins
from turbospark_core.convert.assemble import ConvertOptions
from turbospark_core.convert.gguf_reader import GGUFSource, open_gguf, unpermute_rotary_rows
from turbospark_core.convert.gguf_tokenizer import tokenizer_files_from_gguf
from turbospark_core.convert.records import SourceTensor, TensorTarget
from turbospark_core.errors import UnknownFamilyError

Item = tuple[TensorTarget | None, SourceTensor, None]
_EMPTY = np.zeros((0,), np.float32)


def _generation_config(src: GGUFSource) -> str:
    config = {
        key: src.metadata[f"tokenizer.ggml.{key}"]
        for key in ("bos_token_id", "eos_token_id")
        if f"tokenizer.ggml.{key}" in src.metadata
    }
    return json.dumps(config, indent=1)


def gguf_source(path: Path, options: ConvertOptions) -> tuple[dict[str, Any], Iterator[Item], dict[str, str], int]:
    """Arch config, mapped tensors, tokenizer files and tensor count of a GGUF file."""
    src = open_gguf(path)
    arch = plugins.arch_from_gguf(src.architecture, src.metadata)
    if arch is None:
        reg = plugins.registry()
        served = ", ".join(a for s in reg.families() for a in s.gguf_architectures) or "none"
        msg = (
            f"{path}: no installed plugin serves GGUF architecture {src.architecture!r} "
            f"(served: {served}); install the turbospark plugin distribution for it"
        )
        raise UnknownFamilyError(msg)
    hooks = plugins.family_hooks(arch["model_type"])
    texts = tokenizer_files_from_gguf(src)
    texts["generation_config.json"] = _generation_config(src)

    def items() -> Iterator[Item]:
        for name in src.tensor_names():
            target = hooks.gguf_tensor_target(arch, name)
            if target is None or target.name is None:
                yield target, SourceTensor(name=name, data=_EMPTY), None
                continue
            tensor = src.read_tensor(name, dequantize=options.dequantize)
            if target.unpermute_heads:
                tensor = SourceTensor(name=name, data=unpermute_rotary_rows(tensor.data, target.unpermute_heads))
            yield target, tensor, None

    return arch, items(), texts, len(src.tensor_names())
