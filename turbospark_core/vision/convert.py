"""``turbospark convert SRC DST --vision SIDECAR``: write a checkpoint's vision tower as a sidecar."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from turbospark_core import __version__, plugins
from turbospark_core.convert import hf
from turbospark_core.convert.writer import destination_lock, finish, prepare_destination
from turbospark_core.errors import ConversionError
from turbospark_core.vision.sidecar import CHAT_TEMPLATE, VISION_WEIGHTS, Sidecar, load_sidecar, write_sidecar_manifest

_DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
_FLOATS = (mx.bfloat16, mx.float16, mx.float32)


def processor_config(src: Path) -> dict[str, Any] | None:
    """``preprocessor_config.json``, with ``processor_config.json``'s ``image_processor`` laid over it
    (transformers 5 reads that file first); ``None`` when the checkpoint has neither."""
    out: dict[str, Any] = {}
    found = False
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = src / name
        if not path.is_file():
            continue
        try:
            raw = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise ConversionError(f"{path} is not valid JSON ({e})") from None
        section = raw.get(key) if key and isinstance(raw, dict) else raw
        if isinstance(section, dict):
            out.update(section)
            found = True
            if key and isinstance(raw, dict):
                out.update({k: v for k, v in raw.items() if k != key and not isinstance(v, dict)})
    return out if found else None


def _token_texts(src: Path, tokens: dict[str, int]) -> dict[str, str]:
    from tokenizers import Tokenizer as _HFTokenizer

    try:
        tok = _HFTokenizer.from_file(str(src / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
        raise ConversionError(f"{src / 'tokenizer.json'} could not be loaded ({e})") from None
    out = {}
    for name, token_id in tokens.items():
        text = tok.id_to_token(token_id)
        if text is None:
            raise ConversionError(f"{src}: placeholder {name!r} id {token_id} is not in tokenizer.json")
        out[name] = text
    return out


def convert_sidecar(
    src: str | Path,
    dst: str | Path,
    *,
    dtype: str | None = None,
    force: bool = False,
) -> Sidecar:
    """Write ``src``'s vision tower as a sidecar at ``dst``.

    Args:
        src: A Hugging Face checkpoint directory with a ``vision_config``.
        dst: The sidecar directory to create.
        dtype: Cast the tower's float tensors (``bfloat16``/``float16``/``float32``).
        force: Replace a non-empty ``dst``.

    Raises:
        ConversionError: The source has no tower the family serves, no processor config, or a tensor with no place.
        UnknownFamilyError: No installed plugin serves the model type.
    """
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise ConversionError(f"{src}: --vision needs a Hugging Face checkpoint directory (a GGUF has no tower here)")
    config = hf.read_config(src)
    hooks = plugins.family_hooks(config["model_type"])
    arch = hooks.arch_from_hf_config(config)
    spec = hooks.vision_arch_from_hf_config(config)
    if spec is None or arch is None:
        msg = (
            f"{src}: family {hooks.spec.name!r} ({hooks.spec.distribution}) has no vision tower for model type "
            f"{config['model_type']!r}; convert without --vision"
        )
        raise ConversionError(msg)
    if spec.hidden_size != arch.get("hidden_size"):
        msg = f"{src}: the tower emits width {spec.hidden_size}, the text model is {arch.get('hidden_size')} wide"
        raise ConversionError(msg)
    processor = processor_config(src)
    if processor is None:
        raise ConversionError(f"{src} has no preprocessor_config.json; the image preprocessing is unknown")
    cast = _DTYPES.get(dtype) if dtype else None
    tensors: dict[str, mx.array] = {}
    for shard in hf.weight_files(src):
        for name, data in hf.load_shard(shard).items():
            target = hooks.vision_tensor_target(spec.vision, name)
            if target is None:
                raise ConversionError(f"{src}: tensor {name!r} has no place in the vision sidecar")
            if target.name is None:
                continue
            tensors[target.name] = data.astype(cast) if cast is not None and data.dtype in _FLOATS else data
    if not tensors:
        raise ConversionError(f"{src}: no vision tower tensors found; convert without --vision")
    record = Sidecar(
        root=dst,
        family=hooks.spec.name,
        distribution=hooks.spec.distribution,
        trunk={"model_type": arch["model_type"], "hidden_size": arch["hidden_size"], "vocab_size": arch["vocab_size"]},
        vision=spec.vision,
        tokens=dict(spec.tokens),
        token_texts=_token_texts(src, dict(spec.tokens)),
        processor=processor,
        files={},
        provenance={
            "source": str(src.resolve()),
            "converter": f"turbospark {__version__}",
            "dtype": dtype,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    )
    with destination_lock(dst):
        staging = prepare_destination(dst, force=force)
        try:
            mx.save_safetensors(str(staging / VISION_WEIGHTS), tensors, metadata={"format": "mlx"})
            if (src / CHAT_TEMPLATE).is_file():
                shutil.copyfile(src / CHAT_TEMPLATE, staging / CHAT_TEMPLATE)
            write_sidecar_manifest(staging, record)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finish(staging, dst)
    return load_sidecar(dst)
