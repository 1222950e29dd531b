"""Rebuild Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json) from GGUF metadata."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from turbospark_core.convert.gguf_reader import GGUFSource
from turbospark_core.errors import ConversionError

_NORMAL = 1
_CONTROL = 3
_USER_DEFINED = 4
_SPACE = "\u2581"  # SentencePiece's visible space "▁"
_KEY = "tokenizer.ggml."
_TEMPLATE_KEY = "tokenizer.chat_template"

# Split patterns of the byte-level BPE variants named by ``tokenizer.ggml.pre``.
_PATTERN_DIGITS_BY_3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PATTERN_DIGITS_BY_1 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool = True) -> pre_tokenizers.PreTokenizer:
    """GPT-2 byte-level mapping, with or without its own split regex."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    """Split on ``pattern`` (isolating the matches), then map to bytes."""
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    return pre_tokenizers.Sequence([split, _byte_level(use_regex=False)])


def _digits_then_bytes() -> pre_tokenizers.PreTokenizer:
    """Single digits, then GPT-2 byte-level splitting."""
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


@attrs.frozen
class _BPEVariant:
    """How one ``tokenizer.ggml.pre`` value pre-tokenizes and merges."""

    pre_tokenizer: Callable[[], pre_tokenizers.PreTokenizer]
    ignore_merges: bool = False


_BPE_VARIANTS: dict[str, _BPEVariant] = {
    "default": _BPEVariant(_byte_level),
    "gpt2": _BPEVariant(_byte_level),
    "smollm": _BPEVariant(_digits_then_bytes),
    "llama-bpe": _BPEVariant(lambda: _split_then_bytes(_PATTERN_DIGITS_BY_3), ignore_merges=True),
    "qwen2": _BPEVariant(lambda: _split_then_bytes(_PATTERN_DIGITS_BY_1)),
}


def tokenizer_files_from_gguf(src: GGUFSource) -> dict[str, str]:
    """Build ``tokenizer.json`` and ``tokenizer_config.json`` from a GGUF file's metadata.

    Args:
        src: The opened GGUF file.

    Returns:
        ``{"tokenizer.json": text, "tokenizer_config.json": text}``.

    Raises:
        ConversionError: The tokenizer metadata is missing, inconsistent, or of a
            kind (``tokenizer.ggml.model`` / ``.pre``) not supported yet.
    """
    tokens = _string_list(src, _KEY + "tokens")
    tokenizer = _build_tokenizer(src, tokens)
    config = _tokenizer_config(src, tokens)
    return {
        "tokenizer.json": tokenizer.to_str(),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
    }


def _build_tokenizer(src: GGUFSource, tokens: list[str]) -> Tokenizer:
    """Dispatch on ``tokenizer.ggml.model``."""
    kind = _require(src, _KEY + "model")
    if kind == "gpt2":
        return _byte_level_bpe(src, tokens)
    if kind == "llama":
        return _sentencepiece_bpe(src, tokens)
    msg = (
        f"GGUF file {src.path} has tokenizer.ggml.model={kind!r}; only byte-level BPE ('gpt2') and "
        "SentencePiece BPE ('llama') tokenizers can be rebuilt so far; convert from the Hugging Face "
        "checkpoint instead"
    )
    raise ConversionError(msg)


def _byte_level_bpe(src: GGUFSource, tokens: list[str]) -> Tokenizer:
    """A GPT-2 style byte-level BPE tokenizer."""
    variant = _bpe_variant(src)
    model = _bpe_model(src, vocab=_vocab(tokens), merges=_merges(src), ignore_merges=variant.ignore_merges)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = variant.pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    _add_marked_tokens(src, tokenizer, tokens)
    tokenizer.post_processor = _post_processor(src, tokens)
    return tokenizer


def _sentencepiece_bpe(src: GGUFSource, tokens: list[str]) -> Tokenizer:
    """A SentencePiece BPE tokenizer (``tokenizer.ggml.model == "llama"``: Llama 2, Gemma...).

    Spaces become "▁" (plus one leading "▁" when ``add_space_prefix``), nothing
    splits the text before the model, characters outside the vocabulary fall back to ``<0xXX>`` byte
    tokens, and merges come from ``tokenizer.ggml.merges`` or, when absent, from the
    piece scores: SentencePiece merges the adjacent pair whose joined piece scores highest.
    """
    types = _token_types(src, len(tokens))
    merges = _merges(src) if _KEY + "merges" in src.metadata else _merges_from_scores(src, tokens, types)
    unk = _special(src, tokens, "unknown")
    model = _bpe_model(
        src,
        vocab=_vocab(tokens),
        merges=merges,
        unk_token=unk[0] if unk else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    prefix = bool(src.metadata.get(_KEY + "add_space_prefix", True))
    replace = normalizers.Replace(" ", _SPACE)
    # With a prefix, each text segment between added tokens gets one "▁" (as llama.cpp does)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if prefix else replace
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    _add_marked_tokens(src, tokenizer, tokens)
    template = _bos_eos_template(src, tokens)
    if template is not None:
        tokenizer.post_processor = template
    return tokenizer


def _bpe_model(src: GGUFSource, **kwargs: Any) -> models.BPE:
    """``models.BPE(**kwargs)``; what tokenizers refuses (a merge of an unknown token...) is a ConversionError."""
    try:
        return models.BPE(**kwargs)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception ("Error while initializing BPE")
        msg = (
            f"GGUF file {src.path}: its BPE vocabulary and merges do not form a tokenizer ({str(exc)[:300]}); "
            "the file is corrupt, or supply Hugging Face tokenizer files instead"
        )
        raise ConversionError(msg) from None


def _merges_from_scores(src: GGUFSource, tokens: list[str], types: np.ndarray) -> list[tuple[str, str]]:
    """BPE merges implied by SentencePiece scores: every split of a normal piece into two
    normal pieces, highest-scoring joined piece first (ties: by piece, left and right id)."""
    scores = src.metadata.get(_KEY + "scores")
    if isinstance(scores, list) and not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in scores):
        msg = f"GGUF file {src.path}: tokenizer.ggml.scores holds a value that is not a number; the file is corrupt"
        raise ConversionError(msg)
    if not isinstance(scores, list) or len(scores) != len(tokens):
        got = "absent" if scores is None else f"{len(scores) if isinstance(scores, list) else scores!r}"
        msg = (
            f"GGUF file {src.path} has neither tokenizer.ggml.merges nor one tokenizer.ggml.scores "
            f"entry per token ({got} for {len(tokens)} tokens); its SentencePiece vocabulary cannot be rebuilt"
        )
        raise ConversionError(msg)
    normal: dict[str, int] = {tokens[i]: i for i in np.flatnonzero(types == _NORMAL).tolist()}
    find = normal.get
    ranked: list[tuple[float, int, int, int]] = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left = find(piece[:cut])
            right = None if left is None else find(piece[cut:])
            if left is not None and right is not None:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    return [(tokens[left], tokens[right]) for _, _, left, right in ranked]


def _bpe_variant(src: GGUFSource) -> _BPEVariant:
    """The variant named by ``tokenizer.ggml.pre`` (``"default"`` when absent)."""
    pre = src.metadata.get(_KEY + "pre", "default")
    if not isinstance(pre, str) or pre not in _BPE_VARIANTS:
        known = ", ".join(sorted(_BPE_VARIANTS))
        msg = (
            f"GGUF file {src.path} has tokenizer.ggml.pre={pre!r}, a pre-tokenizer not supported "
            f"yet (supported: {known}); convert from the Hugging Face checkpoint instead"
        )
        raise ConversionError(msg)
    return _BPE_VARIANTS[pre]


def _vocab(tokens: list[str]) -> dict[str, int]:
    """Token text -> id; a repeated text keeps its first id."""
    ids = np.arange(len(tokens) - 1, -1, -1)
    return dict(zip(tokens[::-1], ids.tolist(), strict=True))


def _merges(src: GGUFSource) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` ("left right" strings) as pairs."""
    merges = _string_list(src, _KEY + "merges")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bad = next((m for m, p in zip(merges, pairs, strict=True) if len(p) != 2), None)
    if bad is not None:
        msg = f"GGUF file {src.path}: merge {bad!r} in tokenizer.ggml.merges is not 'left right'; the file is corrupt"
        raise ConversionError(msg)
    return pairs  # type: ignore[return-value]


def _token_types(src: GGUFSource, n_tokens: int) -> np.ndarray:
    """``tokenizer.ggml.token_type`` as an int array (all normal when absent)."""
    raw = src.metadata.get(_KEY + "token_type", [1] * n_tokens)
    if not isinstance(raw, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and abs(t) < 1 << 31 for t in raw
    ):
        msg = f"GGUF file {src.path}: tokenizer.ggml.token_type is not a list of small integers; the file is corrupt"
        raise ConversionError(msg)
    types = np.asarray(raw, dtype=np.int64)
    if types.shape != (n_tokens,):
        msg = (
            f"GGUF file {src.path}: tokenizer.ggml.token_type has {types.size} entries for {n_tokens} "
            "tokens; the file is corrupt"
        )
        raise ConversionError(msg)
    return types


def _add_marked_tokens(src: GGUFSource, tokenizer: Tokenizer, tokens: list[str]) -> None:
    """Register control tokens (special) and user-defined tokens as added tokens."""
    types = _token_types(src, len(tokens))
    marked = np.flatnonzero((types == _CONTROL) | (types == _USER_DEFINED)).tolist()
    added = [AddedToken(tokens[i], special=bool(types[i] == _CONTROL), normalized=False) for i in marked]
    tokenizer.add_tokens(added)
    wrong = next((i for i in marked if tokenizer.token_to_id(tokens[i]) != i), None)
    if wrong is not None:
        msg = (
            f"GGUF file {src.path}: token {tokens[wrong]!r} (id {wrong}) is also stored under id "
            f"{tokenizer.token_to_id(tokens[wrong])}; the vocabulary is ambiguous and cannot be rebuilt"
        )
        raise ConversionError(msg)


def _post_processor(src: GGUFSource, tokens: list[str]) -> processors.PostProcessor:
    """Byte-level offsets, plus BOS/EOS insertion as ``add_bos_token``/``add_eos_token`` say."""
    steps: list[processors.PostProcessor] = [processors.ByteLevel(trim_offsets=False)]
    template = _bos_eos_template(src, tokens)
    if template is not None:
        steps.append(template)
    return processors.Sequence(steps)


def _bos_eos_template(src: GGUFSource, tokens: list[str]) -> processors.PostProcessor | None:
    """BOS/EOS insertion as ``add_bos_token``/``add_eos_token`` say, or None for neither."""
    bos = _special(src, tokens, "bos") if src.metadata.get(_KEY + "add_bos_token") else None
    eos = _special(src, tokens, "eos") if src.metadata.get(_KEY + "add_eos_token") else None
    if bos is None and eos is None:
        return None
    return _template(src, [t for t in (bos, eos) if t is not None], bos, eos)


def _template(
    src: GGUFSource, specials: list[tuple[str, int]], bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.PostProcessor:
    """A TemplateProcessing wrapping each sequence in the given BOS/EOS."""
    head = [f"{bos[0]}:{{}}"] if bos else []
    tail = [f"{eos[0]}:{{}}"] if eos else []
    single = [p.format(0) for p in head] + ["$A:0"] + [p.format(0) for p in tail]
    pair = single + [p.format(1) for p in head] + ["$B:1"] + [p.format(1) for p in tail]
    try:
        return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    except Exception as exc:  # tokenizers raises plain Exception subclasses
        msg = f"GGUF file {src.path}: cannot build the BOS/EOS template from {specials!r} ({exc})"
        raise ConversionError(msg) from exc


def _special(src: GGUFSource, tokens: list[str], role: str) -> tuple[str, int] | None:
    """(text, id) of ``tokenizer.ggml.{role}_token_id``, or None when absent."""
    key = f"{_KEY}{role}_token_id"
    token_id = src.metadata.get(key)
    if token_id is None:
        return None
    if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < len(tokens):
        msg = (
            f"GGUF file {src.path}: {key}={token_id!r} is outside the {len(tokens)}-token vocabulary;"
            " the file is corrupt"
        )
        raise ConversionError(msg)
    return tokens[token_id], token_id


def _tokenizer_config(src: GGUFSource, tokens: list[str]) -> dict[str, object]:
    """The tokenizer_config.json contents."""
    config: dict[str, object] = {}
    for role, field in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        special = _special(src, tokens, field)
        config[f"{role}_token"] = special[0] if special else None
    config["add_bos_token"] = bool(src.metadata.get(_KEY + "add_bos_token", False))
    config["add_eos_token"] = bool(src.metadata.get(_KEY + "add_eos_token", False))
    config["chat_template"] = _chat_template(src)
    context = src.arch_value("context_length", None)
    if context is not None:
        config["model_max_length"] = context
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    return config


def _chat_template(src: GGUFSource) -> str | list[dict[str, str]] | None:
    """The default chat template, or the Hugging Face list form when named templates exist."""
    default = src.metadata.get(_TEMPLATE_KEY)
    prefix = _TEMPLATE_KEY + "."
    named = [
        {"name": key[len(prefix) :], "template": value}
        for key, value in src.metadata.items()
        if key.startswith(prefix) and isinstance(value, str)
    ]
    if not named:
        return default if isinstance(default, str) else None
    head = [{"name": "default", "template": default}] if isinstance(default, str) else []
    return head + named


def _require(src: GGUFSource, key: str) -> object:
    """``src.metadata[key]``, or a ConversionError naming the missing key."""
    if key not in src.metadata:
        msg = (
            f"GGUF file {src.path} lacks {key!r}, so its tokenizer cannot be rebuilt;"
            " supply Hugging Face tokenizer files instead"
        )
        raise ConversionError(msg)
    return src.metadata[key]


def _string_list(src: GGUFSource, key: str) -> list[str]:
    """A required metadata list of strings."""
    value = _require(src, key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        msg = f"GGUF file {src.path}: {key} is not a list of strings; the file is corrupt"
        raise ConversionError(msg)
    return value
