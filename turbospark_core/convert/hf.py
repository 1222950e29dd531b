"""Source: a Hugging Face checkpoint directory, or an mlx-lm (possibly quantized) one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from turbospark_core.convert import mxfp4
from turbospark_core.convert.records import SourceTensor
from turbospark_core.errors import ConversionError

TEXT_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def read_config(src: Path) -> dict[str, Any]:
    """``config.json`` of a checkpoint directory."""
    path = src / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        msg = f"{src} has no config.json; pass a Hugging Face or mlx-lm checkpoint directory or a .gguf file"
        raise ConversionError(msg) from None
    except json.JSONDecodeError as e:
        msg = f"{path} is not valid JSON ({e})"
        raise ConversionError(msg) from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        msg = f"{path} has no 'model_type'; cannot tell which family serves it"
        raise ConversionError(msg)
    return config


def weight_files(src: Path) -> list[Path]:
    """The checkpoint's safetensors files (pickled .bin checkpoints are refused)."""
    files = sorted(src.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in src.glob("*.bin")) + sorted(p.name for p in src.glob("*.pt*"))
        hint = f" (found {', '.join(pickled)}: pickle checkpoints are never loaded)" if pickled else ""
        msg = f"{src} has no *.safetensors weights{hint}; re-save the checkpoint as safetensors"
        raise ConversionError(msg)
    return files


def quant_for(config: dict[str, Any], base: str) -> dict[str, Any] | None:
    """mlx-lm quantization parameters of matrix ``base`` (per-module overrides honoured)."""
    q = config.get("quantization") or config.get("quantization_config")
    if not isinstance(q, dict) or "bits" not in q:
        return None
    own = q.get(base)
    params = own if isinstance(own, dict) else q
    return {"bits": params["bits"], "group_size": params["group_size"], "mode": params.get("mode", "affine")}


def load_shard(path: Path) -> dict[str, mx.array]:
    """A safetensors shard's tensors by name, loaded lazily."""
    return cast(dict[str, mx.array], mx.load(str(path)))  # a safetensors file loads as a dict


def tensors(src: Path, config: dict[str, Any]) -> Iterator[tuple[SourceTensor, dict[str, Any] | None]]:
    """Every tensor (lazily loaded) with its quantization when it is a packed part.

    In an MXFP4 checkpoint each ``X_blocks``/``X_scales`` pair (possibly in two
    shards) is yielded once, as ``X`` holding an ``mxfp4`` :class:`AffineQuantized`.
    """
    files = [(path, load_shard(path)) for path in weight_files(src)]
    fp4 = {n: a for _, arrays in files for n, a in arrays.items()} if mxfp4.is_mxfp4(config) else {}
    fp4_names = set(fp4)
    mxfp4.check_pairs(fp4_names)
    for path, arrays in files:
        names = set(arrays)
        for name in sorted(arrays):
            if fp4 and mxfp4.is_pair_part(name, fp4_names):
                if name.endswith(mxfp4.BLOCKS_SUFFIX):
                    matrix = name[: -len(mxfp4.BLOCKS_SUFFIX)]
                    data = mxfp4.from_blocks(matrix, arrays[name], fp4[matrix + mxfp4.SCALES_SUFFIX])
                    yield SourceTensor(name=matrix, data=data), None
                continue
            base = name.rpartition(".")[0]
            quant = quant_for(config, base) if f"{base}.scales" in names else None
            if f"{base}.scales" in names and quant is None:
                msg = f"{path.name}: {name!r} is quantized but config.json has no 'quantization' section"
                raise ConversionError(msg)
            yield SourceTensor(name=name, data=arrays[name]), quant


def text_files(src: Path) -> dict[str, str]:
    """Tokenizer and generation files to copy (``chat_template.jinja`` folded into the config)."""
    if not (src / "tokenizer.json").is_file():
        msg = f"{src} has no tokenizer.json; turbospark needs the fast (JSON) tokenizer"
        raise ConversionError(msg)
    out = {name: (src / name).read_text() for name in TEXT_FILES if (src / name).is_file()}
    template = src / "chat_template.jinja"
    if template.is_file():
        config = json.loads(out.get("tokenizer_config.json", "{}"))
        config.setdefault("chat_template", template.read_text())
        out["tokenizer_config.json"] = json.dumps(config, indent=1)
    return out
